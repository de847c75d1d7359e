"""Page-aligned host memory from anonymous mmap: the raw material of the host tier.

Why mmap and not ``torch.empty``: the CPU allocator aligns to 64 bytes, O_DIRECT needs
4096; mmap gives page alignment for free, lets us ``madvise(MADV_HUGEPAGE)`` (huge-page
buffers measured ~2x faster for disk IO here) and lets us page-lock (``mlock``) or
register with CUDA (``cudaHostRegister``) a whole block at once instead of relying on
the pinned caching allocator's power-of-two rounding.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref

import numpy as np
import torch

__all__ = [
    "PAGE_SIZE",
    "HUGE_PAGE_SIZE",
    "MappedBlock",
    "aligned_empty",
    "round_up",
    "return_free_heap",
    "keep_heap",
]

PAGE_SIZE = mmap.PAGESIZE
HUGE_PAGE_SIZE = 2 * 2**20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def return_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op
    elsewhere). Tensors the CPU allocator freed stay in glibc's heap, counted in the
    resident set, until this or a lucky free at the heap's top returns them."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


# glibc's mallopt parameters (malloc.h) and values
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_CEILING = 32 * 2**20  # the most glibc takes on 64 bits (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD_DEFAULT = 128 * 1024
_NEVER = 2**31 - 1


def keep_heap(on: bool) -> bool:
    """``on``: glibc stops giving the heap's free top back by itself (its trim threshold
    out of reach) and serves every request up to its mmap ceiling (32 MiB) from the heap,
    so freed chunks serve the next request of their size without fresh pages; only
    :func:`return_free_heap` gives memory back. Off: glibc's default trim threshold
    again; not glibc's first state: the mmap threshold stays at the ceiling, and
    neither threshold rises by itself any more (setting either ends that). False where
    there is no ``mallopt`` (not glibc)."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is None:
        return False
    if on:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING)
    return bool(mallopt(_M_TRIM_THRESHOLD, _NEVER if on else _TRIM_THRESHOLD_DEFAULT))


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _cuda_call(name: str, *args) -> None:
    """Call a CUDA runtime function through torch; raise ``RuntimeError`` naming it and
    the error on failure (torch's binding returns the error code on some versions and
    raises on others)."""
    try:
        result = int(getattr(torch.cuda.cudart(), name)(*args))
    except Exception as exc:  # torch.AcceleratorError, RuntimeError
        _clear_last_cuda_error()
        raise RuntimeError(f"{name} failed: {str(exc).splitlines()[0]}") from None
    if result != 0:
        _clear_last_cuda_error()
        raise RuntimeError(f"{name} failed with CUDA error {result}")


def _clear_last_cuda_error() -> None:
    """Read off the thread's last CUDA error. Why: a failed host registration stays the
    runtime's last error, and torch reports it at its next kernel launch as that kernel's
    own failure (seen on torch 2.11: an embedding raised "already registered"), which
    would turn the pageable fallback into a crash far from its cause. torch binds no
    cudaGetLastError, so it is called in the CUDA runtime library this process loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            pass


class _PageLocks:
    """What holds a mapping's pages: ``mlock`` and CUDA's registration. Undone once, by
    ``MappedBlock.release()`` or when the last tensor viewing the mapping dies, whichever
    comes first, and always before the pages are unmapped. Why it matters: CUDA keeps a
    registration by address, so a range unmapped while still registered makes the next
    mapping placed there fail to register ("already registered") and copies from it fail
    ("resource already mapped"), in the same process, long after the model is gone."""

    def __init__(self, address: int, nbytes: int):
        self.address = address
        self.nbytes = nbytes
        self.locked = False
        self.cuda_registered = False

    def undo(self) -> None:
        if self.cuda_registered:
            self.cuda_registered = False
            _cuda_call("cudaHostUnregister", self.address)
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
            self.locked = False


class MappedBlock:
    """One anonymous mapping of ``nbytes`` (rounded up to a page), viewed as a uint8 tensor.

    Lifetime: the mapping lives as long as any tensor viewing it, so ``release()`` only
    undoes locking and drops our reference; memory returns to the OS when the last view
    dies. The tensor views the mapping through a numpy array (which holds the mmap's
    buffer): the array dies with the last view, and a finalizer on it undoes the page
    locks just before the mapping goes.
    """

    def __init__(self, nbytes: int, *, huge_pages: bool = True):
        self.nbytes = round_up(max(nbytes, 1), PAGE_SIZE)
        mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # transparent huge pages disabled: a speed hint only
        array = np.frombuffer(mapping, dtype=np.uint8)
        self.tensor = torch.from_numpy(array)
        self.address = self.tensor.data_ptr()
        self._locks = _PageLocks(self.address, self.nbytes)
        # Not at interpreter exit: the process's pages and registrations go with it, and
        # CUDA may already be torn down by then.
        weakref.finalize(array, self._locks.undo).atexit = False

    @property
    def page_locks(self):
        """The pages' lock and CUDA registration, which outlive the block while a view of
        its tensor does (undone when the last one goes)."""
        return self._locks

    @property
    def locked(self) -> bool:
        return self._locks.locked

    @property
    def cuda_registered(self) -> bool:
        return self._locks.cuda_registered

    def lock(self) -> None:
        """Page-lock with mlock; raises OSError (e.g. memlock limit) so callers can fall back."""
        if _libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mlock of {self.nbytes} bytes failed: {os.strerror(err)}")
        self._locks.locked = True

    def register_cuda(self) -> None:
        """Pin for fast async H2D/D2H (cudaHostRegister); raises RuntimeError on failure."""
        _cuda_call("cudaHostRegister", self.address, self.nbytes, 0)
        self._locks.cuda_registered = True

    def release(self) -> None:
        self._locks.undo()
        self.tensor = None  # the mapping itself goes when the last view does


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A page-aligned, uninitialised host tensor of ``nbytes`` bytes viewed as ``dtype``.

    For staging buffers and tests; pooled allocations go through ``HostTier``.
    """
    block = MappedBlock(nbytes)
    return block.tensor[:nbytes].view(dtype)
