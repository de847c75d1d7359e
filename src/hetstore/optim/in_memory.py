"""The step of a unit whose master and states are in memory.

``InMemoryUnitStep`` is one unit's inner optimizer (the user's class) over the unit's
fp32 master: one fused call per param-group segment for the flat families
(:mod:`hetstore.optim.registry`), per-parameter views for any other class. Its step is
the ordinary one, in place, at ``optimizer.step()``, or on the worker: during backward
as soon as the unit's gradients are on the host with ``step_in_backward``
(:mod:`hetstore.optim.in_backward`), or on a GPU during the next forward
(:mod:`hetstore.optim.in_forward`). Either way the step is known when it starts (after
``optimizer.step()``, or under ``step_in_backward``, which refuses what would change it),
so in place is exact with nothing copied. It is never stepped speculatively into shadows:
that would first copy the live master and states (about 3x the ordinary step's bytes;
on an H100 the slowest way in every case measured, docs/dev/BENCHMARKS.md, 2026-11-28).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import Optimizer

from hetstore.optim.registry import flat_spec
from hetstore.optim.step_job import StepJob, When
from hetstore.optim.streamed import placeholder_optimizers, step_flat
from hetstore.runtime.unit import Unit
from hetstore.tier import Tier

__all__ = ["InMemoryUnitStep", "in_place_failure", "step_in_place"]


class InMemoryUnitStep:
    """The inner optimizer of one unit and the tensors it steps (see module doc)."""

    def __init__(
        self,
        unit: Unit,
        optimizer: Optimizer,
        tensors: list[torch.Tensor],
        groups,
        flat: bool = False,
    ):
        self.unit = unit
        self.optimizer = optimizer
        self.tensors = tensors  # stepped tensors (segments or per-parameter views)
        self.groups = groups  # outer group index of each inner group
        # the tensors are the param-group segments, each stepped by one fused call
        # (streamed.step_flat); else per-parameter views the user's class steps itself
        self.flat = flat
        self._spec = flat_spec(type(optimizer))
        self._placeholders: list[Optimizer] | None = None  # the worker's, per segment

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the inner optimizer's state (the moments, the step counts)."""
        return [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]

    def step(self, hyper: Callable[[int], dict]) -> None:
        """The ordinary step, in place: each inner group takes the values ``hyper`` gives
        for its outer group (the live ones in ``optimizer.step()``; those of that call
        for a step in the next forward), then the compute-dtype copies are refreshed.
        Flat: each param-group segment of the master by one fused call,
        :func:`step_flat`, the one kernel call of every flat step in memory."""
        values = {outer: hyper(outer) for outer in self.groups}
        for inner, outer in zip(self.optimizer.param_groups, self.groups, strict=True):
            inner.update(values[outer])
        if not self.flat:
            self.optimizer.step()
        else:
            self._step_flat(values)
        self.unit.refresh_after_step()

    def _step_flat(self, values: dict[int, dict]) -> None:
        """Each segment with its gradients and the states its group values keep (the
        user may have turned SGD's momentum on since the last step); the live step
        counter is moved in place, and the states torch made itself (SGD's first
        momentum) are kept in the inner optimizer's state."""
        unit = self.unit
        if self._placeholders is None:
            self._placeholders = placeholder_optimizers(
                type(self.optimizer), self.optimizer.param_groups
            )
        for i, (seg, tensor) in enumerate(zip(unit.segments, self.tensors, strict=True)):
            group = values[self.groups[i]]
            state = self.optimizer.state.get(tensor, {})
            states = {k: state[k] for k in self._spec.state_keys([group]) if k in state}
            counter = state.get("step")
            after = step_flat(
                self._placeholders[i],
                group,
                unit.master[seg.start : seg.end],
                unit.grad[seg.start : seg.end],
                states,
                counter,
                not states and not self._spec.preallocate_states,
            )
            if counter is not None and "step" in after:
                counter.copy_(after["step"])  # (the live counter, moved in place)
                after = {k: v for k, v in after.items() if k != "step"}
            made = {k: v for k, v in after.items() if k not in state}
            if made:  # the states torch made itself (SGD's first momentum)
                self.optimizer.state[tensor] = {**state, **made}

    # ------------------------------------------------------------------ where it steps
    def can_step_on_worker(self, in_backward: bool = False) -> bool:
        """Its ordinary step can run on the worker now: the unit has gradients and no
        device copy (one would be stale until the step lands; a root or a unit with
        frozen weights is still resident in backward), and its parameters are fetched
        from host memory (the policy's ``params_in_memory``, asked now: a plan may have
        moved the home; not the device's own, which a sharded unit releases between
        uses too, nor disk, whose write allocates). ``in_backward``: not where the
        parameters are the home itself (a CPU device, ``Unit.fetches_in_place``): a
        tensor backward saved may share its storage (``w.detach()``) and be read after
        the unit's last gradient."""
        unit = self.unit
        return (
            not unit.materialized
            and isinstance(unit.home, torch.Tensor)
            and unit.home.device.type == "cpu"
            and not (in_backward and unit.fetches_in_place)
            and unit.grads.any()
        )

    def steps_flat_in_memory(self) -> bool:
        """A flat step (one fused call per segment) of a master in host memory whose
        states are torch's own fp32 tensors: the step the next forward can run in place
        on the worker. Sharded too: a rank steps its own shard, with nothing collective
        in it."""
        unit = self.unit
        return (
            self.flat
            and unit.placement.optimizer is Tier.HOST
            and isinstance(unit.master, torch.Tensor)
            and isinstance(unit.grad, torch.Tensor)
            and unit.grad.device.type == "cpu"
        )


def step_in_place(job: StepJob) -> None:
    """The worker: a host-memory unit's ordinary step, with the group values of the
    ``optimizer.step()`` call that handed it over (or, in backward, of that moment)."""
    job.unit_step.step(job.hyper.__getitem__)


def in_place_failure(job: StepJob) -> RuntimeError:
    """The error of a step in place that failed on the worker (its cause attached)."""
    where = (
        "during the next forward (step_in_forward)"
        if job.when is When.IN_FORWARD
        else "in place during backward (step_in_backward)"
    )
    error = RuntimeError(
        f"hetstore: the optimizer step of unit {job.unit.name!r}, run {where}, failed "
        "part-way; its weights and states may be partly stepped, as after a failure "
        "inside optimizer.step()"
    )
    error.__cause__ = job.future.exception()
    return error
