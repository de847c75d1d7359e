"""Step a unit as soon as its gradients are final, beside the rest of backward: exact.

Without this, every unit's streamed step (read master and moments from disk, step, write
them back) waits for ``optimizer.step()``, after backward; it is the phase users of
offloaded training complain about most. Here, when backward has produced a unit's last
gradient, a worker thread steps that unit *speculatively* while backward goes on with the
units before it: the same arithmetic as the real step (same chunks, same fused kernel),
into shadow regions of its master, moments and compute-dtype copy. Nothing the model
reads changes. ``optimizer.step()`` then commits each speculation whose assumptions still
hold (a swap of disk regions: no IO), and discards the others and steps those units the
ordinary way. The result is the ordinary step's, bit for bit, either way.

A speculation assumes that what the step would read is what it read:

- the gradients did not change since: no gradient was added (``Unit.grads.version``:
  another micro-batch's backward) and a buffer in memory was not changed in place
  (``Tensor._version``: clipping through ``p.grad``, a user's hook);
  ``optimizer.clip_grad_norm_`` leaves it alone when it does not clip;
- the same parameters have a gradient (``model.zero_grad()`` clears the flags);
- every param group's values (lr, betas, weight decay, ...) are the ones it used;
- the master and the states were not rewritten since (a checkpoint or state-dict load).

A speculation that was wrong costs the disk traffic of one step, never correctness.
After a step whose ``clip_grad_norm_`` scaled the gradients, the next step's would most
likely be wrong too: they are held back (``held_back``) until a step whose clip did not
bite. (The clip itself reads no gradient back from disk either way: its norms are taken
in backward, :mod:`hetstore.optim.grad_norms`.)

Which backward is the last before a step: by default the one whose count since the last
step reaches the count the last step had (1 at first), so a plain loop speculates on
every backward and a loop accumulating N micro-batches learns N after its first step.
``with hetstore.no_sync(model):`` around the backward of the micro-batches that are not
the last (the DDP/FSDP convention) says it at once.

Eligible units: master and states on disk (the streamed step), parameters homed on disk
or in the master itself (so every copy is shadowed), sharded too (a rank steps its
shard). And, chosen by
``overlap_step`` (on a GPU by default), units whose master and states are in host memory:
their shadows are host buffers, filled by a copy and committed by a swap of references
(:mod:`hetstore.optim.in_memory`); one starts only where the host tier has room for it. With fp16 loss
scaling a speculation unscales by the current scale itself (into its own buffer); the
optimizer's unscale of gradients in memory, in place, is then the one change it expects
(:meth:`StepAhead.unscaling`), and an overflow skips the step and drops them all. Gradients in memory are read where they
are. Gradients on disk are read from the gradient stager's host buffer when it can lend one
(until the speculation is done; its write to disk goes on: a rollback reads that), else
read back from disk once written. A clip that scales gradients on disk (a
factor the ordinary step applies as it reads them) rolls the speculation back.

With ``step_in_backward`` (``consume=True``) the step in backward is not a speculation
but the step itself: it takes the unit's gathered gradients from the gradient stager
(never written to disk), and its shadows are committed as soon as it is done, still
during backward (a unit still resident is committed once backward has released it).
``optimizer.step()`` then only checks that the param groups are the ones those steps
used. What would need the gradients later is refused instead of rolled back: clipping
(:meth:`OffloadedOptimizer.clip_grad_norm_`), ``p.grad`` of a consumed unit, a second
backward before ``optimizer.step()`` (micro-batches that are not the last go under
``hetstore.no_sync(model)``, whose gradients are written to disk as before). A step that
could not start (no room for its shadows or chunks) or failed leaves its gradients on
disk for the ordinary step.

Threads: the worker only submits disk IO (the AIO engine is thread-safe) and runs the
step's arithmetic on buffers it was given; every allocation, commit and discard happens
on the caller's thread.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.footprints import LENT_MASTERS, READ_AHEAD_UNITS
from hetstore.optim.in_memory import InMemoryUnitStep, MemoryShadows
from hetstore.optim.policy import StepPace, StepPolicy
from hetstore.optim.step_job import JobState, StepJob, Target, When
from hetstore.optim.streamed import StreamedUnitStep
from hetstore.runtime.events import Event
from hetstore.runtime.rewrite import ChunkedRewrite, chunk_buffers
from hetstore.runtime.staging import GradStager, ParamStager, stagers_of
from hetstore.tiers.hostmem import PAGE_SIZE, round_up
from hetstore.tiers.store import Store, transfers_only, wait_all

if TYPE_CHECKING:
    from collections.abc import Callable

    from hetstore.runtime.unit import Unit

__all__ = ["StepAhead", "SpeculationStats"]


@dataclass
class SpeculationStats:
    """Counts since the model was offloaded."""

    started: int = 0
    committed: int = 0  # hits: the step was already done when optimizer.step() came
    # of those, host-memory units whose gradients were handed out or rewritten in place
    # (torch's clip_grad_norm_ that did not bite) but compared equal, bit for bit
    verified: int = 0
    rolled_back: int = 0  # discarded at optimizer.step(), stepped again the ordinary way
    cancelled: int = 0  # superseded by a later backward, or dropped by zero_grad()/a load
    not_started: int = 0  # no disk room for the shadows, or host room for the chunks
    # not tried: the last step's clip bit, so this one's would most likely roll back too
    held_back: int = 0
    # step_in_forward: unit steps optimizer.step() left to run during the next forward
    in_forward: int = 0
    # of those, steps that left their unit's new parameters in a staging buffer for its
    # fetch (else the fetch reads them back from disk)
    params_staged: int = 0
    # and steps that read their master and states from host memory, read during the
    # backward before (after a clip that bit: the first units the next forward uses)
    read_ahead: int = 0
    # steps in backward that read the master from the unit's lent device copy instead of
    # from disk (a CPU device)
    master_from_memory: int = 0
    # host-memory units not stepped ahead because the worker would not have finished
    # them before optimizer.step() (overlap_step='auto'; see optim.policy): stepped there
    too_late: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class ReadAhead:
    """A disk unit's master and optimizer states read into host memory during backward,
    for its step in the next forward to read instead of the disk; valid while the unit's
    ``state_version`` (loads, edits) and ``param_version`` (every step) are the ones
    they were read at."""

    unit_step: StreamedUnitStep
    arrays: dict[str, torch.Tensor]  # "master" and each state key: the unit's whole
    buffers: list  # the host buffers they are views of
    versions: tuple[int, int]  # the unit's (state_version, param_version) read at
    future: Future | None = None
    ok: bool | None = None


def _settling(job: StepJob) -> bool:
    """A step in backward not settled yet (running, done ahead, or failed)."""
    return job.when is When.IN_BACKWARD and job.state is not JobState.COMMITTED


def _taken(job: StepJob) -> bool:
    """A step taken and committed in backward (step_in_backward), until optimizer.step()."""
    return job.when is When.IN_BACKWARD and job.state is JobState.COMMITTED


def eligible(unit_step, unit: Unit) -> bool:
    """A disk unit the step ahead can step into shadows (memory units:
    :meth:`InMemoryUnitStep.can_speculate`, chosen by ``overlap_step``). Sharded too: a
    rank steps its own shard, with nothing collective in the step; its fetch lands the
    step before the all-gather, on every rank in the same order."""
    return (
        isinstance(unit_step, StreamedUnitStep)
        and (isinstance(unit.grad, torch.Tensor) or unit.grad_stager is not None)
        and ChunkedRewrite.can_speculate(unit)
    )


def _changed(a: dict, b: dict) -> list[str]:
    """The keys whose values differ between two param-group snapshots (or that only
    one has)."""
    changed = []
    for key in a.keys() | b.keys():
        if key not in a or key not in b:
            changed.append(key)
            continue
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.shape == y.shape
                and torch.equal(x, y)
            )
        else:
            same = x == y
        if not same:
            changed.append(key)
    return sorted(changed)


def _same(a: dict, b: dict) -> bool:
    return not _changed(a, b)


def _snapshot(hyper: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in hyper.items()}


class StepAhead:
    """Speculative steps of the eligible disk units of one optimizer (see module doc)."""

    def __init__(
        self,
        unit_steps: list[StreamedUnitStep | InMemoryUnitStep],
        hyper: Callable[[int], dict],
        loss_scaler=None,
        consume: bool = False,
        *,
        speculate: bool = True,
        in_forward: bool = False,
        pace: bool = False,
        in_place: list[InMemoryUnitStep] = (),
    ):
        self._steps = {id(s.unit): s for s in unit_steps}
        # host-memory units whose ordinary step runs on during the next forward, in
        # place (step_in_forward on a GPU); and those running now
        self._in_place_steps = {id(s.unit): s for s in in_place}
        first = (list(unit_steps) or list(in_place))[0]  # (the tiers of either)
        # step units during backward (overlap_step, step_in_backward); and finish the
        # ordinary step of disk units during the next forward (step_in_forward)
        self.speculate = speculate or consume
        self.in_forward = in_forward
        # when each unit's step runs: micro-batch counting, hold-back, back-off, pacing
        self.policy = StepPolicy(pace)
        # the worker thread then lasts across steps (see _stop_worker_if_idle)
        self._keep_worker = pace and any(isinstance(s, InMemoryUnitStep) for s in unit_steps)
        # the units in the order the next forward uses them (the runtime's), else None
        self.use_order: Callable[[], list[Unit]] | None = None
        # the worker thread's ident, set by the thread itself: a box, not this object,
        # so the thread does not keep it alive (a model dropped without release())
        self._worker_box: list[int | None] = [None]
        self._streamed = [s for s in unit_steps if isinstance(s, StreamedUnitStep)]
        self._hyper = hyper
        self._loss_scaler = loss_scaler  # fp16: gradients are unscaled before the step
        # every unit's step job, one per unit at a time, in the order they were made
        # (so the worker's order): steps in backward until settled (and, taken in
        # backward, until optimizer.step()), steps handed to the next forward until used
        self._jobs: dict[int, StepJob] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._slots: list[dict[str, torch.Tensor]] | None = None
        # the host needed the worker's buffers back (_reclaim_host): none are made again
        # until the next backward, or every unit after would take and give them back
        self._slots_reclaimed = False
        self._slot_buffers: list = []
        self._host = first.unit.tiers.host
        self._device = first.unit.device  # the compute device
        # attached by offload() before the optimizer is built; fixed from here on
        self._stagers = stagers_of([s.unit for s in unit_steps])
        self._disk = first.unit.tiers.disk
        # kept free on disk while speculations hold their shadows: one ordinary step's
        self._disk_reserve = max((s.shadow_bytes for s in self._streamed), default=0)
        self.suspended = 0  # depth of hetstore.no_sync
        self.stats = SpeculationStats()
        # host memory held only to save time: given back when an allocation needs it
        # (activations restored in backward, a later micro-batch's forward)
        self._reclaiming_allowed = True
        # (host shadows, the worker's buffers in the next forward, lent masters)
        self._host.reclaimers.append(self._reclaim_host)
        # step_in_backward: steps taken in backward and committed, until optimizer.step()
        self.consume = consume
        # the runtime's events (runtime.events): told when gradients are final, when
        # backward starts and ends, when a unit is read while its step runs on, and
        # when a unit's states are rewritten outside a step
        self._events = first.unit.events
        # (a disk unit's step in backward reads the stager's buffer on this thread, so
        # it must wait for the gradient copies when the unit's backward is done; a memory
        # unit's step waits for them on the worker, so backward goes on queueing work)
        reads_grads = self.speculate and bool(self._streamed)
        for event, handler in self._subscriptions():
            on_grads = event in (Event.GRADS_GATHERED, Event.GRADS_FINAL)
            self._events.subscribe(event, handler, reads_grads=reads_grads and on_grads)
        if consume:
            for stager in self._stagers:
                if isinstance(stager, GradStager):
                    stager.reclaim = self._reclaim_oldest
        # step_in_forward: a step in the next forward waits for a buffer for its parameters under this
        # condition, until one is lent or a caller waits for the worker (``_waiting``)
        self._claims = threading.Condition()
        self._waiting = 0
        self._forward_running = False  # a fetch gave a buffer back since the last defer
        self._fetches_from_disk = False  # (set by defer; see _buffers_to_keep)
        self._read_ahead: dict[int, ReadAhead] = {}  # unit id -> read during backward
        self._param_stagers = [s for s in self._stagers if isinstance(s, ParamStager)]
        if in_forward:
            for stager in self._param_stagers:
                stager.on_give_back = self._fetch_gave_back
                stager.reclaim_lent = self._reclaim_lent_params

    # ------------------------------------------------------------------ read-only views
    @property
    def unit_steps(self) -> tuple[StreamedUnitStep | InMemoryUnitStep, ...]:
        """The unit steps this object may take outside ``optimizer.step()``."""
        return tuple(self._steps.values())

    def step_of(self, unit: Unit) -> StreamedUnitStep | InMemoryUnitStep | None:
        """``unit``'s step, or None where this object takes none of it."""
        return self._steps.get(id(unit))

    @property
    def speculations(self) -> tuple[StepJob, ...]:
        """The steps started during backward, not yet committed or rolled back."""
        return tuple(self._pending().values())

    @property
    def steps_in_forward(self) -> tuple[StepJob, ...]:
        """The disk units' steps left to the next forward, in the order the worker runs them."""
        return tuple(self._in_forward().values())

    @property
    def steps_in_place(self) -> tuple[StepJob, ...]:
        """The host-memory units' steps handed to the worker and not yet waited for."""
        return tuple(self._in_place().values())

    @property
    def read_ahead(self) -> tuple[ReadAhead, ...]:
        """The units' masters and states read during backward, not yet taken by a step."""
        return tuple(self._read_ahead.values())

    @property
    def worker_running(self) -> bool:
        """Whether the worker thread exists (it is stopped when nothing is left for it)."""
        return self._executor is not None

    @property
    def pace(self) -> StepPace | None:
        """The pacing of host-memory units stepped ahead (``overlap_step='auto'``), or None."""
        return self.policy.pace

    # ------------------------------------------------------------------ the jobs
    def _add_job(self, unit: Unit, job: StepJob) -> None:
        """One job per unit at a time: a unit's earlier job is settled, landed or
        cancelled before another is made (one left would be orphaned: its shadows, gates
        and borrowed buffers never given back)."""
        if id(unit) in self._jobs:
            raise RuntimeError(
                f"hetstore internal error: unit {unit.name!r} already has a step job "
                f"({self._jobs[id(unit)].state.value})"
            )
        self._jobs[id(unit)] = job

    def _where(self, kind: Callable[[StepJob], bool]) -> dict[int, StepJob]:
        """The jobs of one kind (unit id -> job), in the order they were made."""
        return {k: j for k, j in self._jobs.items() if kind(j)}

    def _pending(self) -> dict[int, StepJob]:
        """Steps in backward not settled yet (running, done ahead, or failed)."""
        return self._where(_settling)

    def _consumed(self) -> dict[int, StepJob]:
        """step_in_backward: steps taken and committed in backward, until optimizer.step()."""
        return self._where(_taken)

    def _in_forward(self) -> dict[int, StepJob]:
        """Disk units' steps handed to the next forward, into shadows."""
        return self._where(lambda j: j.when is When.IN_FORWARD and j.target is Target.SHADOWS)

    def _in_place(self) -> dict[int, StepJob]:
        """Host-memory units' ordinary steps handed to the next forward, in place."""
        return self._where(lambda j: j.when is When.IN_FORWARD and j.target is Target.IN_PLACE)

    # ------------------------------------------------------------------ runtime events
    def _subscriptions(self) -> list:
        """What it listens to. Made on each call, not kept: bound methods kept on the
        object would be a reference cycle, and a released model's step machinery (its
        unit steps, their buffers) would then wait for the garbage collector."""
        return [
            (Event.BACKWARD_STARTED, self.backward_started),
            (Event.GRADS_GATHERED, self.consume_grads),
            (Event.GRADS_FINAL, self.grads_final),
            (Event.BACKWARD_ENDED, self.backward_ended),
            (Event.UNIT_READ, self.finish_unit_in_forward),
            (Event.STATE_CHANGE, self._state_change),
        ]

    def backward_started(self) -> None:
        self.finish_in_forward()  # the gradients they read are about to be written
        self.policy.backward_started()
        self._slots_reclaimed = False
        if self.consume:
            self._check_fresh_backward()
        self._start_read_ahead()

    def backward_ended(self) -> None:
        """Every unit is released: finish and commit the steps taken in backward."""
        if self.consume:
            self._collect(block=True)

    def consume_grads(self, unit: Unit) -> bool:
        """step_in_backward: backward produced ``unit``'s last gradient; step it now from
        them. True when the step took the gradients (nothing is to be written to disk)."""
        if not self.consume or self.suspended:
            return False
        if not isinstance(self._steps.get(id(unit)), StreamedUnitStep):
            return False  # memory units are stepped ahead only speculatively
        self._collect(block=False)
        spec = self._start(unit)
        if spec is None:
            return False
        self._add_job(unit, spec)
        return True

    def grads_final(self, unit: Unit) -> None:
        """Backward produced ``unit``'s last gradient: start its speculative step."""
        if not self.speculate or self.consume or self.suspended or not self.policy.last_backward:
            return
        self._cancel(id(unit))  # one from an earlier micro-batch: superseded
        if id(unit) not in self._steps:
            return  # not stepped ahead (e.g. gradients in memory of a unit not on disk)
        if self.policy.held_back(id(unit)):
            self.stats.held_back += 1
            return
        with self._own_allocations():
            spec = self._start(unit)
        if spec is not None:
            self._add_job(unit, spec)

    def _start(self, unit: Unit) -> StepJob | None:
        """A step of ``unit`` into shadows on the worker, or None when there is no room
        for it (counted in ``not_started``)."""
        unit_step = self._steps.get(id(unit))
        if unit_step is None:
            return None
        if isinstance(unit_step, InMemoryUnitStep):
            return self._start_in_memory(unit, unit_step)
        room = unit_step.shadow_bytes + self._disk_reserve
        if not self._disk.would_fit(room) and self.consume and self._pending():
            # in backward: the steps before hold their shadows until committed; their
            # commits free the regions they replace, so wait for them rather than spill
            # this unit's gradients to disk (the planner counts two shadows: this one
            # and the reserve)
            self._collect(block=False, wait=True)
        if not self._disk.would_fit(room):
            # pending speculations hold a shadow each until the step: they may fill the
            # disk only up to one ordinary step's room (a window, on a big model)
            self.stats.not_started += 1
            return None
        try:
            rewrite = unit_step.begin_speculation()
        except OutOfTierMemory:
            self.stats.not_started += 1  # the ordinary step will say so if it cannot run
            return None
        try:
            spec = self._speculation(unit_step, rewrite)
            slots = self._worker_slots()
        except BaseException:
            rewrite.discard()
            raise
        if slots is None:  # no host room for the worker's chunks: stepped after backward
            rewrite.discard()
            self.stats.not_started += 1
            return None
        # gradients on disk: step from the stager's buffer, not a read back: the one just
        # flushed, or (step in backward) the one gathered, which is never written
        grads = None
        if unit.grad_stager is not None:
            stager = unit.grad_stager
            grads = stager.hand_over(unit) if self.consume else stager.lend(unit)
        spec.lent_grads = grads is not None
        try:
            master = self._lend_master(spec)
            spec.submitted(
                self._pool().submit(
                    unit_step.run_speculation,
                    rewrite,
                    slots,
                    spec.hyper,
                    grads,
                    spec.factor,
                    master,
                )
            )
        except BaseException:
            if spec.lent_grads:
                unit.grad_stager.give_back(unit)
            _give_back_master(spec)
            rewrite.discard()
            raise
        self.stats.started += 1
        return spec

    def _lend_master(self, spec: StepJob) -> torch.Tensor | None:
        """The unit's device copy as the master the step reads, instead of a disk read of
        the same values, when it is in host memory (``Unit.lends_device_copy``), fewer
        than ``LENT_MASTERS`` are lent, and the host tier has room for it beside what
        the rest of backward will allocate (it moves from the device budget to the
        host's). None: the step reads the master from disk."""
        self._return_masters()
        unit = spec.unit_step.unit
        if not unit.lends_device_copy:
            return None
        if sum(s.master is not None for s in self._pending().values()) >= LENT_MASTERS:
            return None
        nbytes = unit.device_bytes
        if not self._host.account.would_fit(nbytes + self._staging_to_come()):
            return None
        self._host.account.reserve(nbytes, _lent_label(unit))
        spec.master = unit.lend_device_copy()
        self.stats.master_from_memory += 1
        return spec.master

    def _return_masters(self) -> None:
        """Give back the lent masters of the steps the worker has finished."""
        for spec in self._pending().values():
            if spec.master is not None and spec.future is not None and spec.future.done():
                _give_back_master(spec)

    def _hyper_now(self, unit: Unit) -> dict[int, dict]:
        """A snapshot of the values of every param group ``unit`` has a segment in."""
        return {s.group: _snapshot(self._hyper(s.group)) for s in unit.segments}

    def _speculation(self, unit_step, shadows, hyper: dict | None = None) -> StepJob:
        """What a speculation of ``unit_step`` into ``shadows`` assumes, taken now."""
        unit = unit_step.unit
        return StepJob(
            unit_step,
            When.IN_BACKWARD,
            Target.SHADOWS,
            hyper if hyper is not None else self._hyper_now(unit),
            shadows,
            grad_state=unit.grads.state(),
            state_version=unit.state_version,
            factor=1.0 / self._loss_scaler.scale if self._loss_scaler is not None else None,
        )

    def _start_in_memory(self, unit: Unit, unit_step: InMemoryUnitStep) -> StepJob | None:
        """A step of a unit whose master and states are in host memory, into host
        shadows (:mod:`hetstore.optim.in_memory`), or None when the host tier has no
        room for them beside what the rest of backward will still allocate."""
        hyper = self._hyper_now(unit)
        need = unit_step.shadow_bytes(hyper)
        if not self._host.account.would_fit(need + self._staging_to_come()):
            self.stats.not_started += 1
            return None
        if not self.policy.admit_memory_step():
            self.stats.too_late += 1  # optimizer.step() steps it, sooner than we would
            return None
        try:
            shadows = unit_step.begin_speculation(hyper)
        except OutOfTierMemory:  # the pool could not grow (fragmentation): not now
            self.stats.not_started += 1
            return None
        try:
            spec = self._speculation(unit_step, shadows, hyper)
            spec.submitted(
                self._pool().submit(
                    self._run_in_memory, unit_step, shadows, spec.factor, unit.grads.copies_event()
                )
            )
        except BaseException:
            shadows.discard()
            raise
        self.stats.started += 1
        return spec

    def caller_waits(self) -> None:
        """The caller is about to wait for the steps taken in backward (``optimizer.step()``,
        or a clip or fp16's unscale before it): the pace measures lateness from here."""
        self.policy.step_called()

    def _run_in_memory(self, unit_step: InMemoryUnitStep, shadows, factor, copies) -> None:
        """Worker: a host-memory unit's speculative step, timed for the pace (without
        the wait for the gradients' copies, which is backward's time, not the step's)."""
        if copies is not None:
            copies.synchronize()  # on this thread: backward's never waits for them
        start = time.perf_counter()
        unit_step.run_speculation(shadows, factor)
        self.policy.ran(time.perf_counter() - start)

    # ------------------------------------------------------------------ optimizer events
    def settle(self, disk_grad_factors: list, committed: set[int], clipped: bool = False) -> None:
        """At ``optimizer.step()``: commit what still holds, discard the rest; add the ids
        of the units committed to ``committed`` as each commits. ``disk_grad_factors``:
        what the ordinary step would multiply gradients on disk by (clipping); a
        speculation took none. ``clipped``: a clip scaled the gradients this step (the
        next step's speculations are held back: the policy's hold-back)."""
        # what the ordinary step multiplies gradients on disk by; factors of exactly 1.0
        # (a clip that does not bite) change nothing
        factors = [float(f) for f in disk_grad_factors if float(f) != 1.0]
        if self.consume:
            try:
                self._settle_consumed(committed)
            finally:
                self.discard_all()
                self.step_ended()
            return
        outcomes: dict[int, bool] = {}
        try:
            with self._own_allocations():
                # gradient writes of backward: their errors now, not at a later backward
                for stager in self._stagers:
                    if isinstance(stager, GradStager):
                        stager.finish()
                self._quiesce_device_reads()
                for key, spec in self._pending().items():
                    del self._jobs[key]
                    finished = self._finished(spec)  # always: never discard under the worker
                    holds = verified = False
                    if finished and self._inputs_hold(spec):
                        holds = self._grads_hold(spec, factors)
                        verified = not holds and self._grads_equal(spec)
                    if holds or verified:
                        spec.unit_step.commit_speculation(spec.shadows)
                        spec.move(JobState.COMMITTED)
                        committed.add(key)
                        self.stats.committed += 1
                        self.stats.verified += verified
                        outcomes[key] = True
                    else:
                        spec.shadows.discard()
                        spec.cancel()
                        self.stats.rolled_back += 1
                        outcomes[key] = False
                self.policy.settled()  # the worker is done: how late it was
        finally:
            self.discard_all()  # after an error: nothing may stay pending
            self.step_ended()
            self.policy.step_settled(outcomes, clipped)

    def _quiesce_device_reads(self) -> None:
        """CUDA: a commit gives the old master back to the host pool, and a fetch of it
        (an eval forward between backward and step) may still be copying it to the GPU
        asynchronously; the pool must not hand it out before that copy has read it. At
        ``optimizer.step()`` the GPU has usually finished backward already, so waiting
        for it costs little, and only when a host-memory speculation will commit."""
        if not any(isinstance(s.shadows, MemoryShadows) for s in self._pending().values()):
            return
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def step_ended(self) -> None:
        """A step was taken or skipped (fp16 overflow): count micro-batches anew."""
        self.policy.step_ended()

    def unscaling(self, units: list[Unit]):
        """fp16: the optimizer is about to unscale these units' gradients in memory, in
        place, by the factor every speculation applied itself. Waits for the worker
        (it must not read a buffer being unscaled); returns a callable to run after,
        which lets the speculations hold through that one change."""
        pending = self._pending()
        specs = [pending.get(id(u)) for u in units]
        for spec in specs:
            if spec is not None:
                self._finished(spec)
        before = [u.grad._version for u in units]

        def done(inv: float) -> None:
            for unit, spec, version in zip(units, specs, before, strict=True):
                if spec is None or spec.factor != inv:
                    continue
                if spec.grad_state.in_place == version:  # nothing else changed it since
                    spec.grad_state = spec.grad_state._replace(in_place=unit.grad._version)

        return done

    def discard_all(self) -> None:
        """Drop every speculation (``zero_grad()`` without a step, a load, release). The
        worker thread and its buffers go too: they exist only while a speculation does
        (a model dropped between steps leaves no thread behind)."""
        for key in self._pending():
            self._cancel(key)
        self._stop_worker_if_idle()

    def _stop_worker_if_idle(self, closing: bool = False) -> None:
        """No speculation and no step in the next forward left: the worker and its
        buffers go. Except the thread itself where host-memory units are paced (a GPU):
        every backward uses it again, and a new thread starts a new OpenMP team (on an
        H100's host the ordinary steps right after the worker's ran slowly, cause not
        known; docs/dev/BENCHMARKS.md). It goes with the model (``close``, or garbage
        collection: the thread does not keep this object alive)."""
        if any(not _taken(j) for j in self._jobs.values()) or self._read_ahead:
            return
        self._free_slots()  # (the disk steps' chunk buffers: nothing reads them now)
        if self._executor is not None and (closing or not self._keep_worker):
            with self._hurry():
                self._executor.shutdown(wait=True)
            self._executor = None

    def close(self) -> None:
        try:
            self.finish_in_forward()
        except Exception:  # noqa: BLE001 - the model is being released: nothing reads it
            pass
        finally:
            for key in self._in_forward():
                self._forget_in_forward(key)
            for record in self._in_place().values():
                try:
                    self._finish_in_place(record)
                except Exception:  # noqa: BLE001 - released: nothing reads it
                    pass
            self._drop_read_ahead()
            self.discard_all()
            self._stop_worker_if_idle(closing=True)
        if self._reclaim_host in self._host.reclaimers:
            self._host.reclaimers.remove(self._reclaim_host)
        for stager in self._param_stagers:
            stager.on_give_back = stager.reclaim_lent = None
        for event, handler in self._subscriptions():
            self._events.unsubscribe(event, handler)

    @contextlib.contextmanager
    def _own_allocations(self):
        """Host allocations made for the speculations themselves, or while they are being
        settled, do not reclaim other speculations' shadows."""
        before, self._reclaiming_allowed = self._reclaiming_allowed, False
        try:
            yield
        finally:
            self._reclaiming_allowed = before

    def _reclaim_host(self) -> bool:
        """The host tier is out of room: drop the oldest speculation holding host shadows
        (its unit is stepped the ordinary way at ``optimizer.step()``). True when one
        was dropped; False leaves the allocation to fail as it would without the step
        ahead."""
        if not self._reclaiming_allowed:
            return False
        if self._read_ahead:  # the disk has the same values
            self._drop_read_ahead()
            return True
        for spec in self._pending().values():
            if spec.master is not None:  # a lent master: the disk has the same values
                self._wait_worker(spec)
                _give_back_master(spec)
                return True
        for key, spec in self._pending().items():
            if isinstance(spec.shadows, MemoryShadows):
                self._cancel(key)
                return True
        if self._slots is not None and not self._on_worker_thread():
            # the worker's chunk buffers: what needs the room (the next forward, the
            # clip's scan of gradients on disk, an ordinary step) comes first. Let the
            # steps running on them finish (a speculation's result is in its disk
            # shadows, a step in the next forward's is committed at its unit's use, as
            # always); a later one makes them again where there is room
            for job in [*self._pending().values(), *self._in_forward().values()]:
                if job.future is not None:
                    self._wait_worker(job)
            self._free_slots()
            self._slots_reclaimed = True
            return True
        return False

    @contextlib.contextmanager
    def no_sync(self):
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    # ------------------------------------------------------------------ step in backward
    def _check_fresh_backward(self) -> None:
        """A backward is starting: refuse it when it would step units again (or add into
        gradients the last steps consumed) where plain PyTorch would not."""
        consumed = self._consumed()
        if consumed:
            raise RuntimeError(
                f"step_in_backward=True: a second backward before optimizer.step(), but "
                f"the last backward already stepped {len(consumed)} units (their "
                "gradients were consumed inside it). Call optimizer.step() after each "
                "backward; to accumulate micro-batches, run the backward of every one but "
                "the last under `with hetstore.no_sync(model):`"
            )
        stale = [u.name for u in (s.unit for s in self._steps.values()) if u.grads.consumed]
        if stale:
            raise RuntimeError(
                f"step_in_backward=True: units {stale[:3]} still count the gradients their "
                "last step consumed; a backward now would add into them, which they no "
                "longer hold. Call optimizer.zero_grad() after optimizer.step()"
            )

    def _reclaim_oldest(self) -> bool:
        """The gradient stager needs a buffer: wait for the oldest step in backward that
        holds one. False when none does."""
        for spec in self._pending().values():
            if spec.lent_grads:
                self._finished(spec, keep_failed_grads=True)
                return True
        return False

    def _collect(self, block: bool, *, wait: bool = False) -> None:
        """Commit the steps in backward that are done (with ``wait``, after waiting for
        the running ones; all of them with ``block``); one whose unit is still resident
        (frozen weights backward may read) waits for backward's end."""
        for key, spec in self._pending().items():
            unit = spec.unit_step.unit
            if not block and (unit.materialized or not (wait or spec.future.done())):
                continue
            self._finished(spec, keep_failed_grads=True)
            if not spec.ok:
                del self._jobs[key]
                spec.shadows.discard()
                spec.cancel()
                self.stats.rolled_back += 1
                continue
            try:
                spec.unit_step.commit_speculation(spec.shadows)
            except BaseException:
                del self._jobs[key]  # (as it left the pending steps before the commit)
                raise
            spec.move(JobState.COMMITTED)  # kept, taken, until optimizer.step()
            unit.grads.consumed = True
            self.stats.committed += 1

    def _settle_consumed(self, committed: set[int]) -> None:
        """optimizer.step() after a backward that stepped units: they are done, if the
        param groups are still the values they used."""
        self._collect(block=True)
        consumed = self._consumed()
        for key in consumed:
            del self._jobs[key]
        committed.update(consumed)
        groups = {group for spec in consumed.values() for group in spec.hyper}
        now = {group: self._hyper(group) for group in groups}
        for spec in consumed.values():
            for group, hyper in spec.hyper.items():
                changed = _changed(now[group], hyper)
                if changed:
                    raise RuntimeError(
                        f"step_in_backward=True: param group {group} changed ({changed}) "
                        "between backward and optimizer.step(), but its units were already "
                        "stepped inside backward with the earlier values. Change param "
                        "groups (an LR scheduler's step) after optimizer.step() and before "
                        "the next backward, or set step_in_backward=False"
                    )

    # ------------------------------------------------------------------ in the next forward
    # step_in_forward: the units optimizer.step() would step after the speculations were
    # settled (a clip that bit, the root, rollbacks) are stepped by the worker while the
    # caller goes on to the next forward; each commits before its unit's next use. The
    # ordinary step's arithmetic and inputs exactly (the group values, flags and factors
    # of that call), into shadows; nothing anyone reads changes before the commit.
    def defer(
        self, unit_steps: list, multipliers: Callable[[Unit], list], started: set[int]
    ) -> None:
        """At ``optimizer.step()``: hand the steps of ``unit_steps`` that can run during
        the next forward to the worker, in the order that forward uses them, adding the
        id of each unit to ``started`` as it starts (the others are the caller's to step
        now)."""
        if not self.in_forward:
            return
        with self._claims:
            self._forward_running = False
        used = self.use_order() if self.use_order else []
        order = {id(u): i for i, u in enumerate(used)}
        candidates = [s for s in unit_steps if self._can_defer(s)]
        candidates += [s for s in unit_steps if self._can_defer_in_place(s)]
        candidates.sort(key=lambda s: order.get(id(s.unit), len(order)))
        deferred = {id(s.unit) for s in candidates}
        # a unit with a disk home that forward fetches without a step pending (frozen,
        # no gradients, stepped in backward) reads its parameters into a free buffer
        self._fetches_from_disk = any(
            u.param_stager is not None and transfers_only(u.home) and id(u) not in deferred
            for u in used
        )
        with self._own_allocations():
            for unit_step in candidates:
                if isinstance(unit_step, InMemoryUnitStep):
                    self._start_in_place(unit_step)
                elif not self._start_in_forward(unit_step, multipliers(unit_step.unit)):
                    continue
                started.add(id(unit_step.unit))
        # (what was read ahead for a unit not handed over is for optimizer.step()'s own
        # step of it, next; that call drops the rest at its end)

    def in_forward_shadow_bytes(self) -> tuple[int, int]:
        """(steps, disk bytes): the steps running on into the next forward that hold
        disk shadows until they commit."""
        held = [r.shadows.shadow_bytes for r in self._in_forward().values() if r.shadows]
        return len(held), sum(held)

    def _can_defer(self, unit_step) -> bool:
        unit = unit_step.unit
        return (
            id(unit) in self._steps
            and eligible(unit_step, unit)
            and not unit.materialized  # a device copy would be stale until the commit
            and not unit.home_stale
            and unit.grads.any()
        )

    def _can_defer_in_place(self, unit_step) -> bool:
        unit = unit_step.unit
        return (
            id(unit) in self._in_place_steps
            and not unit.materialized  # a device copy would be stale until it lands
            and isinstance(unit.home, torch.Tensor)  # (a disk home's write allocates)
            and unit.grads.any()
        )

    def _start_in_place(self, unit_step: InMemoryUnitStep) -> None:
        """Hand ``unit_step``'s ordinary step to the worker, as ``optimizer.step()`` would
        run it now: the same group values, the missing gradients zeroed here."""
        unit = unit_step.unit
        unit.grads.fill_missing()
        record = StepJob(unit_step, When.IN_FORWARD, Target.IN_PLACE, self._hyper_now(unit))
        unit.param_version += 1  # as the ordinary step moves it before stepping
        record.submitted(self._pool().submit(_step_in_place, record))
        self._add_job(unit, record)
        unit.work_pending = True
        self.stats.in_forward += 1

    def _finish_in_place(self, record: StepJob) -> None:
        """Wait for ``record``'s step. One that failed on the worker may have stepped
        part of the unit, as a failure inside ``optimizer.step()`` would: its error is
        raised here, once, and the unit is left as the worker left it."""
        unit = record.unit_step.unit
        ok = self._wait_worker(record)
        del self._jobs[id(unit)]
        unit.work_pending = False
        self._stop_worker_if_idle()
        if not ok:
            raise RuntimeError(
                f"hetstore: the optimizer step of unit {unit.name!r}, run on during the next "
                "forward (step_in_forward), failed part-way; its weights and states "
                "may be partly stepped, as after a failure inside optimizer.step()"
            ) from record.future.exception()

    def _start_in_forward(self, unit_step: StreamedUnitStep, multipliers: list) -> bool:
        unit = unit_step.unit
        if not self._disk.would_fit(unit_step.shadow_bytes + self._disk_reserve):
            return False  # (the ordinary step needs one shadow's room: the reserve)
        if unit.grad_stager is not None:
            unit.grad_stager.finish()  # backward's gradient writes, and their errors
        if isinstance(unit.grad, torch.Tensor):
            unit.grads.fill_missing()  # what the ordinary step does to the live buffer
        slots = self._worker_slots()
        if slots is None:
            return False
        try:
            rewrite = unit_step.begin_speculation()
        except OutOfTierMemory:
            return False
        record = StepJob(
            unit_step,
            When.IN_FORWARD,
            Target.SHADOWS,
            self._hyper_now(unit),
            rewrite,
            multipliers=list(multipliers),
            has_grad=unit.grads.state().has_grad,
        )
        try:
            record.wants_params = _stages_params(unit)
            if record.wants_params and unit.param_stager.spare > self._buffers_to_keep():
                record.params = unit.param_stager.lend()
            record.read_ahead = self.take_read_ahead(unit)
            record.submitted(self._pool().submit(self._run_in_forward, record, slots))
        except BaseException:
            rewrite.discard()
            self._give_back_borrowed(record)
            raise
        self._add_job(unit, record)
        self._arm(unit_step, True)
        self.stats.in_forward += 1
        return True

    def _run_in_forward(self, record: StepJob, slots: list) -> None:
        """The worker: ``record``'s step, leaving the new parameters in the staging buffer
        lent to it, if one was by the time it starts."""
        with self._claims:
            # once forward runs, wait for a buffer to be lent (forward gives one back as
            # it takes the unit before's) rather than go on without: the unit's fetch
            # would then read its parameters from disk, beside this worker's reads.
            # Before forward runs (the loop's data loading, logging) go on: the steps
            # are best done by then. Not while the caller waits for the worker either
            # (nothing would be given back until it is done), nor once the program is
            # exiting (the interpreter joins this thread).
            while (
                record.params is None
                and record.wants_params
                and self._forward_running
                and not self._waiting
                and not _EXITING.is_set()
            ):
                self._claims.wait(timeout=0.05)
            record.claimed = True
            params = record.params
        unit_step = record.unit_step
        out = None if params is None else unit_step.unit.param_stager.view(params, unit_step.unit)
        unit_step.run_in_forward(
            record.shadows,
            slots,
            record.hyper,
            record.multipliers,
            record.has_grad,
            params_out=out,
            read_ahead=None if record.read_ahead is None else record.read_ahead.arrays,
        )
        record.filled = out is not None

    # ------------------------------------------------------------------ read ahead
    # After a clip that bit (or with step_in_forward and without overlap_step) no disk
    # unit is stepped during backward: every step runs after it, in optimizer.step(), or
    # during the next forward, which waits for each. Either way the first units' reads
    # of master and states are on the critical path, while backward leaves the disk
    # mostly idle. So at the start of that backward the worker reads the first
    # READ_AHEAD_UNITS units' masters and states (in the order they will be stepped)
    # into host memory, where the host tier has room beside what backward will still
    # allocate (memory held only to save time: a host allocation that finds no room
    # drops them first).
    def _start_read_ahead(self) -> None:
        if (
            self.consume
            or self.suspended
            or not self.policy.last_backward  # not the last micro-batch's backward
            or (self.speculate and not self.policy.hold_back)  # steps taken in backward
            or (self.in_forward and self.use_order is None)
        ):
            return
        if self.in_forward:
            order = self.use_order()
        else:  # optimizer.step()'s order
            order = [s.unit for s in self._steps.values()]
        with self._own_allocations():
            for unit in order:
                if len(self._read_ahead) >= READ_AHEAD_UNITS:
                    return
                unit_step = self._steps.get(id(unit))
                if id(unit) in self._read_ahead or not _reads_ahead(unit_step, unit):
                    continue
                if not self._read_ahead_into_memory(unit_step):
                    return

    def _read_ahead_into_memory(self, unit_step: StreamedUnitStep) -> bool:
        """Allocate ``unit_step``'s unit's master and states in host memory and have the
        worker read them; False when the host has no room for them."""
        unit = unit_step.unit
        arrays = {"master": unit.master}
        if not unit_step.states_absent:
            arrays.update(unit_step.states)
        need = sum(round_up(a.numel * a.dtype.itemsize, PAGE_SIZE) for a in arrays.values())
        # beside it, the chunk buffers the step that reads it will make (the worker's, or
        # optimizer.step()'s own): a read ahead in use cannot give way to them
        if not self._host.account.would_fit(need + self._slot_bytes() + self._staging_to_come()):
            return False
        record = ReadAhead(unit_step, {}, [], _versions(unit))
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
            self.give_back_read_ahead(record)
            return False
        record.future = self._pool().submit(_read_into, dict(arrays), record.arrays)
        self._read_ahead[id(unit)] = record
        return True

    def drop_read_ahead(self) -> None:
        """The end of ``optimizer.step()``: what no step used goes (and the worker, if
        nothing is left for it)."""
        self._drop_read_ahead()
        self._stop_worker_if_idle()

    def take_read_ahead(self, unit: Unit) -> ReadAhead | None:
        """What was read ahead for ``unit``, if it is still its master and states (and
        the worker read it without error): its ``arrays`` for the step's
        ``read_ahead=``. Hand it back with :meth:`give_back_read_ahead` once that step
        is done."""
        record = self._read_ahead.get(id(unit))
        if record is None:
            return None
        ok = self._wait_worker(record)
        del self._read_ahead[id(unit)]  # (after the wait: interrupted, it is still held)
        if not ok or record.versions != _versions(unit):
            self.give_back_read_ahead(record)
            return None
        self.stats.read_ahead += 1
        return record

    def _drop_read_ahead(self, unit: Unit | None = None) -> None:
        """Free what was read ahead (for ``unit`` only, or for every unit)."""
        keys = list(self._read_ahead) if unit is None else [id(unit)]
        for key in keys:
            record = self._read_ahead.get(key)
            if record is not None:
                self._wait_worker(record)  # (before it leaves: interrupted, it is still held)
                del self._read_ahead[key]
                self.give_back_read_ahead(record)

    def give_back_read_ahead(self, record: ReadAhead) -> None:
        if record.future is not None:
            self._wait_worker(record)  # never free a buffer the worker reads into
        for buffer in record.buffers:
            self._host.free(buffer)
        record.buffers.clear()

    def _buffers_to_keep(self, before: StepJob | None = None) -> int:
        """Free parameter staging buffers not to lend: one while a unit forward uses
        before ``before`` (or any, without it) will read its parameters from disk at its
        fetch (its step has no buffer), so that fetch finds one free (fetches take one
        at a time and give it back after the copy), and one while forward fetches any
        unit with a disk home that has no step pending."""
        if self._fetches_from_disk:
            return 1
        for record in self._in_forward().values():
            if record is before:
                break
            if record.params is None and record.wants_params:
                return 1
        return 0

    @contextlib.contextmanager
    def _hurry(self):
        """Around a wait for the worker: a step waiting for a parameter buffer goes on
        without one meanwhile (nothing would be given back until the wait is over)."""
        with self._claims:
            self._waiting += 1
            self._claims.notify_all()
        try:
            yield
        finally:
            with self._claims:
                self._waiting -= 1

    def _fetch_gave_back(self) -> None:
        """A fetch gave its parameter buffer back: forward runs; lend it on."""
        with self._claims:
            self._forward_running = True
        self._lend_params()

    def _lend_params(self) -> None:
        """A parameter staging buffer came free: lend it to the first step in the next
        forward the worker has not started and that has none (the worker runs them in
        the order forward uses the units, so this is the next unit forward needs)."""
        for record in self._in_forward().values():
            if record.claimed or record.params is not None or not record.wants_params:
                continue
            stager = record.unit_step.unit.param_stager
            if stager.spare <= self._buffers_to_keep(before=record):
                return
            slot = stager.lend()
            with self._claims:
                if not record.claimed:
                    record.params = slot
                    self._claims.notify_all()
                    continue
            stager.unlend(slot)  # started meanwhile: it reads from disk; the next one

    def _reclaim_lent_params(self) -> bool:
        """A fetch found every parameter staging buffer lent: finish the first step
        holding one (its buffer is then staged, for its fetch, or returned). A step that
        fails here stays pending and raises at its own unit's use (its buffer was
        returned before the retry): not at this fetch of another unit."""
        for record in self._in_forward().values():
            if record.params is not None:
                try:
                    self.finish_unit_in_forward(record.unit_step.unit)
                except Exception:  # noqa: BLE001 - raised again at that unit's use
                    pass
                return True
        return False

    def _give_back_borrowed(self, record: StepJob, committed: bool = False) -> None:
        """Give back what ``record`` borrowed, once the worker is done with it: what was
        read ahead for it, and its lent parameter buffer (staged for the unit's fetch
        when ``committed`` and filled, else unused)."""
        read_ahead, record.read_ahead = record.read_ahead, None
        if read_ahead is not None:
            self.give_back_read_ahead(read_ahead)
        slot, record.params = record.params, None
        if slot is None:
            return
        stager = record.unit_step.unit.param_stager
        if committed and record.filled:
            stager.stage(record.unit_step.unit, slot)
            self.stats.params_staged += 1
        else:
            stager.unlend(slot)

    @staticmethod
    def _arrays_of(unit_step: StreamedUnitStep) -> list:
        unit = unit_step.unit
        arrays = [unit.master, *unit_step.states.values(), *unit_step.scales.values()]
        arrays += [a for a in (unit.home, unit.grad) if transfers_only(a)]
        return arrays

    def _arm(self, unit_step: StreamedUnitStep, on: bool) -> None:
        """Make every use of the unit (and every disk read of its arrays) land its step
        in the next forward first; or, ``on=False``, stop."""
        unit = unit_step.unit
        gate = (lambda: self._finish_from_reader(unit)) if on else None
        for array in self._arrays_of(unit_step):
            array.before_read = gate
        unit.work_pending = on

    def _finish_from_reader(self, unit: Unit) -> None:
        """A disk read of one of ``unit``'s arrays: its step lands first, unless the
        read is the worker's own (the step reading its inputs)."""
        if not self._on_worker_thread():
            self.finish_unit_in_forward(unit)

    def finish_in_forward(self) -> None:
        """Commit every step running in the next forward (waiting for the worker)."""
        for record in self._in_forward().values():
            self.finish_unit_in_forward(record.unit_step.unit)
        for record in self._in_place().values():
            self._finish_in_place(record)

    def finish_unit_in_forward(self, unit: Unit) -> None:
        """Wait for ``unit``'s step in the next forward and commit it. One the worker
        could not finish is run again here, the ordinary way, with the same inputs; if
        that fails too the error is raised and the step stays pending (every later use
        of the unit tries it again: nothing sees the unit as stepped until it is)."""
        if self._on_worker_thread():
            return  # the worker's own use of the unit, inside its step
        record = self._jobs.get(id(unit))
        if record is None or record.when is not When.IN_FORWARD:
            return
        if record.target is Target.IN_PLACE:
            self._finish_in_place(record)
            return
        with self._claims:  # a unit is used: forward runs (on CUDA a fetch gives its
            self._forward_running = True  # buffer back only once its upload is done)
        self._lend_params()  # to the units after it, before the worker reaches them
        unit_step = record.unit_step
        self._arm(unit_step, False)  # this thread's own reads and rewrites below go through
        try:
            if self._wait_worker(record) and record.shadows is not None:
                unit_step.commit_speculation(record.shadows)
                record.move(JobState.COMMITTED)
                record.shadows = None
                self._give_back_borrowed(record, committed=True)
            else:  # failed on the worker (or here before): again, the ordinary way
                self._give_back_borrowed(record)
                if record.shadows is not None:
                    record.shadows.discard()
                    record.shadows = None
                unit_step.step(record.multipliers, hyper=record.hyper, has_grad=record.has_grad)
                record.move(JobState.LANDED)  # (stepped here instead: the step is done)
        except BaseException as exc:
            if record.state in (JobState.COMMITTED, JobState.LANDED):
                # the step is the unit's already (what failed came after: giving back a
                # staging buffer): done, never run again
                self._forget_in_forward(id(unit))
                raise
            self._arm(unit_step, True)
            exc.add_note(
                f"hetstore: the optimizer step of unit {unit.name!r}, run on during the next "
                "forward (step_in_forward), failed; the unit keeps its weights from "
                "before that step, and its next use runs the step again"
            )
            raise
        self._forget_in_forward(id(unit))
        self._stop_worker_if_idle()

    def _forget_in_forward(self, key: int) -> None:
        record = self._jobs[key]
        if record.shadows is not None or record.params is not None or record.read_ahead:
            self._wait_worker(record)  # never discard (or give back) under the worker
        del self._jobs[key]  # (after the wait: interrupted, it is still recorded)
        if record.shadows is not None:
            record.shadows.discard()
            record.cancel()
        self._give_back_borrowed(record)
        self._arm(record.unit_step, False)

    # ------------------------------------------------------------------ internals
    def _state_change(self, unit: Unit) -> None:
        if id(unit) in self._steps:  # (only those stepped ahead hold anything of it)
            self._drop(unit)

    def _drop(self, unit: Unit) -> None:
        """The unit's master or states are about to be rewritten outside a step."""
        self._cancel(id(unit))
        self._drop_read_ahead(unit)

    def _cancel(self, key: int) -> None:
        spec = self._pending().get(key)
        if spec is None:
            return
        self._finished(spec)  # (interrupted here, it stays pending: the worker may write)
        del self._jobs[key]
        spec.shadows.discard()
        spec.cancel()
        self.stats.cancelled += 1

    def _finished(self, spec: StepJob, keep_failed_grads: bool = False) -> bool:
        """Wait for the worker (once: the outcome is kept in ``spec.ok``) and give back
        the gradient buffer it read; False when the step failed (the ordinary step then
        runs, and raises if the cause persists). ``keep_failed_grads``: a step in
        backward that failed writes its gradients to disk instead, for that step."""
        self._wait_worker(spec)
        # (an interrupt of this thread while it waits propagates, and the buffer stays
        # lent: the worker may still be reading it)
        _give_back_master(spec)
        if spec.lent_grads:
            spec.lent_grads = False
            unit = spec.unit_step.unit
            if spec.ok or not keep_failed_grads:
                unit.grad_stager.give_back(unit)
            else:
                unit.grad_stager.flush_lent(unit)
        return spec.ok

    def _wait_worker(self, job: StepJob | StepJob | ReadAhead) -> bool:
        """Wait for the worker's run of ``job`` (once: the outcome is kept in ``job.ok``);
        False when it raised (the caller steps the unit the ordinary way instead)."""
        if job.ok is None:
            with self._hurry():
                job.ok = _outcome(job.future)
            if isinstance(job, StepJob):
                job.finished(job.ok)
        return job.ok

    def _inputs_hold(self, spec: StepJob) -> bool:
        """The master and states it stepped from, and the group values, are current."""
        return spec.unit_step.unit.state_version == spec.state_version and all(
            _same(self._hyper(group), hyper) for group, hyper in spec.hyper.items()
        )

    def _grads_hold(self, spec: StepJob, factors: list[float]) -> bool:
        """No gradient changed since it began, by the counters; gradients on disk carry
        no factor (a clip that bit) but the one it applied itself."""
        on_disk = not isinstance(spec.unit_step.unit.grad, torch.Tensor)
        took = [spec.factor] if spec.factor is not None else []
        return (factors == took or not on_disk) and spec.unit_step.unit.grads.state() == (
            spec.grad_state
        )

    def _grads_equal(self, spec: StepJob) -> bool:
        """A host-memory unit's speculation that only the gradients' version counters
        reject (handed out through p.grad, multiplied by torch's clip): it holds if the
        gradients are still, bit for bit, the ones it stepped with."""
        return (
            isinstance(spec.shadows, MemoryShadows)
            and spec.factor is None
            and spec.unit_step.unit.grads.state().has_grad == spec.grad_state.has_grad
            and spec.unit_step.grads_unchanged(spec.shadows)
        )

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1,
                thread_name_prefix="hetstore-step-ahead",
                initializer=_mark_thread,
                initargs=(self._worker_box,),
            )
        return self._executor

    def _on_worker_thread(self) -> bool:
        return threading.get_ident() == self._worker_box[0]

    def _worker_slots(self) -> list[dict[str, torch.Tensor]] | None:
        """The worker's chunk buffers (one worker: one set of sets for every unit), made
        on this thread at the first speculation after a step and freed at the next;
        None when the host tier has no room for them beside what backward still needs."""
        if self._slots is not None:
            return self._slots
        if self._slots_reclaimed:
            return None
        sets, names, numel = self._slot_shape
        if not self._host.account.would_fit(self._slot_bytes() + self._staging_to_come()):
            # the rest of backward must still find its staging buffers: never take
            # host memory it will need (its stagers make theirs on first use)
            return None
        try:
            self._slots, self._slot_buffers = chunk_buffers(
                self._host, sets, list(names.items()), numel, "step ahead"
            )
        except OutOfTierMemory:  # the pool could not grow (fragmentation): not now
            return None
        return self._slots

    @functools.cached_property
    def _slot_shape(self) -> tuple[int, dict[str, torch.dtype], int]:
        """The worker's chunk buffers: (sets, buffer names and dtypes, elements each);
        the unit steps are fixed for the step ahead's life."""
        names: dict[str, torch.dtype] = {}
        for unit_step in self._streamed:
            names.update(unit_step.slot_names())
        numel = max(s.longest_chunk for s in self._streamed)
        # one set per chunk in flight: a unit of one chunk steps from one set (the
        # planner counts the same, footprints.streamed_step_bytes)
        sets = max(s.slot_sets for s in self._streamed)
        return sets, names, numel

    def _slot_bytes(self) -> int:
        """Host bytes of the worker's chunk buffers (as much as any streamed step's)."""
        sets, names, numel = self._slot_shape
        return sets * sum(round_up(numel * d.itemsize, PAGE_SIZE) for d in names.values())

    def _staging_to_come(self) -> int:
        """Host bytes the parameter and gradient stagers have not made yet."""
        return sum(s.unmade_bytes for s in self._stagers)

    def _free_slots(self) -> None:
        for buffer in self._slot_buffers:
            self._host.free(buffer)
        self._slot_buffers.clear()
        self._slots = None


