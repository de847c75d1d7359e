"""Steps handed by ``optimizer.step()`` to the next forward (``step_in_forward``): how they
start and how a unit's use lands them.

The units ``optimizer.step()`` would step after the steps in backward were settled (a clip
that bit, rollbacks) are stepped by the worker while the caller goes on to the next
forward; each lands before its unit's next use, at the one landing point every reader goes
through (``Unit.barrier``, which publishes the runtime's ``UNIT_READ`` event; a disk read
of one of the unit's arrays calls it too). The step is known: the ordinary step's
arithmetic and inputs exactly (the group values, flags and factors of that call).
Two targets:

- **disk units** (``Target.SHADOWS``): into shadows, committed at the unit's use; one the
  worker could not finish is run again there, the ordinary way, with the same inputs;
- **host-memory units** on a GPU (``Target.IN_PLACE``): the ordinary step in place; the
  unit is not read until it has landed.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.optim import in_memory
from hetstore.optim.in_backward import eligible
from hetstore.optim.in_memory import InMemoryUnitStep, in_place_failure
from hetstore.optim.step_job import JobState, StepJob, Target, When
from hetstore.optim.step_worker import in_forward
from hetstore.tiers.store import transfers_only

if TYPE_CHECKING:
    from collections.abc import Callable

    from hetstore.optim.step_ahead import StepAhead
    from hetstore.optim.streamed import StreamedUnitStep
    from hetstore.runtime.unit import Unit

__all__ = ["ForwardSteps"]


class ForwardSteps:
    """The steps in the next forward of one step ahead (see the module doc)."""

    def __init__(self, ahead: StepAhead):
        self._ahead = weakref.proxy(ahead)  # (the owner: see BackwardSteps)
        self._worker = ahead.worker
        self._stats = ahead.stats

    # ------------------------------------------------------------------ handing over
    def hand_over(
        self, unit_steps: list, multipliers: Callable[[Unit], list], started: set[int]
    ) -> None:
        """At ``optimizer.step()``: hand the steps of ``unit_steps`` that can run during
        the next forward to the worker, in the order that forward uses them, adding the
        id of each unit to ``started`` as it starts (the others are the caller's to step
        now)."""
        ahead = self._ahead
        used = ahead.use_order() if ahead.use_order else []
        order = {id(u): i for i, u in enumerate(used)}
        candidates = []
        if ahead.policy.overlapping:  # (else the trial's step without overlap)
            candidates = [s for s in unit_steps if self._can_shadow(s)]
            candidates += [s for s in unit_steps if self._can_step_in_place(s)]
        candidates.sort(key=lambda s: order.get(id(s.unit), len(order)))
        ahead.lending.handed_over(used, {id(s.unit) for s in candidates})
        with ahead.own_allocations():
            for unit_step in candidates:
                next_use = in_forward(order.get(id(unit_step.unit), len(order)))
                if isinstance(unit_step, InMemoryUnitStep):
                    self._start_in_place(unit_step, next_use)
                elif not self._start_into_shadows(unit_step, multipliers(unit_step.unit), next_use):
                    continue
                started.add(id(unit_step.unit))
        # (what was read ahead for a unit not handed over is for optimizer.step()'s own
        # step of it, next; that call drops the rest at its end)

    def shadow_bytes(self) -> tuple[int, int]:
        """(steps, disk bytes): the steps running on into the next forward that hold
        disk shadows until they commit."""
        held = [j.shadows.shadow_bytes for j in self._ahead.in_forward_jobs() if j.shadows]
        return len(held), sum(held)

    def _can_shadow(self, unit_step) -> bool:
        unit = unit_step.unit
        return (
            self._ahead.step_of(unit) is not None
            and eligible(unit_step, unit)
            and not unit.materialized  # a device copy would be stale until the commit
            and not unit.home_stale
            and unit.grads.any()
        )

    def _can_step_in_place(self, unit_step) -> bool:
        """A host-memory unit's step for the next forward (on a GPU: the policy's
        ``memory_in_forward``), where it can run on the worker now."""
        return (
            self._ahead.modes.in_forward_memory
            and self._ahead.in_place_step_of(unit_step.unit) is unit_step
            and unit_step.can_step_on_worker()
        )

    def _start_in_place(self, unit_step: InMemoryUnitStep, next_use: tuple[int, int]) -> None:
        """Hand ``unit_step``'s ordinary step to the worker, as ``optimizer.step()`` would
        run it now: the same group values, the missing gradients zeroed here."""
        unit = unit_step.unit
        unit.grads.fill_missing()
        job = StepJob(unit_step, When.IN_FORWARD, Target.IN_PLACE, self._ahead.hyper_now(unit))
        unit.param_version += 1  # as the ordinary step moves it before stepping
        job.submitted(self._worker.submit(in_memory.step_in_place, job, next_use=next_use))
        self._ahead.add_job(unit, job)
        unit.work_pending = True
        self._stats.in_forward += 1

    def _start_into_shadows(
        self, unit_step: StreamedUnitStep, multipliers: list, next_use: tuple[int, int]
    ) -> bool:
        ahead = self._ahead
        unit = unit_step.unit
        if not ahead.disk_room(unit_step):
            return False  # (the ordinary step needs one shadow's room: the reserve)
        if unit.grad_stager is not None:
            unit.grad_stager.finish()  # backward's gradient writes, and their errors
        if isinstance(unit.grad, torch.Tensor):
            unit.grads.fill_missing()  # what the ordinary step does to the live buffer
        slots = self._worker.slots()
        if slots is None:
            return False
        try:
            rewrite = unit_step.begin_speculation()
        except OutOfTierMemory:
            return False
        job = StepJob(
            unit_step,
            When.IN_FORWARD,
            Target.SHADOWS,
            ahead.hyper_now(unit),
            rewrite,
            multipliers=list(multipliers),
            has_grad=unit.grads.state().has_grad,
        )
        try:
            ahead.lending.offer(job)
            job.read_ahead = ahead.read_aheads.take(unit)
            # gradients on disk still in the stager's buffer they were written from (the
            # units whose backward ended last, the first this forward uses): not read back
            stager = unit.grad_stager
            grads = stager.lend_written(unit, job.has_grad) if stager is not None else None
            job.lent_grads = grads is not None
            job.submitted(self._worker.submit(self._run, job, slots, grads, next_use=next_use))
        except BaseException:
            rewrite.discard()
            self._give_back_borrowed(job)
            raise
        ahead.add_job(unit, job)
        self._arm(unit_step, True)
        self._stats.in_forward += 1
        return True

    def _run(self, job: StepJob, slots: list, grads: torch.Tensor | None) -> None:
        """The worker: ``job``'s step (from ``grads``, lent, else where they are),
        leaving the new parameters in the staging buffer lent to it, if one was by the
        time it starts."""
        params = self._ahead.lending.claim(job)
        unit_step = job.unit_step
        out = None if params is None else unit_step.unit.param_stager.view(params, unit_step.unit)
        unit_step.run_into_shadows(
            job.shadows,
            slots,
            job.hyper,
            job.multipliers,
            # (gradients lent, or in memory: the worker must not zero the live ones, which
            # optimizer.step() zeroed before handing the step over)
            live_grads=grads is not None or isinstance(unit_step.unit.grad, torch.Tensor),
            grads=grads,
            has_grad=job.has_grad,
            params_out=out,
            read_ahead=None if job.read_ahead is None else job.read_ahead.arrays,
        )
        job.filled = out is not None

    # ------------------------------------------------------------------ landing
    def land_all(self) -> None:
        """Land every step running in the next forward (waiting for the worker): those
        into shadows, then those in place."""
        for job in [*self._ahead.in_forward_jobs(), *self._ahead.in_place()]:
            self.land(job.unit)

    def land(self, unit: Unit) -> None:
        """Wait for ``unit``'s step in the next forward and make it the unit's. A step
        into shadows that the worker could not finish is run again here, the ordinary way,
        with the same inputs; if that fails too the error is raised and the step stays
        pending (every later use of the unit tries it again: nothing sees the unit as
        stepped until it is)."""
        if self._worker.on_worker_thread():
            return  # the worker's own use of the unit, inside its step
        job = self._ahead.jobs.get(id(unit))
        if job is None:
            return
        if job.target is Target.IN_PLACE:  # (in backward too: BackwardSteps.start_in_place)
            if job.state is JobState.RUNNING:
                self._land_in_place(job)
            return
        if job.when is not When.IN_FORWARD:
            return
        self._ahead.lending.forward_runs()
        unit_step = job.unit_step
        self._arm(unit_step, False)  # this thread's own reads and rewrites below go through
        try:
            if self._worker.wait(job) and job.shadows is not None:
                unit_step.commit_speculation(job.shadows)
                job.move(JobState.COMMITTED)
                job.shadows = None
                self._give_back_borrowed(job, committed=True)
            else:  # failed on the worker (or here before): again, the ordinary way
                self._give_back_borrowed(job)
                if job.shadows is not None:
                    job.shadows.discard()
                    job.shadows = None
                unit_step.step(job.multipliers, hyper=job.hyper, has_grad=job.has_grad)
                job.move(JobState.LANDED)  # (stepped here instead: the step is done)
        except BaseException as exc:
            if job.state in (JobState.COMMITTED, JobState.LANDED):
                # the step is the unit's already (what failed came after: giving back a
                # staging buffer): done, never run again
                self.forget(id(unit))
                raise
            self._arm(unit_step, True)
            exc.add_note(
                f"hetstore: the optimizer step of unit {unit.name!r}, run on during the next "
                "forward (step_in_forward), failed; the unit keeps its weights from "
                "before that step, and its next use runs the step again"
            )
            raise
        self.forget(id(unit))
        self._ahead.stop_worker_if_idle()

    def _land_in_place(self, job: StepJob) -> None:
        """Wait for ``job``'s step in place. One that failed on the worker may have
        stepped part of the unit, as a failure inside ``optimizer.step()`` would: its
        error is raised here, once, and the unit is left as the worker left it. A step
        taken in backward stays recorded, landed or failed, until ``optimizer.step()``
        settles it (``BackwardSteps.settle_consumed``)."""
        unit = job.unit
        ok = self._worker.wait(job)
        unit.work_pending = False
        if job.when is When.IN_FORWARD:
            del self._ahead.jobs[id(unit)]
            self._ahead.stop_worker_if_idle()
        if not ok:
            job.cancel()  # (raised here, once: optimizer.step() only skips it)
            raise in_place_failure(job)

    def forget(self, key: int) -> None:
        """Drop the job of the unit ``key`` (landed, or the model is released)."""
        job = self._ahead.jobs[key]
        if job.shadows is not None or job.params is not None or job.read_ahead or job.lent_grads:
            self._worker.wait(job)  # never discard (or give back) under the worker
        del self._ahead.jobs[key]  # (after the wait: interrupted, it is still recorded)
        if job.shadows is not None:
            job.shadows.discard()
            job.cancel()
        self._give_back_borrowed(job)
        self._arm(job.unit_step, False)

    def close(self) -> None:
        """Released: drop the steps into shadows; wait for those in place."""
        for job in self._ahead.in_forward_jobs():
            self.forget(id(job.unit))
        for job in self._ahead.in_place():
            try:
                self._land_in_place(job)
            except Exception:  # noqa: BLE001 - released: nothing reads it
                pass

    def _give_back_borrowed(self, job: StepJob, committed: bool = False) -> None:
        """Give back what ``job`` borrowed, once the worker is done with it: what was read
        ahead for it, its gradients' buffer, and its lent parameter buffer (staged for
        the unit's fetch when ``committed`` and filled, else unused)."""
        if job.lent_grads:
            job.lent_grads = False
            job.unit.grad_stager.give_back(job.unit)
        read_ahead, job.read_ahead = job.read_ahead, None
        if read_ahead is not None:
            self._ahead.read_aheads.give_back(read_ahead)
        if self._ahead.lending.give_back(job, committed):
            self._stats.params_staged += 1

    def _arm(self, unit_step: StreamedUnitStep, on: bool) -> None:
        """Make every use of the unit land its step first, through the one landing point
        (``Unit.barrier``, which every reader calls, and every disk read of the unit's
        arrays, whatever reads them; the worker's own reads go on: :meth:`land`); or,
        ``on=False``, stop."""
        unit = unit_step.unit
        arrays = [unit.master, *unit_step.states.values(), *unit_step.scales.values()]
        arrays += [a for a in (unit.home, unit.grad) if transfers_only(a)]
        for array in arrays:
            array.before_read = unit.barrier if on else None
        unit.work_pending = on
