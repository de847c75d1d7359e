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

import torch

__all__ = [
    "PAGE_SIZE",
    "HUGE_PAGE_SIZE",
    "MappedBlock",
    "aligned_empty",
    "round_up",
    "return_free_heap",
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


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class MappedBlock:
    """One anonymous mapping of ``nbytes`` (rounded up to a page), viewed as a uint8 tensor.

    Lifetime: the mapping lives as long as any tensor viewing it (``torch.frombuffer``
    holds a reference to the mmap object), so ``release()`` only undoes locking and
    drops our reference; memory returns to the OS when the last view dies.
    """

    def __init__(self, nbytes: int, *, huge_pages: bool = True):
        self.nbytes = round_up(max(nbytes, 1), PAGE_SIZE)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # transparent huge pages disabled: a speed hint only
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.locked = False
        self.cuda_registered = False

    def lock(self) -> None:
        """Page-lock with mlock; raises OSError (e.g. memlock limit) so callers can fall back."""
        if _libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mlock of {self.nbytes} bytes failed: {os.strerror(err)}")
        self.locked = True

    def register_cuda(self) -> None:
        """Pin for fast async H2D/D2H (cudaHostRegister); raises RuntimeError on failure."""
        result = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0)
        if int(result) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with code {result}")
        self.cuda_registered = True

    def release(self) -> None:
        if self.cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.cuda_registered = False
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
            self.locked = False
        self.tensor = None  # the mapping itself goes when the last view does


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A page-aligned, uninitialised host tensor of ``nbytes`` bytes viewed as ``dtype``.

    For staging buffers and tests; pooled allocations go through ``HostTier``.
    """
    block = MappedBlock(nbytes)
    return block.tensor[:nbytes].view(dtype)