def _reads_ahead(unit_step, unit: Unit) -> bool:
    """A unit whose step in the next forward can read its master and states from host
    memory read during backward: stepped there at all, in the fp32 format (the compact
    ones carry block scales besides), its home not behind its master."""
    return (
        isinstance(unit_step, StreamedUnitStep)
        and eligible(unit_step, unit)
        and unit_step.format.exact
        and not unit_step.scales
        and not unit.home_stale
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


def _outcome(future: Future) -> bool:
    """Wait for ``future``: True when it ran, False when it raised (the worker's error:
    the job is dropped, and the caller does it the ordinary way)."""
    try:
        future.result()
        return True
    except Exception:  # noqa: BLE001
        return False


def _versions(unit: Unit) -> tuple[int, int]:
    return unit.state_version, unit.param_version


def _mark_thread(box: list) -> None:
    box[0] = threading.get_ident()


def _step_in_place(record: StepJob) -> None:
    """The worker: a host-memory unit's ordinary step, with the group values of the
    ``optimizer.step()`` call that handed it over."""
    record.unit_step.step(record.hyper.__getitem__)


def _read_into(arrays: dict[str, Store], into: dict[str, torch.Tensor]) -> None:
    """The worker: read each disk array whole into its host tensor."""
    wait_all([array.read(into[key], 0) for key, array in arrays.items()])


def _stages_params(unit: Unit) -> bool:
    """A step of ``unit`` in the next forward can leave its new parameters in a
    parameter staging buffer: its home is on disk, fetched through one, and every
    element of it is rewritten by the step (no frozen tail without a master)."""
    return (
        unit.param_stager is not None
        and transfers_only(unit.home)
        and unit.master_numel == unit.numel
    )


def _lent_label(unit: Unit) -> str:
    return f"lent master {unit.name}"


def _give_back_master(spec: StepJob) -> None:
    """The worker is done with (or never got) the spec's lent master: its bytes go."""
    if spec.master is not None:
        spec.master = None
        unit = spec.unit_step.unit
        unit.tiers.host.account.release(unit.device_bytes, _lent_label(unit))
