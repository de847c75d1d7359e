"""The disk tier: page-aligned regions in private files under ``offload_path``.

Layout. Each process (and rank) owns one directory under the root,
``hetstore-<hostname>-pid<pid>-rank<rank>-<random>`` (mode 0700), with an ``owner.json``
(pid, hostname, start time, boot and pid-namespace ids) and one file per region (mode
0600). The directory and its files are removed by :meth:`DiskTier.close`, by a
``weakref.finalize`` when the tier is collected, and at interpreter exit. What a crash
leaves behind is removed by the next tier started on the same root and host.

One file per region, recycled. Every region is its own file, preallocated with
``posix_fallocate`` (so a full disk shows up at ``allocate`` and not in the middle of a
step). A freed region's file is kept, still open, and handed to the next request of the
same rounded size: on this machine overwriting written blocks ran ~1.5-2x faster than the
first write into freshly allocated or fallocated blocks (ext4 converts unwritten extents
on first write), and training asks for the same sizes every step. Kept files count
against the capacity and are deleted first when a request needs the room. One file per
region rather than a sub-allocator in a few large files: no fragmentation, a region's
bytes go back to the file system the moment its file is deleted, and the file is the
unit of cleanup; the cost is one open fd per live or kept region.

Reads of bytes never written raise :class:`~hetstore.errors.DiskIOError` at ``read()``
(a recycled file still holds its previous region's bytes, so "zeros" could not be
promised cheaply). A write of ``[a, b)`` owns the rest of its last page (see
:mod:`hetstore.tiers.aio`): bytes in ``[b, next 4096 boundary)`` count as unwritten after it.
"""

from __future__ import annotations

import bisect
import errno as errno_mod
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat as stat_mod
import threading
import time
import weakref
from collections import defaultdict

import torch

from hetstore._safefs import (
    create_private_file,
    make_private_dir,
    missing_dirs,
    open_root,
    read_small_file,
    remove_empty_dirs,
)
from hetstore._sizes import format_size, parse_size
from hetstore.errors import DiskIOError, OutOfTierMemory
from hetstore.tier import Tier
from hetstore.tiers.accounting import FlatAllocation, TierUsage
from hetstore.tiers.aio import ALIGNMENT, AsyncIOEngine, DiskFile, IOHandle

__all__ = ["DiskRegion", "DiskTier", "reclaim_leftovers"]

logger = logging.getLogger(__name__)

MiB = 2**20
_DIR_RE = re.compile(
    r"^hetstore-(?P<host>.+)-pid(?P<pid>\d+)-rank(?P<rank>\d+)-(?P<tag>[0-9a-f]+)$"
)
_OWNER = "owner.json"


def _round_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


class _Intervals:
    """Sorted, merged half-open byte ranges: which bytes of a region hold written data."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, a: int, b: int) -> None:
        if a >= b:
            return
        i = bisect.bisect_left(self.ends, a)  # first range that ends at or after a
        j = bisect.bisect_right(self.starts, b)  # ranges before j start at or before b
        if i < j:
            a, b = min(a, self.starts[i]), max(b, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [a], [b]

    def remove(self, a: int, b: int) -> None:
        if a >= b:
            return
        i = bisect.bisect_right(self.ends, a)  # first range that ends after a
        j = bisect.bisect_left(self.starts, b)  # ranges before j start before b
        if i >= j:
            return
        starts, ends = [], []
        if self.starts[i] < a:
            starts.append(self.starts[i])
            ends.append(a)
        if self.ends[j - 1] > b:
            starts.append(b)
            ends.append(self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = starts, ends

    def covers(self, a: int, b: int) -> bool:
        if a >= b:
            return True
        i = bisect.bisect_right(self.starts, a) - 1
        return i >= 0 and self.ends[i] >= b

    def first_gap(self, a: int, b: int) -> int:
        """The first byte in ``[a, b)`` not covered (``b`` if all are)."""
        i = bisect.bisect_right(self.starts, a) - 1
        if i >= 0 and self.ends[i] > a:
            return min(self.ends[i], b)
        return a


class DiskRegion:
    """``nbytes`` bytes at ``offset`` of ``file``, reserved as ``size`` (a multiple of 4096).

    Created by :meth:`DiskTier.allocate`; move bytes with :meth:`DiskTier.write` and
    :meth:`DiskTier.read`; give back with :meth:`DiskTier.free`.
    """

    __slots__ = ("file", "offset", "nbytes", "size", "label", "freed", "_written")

    def __init__(self, file: DiskFile, offset: int, nbytes: int, size: int, label: str):
        self.file = file
        self.offset = offset
        self.nbytes = nbytes
        self.size = size
        self.label = label
        self.freed = False
        self._written = _Intervals()

    def forget_written(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` no longer hold what was last written (a write into
        them failed): reading them raises until they are written again."""
        self._written.remove(start, end)

    def __repr__(self) -> str:
        state = ", freed" if self.freed else ""
        return f"DiskRegion({self.label!r}, {format_size(self.nbytes)}, {self.file.path}{state})"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _identity() -> dict:
    """What tells this process apart: used in our owner file and to judge others'."""
    pid = os.getpid()
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {
        "pid": pid,
        "hostname": socket.gethostname(),
        "start_time": time.time(),
        "proc_start_ticks": proc_start_ticks(pid),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
    }


