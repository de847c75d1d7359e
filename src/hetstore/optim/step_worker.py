"""``StepWorker``: the one thread that runs unit steps away from ``optimizer.step()``, and
the chunk buffers those steps stream through.

Every step job (:mod:`hetstore.optim.step_job`) runs here, one at a time, the one whose
result is needed soonest first (its *next use*, :data:`AT_STEP` or :func:`in_forward`;
in the order submitted between equals); the step ahead (:mod:`hetstore.optim.step_ahead`)
decides what to submit and when. The worker only submits disk IO (the AIO engine is
thread-safe) and runs a step's arithmetic on buffers it was given; every allocation,
commit and discard happens on the caller's thread.

Host memory: the chunk buffers (one set per chunk in flight, as large as the longest
chunk of any streamed unit step) are made at the first job that needs them and freed
when no job is left (or given back to a host allocation that found no room, after which
none are made again until the next backward). Every buffer a job borrows is taken only
where the host tier has room for it *beside* what the rest of backward will still
allocate (:meth:`StepWorker.host_room`): backward's own staging buffers come first.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.optim.step_job import StepJob
from hetstore.runtime import upload
from hetstore.runtime.rewrite import chunk_buffers
from hetstore.tiers.aio import background_io
from hetstore.tiers.hostmem import PAGE_SIZE, round_up

if TYPE_CHECKING:
    from collections.abc import Callable

    from hetstore.optim.streamed import StreamedUnitStep

__all__ = ["AT_STEP", "StepWorker", "in_forward", "outcome"]

# When a job's result is next used, its place in the worker's queue: at
# optimizer.step() (a step in backward, settled there; what its own steps read), or at
# a unit's use in the next forward (its position in that forward's order)
AT_STEP = (0, 0)


def in_forward(position: int) -> tuple[int, int]:
    return (1, position)


class StepWorker:
    """The worker thread and its chunk buffers (see the module doc)."""

    def __init__(self, host, streamed: list[StreamedUnitStep], stagers: list, keep_thread: bool):
        self._host = host
        self._streamed = streamed
        self._stagers = stagers
        # the thread lasts across steps (it steps host-memory units; see stop)
        self._keep_thread = keep_thread
        self._executor: ThreadPoolExecutor | None = None
        # (next use, order submitted, the call, its future): the thread runs the first
        self._queue: list[tuple] = []
        self._submitted = itertools.count()
        self._queue_lock = threading.Lock()
        # the thread's ident, set by the thread itself: a box, not this object, so the
        # thread does not keep it alive (a model dropped without release())
        self._box: list[int | None] = [None]
        self._slots: list[dict[str, torch.Tensor]] | None = None
        self._slot_buffers: list = []
        # the host needed the chunk buffers back: none are made again until the next
        # backward, or every unit after would take and give them back
        self._slots_reclaimed = False
        # a caller waiting for the worker (``hurry``) wakes a job waiting on this
        # condition for a buffer that nothing would give back meanwhile
        self.claims = threading.Condition()
        self._waiting = 0

    # ------------------------------------------------------------------ the thread
    def submit(self, fn: Callable, *args, next_use: tuple[int, int] = AT_STEP) -> Future:
        """Queue ``fn(*args)``, run before every queued call used later than ``next_use``."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1,
                thread_name_prefix="hetstore-step-ahead",
                initializer=_mark_thread,
                initargs=(self._box,),
            )
        future: Future = Future()
        entry = (next_use, next(self._submitted), fn, args, future)
        with self._queue_lock:
            heapq.heappush(self._queue, entry)
        # one run of the queue's first per call queued: each call runs once, the thread
        # taking whichever is first when it is free
        try:
            self._executor.submit(_run_first, self._queue, self._queue_lock)
        except BaseException:  # (the interpreter is exiting): the call is not queued
            with self._queue_lock:
                self._queue.remove(entry)
                heapq.heapify(self._queue)
            raise
        return future

    @property
    def running(self) -> bool:
        """Whether the thread exists (it is stopped when nothing is left for it)."""
        return self._executor is not None

    def on_worker_thread(self) -> bool:
        return threading.get_ident() == self._box[0]

    @property
    def caller_waiting(self) -> bool:
        """Whether a caller is waiting for the worker now (``hurry``)."""
        return self._waiting > 0

    @contextlib.contextmanager
    def hurry(self):
        """Around a wait for the worker: a job waiting on ``claims`` goes on without what
        it waits for meanwhile (nothing would be given back until the wait is over)."""
        with self.claims:
            self._waiting += 1
            self.claims.notify_all()
        try:
            yield
        finally:
            with self.claims:
                self._waiting -= 1

    def wait(self, job) -> bool:
        """Wait for the worker's run of ``job`` (once: the outcome is kept in ``job.ok``);
        False when it raised (the caller does the work the ordinary way instead). A
        ``StepJob`` also records the outcome in its state."""
        if job.ok is None:
            with self.hurry():
                job.ok = outcome(job.future)
            if isinstance(job, StepJob):
                job.finished(job.ok)
        return job.ok

    def stop(self, closing: bool = False) -> None:
        """Nothing is left for the worker: its chunk buffers go, and the thread too.
        Except the thread itself where it is kept (it steps host-memory units):
        every step's hand-over uses it again, and a new thread starts a new OpenMP team (on an
        H100's host the ordinary steps right after the worker's ran slowly, cause not
        known; docs/dev/BENCHMARKS.md). It goes with the model (``closing``, or garbage
        collection: the thread does not keep this object alive)."""
        self.free_slots()
        if self._executor is not None and (closing or not self._keep_thread):
            with self.hurry():
                self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ host room
    def host_room(self, nbytes: int) -> bool:
        """Whether the host tier has room for ``nbytes`` beside the staging buffers the
        rest of backward will still make (its stagers make theirs on first use)."""
        return self._host.account.would_fit(nbytes + sum(s.unmade_bytes for s in self._stagers))

    # ------------------------------------------------------------------ chunk buffers
    def new_backward(self) -> None:
        self._slots_reclaimed = False

    def slots(self) -> list[dict[str, torch.Tensor]] | None:
        """The chunk buffers (one worker: one set of sets for every unit), made on the
        caller's thread at the first job after a step and freed when none is left; None
        when the host has no room for them beside what backward still needs."""
        if self._slots is not None:
            return self._slots
        if self._slots_reclaimed or not self.host_room(self.slot_bytes()):
            return None
        sets, names, numel = self._slot_shape
        try:
            self._slots, self._slot_buffers = chunk_buffers(
                self._host, sets, list(names.items()), numel, "step ahead"
            )
        except OutOfTierMemory:  # the pool could not grow (fragmentation): not now
            return None
        return self._slots

    @property
    def has_slots(self) -> bool:
        return self._slots is not None

    @functools.cached_property
    def _slot_shape(self) -> tuple[int, dict[str, torch.dtype], int]:
        """(sets, buffer names and dtypes, elements each); the unit steps are fixed for
        the worker's life (asked only where it has some: for a streamed step's job or
        read-ahead)."""
        names: dict[str, torch.dtype] = {}
        for unit_step in self._streamed:
            names.update(unit_step.slot_names())
        numel = max(s.longest_chunk for s in self._streamed)
        # one set per chunk in flight: a unit of one chunk steps from one set (the
        # planner counts the same, footprints.streamed_step_bytes)
        sets = max(s.slot_sets for s in self._streamed)
        return sets, names, numel

    def slot_bytes(self) -> int:
        """Host bytes of the chunk buffers (as much as any streamed step's)."""
        sets, names, numel = self._slot_shape
        return sets * sum(round_up(numel * d.itemsize, PAGE_SIZE) for d in names.values())

    def free_slots(self) -> None:
        for buffer in self._slot_buffers:
            self._host.free(buffer)
        self._slot_buffers.clear()
        self._slots = None

    def reclaim_slots(self) -> None:
        """Give the chunk buffers to a host allocation that found no room (the caller
        waited for the jobs running on them); none are made again this backward."""
        self.free_slots()
        self._slots_reclaimed = True


def outcome(future: Future) -> bool:
    """Wait for ``future``: True when it ran, False when it raised (the worker's error:
    the job is dropped, and the caller does it the ordinary way)."""
    try:
        future.result()
        return True
    except Exception:  # noqa: BLE001
        return False


def _run_first(queue: list, lock: threading.Lock) -> None:
    with lock:
        _, _, fn, args, future = heapq.heappop(queue)
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the caller's to see (outcome)
        future.set_exception(exc)
    else:
        future.set_result(result)


def _mark_thread(box: list) -> None:
    box[0] = threading.get_ident()
    upload.mark_step_worker()  # (it allocates no host memory: runtime.upload's staging)
    # its disk IO (a step's master and states, read-ahead) waits behind the compute
    # path's (the parameter fetches forward and backward wait for)
    background_io()
