"""Host memory a step job borrows to save a disk read: held only to save time, given back
when the job is done or when a host allocation needs the room. None changes what the job
computes (the values are the same bytes):

- :class:`ReadAheads`: where every disk unit's step runs after backward (a clip that bit,
  or ``step_in_forward`` with no step in backward), the first units' reads of master and
  states would be on the critical path while backward leaves the disk mostly idle; so the
  worker reads them into host memory at the start of that backward;
- :class:`ParamLending`: free parameter staging buffers lent to steps in the next
  forward, which leave the unit's new parameters there, so that its fetch does not read
  back from disk what its step just wrote.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.optim import policy
from hetstore.optim.in_backward import site_of
from hetstore.optim.step_worker import AT_STEP
from hetstore.tiers.hostmem import PAGE_SIZE, round_up
from hetstore.tiers.store import Store, transfers_only, wait_all

if TYPE_CHECKING:
    from collections.abc import Callable

    from hetstore.optim.step_job import StepJob
    from hetstore.optim.step_worker import StepWorker
    from hetstore.optim.streamed import StreamedUnitStep
    from hetstore.runtime.unit import Unit

__all__ = ["ParamLending", "ReadAhead", "ReadAheads"]


# ---------------------------------------------------------------------- read-ahead
@dataclass
class ReadAhead:
    """A disk unit's master and optimizer states read into host memory during backward,
    for its step to read instead of the disk; valid while the unit's ``state_version``
    (loads, edits) and ``param_version`` (every step) are the ones they were read at."""

    arrays: dict[str, torch.Tensor]  # "master" and each state key: the unit's whole
    buffers: list  # the host buffers they are views of
    versions: tuple[int, int]  # the unit's (state_version, param_version) read at
    future: Future | None = None
    ok: bool | None = None


class ReadAheads:
    """The units' masters and states read ahead, by unit (see the module doc)."""

    def __init__(self, host, worker: StepWorker, stats):
        self._host = host
        self._worker = worker
        self._stats = stats  # (the step ahead's: counts the records taken)
        self._records: dict[int, ReadAhead] = {}

    @property
    def records(self) -> tuple[ReadAhead, ...]:
        return tuple(self._records.values())

    def __bool__(self) -> bool:
        return bool(self._records)

    def fill(self, order: list[Unit], step_of: Callable[[Unit], object]) -> None:
        """Read ahead the first units of ``order`` that can be, up to
        ``policy.READ_AHEAD_UNITS``, while the host has room. Which can be is the step
        policy's rule (``policy.reads_ahead``, the planner's too); whether now, the
        unit's: its home not behind its master, not read already."""
        for unit in order:
            if len(self._records) >= policy.READ_AHEAD_UNITS:
                return
            unit_step = step_of(unit)
            if unit_step is None or id(unit) in self._records or unit.home_stale:
                continue
            # (flat decides nothing of a read ahead)
            if not policy.reads_ahead(site_of(unit_step)):
                continue
            if not self._read(unit_step):
                return

    def _read(self, unit_step: StreamedUnitStep) -> bool:
        """Allocate the unit's master and states in host memory and have the worker read
        them; False when the host has no room for them."""
        unit = unit_step.unit
        arrays = {"master": unit.master}
        if not unit_step.states_absent:
            arrays.update(unit_step.states)
        need = sum(round_up(a.numel * a.dtype.itemsize, PAGE_SIZE) for a in arrays.values())
        # beside it, the chunk buffers the step that reads it will make (the worker's, or
        # optimizer.step()'s own): a read ahead in use cannot give way to them
        if not self._worker.host_room(need + self._worker.slot_bytes()):
            return False
        record = ReadAhead({}, [], versions(unit))
        try:
            for key, array in arrays.items():
                buffer = self._host.allocate(
                    array.numel * array.dtype.itemsize,
                    f"read ahead {unit.name} {key}",
                    array.dtype,
                    transient=True,  # (given back by the step that reads it)
                )
                record.buffers.append(buffer)
                record.arrays[key] = buffer.tensor[: array.numel]
        except OutOfTierMemory:  # the pool could not grow (fragmentation): not now
            self.give_back(record)
            return False
        # (taken by optimizer.step(): its own step, or the hand-over to the next forward)
        record.future = self._worker.submit(
            _read_into, dict(arrays), record.arrays, next_use=AT_STEP
        )
        self._records[id(unit)] = record
        return True

    def take(self, unit: Unit) -> ReadAhead | None:
        """What was read ahead for ``unit``, if it is still its master and states (and the
        worker read it without error). Hand it back with :meth:`give_back` once the step
        that reads it is done."""
        record = self._records.get(id(unit))
        if record is None:
            return None
        ok = self._worker.wait(record)
        del self._records[id(unit)]  # (after the wait: interrupted, it is still held)
        if not ok or record.versions != versions(unit):
            self.give_back(record)
            return None
        self._stats.read_ahead += 1
        return record

    def drop(self, unit: Unit | None = None) -> None:
        """Free what was read ahead (for ``unit`` only, or for every unit)."""
        keys = list(self._records) if unit is None else [id(unit)]
        for key in keys:
            record = self._records.get(key)
            if record is not None:
                self._worker.wait(record)  # (before it leaves: interrupted, it is still held)
                del self._records[key]
                self.give_back(record)

    def give_back(self, record: ReadAhead) -> None:
        if record.future is not None:
            self._worker.wait(record)  # never free a buffer the worker reads into
        for buffer in record.buffers:
            self._host.free(buffer)
        record.buffers.clear()


def versions(unit: Unit) -> tuple[int, int]:
    return unit.state_version, unit.param_version