def _owner_alive(owner: dict, me: dict) -> bool:
    """True unless we can tell that the process that owns a directory is gone.

    Directories of other hosts, and of other pid namespaces (containers sharing the disk),
    count as alive: we cannot check them, so we never touch them.
    """
    if owner.get("hostname") != me["hostname"]:
        return True
    if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
        return False  # the machine rebooted since: every process of that boot is gone
    if owner.get("pidns") and me["pidns"] and owner["pidns"] != me["pidns"]:
        return True
    pid = int(owner["pid"])
    if pid == me["pid"]:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to another user
    ticks = owner.get("proc_start_ticks")
    return ticks is None or proc_start_ticks(pid) in (None, ticks)  # else: pid reused


def _du(path: str) -> int:
    """Bytes allocated on disk under ``path``."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def reclaim_leftovers(root: str | os.PathLike, root_fd: int | None = None) -> tuple[int, int]:
    """Remove the directories that crashed hetstore processes of this host left in ``root``.

    Returns ``(directories removed, bytes reclaimed)`` and logs one warning line if any.
    Directories whose owner is alive, of another host, of another pid namespace or of
    another user, and anything not named like ours, are left alone; a directory whose
    owner file cannot be judged (garbled, hostile) is skipped with a warning. Entries are
    examined and removed relative to a descriptor of ``root`` (``root_fd`` if given),
    never through a link.
    """
    own_fd = root_fd is None
    if own_fd:
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, 0
    try:
        return _reclaim(os.fspath(root), root_fd)
    finally:
        if own_fd:
            os.close(root_fd)


def _reclaim(root: str, root_fd: int) -> tuple[int, int]:
    me = _identity()
    removed, reclaimed = 0, 0
    for entry in list(os.scandir(root_fd)):
        match = _DIR_RE.match(entry.name)
        if match is None:
            continue
        try:
            st = os.stat(entry.name, dir_fd=root_fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue  # a link, a file, or another user's: never ours to remove
        try:
            owner = {"hostname": match["host"], "pid": int(match["pid"])}
            owner.update(_read_owner(root_fd, entry.name))
            alive = _owner_alive(owner, me)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            logger.warning(
                "hetstore: skipping %s: its owner file or name cannot be judged (%s: %s); "
                "remove it by hand if no hetstore process uses it",
                os.path.join(root, entry.name),
                type(exc).__name__,
                exc,
            )
            continue
        if alive:
            continue
        size = _du(os.path.join(root, entry.name))
        shutil.rmtree(entry.name, dir_fd=root_fd, ignore_errors=True)
        try:
            os.stat(entry.name, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            removed += 1
            reclaimed += size
    if removed:
        logger.warning(
            "hetstore: removed %d leftover offload director%s of dead processes under %s, "
            "reclaiming %s",
            removed,
            "y" if removed == 1 else "ies",
            root,
            format_size(reclaimed),
        )
    return removed, reclaimed


def _read_owner(root_fd: int, name: str) -> dict:
    """A leftover directory's owner file; {} when missing (crashed before writing it, or
    being created right now: judged by the name). Raises ValueError when garbled."""
    try:
        dir_fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd
        )
    except OSError:
        return {}
    try:
        data = read_small_file(dir_fd, _OWNER, limit=64 * 1024)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"{_OWNER}: {exc.strerror}") from exc
    finally:
        os.close(dir_fd)
    owner = json.loads(data.decode("utf-8"))  # UnicodeDecodeError is a ValueError
    if not isinstance(owner, dict):
        raise ValueError(f"{_OWNER} is not a JSON object")
    return owner


class _TierFiles:
    """The files and directory of one tier: what must go when the tier does.

    Kept apart from :class:`DiskTier` so that its finalizer holds no reference to the tier.
    """

    def __init__(self, path: str, root_fd: int, dir_fd: int, created: list[str]):
        self.path = path
        # the offload root and parents this tier created, removed with it when empty
        # (a run leaves no empty ./offload behind; another process's entries keep them)
        self.created = created
        self.root_fd = root_fd  # the offload root, held open: entries are removed by name
        self.dir_fd = dir_fd  # our private directory: files are created relative to it
        self.files: set[DiskFile] = set()
        self.closed = False

    def cleanup(self, engine: AsyncIOEngine | None) -> None:
        if self.closed:
            return
        self.closed = True
        if engine is not None:
            engine.close()
        for f in self.files:
            try:
                f.close()
            except OSError:
                pass
        self.files.clear()
        os.close(self.dir_fd)
        shutil.rmtree(os.path.basename(self.path), dir_fd=self.root_fd, ignore_errors=True)
        os.close(self.root_fd)
        remove_empty_dirs(self.created)


class DiskTier:
    """Disk capacity under ``root``, handed out as page-aligned regions.

    Args:
        root: the offload directory (``offload_path``); created if missing.
        capacity: most bytes of regions alive at once (``offload_disk_size``): an int, a
            size string such as ``"200GB"``, or None for the free space at start.
        rank: distinguishes the directories of processes of one job.
        engine: the IO engine to use; by default the tier makes (and closes) its own
            from ``block_size``, ``queue_depth``, ``threads`` and ``enable_aio``.

    Raises ``OutOfTierMemory(tier=Tier.DISK.label)`` if ``capacity`` exceeds the free space.
    """

    def __init__(
        self,
        *,
        root: str | os.PathLike,
        capacity: int | str | None,
        rank: int = 0,
        engine: AsyncIOEngine | None = None,
        block_size: int = 8 * MiB,
        queue_depth: int = 32,
        threads: int = 0,
        enable_aio: bool = True,
    ):
        self.root = os.path.abspath(os.fspath(root))
        self._owns_engine = engine is None
        self.engine = engine or AsyncIOEngine(  # first: a bad setting leaves nothing behind
            block_size=block_size, queue_depth=queue_depth, threads=threads, enable_aio=enable_aio
        )
        created = missing_dirs(self.root)
        root_fd = open_root(self.root, "offload_path")
        self._files: _TierFiles | None = None
        try:
            reclaim_leftovers(self.root, root_fd)
            self.capacity = self._checked_capacity(capacity, root_fd)
            me = _identity()
            name = f"hetstore-{me['hostname']}-pid{me['pid']}-rank{rank}-{secrets.token_hex(4)}"
            self.path = os.path.join(self.root, name)
            dir_fd = make_private_dir(root_fd, name, self.path)
            self._files = _TierFiles(self.path, root_fd, dir_fd, created)  # owns both fds now
            self._finalizer = weakref.finalize(
                self, _TierFiles.cleanup, self._files, self.engine if self._owns_engine else None
            )
            # written whole under another name, then renamed: another process sweeping
            # the same root (a sibling rank starting now) sees no owner file (judged by
            # the directory's name) or a whole one, never an empty one it cannot judge
            fd = create_private_file(dir_fd, _OWNER + ".new", os.O_WRONLY)
            with os.fdopen(fd, "w") as f:
                json.dump({**me, "rank": rank}, f)
            os.rename(_OWNER + ".new", _OWNER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            if self._files is None:
                os.close(root_fd)
                remove_empty_dirs(created)
            else:
                self._finalizer()
            raise
        self._lock = threading.Lock()
        self._kept: dict[int, list[DiskFile]] = defaultdict(list)  # freed files, by size
        self._kept_bytes = 0
        self._by_label: dict[str, int] = defaultdict(int)
        self._seq = 0
        self._current = 0
        self._peak = 0
        self.bytes_read = 0  # bytes submitted for reading / writing since creation
        self.bytes_written = 0
        # reads and writes may be submitted from the optimizer's step-ahead thread too
        # (hetstore.optim.step_ahead): the counters are updated under this lock
        self._counters = threading.Lock()

    def _checked_capacity(self, capacity: int | str | None, root_fd: int) -> int:
        st = os.fstatvfs(root_fd)
        free = st.f_bavail * st.f_frsize
        cap = free if capacity is None else parse_size(capacity)
        if cap > free:
            raise OutOfTierMemory(
                f"disk tier: offload_disk_size is {format_size(cap)} but only "
                f"{format_size(free)} is free under offload_path {self.root}. Lower "
                f"offload_disk_size to at most {format_size(free)}, free space there, or "
                f"change offload_path to a larger disk.",
                tier=Tier.DISK.label,
                requested=cap,
                capacity=free,
            )
        return cap

    # -- accounting -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """``{"current", "peak", "capacity"}`` in bytes (region sizes, page-rounded), plus
        ``bytes_read`` / ``bytes_written``: the traffic submitted since creation."""
        return {
            "current": self._current,
            "peak": self._peak,
            "capacity": self.capacity,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }

    @property
    def kept_bytes(self) -> int:
        """Bytes of freed region files kept for reuse (on disk, not in ``current``)."""
        return self._kept_bytes

    def _holders(self, top: int = 5) -> str:
        items = sorted(((n, lab) for lab, n in self._by_label.items() if n), reverse=True)
        if not items:
            return "none"
        text = ", ".join(f"{lab!r} {format_size(n)}" for n, lab in items[:top])
        return text + (f" and {len(items) - top} more" if len(items) > top else "")

    def _out_of_capacity(self, nbytes: int, size: int, label: str, reason: str) -> OutOfTierMemory:
        st = os.statvfs(self.root)
        return OutOfTierMemory(
            f"disk tier out of memory: cannot allocate {format_size(size)} ({nbytes} bytes) "
            f"for {label!r}: {reason}. Capacity (offload_disk_size) {format_size(self.capacity)}, "
            f"in use {format_size(self._current)}, peak {format_size(self._peak)}, "
            f"free on the file system {format_size(st.f_bavail * st.f_frsize)}. "
            f"Largest holders: {self._holders()}. Raise offload_disk_size (or free space "
            f"under offload_path {self.root}, or point it at a larger disk), offload fewer "
            f"states to disk, or free regions that are no longer needed.",
            tier=Tier.DISK.label,
            requested=size,
            capacity=self.capacity,
        )

    # -- regions ----------------------------------------------------------------------

    def usage(self) -> TierUsage:
        return TierUsage(Tier.DISK.label, self._current, self._peak, self.capacity)

    def allocate_flat(self, numel: int, dtype: torch.dtype, label: str) -> FlatAllocation:
        """A ``DiskArray`` of ``numel`` elements, freed by the allocation's ``free``."""
        from hetstore.tiers.flat import DiskArray  # it builds on this module

        array = DiskArray(self, numel, dtype, label)
        return FlatAllocation(array, array.free, tier=Tier.DISK)

    @staticmethod
    def reserved_size(nbytes: int) -> int:
        """The capacity an allocation of ``nbytes`` takes (rounded up to the alignment)."""
        return _round_up(nbytes)

    def would_fit(self, nbytes: int) -> bool:
        """True when ``nbytes`` more (rounded up to 4096) stay within the capacity."""
        with self._lock:
            return self._current + _round_up(nbytes) <= self.capacity

    def allocate(self, nbytes: int, label: str) -> DiskRegion:
        """Reserve ``nbytes`` (rounded up to 4096) of disk, preallocated, for ``label``.

        Raises ``OutOfTierMemory(tier=Tier.DISK.label)`` if the capacity would be passed or the
        file system is full.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = _round_up(nbytes)
        with self._lock:
            self._check_open()
            if self._current + size > self.capacity:
                raise self._out_of_capacity(nbytes, size, label, "the capacity would be passed")
            kept = self._kept.get(size)
            if kept:
                file = kept.pop()
                self._kept_bytes -= size
            else:
                self._drop_kept(self._current + self._kept_bytes + size - self.capacity)
                file = self._new_file(nbytes, size, label)
            self._current += size
            self._peak = max(self._peak, self._current)
            self._by_label[label] += size
        return DiskRegion(file, 0, nbytes, size, label)

    def _new_file(self, nbytes: int, size: int, label: str) -> DiskFile:
        self._seq += 1
        path = os.path.join(self.path, f"r{self._seq:06d}.bin")
        file = DiskFile(path, direct=True, create=True, mode=0o600, dir_fd=self._files.dir_fd)
        self._files.files.add(file)
        try:
            for attempt in range(2):
                try:
                    if size:
                        os.posix_fallocate(file.fd, 0, size)
                    return file
                except OSError as exc:
                    if exc.errno not in (errno_mod.ENOSPC, errno_mod.EDQUOT) or attempt:
                        raise
                    self._drop_kept(self._kept_bytes)  # give back every kept file, retry
        except OSError as exc:
            self._delete(file)
            if exc.errno in (errno_mod.ENOSPC, errno_mod.EDQUOT):
                raise self._out_of_capacity(
                    nbytes, size, label, "the file system under offload_path is full"
                ) from exc
            raise DiskIOError(
                f"preallocating {format_size(size)} in {path} failed: {exc.strerror}. "
                f"Check the disk and permissions under offload_path {self.root}.",
                path=path,
                offset=0,
                errno=exc.errno,
            ) from exc
        raise AssertionError("unreachable")

    def _drop_kept(self, need: int) -> None:
        """Delete kept files, largest first, until ``need`` bytes are given back."""
        for size in sorted(self._kept, reverse=True):
            files = self._kept[size]
            while files and need > 0:
                self._delete(files.pop())
                self._kept_bytes -= size
                need -= size

    def _delete(self, file: DiskFile) -> None:
        self._files.files.discard(file)
        file.close()
        try:
            os.unlink(os.path.basename(file.path), dir_fd=self._files.dir_fd)
        except FileNotFoundError:
            pass

    def free(self, region: DiskRegion) -> None:
        """Give ``region`` back. Waits for transfers still running on it."""
        with self._lock:
            if region.freed:
                raise ValueError(f"{region!r} was freed already")
            region.freed = True
            self._current -= region.size
            self._by_label[region.label] -= region.size
            if not self._by_label[region.label]:
                del self._by_label[region.label]
        region.file.wait_idle()  # outside the lock: other threads may allocate meanwhile
        with self._lock:
            if self._files.closed or region.file.closed:
                return
            self._kept[region.size].append(region.file)
            self._kept_bytes += region.size

    # -- IO ---------------------------------------------------------------------------

    def _check_range(self, region: DiskRegion, buffer: torch.Tensor, offset: int) -> int:
        if region.freed:
            raise ValueError(f"{region!r} was freed")
        n = buffer.numel() * buffer.element_size()
        if offset < 0 or offset + n > region.nbytes:
            raise ValueError(
                f"bytes [{offset}, {offset + n}) are outside {region!r} of {region.nbytes} bytes"
            )
        return n

    def write(self, region: DiskRegion, buffer: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start writing ``buffer``'s bytes at byte ``offset`` of ``region``.

        Do not modify ``buffer`` until the handle is done. Bytes from the end of the write
        to the next 4096 boundary are overwritten (see the module docstring).
        """
        n = self._check_range(region, buffer, offset)
        region._written.add(offset, offset + n)
        region._written.remove(offset + n, _round_up(offset + n))
        with self._counters:
            self.bytes_written += n
        return self.engine.submit_write(region.file, region.offset + offset, buffer)

    def read(self, region: DiskRegion, buffer: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start reading ``buffer``'s bytes from byte ``offset`` of ``region``.

        Raises ``DiskIOError`` at once if any of those bytes was never written.
        """
        n = self._check_range(region, buffer, offset)
        if not region._written.covers(offset, offset + n):
            gap = region._written.first_gap(offset, offset + n)
            raise DiskIOError(
                f"read of bytes [{offset}, {offset + n}) of {region!r}: byte {gap} was never "
                f"written (or was overwritten by the zero padding of a write ending in the "
                f"same 4096-byte page). Write a region before reading it.",
                path=region.file.path,
                offset=region.offset + gap,
            )
        with self._counters:
            self.bytes_read += n
        return self.engine.submit_read(region.file, region.offset + offset, buffer)

    # -- lifetime ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._files.closed:
            raise RuntimeError(f"the disk tier at {self.path} is closed")

    @property
    def closed(self) -> bool:
        return self._files.closed

    def close(self) -> None:
        """Wait for running transfers, delete every file and the directory (idempotent)."""
        self._finalizer()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DiskTier({self.path}, current={format_size(self._current)}, "
            f"peak={format_size(self._peak)}, capacity={format_size(self.capacity)})"
        )
