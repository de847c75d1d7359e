"""The scheduler of every unit step taken outside ``optimizer.step()``'s own loop.

Without it, every disk unit's streamed step (read master and moments from disk, step,
write them back) waits for ``optimizer.step()`` after backward: the phase users of
offloaded training complain about most. ``StepAhead`` owns every such step as a job
(:mod:`hetstore.optim.step_job`, one per unit at a time), the one worker thread that runs
them (:mod:`hetstore.optim.step_worker`), the host memory they borrow
(:mod:`hetstore.optim.borrowed`), and the runtime's events that start and land them
(gradients final, backward started and ended, a unit about to be read, states rewritten).
How a step in backward starts and is settled is :mod:`hetstore.optim.in_backward` (what a
speculation assumes, and how it is checked); a step in the next forward,
:mod:`hetstore.optim.in_forward`; when each runs, :mod:`hetstore.optim.policy`. Either
way the result is the ordinary step's, bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetstore.optim.borrowed import ParamLending, ReadAheads
from hetstore.optim.in_backward import BackwardSteps
from hetstore.optim.in_forward import ForwardSteps
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.policy import OverlapTrial, StepModes, StepPolicy
from hetstore.optim.step_job import JobState, StepJob, Target, When
from hetstore.optim.step_worker import StepWorker
from hetstore.optim.streamed import StreamedUnitStep
from hetstore.runtime.events import Event
from hetstore.runtime.staging import stagers_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from hetstore.runtime.unit import Unit

__all__ = ["SpeculationStats", "StepAhead"]


@dataclass
class SpeculationStats:
    """Counts since the model was offloaded."""

    started: int = 0
    committed: int = 0  # hits: the step was already done when optimizer.step() came
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

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _snapshot(hyper: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in hyper.items()}


class StepAhead:
    """The scheduler of one optimizer's unit steps outside ``optimizer.step()``'s own loop
    (see the module doc)."""

    def __init__(
        self,
        unit_steps: list[StreamedUnitStep],
        hyper: Callable[[int], dict],
        loss_scaler,
        modes: StepModes,
        *,
        trial: OverlapTrial | None = None,
        in_place: list[InMemoryUnitStep] = (),
    ):
        self._steps = {id(s.unit): s for s in unit_steps}
        # host-memory units whose ordinary step may run in place on the worker: in
        # backward (step_in_backward), in the next forward (step_in_forward on a GPU)
        self._in_place = {id(s.unit): s for s in in_place}
        first = (list(unit_steps) or list(in_place))[0]  # (the tiers of either)
        # the configured modes (optim.policy): disk units stepped during backward
        # (overlap_step, or taking the gradients: step_in_backward), and steps left to the
        # next forward (step_in_forward; host units in place: in_place)
        self.modes = modes
        # when each unit's step runs: micro-batch counting, hold-back, back-off, the trial
        self.policy = StepPolicy(trial)
        # the units in the order the next forward uses them (the runtime's), else None
        self.use_order: Callable[[], list[Unit]] | None = None
        self.hyper = hyper  # a param group's current values, by index
        self._host = first.unit.tiers.host
        self._disk = first.unit.tiers.disk
        # attached by offload() before the optimizer is built; fixed from here on
        self.stagers = stagers_of([s.unit for s in unit_steps])
        # kept free on disk while speculations hold their shadows: one ordinary step's
        self.disk_reserve = max((s.shadow_bytes for s in unit_steps), default=0)
        # every unit's step job, one per unit at a time, in the order they were made
        # (the worker's too: by next use, and the steps in the next forward are made in
        # its order): steps in backward until settled (and, taken in backward, until
        # optimizer.step()), steps handed to the next forward until used
        self.jobs: dict[int, StepJob] = {}
        self.stats = SpeculationStats()
        # (the thread lasts across steps where it steps host-memory units: see stop)
        keep_thread = bool(in_place)
        self.worker = StepWorker(self._host, unit_steps, self.stagers, keep_thread)
        self.read_aheads = ReadAheads(self._host, self.worker, self.stats)
        self.lending = ParamLending(self.worker, self)
        self.backward = BackwardSteps(self, loss_scaler)
        self.forward = ForwardSteps(self)
        self.suspended = 0  # depth of hetstore.no_sync
        # host memory held only to save time: given back when an allocation needs it
        # (activations restored in backward, a later micro-batch's forward)
        self._reclaiming_allowed = True
        self._host.reclaimers.append(self._reclaim_host)
        # the runtime's events (runtime.events): told when gradients are final, when
        # backward starts and ends, when a unit is read while its step runs on, and
        # when a unit's states are rewritten outside a step
        self._events = first.unit.events
        # (a disk unit's step in backward reads the stager's buffer on this thread, so
        # it must wait for the gradient copies when the unit's backward is done)
        reads_grads = (modes.overlap_disk or modes.in_backward) and bool(unit_steps)
        for event, handler in self._subscriptions():
            on_grads = event in (Event.GRADS_GATHERED, Event.GRADS_FINAL)
            self._events.subscribe(event, handler, reads_grads=reads_grads and on_grads)

    # ------------------------------------------------------------------ read-only views
    @property
    def unit_steps(self) -> tuple[StreamedUnitStep, ...]:
        """The unit steps this object may step in backward."""
        return tuple(self._steps.values())

    @property
    def units(self) -> list[Unit]:
        """Every unit whose step this object may take outside ``optimizer.step()``."""
        return [s.unit for s in (*self._steps.values(), *self._in_place.values())]

    def step_of(self, unit: Unit) -> StreamedUnitStep | None:
        """``unit``'s step, or None where this object takes none of it in backward."""
        return self._steps.get(id(unit))

    def in_place_step_of(self, unit: Unit) -> InMemoryUnitStep | None:
        """``unit``'s host-memory step, where the worker may run it in place."""
        return self._in_place.get(id(unit))

    # ------------------------------------------------------------------ the jobs
    def add_job(self, unit: Unit, job: StepJob) -> None:
        """One job per unit at a time: a unit's earlier job is settled, landed or
        cancelled before another is made (one left would be orphaned: its shadows, gates
        and borrowed buffers never given back)."""
        if id(unit) in self.jobs:
            raise RuntimeError(
                f"hetstore internal error: unit {unit.name!r} already has a step job "
                f"({self.jobs[id(unit)].state.value})"
            )
        self.jobs[id(unit)] = job

    def _where(self, kind: Callable[[StepJob], bool]) -> dict[int, StepJob]:
        """The jobs of one kind (unit id -> job), in the order they were made."""
        return {k: j for k, j in self.jobs.items() if kind(j)}

    def pending(self) -> dict[int, StepJob]:
        """Steps in backward into shadows not settled yet (running, done ahead, or failed)."""
        return self._where(_settling)

    def consumed(self) -> dict[int, StepJob]:
        """step_in_backward: steps taken in backward (committed, or in place), until
        optimizer.step()."""
        return self._where(_taken)

    def refuse_dropping(self, what: str) -> None:
        """Taking the gradients, between a backward that stepped units and
        ``optimizer.step()``: ``what`` (a zero_grad, a load) would drop or replace what
        plain PyTorch steps next, or (a save) keep a step half taken, but those steps are
        taken already. Refused."""
        consumed = self.consumed()
        if consumed:
            names = [job.unit.name for job in consumed.values()][:3]
            raise RuntimeError(
                f"{what} between backward and optimizer.step() with step_in_backward=True: "
                f"the backward already stepped {len(consumed)} units (e.g. {names}) with "
                "its gradients, which plain PyTorch would step only at optimizer.step(). "
                "Call optimizer.step() first, or set step_in_backward=False"
            )

    def in_forward_jobs(self) -> list[StepJob]:
        """Disk units' steps handed to the next forward, into shadows."""
        shadows = self._where(lambda j: j.when is When.IN_FORWARD and j.target is Target.SHADOWS)
        return list(shadows.values())

    def in_place(self) -> list[StepJob]:
        """Host-memory units' ordinary steps running in place, not landed yet (handed to
        the next forward, or taken in backward)."""
        running = self._where(lambda j: j.target is Target.IN_PLACE and j.state is JobState.RUNNING)
        return list(running.values())

    def hyper_now(self, unit: Unit) -> dict[int, dict]:
        """A snapshot of the values of every param group ``unit`` has a segment in."""
        return {s.group: _snapshot(self.hyper(s.group)) for s in unit.segments}

    def disk_room(self, unit_step: StreamedUnitStep) -> bool:
        """Room on disk for ``unit_step``'s shadows beside one ordinary step's (the reserve)."""
        return self._disk.would_fit(unit_step.shadow_bytes + self.disk_reserve)

    # ------------------------------------------------------------------ runtime events
    def _subscriptions(self) -> list:
        """What it listens to. Made on each call, not kept: bound methods kept on the
        object would be a reference cycle, and a released model's step machinery (its
        unit steps, their buffers) would then wait for the garbage collector."""
        subscriptions = [
            (Event.BACKWARD_STARTED, self.backward_started),
            (Event.GRADS_GATHERED, self.consume_grads),
            (Event.GRADS_FINAL, self.grads_final),
            (Event.BACKWARD_ENDED, self.backward_ended),
            (Event.UNIT_READ, self.forward.land),
            (Event.STATE_CHANGE, self._state_change),
        ]
        if self.modes.in_backward:  # (the stager's buffers it takes over in backward)
            subscriptions.append((Event.GRAD_BUFFERS_LENT, self.backward.give_grad_buffer_back))
        if self.modes.in_forward:  # (the parameter buffers it borrows)
            subscriptions.append((Event.PARAM_BUFFER_FREE, self.lending.forward_runs))
            subscriptions.append((Event.PARAM_BUFFERS_LENT, self.lending.give_one_back))
        return subscriptions

    def backward_started(self) -> None:
        self.forward.land_all()  # the gradients they read are about to be written
        self.policy.backward_started()
        self.worker.new_backward()
        if self.modes.in_backward:
            self.backward.check_fresh_backward()
        self._start_read_ahead()

    def backward_ended(self) -> None:
        """Every unit is released: finish and commit the steps taken in backward."""
        if self.modes.in_backward:
            self.backward.collect(block=True)

    def consume_grads(self, unit: Unit) -> bool:
        """step_in_backward: backward produced ``unit``'s last gradient; step it now from
        them. True when the step took the gradients (nothing is to be written to disk)."""
        if not self.modes.in_backward or self.suspended:
            return False
        in_place = self._in_place.get(id(unit))
        if in_place is not None:
            return self.backward.start_in_place(in_place)
        if id(unit) not in self._steps:
            return False
        self.backward.collect(block=False)
        job = self.backward.start(unit)
        if job is None:
            return False
        self.add_job(unit, job)
        return True

    def grads_final(self, unit: Unit) -> None:
        """Backward produced ``unit``'s last gradient: start its speculative step."""
        if (
            not self.modes.overlap_disk
            or self.modes.in_backward
            or self.suspended
            or not self.policy.last_backward
        ):
            return
        self.backward.cancel(id(unit))  # one from an earlier micro-batch: superseded
        if id(unit) not in self._steps:
            return  # not stepped ahead (e.g. gradients in memory of a unit not on disk)
        if not self.policy.overlapping:  # (the trial's way without overlap: OverlapTrial)
            return
        if self.policy.held_back(id(unit)):
            self.stats.held_back += 1
            return
        with self.own_allocations():
            job = self.backward.start(unit)
        if job is not None:
            self.add_job(unit, job)

    def _start_read_ahead(self) -> None:
        """At the start of a backward whose steps all run after it: the first units'
        masters and states into host memory (:class:`ReadAheads`)."""
        if (
            self.modes.in_backward
            or self.suspended
            or not self.policy.last_backward  # not the last micro-batch's backward
            or not self.policy.overlapping  # (the trial's way without overlap)
            or (self.modes.overlap_disk and not self.policy.hold_back)  # taken in backward
            or (self.modes.in_forward and self.use_order is None)
        ):
            return
        # the order they will be stepped: the next forward's, or optimizer.step()'s
        in_forward = self.modes.in_forward
        order = self.use_order() if in_forward else [s.unit for s in self._steps.values()]
        with self.own_allocations():
            self.read_aheads.fill(order, self.step_of)

    def _state_change(self, unit: Unit) -> None:
        """The unit's master or states are about to be rewritten outside a step: refused
        for a unit stepped in backward, taking its gradients, before optimizer.step()."""
        job = self.jobs.get(id(unit))
        if job is not None and _taken(job):
            self.refuse_dropping(f"a load or edit of unit {unit.name!r}'s weights or states")
        if id(unit) in self._steps:  # (only those stepped ahead hold anything of it)
            self.backward.cancel(id(unit))
            self.read_aheads.drop(unit)

    # ------------------------------------------------------------------ optimizer events
    def settle(self, disk_grad_factors: list, committed: set[int], clipped: bool = False) -> None:
        """At ``optimizer.step()``: land the steps taken in backward (commit what still
        holds, discard the rest); add the ids of the units committed to ``committed`` as
        each commits. ``disk_grad_factors``: what the ordinary step would multiply
        gradients on disk by (clipping); a speculation took none. ``clipped``: a clip
        scaled the gradients this step (the policy's hold-back)."""
        outcomes: dict[int, bool] = {}
        try:
            if self.modes.in_backward:
                self.backward.settle_consumed(committed)
            else:
                with self.own_allocations():
                    self.backward.settle(disk_grad_factors, committed, outcomes)
        finally:
            self.discard_all()  # after an error: nothing may stay pending
            self.policy.step_ended()
            if not self.modes.in_backward:
                self.policy.step_settled(outcomes, clipped)

    # ------------------------------------------------------------------ ending
    def discard_all(self) -> None:
        """Drop every speculation (``zero_grad()`` without a step, a load, release). The
        worker thread and its buffers go too: they exist only while a job does (a model
        dropped between steps leaves no thread behind)."""
        for key in self.pending():
            self.backward.cancel(key)
        self.stop_worker_if_idle()

    def stop_worker_if_idle(self, closing: bool = False) -> None:
        """No job left (but steps taken in backward that are over, which hold nothing of
        the worker's) and nothing read ahead: the worker and its buffers go
        (``StepWorker.stop``)."""
        busy = any(not _taken(j) or j.state is JobState.RUNNING for j in self.jobs.values())
        if busy or self.read_aheads:
            return
        self.worker.stop(closing)

    def close(self) -> None:
        try:
            self.forward.land_all()
        except Exception:  # noqa: BLE001 - the model is being released: nothing reads it
            pass
        finally:
            self.forward.close()
            self.read_aheads.drop()
            self.discard_all()
            self.stop_worker_if_idle(closing=True)
        if self._reclaim_host in self._host.reclaimers:
            self._host.reclaimers.remove(self._reclaim_host)
        for event, handler in self._subscriptions():
            self._events.unsubscribe(event, handler)

    @contextlib.contextmanager
    def own_allocations(self):
        """Host allocations made for the jobs themselves, or while they are being
        settled, do not reclaim other jobs' borrowed buffers."""
        before, self._reclaiming_allowed = self._reclaiming_allowed, False
        try:
            yield
        finally:
            self._reclaiming_allowed = before

    def _reclaim_host(self) -> bool:
        """The host tier is out of room: give back the first of what the jobs hold only
        to save time, in this order: what was read ahead, the worker's chunk buffers.
        True when one was given back;
        False leaves the allocation to fail as it would without the step ahead."""
        if not self._reclaiming_allowed:
            return False
        if self.read_aheads:  # the disk has the same values
            self.read_aheads.drop()
            return True
        if self.worker.has_slots and not self.worker.on_worker_thread():
            # the worker's chunk buffers: what needs the room (the next forward, the
            # clip's scan of gradients on disk, an ordinary step) comes first. Let the
            # steps running on them finish (a speculation's result is in its disk
            # shadows, a step in the next forward's is committed at its unit's use, as
            # always); a later one makes them again where there is room
            for job in [*self.pending().values(), *self.in_forward_jobs()]:
                if job.future is not None:
                    self.worker.wait(job)
            self.worker.reclaim_slots()
            return True
        return False

    @contextlib.contextmanager
    def no_sync(self):
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1


def _settling(job: StepJob) -> bool:
    """A step in backward into shadows not settled yet (running, done ahead, or failed)."""
    return (
        job.when is When.IN_BACKWARD
        and job.target is Target.SHADOWS
        and job.state is not JobState.COMMITTED
    )


def _taken(job: StepJob) -> bool:
    """A step taken in backward (step_in_backward), committed or in place, until
    optimizer.step()."""
    return job.when is When.IN_BACKWARD and (
        job.state is JobState.COMMITTED or job.target is Target.IN_PLACE
    )
