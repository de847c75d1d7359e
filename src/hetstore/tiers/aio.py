"""The async IO engine of the disk tier: O_DIRECT reads and writes served by a worker pool.

A transfer (one tensor <-> one file range) is split into requests of at most ``block_size``
bytes. Worker threads serve them with ``os.preadv``/``os.pwritev`` straight between the
file and the tensor's memory (no copy; both calls release the GIL), so up to
``min(threads, queue_depth)`` requests are in the kernel at once. ``IOHandle.wait()``
returns when every request of the transfer has finished, and raises the first error.

Alignment (O_DIRECT needs 4096-aligned memory address, file offset and length):

* If the buffer address and the file offset are congruent modulo 4096 (the common case:
  page-aligned buffers at aligned offsets), everything between the first and the last
  page boundary goes direct; an unaligned head and tail each go through a one-page
  bounce buffer. Otherwise the whole transfer goes through bounce buffers (one memcpy).
* Writes **own the rest of their last page**: the bytes between the end of a write and
  the next 4096-byte boundary of the file are undefined afterwards (O_DIRECT writes
  zeros there). No read-modify-write is done for a tail, because the disk tier hands out
  whole page-rounded regions. The bytes *before* an unaligned start offset, in the same
  page, are preserved (that one page is read, patched and written back).
* Consequently two transfers in flight at once must not touch the same 4096-byte page of a
  file (distinct disk-tier regions never do).

Two lanes: requests submitted from a thread marked as background (``background_io()``:
the optimizer's step worker, whose steps run beside forward and backward) are served
after every request of the other threads that is queued (FIFO within each lane). The
compute path's reads (a parameter fetch or prefetch a unit's forward or backward waits
for) then never queue behind a step's megabytes of state IO. The order requests are
served in was never a guarantee of the order they finish in (several threads serve
them), so no caller relies on it.

Files whose file system refuses O_DIRECT (``open`` fails with EINVAL) use buffered IO, with
one warning per directory; no alignment is needed there.

Errors (disk full, IO error, short read, closed engine) reach ``IOHandle.wait()`` as
:class:`hetstore.errors.DiskIOError` naming path, offset, errno and the fix. A failed
transfer's requests that had not started are skipped, the ones in flight are waited for,
and only then does ``wait()`` raise: no worker touches the buffer after ``wait()`` returns
or raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_mod
import os
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from hetstore._safefs import create_private_file
from hetstore.errors import ConfigError, DiskIOError
from hetstore.tiers.hostmem import aligned_empty

__all__ = ["ALIGNMENT", "AsyncIOEngine", "DiskFile", "IOHandle", "DEFAULT_THREADS", "background_io"]

_THREAD = threading.local()


def background_io() -> None:
    """Mark the calling thread's transfers as background: served after the queued
    requests of every other thread (see the module doc). For the life of the thread."""
    _THREAD.background = True


def _is_background() -> bool:
    return getattr(_THREAD, "background", False)


ALIGNMENT = 4096  # O_DIRECT alignment of address, offset and length (logical block size)
MiB = 2**20

# Measured with benchmarks/disk_io.py on the 2-vCPU virtio/ext4 project machine (see
# docs/dev/BENCHMARKS.md): throughput reaches the disk's ceiling once about 16 MiB are in
# flight (threads x block_size) and stays flat up to 16 threads; 1 MiB x 2 threads lost
# ~40%. 8 threads x 8 MiB keeps the ceiling for transfers of a few blocks and for many
# small transfers at once, at no measurable cost (the threads sleep in preadv/pwritev).
DEFAULT_THREADS = 8


class DiskFile:
    """One open file of the disk tier: path, a read-write fd, whether O_DIRECT is in use.

    The fd is shared by all requests (``pread``/``pwrite`` carry their own offset). The
    file counts the transfers in flight on it so that ``close()`` can wait for them: an fd
    number closed under a running request could be reused by another ``open`` and the
    request would then write into the wrong file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        direct: bool = True,
        create: bool = True,
        mode: int = 0o600,
        dir_fd: int | None = None,
    ):
        """With ``dir_fd`` (a directory descriptor of ours), the file is created new, by
        its base name relative to that descriptor and never through a link (see
        :mod:`hetstore._safefs`); ``path`` is then what messages call it."""
        self.path = os.fspath(path)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        self.direct = False
        if direct:
            try:
                self.fd = self._open(flags | os.O_DIRECT, mode, dir_fd)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise _open_error(self.path, exc) from exc
                if dir_fd is not None:  # the failed open may have created it: start over
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.basename(self.path), dir_fd=dir_fd)
                # tmpfs before Linux 6.6, character devices, some FUSE/network file systems.
                warnings.warn(
                    f"hetstore: O_DIRECT is not supported for files in "
                    f"{os.path.dirname(os.path.abspath(self.path))!r}; using buffered IO there "
                    f"(slower, and it fills the page cache). Point offload_path at a local "
                    f"ext4/xfs disk for direct IO.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if not self.direct:
            try:
                self.fd = self._open(flags, mode, dir_fd)
            except OSError as exc:
                raise _open_error(self.path, exc) from exc
        self._pending = 0
        self._idle = threading.Condition()

    def _open(self, flags: int, mode: int, dir_fd: int | None) -> int:
        if dir_fd is None:
            return os.open(self.path, flags, mode)
        return create_private_file(dir_fd, os.path.basename(self.path), flags, mode)

    @property
    def size(self) -> int:
        """Current size of the file in bytes."""
        return os.fstat(self.fd).st_size

    @property
    def closed(self) -> bool:
        return self.fd < 0

    @property
    def pending(self) -> int:
        """Requests submitted on this file that have not finished."""
        return self._pending

    def wait_idle(self) -> None:
        """Block until no transfer submitted on this file is still running."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        """Wait for the transfers in flight on this file, then close the fd (idempotent)."""
        self.wait_idle()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _begin(self) -> None:
        with self._idle:
            if self.fd < 0:
                raise ValueError(f"{self.path} is closed")
            self._pending += 1

    def _end(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def __repr__(self) -> str:
        return f"DiskFile({self.path!r}, fd={self.fd}, direct={self.direct})"


def _open_error(path: str, exc: OSError) -> DiskIOError:
    return DiskIOError(
        f"cannot open {path}: {exc.strerror} ({errno_mod.errorcode.get(exc.errno, exc.errno)}). "
        f"Check that offload_path exists and is writable by this user.",
        path=path,
        offset=0,
        errno=exc.errno,
    )


@dataclass(eq=False)
class _Transfer:
    """One submitted transfer: its requests, their completion count and the first error."""

    file: DiskFile
    write: bool
    offset: int
    nbytes: int
    buffer: torch.Tensor | None  # kept alive until every request has finished
    remaining: int = 0
    errors: list[DiskIOError] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)

    def request_done(self, error: DiskIOError | None = None) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(error)
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.buffer = None
            self.file._end()
            self.finished.set()

    @property
    def failed(self) -> bool:
        return bool(self.errors)


@dataclass(eq=False, slots=True)
class _Request:
    """At most ``block_size`` bytes of a transfer.

    Direct when ``span == 0``: ``length`` bytes between ``addr`` and ``file_offset``.
    Bounced otherwise: the file range ``[file_offset, file_offset + span)`` (whole pages)
    goes through a bounce buffer, of which bytes ``[skip, skip + length)`` are the data.
    """

    transfer: _Transfer
    file_offset: int
    addr: int
    length: int
    skip: int = 0
    span: int = 0


class IOHandle:
    """The pending result of one submitted transfer."""

    def __init__(self, transfer: _Transfer):
        self._transfer = transfer

    @property
    def nbytes(self) -> int:
        return self._transfer.nbytes

    def done(self) -> bool:
        """True when every request has finished (successfully or not)."""
        return self._transfer.finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer has finished; raise its first error as ``DiskIOError``.

        Raises ``TimeoutError`` if ``timeout`` seconds pass first (the transfer goes on).
        """
        t = self._transfer
        if not t.finished.wait(timeout):
            raise TimeoutError(
                f"{'write' if t.write else 'read'} of {t.nbytes} bytes at offset {t.offset} "
                f"in {t.file.path} not finished after {timeout} s"
            )
        if t.errors:
            first = t.errors[0]
            more = sum(e.errno != errno_mod.ECANCELED for e in t.errors[1:])
            if more and not getattr(first, "__notes__", None) and hasattr(first, "add_note"):
                first.add_note(f"({more} more request(s) of this transfer failed too)")
            raise first

    def __repr__(self) -> str:
        t = self._transfer
        state = "failed" if t.failed else ("done" if self.done() else "pending")
        op = "write" if t.write else "read"
        return f"IOHandle({op} {t.nbytes} B @ {t.offset} of {t.file.path}, {state})"


class _BouncePool:
    """Page-aligned (huge-page advised) staging buffers of ``block_size`` bytes, reused."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_empty(self.nbytes)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _advice(err: int | None, write: bool) -> str:
    if err in (errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG):
        return (
            "The disk under offload_path is full: free space there, lower offload_disk_size, "
            "or point offload_path at a larger disk."
        )
    if err == errno_mod.EIO:
        return (
            "The device reported an I/O error: check the disk (dmesg), or move offload_path "
            "to another device."
        )
    if err == errno_mod.EBADF:
        return (
            "The file was closed while the transfer was pending: wait for every IOHandle "
            "before freeing a region or closing the tier."
        )
    if err == errno_mod.EINVAL:
        return (
            "The kernel rejected the request (O_DIRECT alignment?): this is a hetstore bug; "
            "please report it with the offsets above."
        )
    return "Check the disk and permissions under offload_path."


def _os_error(req: _Request, exc: OSError) -> DiskIOError:
    t = req.transfer
    op = "write" if t.write else "read"
    name = errno_mod.errorcode.get(exc.errno, str(exc.errno))
    return DiskIOError(
        f"disk {op} of {req.length} bytes at offset {req.file_offset + req.skip} in "
        f"{t.file.path} failed: {exc.strerror} ({name}). {_advice(exc.errno, t.write)}",
        path=t.file.path,
        offset=req.file_offset + req.skip,
        errno=exc.errno,
    )


def _short_read(req: _Request, got_end: int) -> DiskIOError:
    t = req.transfer
    return DiskIOError(
        f"short read in {t.file.path}: wanted bytes [{req.file_offset + req.skip}, "
        f"{req.file_offset + req.skip + req.length}) but the file ends at byte {got_end} "
        f"(size {t.file.size}). Read only ranges that were written before.",
        path=t.file.path,
        offset=req.file_offset + req.skip,
        errno=None,
    )


def _cancelled(req: _Request, why: str) -> DiskIOError:
    t = req.transfer
    return DiskIOError(
        f"disk {'write' if t.write else 'read'} at offset {req.file_offset + req.skip} in "
        f"{t.file.path} was not run: {why}",
        path=t.file.path,
        offset=req.file_offset + req.skip,
        errno=errno_mod.ECANCELED,
    )


def _memory(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``addr`` (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _pread_full(fd: int, view: memoryview, offset: int, direct: bool) -> int:
    """Read into all of ``view``; return the bytes read (fewer only at end of file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
        if direct and (offset + done) % ALIGNMENT:
            break  # O_DIRECT stops short only at end of file, mid-page
    return done


def _pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:  # pragma: no cover - the kernel raises ENOSPC rather than writing 0
            raise OSError(errno_mod.ENOSPC, os.strerror(errno_mod.ENOSPC))
        done += n


def _run(req: _Request, bounces: _BouncePool) -> None:
    """Serve one request; report its outcome to its transfer (never raises)."""
    t = req.transfer
    if t.failed:  # an earlier request of this transfer failed: skip, the caller will raise
        t.request_done(_cancelled(req, "an earlier request of the same transfer failed"))
        return
    fd, direct = t.file.fd, t.file.direct
    error: DiskIOError | None = None
    try:
        if req.span == 0:
            view = _memory(req.addr, req.length)
            if t.write:
                _pwrite_full(fd, view, req.file_offset)
            else:
                got = _pread_full(fd, view, req.file_offset, direct)
                if got < req.length:
                    error = _short_read(req, req.file_offset + got)
        else:
            bounce = bounces.acquire()
            try:
                baddr = bounce.data_ptr()
                bview = _memory(baddr, req.span)
                if t.write:
                    if req.skip:  # preserve the bytes before the start in the first page
                        got = _pread_full(fd, bview[:ALIGNMENT], req.file_offset, direct)
                        if got < req.skip:
                            ctypes.memset(baddr + got, 0, req.skip - got)
                    ctypes.memmove(baddr + req.skip, req.addr, req.length)
                    tail = req.span - req.skip - req.length
                    if tail:  # the write owns the rest of its last page: zeros, not garbage
                        ctypes.memset(baddr + req.skip + req.length, 0, tail)
                    _pwrite_full(fd, bview, req.file_offset)
                else:
                    got = _pread_full(fd, bview, req.file_offset, direct)
                    if got < req.skip + req.length:
                        error = _short_read(req, req.file_offset + got)
                    else:
                        ctypes.memmove(req.addr, baddr + req.skip, req.length)
            finally:
                bounces.release(bounce)
    except OSError as exc:
        error = _os_error(req, exc)
    except Exception as exc:  # never lose an error in a worker: hand it to the waiter
        error = DiskIOError(
            f"disk {'write' if t.write else 'read'} in {t.file.path} failed: {exc!r}",
            path=t.file.path,
            offset=req.file_offset + req.skip,
        )
        error.__cause__ = exc
    t.request_done(error)


def _plan(t: _Transfer, addr: int, block: int) -> list[_Request]:
    """Split a transfer into direct and bounced requests of at most ``block`` bytes."""
    off, n = t.offset, t.nbytes
    reqs: list[_Request] = []

    def direct(mem: int, pos: int, length: int) -> None:
        for i in range(0, length, block):
            reqs.append(_Request(t, pos + i, mem + i, min(block, length - i)))

    if not t.file.direct:
        direct(addr, off, n)
        return reqs
    if (addr - off) % ALIGNMENT == 0:
        head = min(n, -off % ALIGNMENT)
        if head:
            start = off - off % ALIGNMENT
            reqs.append(_Request(t, start, addr, head, skip=off - start, span=ALIGNMENT))
        body = (n - head) // ALIGNMENT * ALIGNMENT
        direct(addr + head, off + head, body)
        tail = n - head - body
        if tail:
            reqs.append(_Request(t, off + head + body, addr + head + body, tail, span=ALIGNMENT))
        return reqs
    # Address and offset disagree modulo 4096: no byte can go direct, bounce everything.
    start = off - off % ALIGNMENT
    end = -(-(off + n) // ALIGNMENT) * ALIGNMENT
    for pos in range(start, end, block):
        span = min(block, end - pos)
        lo, hi = max(pos, off), min(pos + span, off + n)
        reqs.append(_Request(t, pos, addr + (lo - off), hi - lo, skip=lo - pos, span=span))
    return reqs


class _WorkerPool:
    """The threads and the request queue. Owned by one engine; holds no reference to it,
    so an engine dropped without ``close()`` is still collected and its finalizer stops us.
    """

    def __init__(self, threads: int, bounces: _BouncePool):
        self.nthreads = threads
        self.bounces = bounces
        self.queue: deque[_Request] = deque()  # the compute path's lane, served first
        self.later: deque[_Request] = deque()  # background threads' lane
        self.cond = threading.Condition()
        self.closing = False
        self.threads: list[threading.Thread] = []

    def submit(self, reqs: list[_Request], background: bool = False) -> bool:
        """Queue requests in order (FIFO across transfers of a lane; ``background``: the
        lane served once the other is empty); False if the pool is closing."""
        with self.cond:
            if self.closing:
                return False
            if not self.threads:  # start lazily: an engine used only synchronously has none
                for i in range(self.nthreads):
                    th = threading.Thread(target=self._loop, name=f"hetstore-aio-{i}", daemon=True)
                    th.start()
                    self.threads.append(th)
            (self.later if background else self.queue).extend(reqs)
            self.cond.notify(len(reqs))
        return True

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.later and not self.closing:
                    self.cond.wait()
                if self.queue:
                    req = self.queue.popleft()
                elif self.later:
                    req = self.later.popleft()
                else:
                    return
            _run(req, self.bounces)

    def shutdown(self) -> None:
        """Cancel queued requests, let running ones finish, join the threads (idempotent)."""
        with self.cond:
            self.closing = True
            cancelled = [*self.queue, *self.later]
            self.queue.clear()
            self.later.clear()
            self.cond.notify_all()
        for req in cancelled:
            req.transfer.request_done(_cancelled(req, "the AsyncIOEngine was closed"))
        current = threading.current_thread()
        for th in self.threads:
            if th is not current:
                th.join()
        self.bounces.clear()  # the staging buffers go with the engine, not with the last view


class AsyncIOEngine:
    """Moves bytes between CPU tensors and :class:`DiskFile` ranges, asynchronously.

    Args:
        block_size: bytes per request (a multiple of 4096). Larger transfers are split.
        queue_depth: most requests in flight at once. With the thread-pool backend a
            request in flight is a thread inside ``preadv``/``pwritev``, so this caps the
            number of worker threads.
        threads: worker threads; 0 picks ``min(DEFAULT_THREADS, queue_depth)``, the
            measured best on the project machine.
        enable_aio: False runs every transfer synchronously in the caller's thread
            (``submit_*`` returns an already finished handle) -- for debugging, or where
            threads are unwelcome.
    """

    def __init__(
        self,
        *,
        block_size: int = 8 * MiB,
        queue_depth: int = 32,
        threads: int = 0,
        enable_aio: bool = True,
    ):
        if block_size < ALIGNMENT or block_size % ALIGNMENT:
            raise ConfigError(
                f"block_size must be a positive multiple of {ALIGNMENT} bytes, got {block_size}"
            )
        if queue_depth < 1:
            raise ConfigError(f"queue_depth must be >= 1, got {queue_depth}")
        if threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = automatic), got {threads}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = min(threads or DEFAULT_THREADS, queue_depth)
        self.enable_aio = enable_aio
        self._bounces = _BouncePool(block_size)
        self._pool = _WorkerPool(self.threads, self._bounces)
        self._closed = False
        self._finalizer = weakref.finalize(self, _WorkerPool.shutdown, self._pool)

    def submit_read(self, file: DiskFile, offset: int, buffer: torch.Tensor) -> IOHandle:
        """Start reading ``buffer``'s bytes from ``file`` at ``offset``."""
        return self._submit(file, offset, buffer, write=False)

    def submit_write(self, file: DiskFile, offset: int, buffer: torch.Tensor) -> IOHandle:
        """Start writing ``buffer``'s bytes to ``file`` at ``offset``.

        The caller must not modify ``buffer`` until the handle is done.
        """
        return self._submit(file, offset, buffer, write=True)

    def _submit(self, file: DiskFile, offset: int, buffer: torch.Tensor, write: bool) -> IOHandle:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(
                f"the disk tier moves contiguous CPU tensors, got a "
                f"{'non-contiguous ' if not buffer.is_contiguous() else ''}tensor on "
                f"{buffer.device}"
            )
        if offset < 0:
            raise ValueError(f"file offset must be >= 0, got {offset}")
        nbytes = buffer.numel() * buffer.element_size()
        file._begin()
        t = _Transfer(file, write, offset, nbytes, buffer)
        reqs = _plan(t, buffer.data_ptr(), self.block_size) if nbytes else []
        if self._closed:
            t.errors.append(_cancelled(_Request(t, offset, 0, nbytes), "the engine is closed"))
            reqs = []
        t.remaining = len(reqs) + 1  # +1: the submission itself, released below
        if not self.enable_aio:
            for req in reqs:
                _run(req, self._bounces)
            reqs = []
        if reqs:
            why = "the AsyncIOEngine was closed"
            try:
                queued = self._pool.submit(reqs, background=_is_background())
            except RuntimeError as exc:  # "can't start new thread": fail this transfer only
                queued, why = False, f"no worker thread could start ({exc}); try enable_aio=False"
            if not queued:
                for req in reqs:
                    t.request_done(_cancelled(req, why))
        t.request_done()
        return IOHandle(t)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    @property
    def started_threads(self) -> int:
        """Worker threads started so far (none until the first asynchronous transfer)."""
        return len(self._pool.threads)

    def close(self) -> None:
        """Cancel queued requests, wait for running ones, stop the workers (idempotent).

        Handles of cancelled transfers raise ``DiskIOError`` from ``wait()``.
        """
        self._closed = True
        self._finalizer()

    def __enter__(self) -> AsyncIOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AsyncIOEngine(block_size={self.block_size}, queue_depth={self.queue_depth}, "
            f"threads={self.threads}, enable_aio={self.enable_aio}"
            f"{', closed' if self._closed else ''})"
        )
