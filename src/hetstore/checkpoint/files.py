"""The checkpoint's files: written atomically, verified on read.

A checkpoint at ``path`` is a directory of *versions* and one pointer file:

    path/
      LATEST                 "v000002 index.json 1234 89abcdef\n": the complete version, its
                             index's size and CRC-32; replaced atomically
      v000002/
        index.json           every file with its size and CRC-32, written last
        unit-00000.safetensors, optimizer.json, ...

A save writes a new version directory next to the old one: every file is written,
flushed and fsynced, then the index, then the directory is fsynced, and only then is
``LATEST`` replaced (a temporary file fsynced, ``os.replace``, the parent fsynced). The
old version is deleted after that. A crash or SIGKILL at any moment therefore leaves
``LATEST`` naming a complete version: the previous one until the replace, the new one
after. Leftover partial versions are removed by the next save.

Reading checks everything before anything is used: ``LATEST`` is parsed strictly (one
changed byte makes it invalid, or names another size or CRC), the index must have the
size and CRC-32 ``LATEST`` gives (so the index, which holds every other file's checksum,
is checked too), its entries must have the expected types, and every file it names must
be a plain name (no ``/``, no ``..``), a regular file in the version directory (not a
symlink, FIFO, device or directory: they are looked at with ``lstat`` and opened with
``O_NOFOLLOW | O_NONBLOCK``, then checked again with ``fstat``) of the size the index
gives. No read is larger than the file it reads. A file is checked against its CRC-32 by
:meth:`CheckpointReader.verify`. A failure is a :class:`CheckpointError` naming the file.

Checkpoints written before the index was checksummed (``LATEST`` holding only the
version name) are refused: their index cannot be verified, and this format was never
released (hetstore 0.1.0), so no checkpoint of it exists to keep loading.
Files are written with O_DIRECT from page-aligned staging blocks, several in flight on
the disk tier's IO engine (buffered writes into the page cache ran at ~0.85 GB/s here,
a quarter of the disk), and fsynced. CRC-32 rather than SHA-256: it catches any flipped
byte or burst and ran at 6.2 GB/s against SHA-256's 1.7 on this machine; a checkpoint's
safety against a malicious file comes from never unpickling and from checking every
structure before it is used (here and in :mod:`.training`), not from the checksum.

Tensors are stored as safetensors (no pickle: nothing executable is loaded from a file),
other data as JSON. A tensor file can be streamed (:meth:`CheckpointWriter.stream_tensors`:
header first, then the data in pieces, hashed as it goes), so a caller moving a unit's
states from disk never holds more than its own buffers in memory; reading is streamed the
same way (:meth:`CheckpointReader.open_tensors`, after :meth:`CheckpointReader.verify`).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import json
import os
import re
import shutil
import stat
import warnings
import weakref
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from hetstore._safefs import check_shared_root
from hetstore.checkpoint.safetensors_stream import (
    SafetensorsFile,
    SafetensorsStreamWriter,
    TensorSpec,
    no_duplicates,
)
from hetstore.errors import DiskIOError, HetstoreError
from hetstore.tiers.aio import ALIGNMENT, AsyncIOEngine, DiskFile
from hetstore.tiers.hostmem import aligned_empty

__all__ = ["CheckpointError", "CheckpointWriter", "CheckpointReader"]

FORMAT = "hetstore-checkpoint"
FORMAT_VERSION = 1
_VERSION = re.compile(r"^v(\d{6})$")
_READ_BLOCK = 8 * 2**20  # bytes checked per read when verifying
_STAGING_BLOCK = 16 * 2**20  # bytes per O_DIRECT write; 3 in flight reach the disk's ceiling
_STAGING_DEPTH = 3
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
# LATEST: the version, its index's size and CRC-32. Strict: no leading zeros, lower-case
# hex, one newline, so any changed byte breaks the pattern or names another value.
_POINTER = re.compile(rb"(v\d{6}) index\.json (0|[1-9]\d{0,11}) ([0-9a-f]{8})\n")
_MAX_POINTER = 256  # bytes of LATEST read at most
_MAX_INDEX = 256 * 2**20  # an index past this is refused rather than read
_INDEX = "index.json"


class CheckpointError(HetstoreError, ValueError):
    """A checkpoint that is missing, incomplete, truncated or corrupted; names the file."""


def fsync_dir(path: Path) -> None:
    """Fsync the directory ``path``: the names created or renamed in it become durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_durable(path: Path, data: bytes) -> None:
    """Create ``path`` (new: never through a link or over a file) with ``data``, fsynced."""
    fd = os.open(path, _CREATE_NEW, 0o644)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Staging:
    """Page-aligned blocks shared by the files of one save (written one at a time)."""

    def __init__(self):
        self.blocks = [aligned_empty(_STAGING_BLOCK) for _ in range(_STAGING_DEPTH)]
        self.arrays = [memoryview(b.numpy()) for b in self.blocks]
        self.engine = AsyncIOEngine(block_size=4 * 2**20, queue_depth=16)

    def close(self) -> None:
        self.engine.close()


