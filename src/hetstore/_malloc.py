"""Keep freed working memory from staying resident on a CPU device, at no cost per tensor.

On a CPU device the "device" is host RAM allocated by torch through the C allocator,
and every budget hetstore keeps is a share of the process's resident set. glibc serves
a request below its mmap threshold from the heap, and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed: after the first few steps, autograd's
gradients and the units' temporaries (a few MiB to tens of MiB each) come from the heap,
and what they free stays resident in holes between live blocks. Measured on a 277M GPT
trained from disk under a 256 MiB device and 512 MiB host budget: the process peaked
328 MiB above its budgets' peaks and its start-up size.

The first remedy fixed glibc's mmap threshold at 1 MiB for the whole process, so every
large temporary was mapped on its own and unmapped when freed (107 MiB over on that
run). It cost every such temporary a fresh mapping and its page faults: a 100M GPT with
its states in host memory ran at 1.22x plain PyTorch with it, 1.04x without; a 77M GPT
trained from disk with a clip that bites, 1.45x with it, 1.12x without
(benchmarks/results/disk_offload_heap_bound_2026-11-27_epyc.txt).

So :class:`HeapBound` watches the resident set instead: after each unit's forward and
backward the runtime asks it (``check``), and when the process holds more than it did
before ``offload()``, plus what the tiers hold now, plus ``slack``, the heap's free pages
go back to the OS (``malloc_trim``). What a trim cannot give back is live memory the
process holds outside hetstore (a second model, a dataset, a rollout engine's cache):
the bound takes it as the process's own from then on, so it does not trim after every
unit for memory no trim can return.

While a bound lives it is the heap's only trim (``tiers.hostmem.keep_heap``): glibc's
own gives the heap's free top back whenever more than twice its (rising) mmap threshold
is free there, and a thread's heap likewise, so a unit's ~30 MiB device copy freed at
its release was faulted in afresh at its next fetch: about 10,000 page faults a step on
that 77M GPT, each costly on a VM whose memory the host backs lazily (first touch
measured at ~1.4 ms a MiB). With glibc's trim threshold out of reach and its mmap
threshold at its 32 MiB ceiling, freed chunks serve the next tensors of their size: the
faults went to ~1,000 a step and that run's forward from 0.81-0.84 s to 0.71-0.74 s
(benchmarks/results/disk_offload_keep_heap_2026-11-27_epyc.txt). When the last bound
goes (its model released, or collected), glibc's trim threshold is its default (128 KiB)
again; not all of glibc's own state comes back: its mmap threshold stays at 32 MiB, and
neither threshold rises by itself any more (any setting ends that), so a process that
goes on after its offloaded models serves requests up to 32 MiB from the heap.

It applies where the process's memory is what the user bounds: a model offloaded onto a
CPU device with a host budget (``offload_cpu_size``) or anything on disk.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

from hetstore.tiers.hostmem import keep_heap, return_free_heap

__all__ = ["HeapBound", "current_rss", "live_bounds"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int | None:
    """This process's resident set in bytes now (/proc/self/statm), None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class HeapBound:
    """Trim the C heap when the resident set outgrows the tiers (see the module doc).
    ``baseline``: the resident set before ``offload()`` made anything; ``held()``: the
    bytes the tiers hold now (the device account, the host pool's mapped blocks)."""

    def __init__(self, baseline: int, held: Callable[[], int], slack: int):
        _hold_heap()
        # (the heap goes back to glibc with the bound: collected, or closed)
        self._let_go = weakref.finalize(self, _let_go_of_heap)
        self._baseline = baseline
        self._held = held
        self.slack = slack
        self.trims = 0  # how often it gave memory back (a busy bound costs page faults)

    def close(self) -> None:
        """The model this bound kept is released: glibc trims its heap again (once the
        process holds no other bound)."""
        self._let_go()

    def check(self) -> None:
        rss = current_rss()
        if rss is None:
            return
        limit = self._baseline + self._held() + self.slack
        if rss <= limit:
            return
        return_free_heap()
        self.trims += 1
        after = current_rss()
        if after is not None and after > limit:
            # live memory no trim returns: the process's own from here on, with the
            # slack above it again (no trim for the next page it grows by)
            self._baseline += after - limit + self.slack


# live HeapBounds: while there is one, glibc keeps the heap (tiers.hostmem.keep_heap)
_bounds = 0
_bounds_lock = threading.Lock()


def _hold_heap() -> None:
    global _bounds
    with _bounds_lock:
        _bounds += 1
        if _bounds == 1:
            keep_heap(True)


def _let_go_of_heap() -> None:
    global _bounds
    with _bounds_lock:
        _bounds -= 1
        if _bounds == 0:
            keep_heap(False)


def live_bounds() -> int:
    """The bounds alive now: while there is one, glibc does not trim its heap by itself
    (``tiers.hostmem.keep_heap``)."""
    with _bounds_lock:
        return _bounds
