"""Creating hetstore's private directories and files where other users may write.

The threat: an offload root or checkpoint directory that another local user can write
to (``/scratch/offload`` created 0777). Between our ``mkdir`` and our first ``open`` of a
path, that user can swap our directory (or a file in it) for a symlink to a file we own,
and our next write lands there. Paths cannot be made safe by checking them first (the
check and the use race); descriptors can. So:

- the root is opened once as a directory descriptor, and refused when others can write
  to it without the sticky bit (there, anyone may rename or delete our entries);
- our directory is made with ``mkdirat`` and opened with ``O_NOFOLLOW`` relative to that
  descriptor, then checked by ``fstat`` (a directory, ours, mode 0700) -- a swap in
  between fails the open or the check;
- every file is created relative to our directory's descriptor with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` and checked by ``fstat`` (a regular file, ours).

Inside a 0700 directory of ours no one else can create or swap anything, so from then on
the descriptors are only a second line of defence.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

from hetstore.errors import ConfigError

__all__ = [
    "open_root",
    "make_private_dir",
    "create_private_file",
    "read_small_file",
    "check_private_file",
    "removing_created_dirs",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_root(path: str, key: str) -> int:
    """Create ``path`` if missing and return a descriptor of it, refusing a directory that
    users other than us may write to without the sticky bit. ``key`` names the setting
    (``offload_path``) in the error."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot use {path!r} as a directory ({exc.strerror}); point {key} at a "
            "directory this process can create and write"
        ) from exc
    try:
        check_shared_root(os.fstat(fd), path, key)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def removing_created_dirs(path: str) -> Iterator[None]:
    """Within the block, ``path`` may be created (``open_root``); at its end ``path`` and
    the parents of it that did not exist before are removed again, deepest first, where
    they are empty. Something else written there in the meantime stays, and so do they:
    ``rmdir`` removes nothing but an empty directory, so nobody's files are lost."""
    missing = missing_dirs(path)
    try:
        yield
    finally:
        remove_empty_dirs(missing)


def missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, deepest first: what
    creating it makes (hand them to :func:`remove_empty_dirs` afterwards)."""
    missing = []
    here = os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        missing.append(here)
        here = os.path.dirname(here)
    return missing


def remove_empty_dirs(directories: list[str]) -> None:
    """``rmdir`` each of ``directories`` (deepest first) until one is not empty."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except FileNotFoundError:  # never made (a failed makedirs stops part way)
            continue
        except OSError:  # not empty: something else uses it, and its parents
            break


def check_shared_root(st: os.stat_result, path: str, key: str) -> None:
    """Refuse a root where another user could replace or delete our entries."""
    others_write = st.st_mode & stat.S_IWOTH
    group_write = st.st_mode & stat.S_IWGRP and st.st_gid != os.getegid()
    if (others_write or group_write) and not st.st_mode & stat.S_ISVTX:
        who = "every user" if others_write else f"group {st.st_gid}"
        raise ConfigError(
            f"{key}: {path!r} is writable by {who} without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace hetstore's "
            f"private files there with links to yours. Use a directory only you can write "
            f"(e.g. a subdirectory: mkdir -m 700 {os.path.join(path, os.environ.get('USER', 'me'))}), "
            f"or set the sticky bit as /tmp has it (chmod +t {path})"
        )


def make_private_dir(root_fd: int, name: str, where: str) -> int:
    """Create ``name`` (mode 0700) under ``root_fd`` and return its descriptor, checked to
    be the directory we created. ``where`` (the full path) is for messages."""
    os.mkdir(name, 0o700, dir_fd=root_fd)
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root_fd)
    except OSError as exc:
        raise PermissionError(
            exc.errno, f"{where} was replaced right after hetstore created it ({exc.strerror})"
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{where} was replaced right after hetstore created it")
        os.fchmod(fd, 0o700)  # mkdir's mode passed through the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private_file(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """Create ``name`` under ``dir_fd`` (it must not exist; never through a link) and
    return its descriptor, checked to be a regular file of ours."""
    fd = os.open(
        name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd
    )
    try:
        check_private_file(fd, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_file(fd: int, name: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{name} is not a regular file of this user")


def read_small_file(dir_fd: int, name: str, limit: int) -> bytes:
    """The bytes of regular file ``name`` under ``dir_fd``, at most ``limit``: never
    through a link, never blocking on a FIFO or device. Raises OSError/ValueError."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{name} is {st.st_size} bytes, more than {limit}")
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)