class DirectFile:
    """A new file filled by appending: bytes are copied into staging blocks, each full
    block is written with O_DIRECT while the next fills, and a CRC-32 is kept.
    :meth:`finish` writes the last block padded to a page, truncates the file to its
    real size and fsyncs it. (Where O_DIRECT is refused, tmpfs say, the same writes go
    through the page cache.)"""

    def __init__(self, path: Path, staging: Staging):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the buffered fallback is fine
            # created new, never through a link (a planted one fails the open); reopened
            # for direct IO where no one else can swap it (see CheckpointWriter._start)
            os.close(os.open(path, _CREATE_NEW, 0o644))
            self.file = DiskFile(path, direct=True, create=False)
        self.staging = staging
        self.handles: list = [None] * _STAGING_DEPTH
        self.current = 0  # staging block being filled
        self.fill = 0  # bytes in it
        self.offset = 0  # file offset of its first byte
        self.crc = 0
        self.bytes = 0
        self.failure: BaseException | None = None  # an error of this file's own writes

    def write(self, data) -> None:
        try:
            self._append(data)
        except BaseException as exc:
            self.failure = exc
            raise

    def _append(self, data) -> None:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.bytes += len(view)
        while len(view):
            n = min(len(view), _STAGING_BLOCK - self.fill)
            self.staging.arrays[self.current][self.fill : self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            if self.fill == _STAGING_BLOCK:
                self._submit(_STAGING_BLOCK)

    def _submit(self, length: int) -> None:
        block = self.staging.blocks[self.current][:length]
        self.handles[self.current] = self.staging.engine.submit_write(self.file, self.offset, block)
        self.offset += length
        self.current = (self.current + 1) % _STAGING_DEPTH
        self.fill = 0
        self._wait(self.current)  # the next block to fill must be written out first

    def _wait(self, index: int) -> None:
        handle, self.handles[index] = self.handles[index], None
        if handle is not None:
            handle.wait()

    def finish(self) -> None:
        try:
            self._finish()
        except BaseException as exc:
            self.failure = exc
            raise

    def _finish(self) -> None:
        if self.fill:
            padded = self.fill + (-self.fill % ALIGNMENT)
            self.staging.blocks[self.current][self.fill : padded].zero_()
            self._submit(padded)
        for index in range(_STAGING_DEPTH):
            self._wait(index)
        os.ftruncate(self.file.fd, self.bytes)
        os.fsync(self.file.fd)
        self.file.close()

    def abort(self) -> None:
        for index in range(_STAGING_DEPTH):
            with contextlib.suppress(BaseException):
                self._wait(index)
        self.file.close()


def _valid_name(name) -> bool:
    """A plain file name inside the version directory: no separator, not ``.``/``..``."""
    return (
        isinstance(name, str)
        and _NAME.fullmatch(name) is not None
        and name not in (_INDEX, ".", "..")
    )


def _check_name(name: str) -> None:
    if not _valid_name(name):
        raise ValueError(f"checkpoint file name {name!r}: use letters, digits, '_', '.', '-'")


def _versions(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _VERSION.match(p.name))


class CheckpointWriter:
    """Writes one new version of the checkpoint at ``path`` (see module doc).

    ``write_tensors`` / ``write_json`` add files; ``commit()`` makes the version the one
    ``LATEST`` names. Used as a context manager, an exception before ``commit`` removes
    the partial version and leaves the previous checkpoint as it was.
    """

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"checkpoint path {str(self.root)!r} exists and is not a directory"
            )
        try:
            self._start()
        except OSError as exc:  # the checkpoint's disk failed before any file was written
            if isinstance(exc, DiskIOError):
                raise
            raise self._write_error(self.root, exc) from exc
        self.files: dict[str, dict] = {}
        self.committed = False
        self._staging: Staging | None = None

    def _start(self) -> None:
        """Check the root, clear what dead saves left, and make this version's directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        # where others may write and rename, they could plant a link where the next
        # LATEST goes (see hetstore._safefs); a root like /tmp, with the sticky bit, is fine
        check_shared_root(os.stat(self.root), str(self.root), "checkpoint path")
        latest = _current_version(self.root)
        # partial versions of saves that died; none when LATEST exists but cannot be read
        # (a damaged pointer must not cost the version it pointed at)
        if latest is not None or not os.path.lexists(self.root / "LATEST"):
            for stale in _versions(self.root):
                if stale != latest:
                    shutil.rmtree(self.root / stale, ignore_errors=True)
        for pointer in self.root.glob(".LATEST.*"):  # their unfinished pointer files
            pointer.unlink(missing_ok=True)
        number = max((int(_VERSION.match(v).group(1)) for v in _versions(self.root)), default=0)
        self.version = f"v{number + 1:06d}"
        self.dir = self.root / self.version
        self.dir.mkdir()  # never through a link: mkdir fails on anything already there

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and not self.committed:
                self.abort()
        finally:
            self._close_staging()

    def _close_staging(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    @contextlib.contextmanager
    def _durable_file(self, name: str) -> Iterator[DirectFile]:
        """A new file of this version, checksummed as written, fsynced on exit.

        Only a failure of this file's own writes is reported as a failed write of the
        checkpoint file; an error raised by the code producing the data (reading the
        offload disk, say) goes up as it is, after the partial file is dropped."""
        _check_name(name)
        if name in self.files:
            raise ValueError(f"checkpoint file {name!r} written twice")
        if self._staging is None:
            self._staging = Staging()
        path = self.dir / name
        try:
            out = DirectFile(path, self._staging)
        except OSError as exc:
            raise self._write_error(path, exc) from exc
        try:
            yield out
            out.finish()
        except BaseException as exc:
            out.abort()
            if exc is out.failure and isinstance(exc, OSError):
                raise self._write_error(path, exc) from exc
            raise
        self.files[name] = {"bytes": out.bytes, "crc32": out.crc}

    def _write_error(self, path: Path, exc: OSError) -> DiskIOError:
        """A write of the checkpoint file ``path`` failed: the checkpoint's disk is at fault."""
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno in (errno_mod.ENOSPC, errno_mod.EDQUOT):
            advice = "free space there or save somewhere else"
        else:
            advice = "check the disk it is on (dmesg) or save somewhere else"
        return DiskIOError(
            f"saving checkpoint file {str(path)!r} failed: {reason}. The previous "
            f"checkpoint at {str(self.root)!r} is unchanged; {advice}",
            path=str(path),
            offset=getattr(exc, "offset", 0) or 0,
            errno=exc.errno,
        )

    def _add(self, name: str, data: bytes) -> None:
        with self._durable_file(name) as out:
            out.write(data)

    @contextlib.contextmanager
    def stream_tensors(
        self, name: str, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ) -> Iterator[SafetensorsStreamWriter]:
        """A safetensors file whose data the caller writes piece by piece, in the order of
        ``specs``; it must write every announced byte before the block ends."""
        with self._durable_file(name) as out:
            writer = SafetensorsStreamWriter(out, specs, metadata)
            yield writer
            writer.finish()

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """One safetensors file of ``tensors`` (small ones: each is written whole)."""
        specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
        with self.stream_tensors(name, specs) as writer:
            for tensor in tensors.values():
                writer.write(tensor)

    def write_json(self, name: str, value) -> None:
        self._add(name, json.dumps(value, sort_keys=True).encode())

    def commit(self, meta: dict | None = None) -> Path:
        """Write the index, then point ``LATEST`` at this version (with the index's size
        and CRC-32); the old version is removed."""
        index = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "files": self.files,
            "meta": meta or {},
        }
        self._close_staging()
        encoded = json.dumps(index, sort_keys=True, indent=1).encode()
        with self._writing(self.dir / _INDEX):
            write_durable(self.dir / _INDEX, encoded)
            fsync_dir(self.dir)
            fsync_dir(self.root)
        previous = _current_version(self.root)
        pointer = self.root / f".LATEST.{os.getpid()}"
        with self._writing(self.root / "LATEST"):
            write_durable(pointer, _pointer(self.version, encoded))
            os.replace(pointer, self.root / "LATEST")
            fsync_dir(self.root)
        self.committed = True
        if previous and previous != self.version:
            shutil.rmtree(self.root / previous, ignore_errors=True)
        return self.dir

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if isinstance(exc, DiskIOError):
                raise
            raise self._write_error(path, exc) from exc

    def abort(self) -> None:
        """Remove this partial version; the previous checkpoint stays as it was."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _pointer(version: str, index: bytes) -> bytes:
    """What ``LATEST`` holds: the version, its index's size and CRC-32."""
    return f"{version} {_INDEX} {len(index)} {zlib.crc32(index):08x}\n".encode()


