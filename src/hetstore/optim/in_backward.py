"""Steps started during backward, as soon as a unit's gradients are final (``StepJob``s
with ``When.IN_BACKWARD``), and how ``optimizer.step()`` (or, taking the gradients, the
end of backward) lands them.

A disk unit (:func:`eligible`) is stepped with the ordinary step's chunks and kernel into
shadow regions of its master, moments and compute-dtype copy (``Target.SHADOWS``), so
nothing the model reads changes until the commit, a swap of disk regions. Speculatively
(``overlap_step``): committed where what it assumed still holds, else discarded and the
unit stepped the ordinary way (a wrong guess costs one step's disk traffic, never
correctness). Taking the gradients (``step_in_backward``): committed in backward; what
would need the gradients later (a clip, ``p.grad`` of a consumed unit, a second backward)
is refused instead. A host-memory unit is stepped in backward only taking its gradients,
in place (``Target.IN_PLACE``), never speculatively (:mod:`hetstore.optim.in_memory`
says why).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.optim import in_memory
from hetstore.optim.in_memory import InMemoryUnitStep, in_place_failure
from hetstore.optim.policy import StepSite
from hetstore.optim.step_job import JobState, StepJob, Target, When
from hetstore.optim.step_worker import AT_STEP
from hetstore.optim.streamed import StreamedUnitStep, UnitStates
from hetstore.runtime.rewrite import ChunkedRewrite
from hetstore.runtime.staging import GradStager

if TYPE_CHECKING:
    from hetstore.optim.step_ahead import StepAhead
    from hetstore.runtime.unit import Unit

__all__ = ["BackwardSteps", "changed_keys", "eligible", "site_of"]


class BackwardSteps:
    """The steps in backward of one step ahead (see the module doc)."""

    def __init__(self, ahead: StepAhead, loss_scaler):
        # (a proxy: the step ahead owns this object, and a cycle would keep a released
        # model's step machinery for the garbage collector)
        self._ahead = weakref.proxy(ahead)
        self._worker = ahead.worker
        self._stats = ahead.stats
        self._loss_scaler = loss_scaler  # fp16: gradients are unscaled before the step

    # ------------------------------------------------------------------ starting
    def start(self, unit: Unit) -> StepJob | None:
        """A step of ``unit`` into shadows on the worker, or None when there is no room
        for it (counted in ``not_started``)."""
        ahead = self._ahead
        unit_step = ahead.step_of(unit)
        # step_in_backward: the steps take the gradients, and are committed in backward
        consume = ahead.modes.in_backward
        if not ahead.disk_room(unit_step) and consume and ahead.pending():
            # in backward: the steps before hold their shadows until committed; their
            # commits free the regions they replace, so wait for them rather than spill
            # this unit's gradients to disk (the planner counts two shadows: this one
            # and the reserve)
            self.collect(block=False, wait=True)
        if not ahead.disk_room(unit_step):
            # pending speculations hold a shadow each until the step: they may fill the
            # disk only up to one ordinary step's room (a window, on a big model)
            self._stats.not_started += 1
            return None
        try:
            rewrite = unit_step.begin_speculation()
        except OutOfTierMemory:
            self._stats.not_started += 1  # the ordinary step will say so if it cannot run
            return None
        try:
            # what it assumes, taken now
            job = StepJob(
                unit_step,
                When.IN_BACKWARD,
                Target.SHADOWS,
                ahead.hyper_now(unit),
                rewrite,
                grad_state=unit.grads.state(),
                state_version=unit.state_version,
                factor=1.0 / self._loss_scaler.scale if self._loss_scaler is not None else None,
            )
            slots = self._worker.slots()
        except BaseException:
            rewrite.discard()
            raise
        if slots is None:  # no host room for the worker's chunks: stepped after backward
            rewrite.discard()
            self._stats.not_started += 1
            return None
        # gradients on disk: step from the stager's buffer, not a read back: the one just
        # flushed, or (step in backward) the one gathered, which is never written
        grads = None
        if unit.grad_stager is not None:
            stager = unit.grad_stager
            grads = stager.hand_over(unit) if consume else stager.lend(unit)
        job.lent_grads = grads is not None
        try:
            job.submitted(
                self._worker.submit(
                    functools.partial(unit_step.run_into_shadows, live_grads=True, grads=grads),
                    rewrite,
                    slots,
                    job.hyper,
                    [job.factor] if job.factor is not None else [],
                    next_use=AT_STEP,  # (settled there)
                )
            )
        except BaseException:
            if job.lent_grads:
                unit.grad_stager.give_back(unit)
            rewrite.discard()
            raise
        self._stats.started += 1
        return job

    def start_in_place(self, unit_step: InMemoryUnitStep) -> bool:
        """Taking the gradients: hand ``unit_step``'s ordinary step to the worker, in
        place, with the group values of now (``settle_consumed`` checks them at
        ``optimizer.step()``). False where it cannot run on the worker now (a unit still
        resident: the root, frozen weights backward may read; on a CPU device, every
        one), which ``optimizer.step()`` then steps."""
        if not unit_step.can_step_on_worker(in_backward=True):
            return False
        ahead = self._ahead
        unit = unit_step.unit
        unit.grads.fill_missing()  # what optimizer.step() does before the ordinary step
        job = StepJob(unit_step, When.IN_BACKWARD, Target.IN_PLACE, ahead.hyper_now(unit))
        # on a GPU the gradients may still be crossing to the host: the worker waits
        copies = unit.grads.copies_in_flight()
        unit.param_version += 1  # as the ordinary step moves it before stepping
        # (needed at optimizer.step(), which waits for every one: AT_STEP, as above)
        job.submitted(self._worker.submit(_in_place_after, job, copies, next_use=AT_STEP))
        ahead.add_job(unit, job)
        unit.work_pending = True  # every reader lands it first (Unit.barrier)
        unit.grads.consumed = True
        self._stats.started += 1
        return True

    # ------------------------------------------------------------------ landing
    def settle(self, disk_grad_factors: list, committed: set[int], outcomes: dict) -> None:
        """At ``optimizer.step()``: commit the speculations that still hold, discard the
        rest; add the ids of the units committed to ``committed`` as each commits, and
        each unit's outcome to ``outcomes`` (for the policy)."""
        # what the ordinary step multiplies gradients on disk by; factors of exactly 1.0
        # (a clip that does not bite) change nothing
        factors = [float(f) for f in disk_grad_factors if float(f) != 1.0]
        # gradient writes of backward: their errors now, not at a later backward
        for stager in self._ahead.stagers:
            if isinstance(stager, GradStager):
                stager.finish()
        for key, job in self._ahead.pending().items():
            del self._ahead.jobs[key]
            finished = self.finished(job)  # always: never discard under the worker
            holds = finished and self._inputs_hold(job) and self._grads_hold(job, factors)
            if holds:
                job.unit_step.commit_speculation(job.shadows)
                job.move(JobState.COMMITTED)
                committed.add(key)
                self._stats.committed += 1
            else:
                self._drop(job)
                self._stats.rolled_back += 1
            outcomes[key] = holds

    def collect(self, block: bool, *, wait: bool = False) -> None:
        """Taking the gradients: commit the steps that are done (with ``wait``, after
        waiting for the running ones; all of them with ``block``); one whose unit is still
        resident (frozen weights backward may read) waits for backward's end."""
        for key, job in self._ahead.pending().items():
            unit = job.unit
            if not block and (unit.materialized or not (wait or job.future.done())):
                continue
            self.finished(job, keep_failed_grads=True)
            if not job.ok:
                del self._ahead.jobs[key]
                self._drop(job)
                self._stats.rolled_back += 1
                continue
            try:
                job.unit_step.commit_speculation(job.shadows)
            except BaseException:
                del self._ahead.jobs[key]  # (as it left the pending steps before the commit)
                raise
            job.move(JobState.COMMITTED)  # kept, taken, until optimizer.step()
            unit.grads.consumed = True
            self._stats.committed += 1

    def settle_consumed(self, committed: set[int]) -> None:
        """optimizer.step() after a backward that stepped units: they are done (the
        steps in place still running are waited for), if the param groups are still the
        values they used."""
        self.collect(block=True)
        consumed = self._ahead.consumed()
        try:
            for job in consumed.values():
                if job.target is Target.IN_PLACE:
                    self._worker.wait(job)
                    job.unit.work_pending = False
        finally:  # (interrupted: what still runs stays, for its unit's use to land)
            for key, job in consumed.items():
                if job.state is not JobState.RUNNING:
                    del self._ahead.jobs[key]
        committed.update(consumed)
        self._stats.committed += sum(j.state is JobState.LANDED for j in consumed.values())
        # (one whose failure a reader already raised at its landing was cancelled there)
        failed = [j for j in consumed.values() if j.state is JobState.FAILED]
        if failed:
            raise in_place_failure(failed[0])
        groups = {group for job in consumed.values() for group in job.hyper}
        now = {group: self._ahead.hyper(group) for group in groups}
        for job in consumed.values():
            for group, hyper in job.hyper.items():
                changed = changed_keys(now[group], hyper)
                if changed:
                    raise RuntimeError(
                        f"step_in_backward=True: param group {group} changed ({changed}) "
                        "between backward and optimizer.step(), but its units were already "
                        "stepped inside backward with the earlier values. Change param "
                        "groups (an LR scheduler's step) after optimizer.step() and before "
                        "the next backward, or set step_in_backward=False"
                    )

    def check_fresh_backward(self) -> None:
        """Taking the gradients, a backward is starting: refuse it when it would step
        units again (or add into gradients the last steps consumed) where plain PyTorch
        would not."""
        consumed = self._ahead.consumed()
        if consumed:
            raise RuntimeError(
                f"step_in_backward=True: a second backward before optimizer.step(), but "
                f"the last backward already stepped {len(consumed)} units (their "
                "gradients were consumed inside it). Call optimizer.step() after each "
                "backward; to accumulate micro-batches, run the backward of every one but "
                "the last under `with hetstore.no_sync(model):`"
            )
        stale = [u.name for u in self._ahead.units if u.grads.consumed]
        if stale:
            raise RuntimeError(
                f"step_in_backward=True: units {stale[:3]} still count the gradients their "
                "last step consumed; a backward now would add into them, which they no "
                "longer hold. Call optimizer.zero_grad() after optimizer.step()"
            )

    def give_grad_buffer_back(self) -> bool:
        """The gradient stager needs a buffer and every free one is lent
        (``Event.GRAD_BUFFERS_LENT``): wait for the oldest step in backward that holds one.
        False when none does."""
        for job in self._ahead.pending().values():
            if job.lent_grads:
                self.finished(job, keep_failed_grads=True)
                return True
        return False

    def unscaling(self, units: list[Unit]):
        """fp16: the optimizer is about to unscale these units' gradients in memory, in
        place, by the factor every speculation applied itself. Waits for the worker
        (it must not read a buffer being unscaled); returns a callable to run after,
        which lets the speculations hold through that one change."""
        pending = self._ahead.pending()
        jobs = [pending.get(id(u)) for u in units]
        for job in jobs:
            if job is not None:
                self.finished(job)
        before = [u.grad._version for u in units]

        def done(inv: float) -> None:
            for unit, job, version in zip(units, jobs, before, strict=True):
                if job is None or job.factor != inv:
                    continue
                if job.grad_state.in_place == version:  # nothing else changed it since
                    job.grad_state = job.grad_state._replace(in_place=unit.grad._version)

        return done

    def cancel(self, key: int) -> None:
        job = self._ahead.pending().get(key)
        if job is None:
            return
        self.finished(job)  # (interrupted here, it stays pending: the worker may write)
        del self._ahead.jobs[key]
        self._drop(job)
        self._stats.cancelled += 1

    @staticmethod
    def _drop(job: StepJob) -> None:
        """Throw ``job`` away, with its shadows."""
        job.shadows.discard()
        job.cancel()

    def finished(self, job: StepJob, keep_failed_grads: bool = False) -> bool:
        """Wait for the worker (once: the outcome is kept in ``job.ok``) and give back
        the gradient buffer it read; False when the step failed (the ordinary step then
        runs, and raises if the cause persists). ``keep_failed_grads``: a step in
        backward that failed writes its gradients to disk instead, for that step."""
        self._worker.wait(job)
        # (an interrupt of this thread while it waits propagates, and the buffer stays
        # lent: the worker may still be reading it)
        if job.lent_grads:
            job.lent_grads = False
            unit = job.unit
            if job.ok or not keep_failed_grads:
                unit.grad_stager.give_back(unit)
            else:
                unit.grad_stager.flush_lent(unit)
        return job.ok

    # ------------------------------------------------------------------ what holds
    def _inputs_hold(self, job: StepJob) -> bool:
        """The master and states it stepped from (not rewritten since: a load), and the
        group values, are current."""
        return job.unit.state_version == job.state_version and all(
            not changed_keys(self._ahead.hyper(group), hyper) for group, hyper in job.hyper.items()
        )

    @staticmethod
    def _grads_hold(job: StepJob, factors: list[float]) -> bool:
        """No gradient changed since it began, by the counters (``Unit.grads.version``:
        another micro-batch's backward; ``Tensor._version``: a clip through ``p.grad``, a
        user's hook), the same parameters have one (``zero_grad()`` clears the flags), and
        gradients on disk carry no factor (a clip that bit) but fp16's unscale, which it
        applied itself into its own buffer (:meth:`unscaling`)."""
        on_disk = not isinstance(job.unit.grad, torch.Tensor)
        took = [job.factor] if job.factor is not None else []
        return (factors == took or not on_disk) and job.unit.grads.state() == job.grad_state