def _read_into(arrays: dict[str, Store], into: dict[str, torch.Tensor]) -> None:
    """The worker: read each disk array whole into its host tensor."""
    wait_all([array.read(into[key], 0) for key, array in arrays.items()])


# ---------------------------------------------------------------------- parameter buffers
class ParamLending:
    """Parameter staging buffers lent to steps in the next forward (see the module doc).

    ``ahead``: the step ahead that owns it, whose ``in_forward_jobs()`` are the steps in
    the next forward in the order the worker runs them (the order forward uses their
    units), and whose ``forward.land(unit)`` lands one."""

    def __init__(self, worker: StepWorker, ahead):
        self._worker = worker
        self._ahead = weakref.proxy(ahead)  # (the owner: a cycle would wait for the gc)
        self._forward_running = False  # a fetch gave a buffer back since the last handover
        self.fetches_from_disk = False  # (set at the handover; see _to_keep)

    def handed_over(self, used: list[Unit], deferred: set[int]) -> None:
        """``optimizer.step()`` handed steps to the next forward: forward has not run yet;
        does a unit it fetches from a disk home without a step pending (frozen, no
        gradients, stepped in backward) need a free buffer?"""
        with self._worker.claims:
            self._forward_running = False
        self.fetches_from_disk = any(
            u.param_stager is not None and transfers_only(u.home) and id(u) not in deferred
            for u in used
        )

    def offer(self, job: StepJob) -> None:
        """At the job's start: a free buffer if one can be spared now."""
        job.wants_params = stages_params(job.unit)
        if job.wants_params and job.unit.param_stager.spare > self._to_keep():
            job.params = job.unit.param_stager.lend()

    def forward_runs(self) -> None:
        """A unit is used, or a fetch gave its buffer back (``Event.PARAM_BUFFER_FREE``):
        forward runs (on CUDA a fetch gives its buffer back only once its upload is done);
        lend to the units after it, before the worker reaches them."""
        with self._worker.claims:
            self._forward_running = True
        self.lend()

    def claim(self, job: StepJob) -> torch.Tensor | None:
        """The worker, starting ``job``: its buffer. Once forward runs, wait for one to be
        lent (forward gives one back as it takes the unit before's) rather than go on
        without: the unit's fetch would then read its parameters from disk, beside the
        worker's reads. Before forward runs (the loop's data loading, logging) go on: the
        steps are best done by then. Not while a caller waits for the worker either
        (nothing would be given back until it is done), nor once the program is exiting
        (the interpreter joins this thread)."""
        with self._worker.claims:
            while (
                job.params is None
                and job.wants_params
                and self._forward_running
                and not self._worker.caller_waiting
                and not _EXITING.is_set()
            ):
                self._worker.claims.wait(timeout=0.05)
            job.claimed = True
            return job.params

    def _to_keep(self, before: StepJob | None = None) -> int:
        """Free buffers not to lend: one while a unit forward uses before ``before`` (or
        any, without it) will read its parameters from disk at its fetch (its step has no
        buffer), so that fetch finds one free (fetches take one at a time and give it back
        after the copy), and one while forward fetches any unit with a disk home that has
        no step pending."""
        if self.fetches_from_disk:
            return 1
        for job in self._ahead.in_forward_jobs():
            if job is before:
                break
            if job.params is None and job.wants_params:
                return 1
        return 0

    def lend(self) -> None:
        """A buffer came free: lend it to the first step the worker has not started and
        that has none (the worker runs them in the order forward uses the units, so this
        is the next unit forward needs)."""
        for job in self._ahead.in_forward_jobs():
            if job.claimed or job.params is not None or not job.wants_params:
                continue
            stager = job.unit.param_stager
            if stager.spare <= self._to_keep(before=job):
                return
            slot = stager.lend()
            with self._worker.claims:
                if not job.claimed:
                    job.params = slot
                    self._worker.claims.notify_all()
                    continue
            stager.unlend(slot)  # started meanwhile: it reads from disk; the next one

    def give_one_back(self) -> bool:
        """A fetch found every buffer lent (``Event.PARAM_BUFFERS_LENT``): land the first
        step holding one (its buffer
        is then staged, for its fetch, or returned). A step that fails here stays pending
        and raises at its own unit's use (its buffer was returned before the retry): not
        at this fetch of another unit."""
        for job in self._ahead.in_forward_jobs():
            if job.params is not None:
                try:
                    self._ahead.forward.land(job.unit)
                except Exception:  # noqa: BLE001 - raised again at that unit's use
                    pass
                return True
        return False

    @staticmethod
    def give_back(job: StepJob, committed: bool) -> bool:
        """The job is done: its buffer is staged for the unit's fetch when ``committed``
        and filled, else returned unused. True when staged."""
        slot, job.params = job.params, None
        if slot is None:
            return False
        stager = job.unit.param_stager
        if committed and job.filled:
            stager.stage(job.unit, slot)
            return True
        stager.unlend(slot)
        return False


def stages_params(unit: Unit) -> bool:
    """A step of ``unit`` in the next forward can leave its new parameters in a parameter
    staging buffer: its home is on disk, fetched through one, and every element of it is
    rewritten by the step (no frozen tail without a master)."""
    return (
        unit.param_stager is not None
        and transfers_only(unit.home)
        and unit.master_numel == unit.numel
    )


# The interpreter is exiting: set just before it joins worker threads (CPython's hook
# for this, the one concurrent.futures uses; registered after its own, so called first),
# so a step in the next forward stops waiting for a parameter buffer no forward will
# give back. Process-wide, like the exit it reports.
_EXITING = threading.Event()
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_EXITING.set)
else:  # no such hook (another interpreter): never wait
    _EXITING.set()