_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _open_regular(name: str, dir_fd: int, shown: Path) -> tuple[int, os.stat_result]:
    """Open ``name`` in the directory ``dir_fd`` for reading, only if it is a regular
    file: looked at with ``lstat`` first (a FIFO or device is never opened), then opened
    without following a symlink and without blocking, and checked again by ``fstat``
    (the same file, still regular). ``shown`` is its path, for messages."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(shown)!r} is missing") from None
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint file {str(shown)!r} cannot be read: {exc.strerror}"
        ) from exc
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointError(
            f"checkpoint file {str(shown)!r} is {_kind(before.st_mode)}, not a regular file: "
            "refused (a checkpoint is made of regular files only)"
        )
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint file {str(shown)!r} cannot be opened: {exc.strerror}"
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (
            before.st_dev,
            before.st_ino,
        ):
            raise CheckpointError(f"checkpoint file {str(shown)!r} was replaced while opened")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _pread_exact(fd: int, n: int, shown: Path) -> bytes:
    """The first ``n`` bytes of a file known to hold at least ``n``."""
    parts, done = [], 0
    while done < n:
        part = os.pread(fd, min(n - done, _READ_BLOCK), done)
        if not part:
            raise CheckpointError(
                f"checkpoint file {str(shown)!r} is truncated: it ends at byte {done}, {n} expected"
            )
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def _json(data: bytes, shown: Path):
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint file {str(shown)!r} is not valid JSON: {exc}") from None


def _current_version(root: Path) -> str | None:
    """The version ``LATEST`` names, read leniently (by a save, to know what to keep and
    what to remove; a load reads it strictly): None when ``LATEST`` is missing or says
    nothing usable."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd, _ = _open_regular("LATEST", root_fd, root / "LATEST")
    except CheckpointError:
        return None
    finally:
        os.close(root_fd)
    try:
        words = os.pread(fd, _MAX_POINTER, 0).decode("ascii", "replace").split()
    except OSError:
        return None
    finally:
        os.close(fd)
    return words[0] if words and _VERSION.match(words[0]) else None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CheckpointReader:
    """The complete version ``LATEST`` names, every file checked before use.

    Opening reads and checks ``LATEST``, the index (its size and CRC-32 against
    ``LATEST``, its entries) and every file the index names (a regular file of the
    indexed size); :meth:`verify` checks the files' CRC-32. Files are opened relative to
    the version directory's descriptor (held until :meth:`close`), never through a
    symlink. Any failure is a :class:`CheckpointError` naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        self._dir_fd = -1
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise CheckpointError(
                f"no complete checkpoint at {str(self.root)!r} ({exc.strerror})"
            ) from None
        try:
            version, index_bytes, index_crc = self._read_pointer(root_fd)
            self.dir = self.root / version
            try:
                self._dir_fd = os.open(
                    version,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=root_fd,
                )
            except OSError as exc:
                why = exc.strerror
                if exc.errno in (errno_mod.ELOOP, errno_mod.ENOTDIR):
                    st = os.stat(version, dir_fd=root_fd, follow_symlinks=False)
                    why = f"it is {_kind(st.st_mode)}"
                raise CheckpointError(
                    f"checkpoint version {str(self.dir)!r} that {str(self.root / 'LATEST')!r} "
                    f"names is not a directory of the checkpoint: {why}"
                ) from None
        finally:
            os.close(root_fd)
        self._finalizer = weakref.finalize(self, os.close, self._dir_fd)
        try:
            self._read_index(index_bytes, index_crc)
        except BaseException:
            self.close()
            raise

    def _read_pointer(self, root_fd: int) -> tuple[str, int, int]:
        shown = self.root / "LATEST"
        if not os.path.lexists(shown):
            raise CheckpointError(f"no complete checkpoint at {str(self.root)!r} (no LATEST file)")
        fd, _ = _open_regular("LATEST", root_fd, shown)
        try:
            data = os.pread(fd, _MAX_POINTER + 1, 0)
        finally:
            os.close(fd)
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError as exc:
            raise CheckpointError(
                f"checkpoint pointer {str(shown)!r} is damaged: byte {data[exc.start]:#04x} at "
                f"offset {exc.start} is not ASCII"
            ) from None
        match = _POINTER.fullmatch(data)
        if match is None:
            if _VERSION.fullmatch(text.strip()):
                raise CheckpointError(
                    f"checkpoint pointer {str(shown)!r} names version {text.strip()!r} without "
                    "its index's checksum (written by a hetstore from before it had one): "
                    "the index cannot be verified, refused. If you trust the checkpoint, "
                    "write 'vNNNNNN index.json <bytes> <crc32 as 8 hex digits>' of its "
                    "index.json into LATEST"
                )
            raise CheckpointError(
                f"checkpoint pointer {str(shown)!r} is damaged: {text[:80]!r} is not "
                "'vNNNNNN index.json <bytes> <crc32>'"
            )
        version, size, crc = match.groups()
        return version.decode(), int(size), int(crc, 16)

    def _read_index(self, size: int, crc: int) -> None:
        shown = self.dir / _INDEX
        if size > _MAX_INDEX:
            raise CheckpointError(
                f"checkpoint index {str(shown)!r}: LATEST gives it {size} bytes, more than "
                f"the {_MAX_INDEX} an index may have"
            )
        fd, st = _open_regular(_INDEX, self._dir_fd, shown)
        try:
            if st.st_size != size:
                raise CheckpointError(
                    f"checkpoint index {str(shown)!r} is truncated or damaged: {st.st_size} "
                    f"bytes, LATEST says {size}"
                )
            data = _pread_exact(fd, size, shown)
        finally:
            os.close(fd)
        if zlib.crc32(data) != crc:
            raise CheckpointError(
                f"checkpoint index {str(shown)!r} is corrupted: its CRC-32 does not match "
                "the one LATEST gives"
            )
        index = _json(data, shown)
        if (
            not isinstance(index, dict)
            or index.get("format") != FORMAT
            or index.get("version") != FORMAT_VERSION
        ):
            raise CheckpointError(f"{str(shown)!r} is not a {FORMAT} v{FORMAT_VERSION} index")
        files, meta = index.get("files"), index.get("meta", {})
        if not isinstance(files, dict) or not isinstance(meta, dict):
            raise CheckpointError(f"{str(shown)!r}: 'files' and 'meta' must be objects")
        for name, entry in files.items():
            if not _valid_name(name):
                raise CheckpointError(
                    f"{str(shown)!r} names a file {name!r} that is not a plain file name in "
                    "the version directory (a path, '..', or other characters): refused"
                )
            if (
                not isinstance(entry, dict)
                or set(entry) != {"bytes", "crc32"}
                or not _is_count(entry["bytes"])
                or not _is_count(entry["crc32"])
                or entry["crc32"] >= 2**32
            ):
                raise CheckpointError(
                    f"{str(shown)!r}: the entry of {name!r} is not {{bytes, crc32}}: {entry!r}"
                )
        self.files: dict[str, dict] = files
        self.meta: dict = meta
        for name in files:
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint file {str(self.dir / name)!r} cannot be read: {exc.strerror}"
                ) from exc
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise CheckpointError(
                    f"checkpoint file {str(self.dir / name)!r} is {_kind(st.st_mode)}, not a "
                    "regular file: refused (a checkpoint is made of regular files only)"
                )
            size = None if st is None else st.st_size
            if size != files[name]["bytes"]:
                found = "missing" if size is None else f"{size} bytes"
                raise CheckpointError(
                    f"checkpoint file {str(self.dir / name)!r} is truncated or damaged: "
                    f"{found}, the index says {files[name]['bytes']}"
                )

    def close(self) -> None:
        """Close the version directory's descriptor (files opened from it stay usable)."""
        if self._dir_fd >= 0:
            self._finalizer()
            self._dir_fd = -1

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def names(self) -> list[str]:
        return list(self.files)

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"checkpoint {str(self.dir)!r} has no file {name!r}")
        return self.dir / name

    def _open(self, name: str) -> int:
        """A descriptor of the regular file ``name``, of the indexed size."""
        shown = self._file(name)
        if self._dir_fd < 0:
            raise CheckpointError(f"the reader of {str(self.dir)!r} is closed")
        fd, st = _open_regular(name, self._dir_fd, shown)
        if st.st_size != self.files[name]["bytes"]:
            os.close(fd)
            raise CheckpointError(
                f"checkpoint file {str(shown)!r} is truncated or damaged: {st.st_size} bytes, "
                f"the index says {self.files[name]['bytes']}"
            )
        return fd

    def _corrupted(self, name: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint file {str(self.dir / name)!r} is corrupted: its CRC-32 does not "
            "match the index"
        )

    def verify(self, names: list[str] | None = None) -> None:
        """Checksum every file (or ``names``) in blocks and compare with the index; a
        mismatch raises :class:`CheckpointError` naming the file. Nothing is kept in
        memory but one block, and no more than the indexed size is read."""
        block = bytearray(
            min(_READ_BLOCK, max((e["bytes"] for e in self.files.values()), default=0)) or 1
        )
        view = memoryview(block)
        for name in self.names() if names is None else names:
            fd = self._open(name)
            size, crc, done = self.files[name]["bytes"], 0, 0
            try:
                # the load reads these bytes again: through the page cache, with a long
                # readahead, so the second pass is served from memory
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while done < size:
                    n = os.preadv(fd, [view[: min(len(view), size - done)]], done)
                    if n == 0:
                        break
                    crc = zlib.crc32(view[:n], crc)
                    done += n
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint file {str(self.dir / name)!r} cannot be read: {exc.strerror}"
                ) from exc
            finally:
                os.close(fd)
            if done != size or crc != self.files[name]["crc32"]:
                raise self._corrupted(name)

    def _read(self, name: str) -> bytes:
        fd = self._open(name)
        try:
            data = _pread_exact(fd, self.files[name]["bytes"], self.dir / name)
        finally:
            os.close(fd)
        if zlib.crc32(data) != self.files[name]["crc32"]:
            raise self._corrupted(name)
        return data

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A small safetensors file whole (checked against its hash first)."""
        self.verify([name])
        with self.open_tensors(name) as f:
            try:
                return {key: f.read(key) for key in f.keys()}
            except (OSError, ValueError) as exc:
                raise CheckpointError(
                    f"checkpoint file {str(self.dir / name)!r} is unreadable: {exc}"
                ) from exc

    def open_tensors(self, name: str) -> SafetensorsFile:
        """A safetensors file to read in pieces, its header parsed and checked (see
        :class:`SafetensorsFile`). Its size was checked when the reader opened; call
        :meth:`verify` first for the content."""
        fd = self._open(name)
        try:
            return SafetensorsFile(self.dir / name, fd=fd)
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint file {str(self.dir / name)!r} is unreadable: {exc}"
            ) from exc

    def read_json(self, name: str):
        return _json(self._read(name), self.dir / name)