def eligible(unit_step, unit: Unit) -> bool:
    """A disk unit the step ahead can step into shadows: master and states on disk,
    parameters homed on disk or in the master itself (every copy shadowed). Sharded too:
    a rank steps its own shard, with nothing collective in the step; its fetch lands the
    step before the all-gather, on every rank in the same order."""
    return (
        isinstance(unit_step, StreamedUnitStep)
        and (isinstance(unit.grad, torch.Tensor) or unit.grad_stager is not None)
        and ChunkedRewrite.can_speculate(unit)
    )


def site_of(unit_step) -> StepSite:
    """What the step policy (:mod:`hetstore.optim.policy`) asks of ``unit_step``'s unit,
    as the planner asks it of a traced unit: a disk unit is one :func:`eligible` says;
    a host-memory one, :meth:`InMemoryUnitStep.steps_flat_in_memory`. Its parameters
    count as in host memory: where they are is asked as each step starts
    (:meth:`InMemoryUnitStep.can_step_on_worker`), since a later plan may bring a unit's
    home from the device into host memory."""
    unit = unit_step.unit
    return StepSite(
        streamed=eligible(unit_step, unit),
        in_memory=isinstance(unit_step, InMemoryUnitStep) and unit_step.steps_flat_in_memory(),
        params_in_memory=True,
        exact=not isinstance(unit_step, UnitStates) or unit_step.format.exact,
        trainable=unit.trainable_numel > 0,
    )


def changed_keys(a: dict, b: dict) -> list[str]:
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


def _in_place_after(job: StepJob, copies) -> None:
    """The worker: ``job``'s step in place once ``copies`` (the CUDA event of the
    unit's last gradient copy to the host, or None) has landed."""
    if copies is not None:
        copies.synchronize()
    in_memory.step_in_place(job)
