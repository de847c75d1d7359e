"""Keep freed working memory from staying resident on a CPU device.

On a CPU device the "device" is host RAM allocated by torch through the C allocator,
and every budget hetstore keeps is a share of the process's resident set. glibc serves
a request below its mmap threshold from the heap, and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed: after the first few steps, autograd's
gradients and the units' temporaries (a few MiB to tens of MiB each) come from the heap,
and what they free stays resident in holes between live blocks. Measured on a 277M GPT
trained from disk under a 256 MiB device and 512 MiB host budget: the process peaked
328 MiB above its budgets' peaks and its start-up size; with the threshold fixed at
1 MiB, 107 MiB (and no measurable change in step time on that disk-bound run).

So :func:`bound_heap_retention` fixes the threshold once per process, on glibc only
(elsewhere it does nothing): requests of 1 MiB or more are mapped on their own and
unmapped when freed. It is process-wide, as any allocator setting is. It costs time
where compute dominates: every large temporary is mapped and faulted in afresh (a 100M
GPT with its states in host memory: 1.22x plain PyTorch with it, 1.04x without,
benchmarks/results/train_step_2026-11-27_malloc_epyc.txt). So it is applied when a
model is offloaded onto a CPU device with a host budget set (``offload_cpu_size``) or
anything on disk, where the process's memory is what the user bounds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["bound_heap_retention"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 1 << 20


@functools.cache
def bound_heap_retention() -> bool:
    """Fix glibc's mmap threshold at 1 MiB; True when it was set."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD))
