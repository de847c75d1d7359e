"""The step of a unit whose master and states are in memory, and its speculative form.

``InMemoryUnitStep`` is one unit's inner optimizer (the user's class) over the unit's
fp32 master: one fused call per param-group segment for the flat families
(:mod:`hetstore.optim.registry`), per-parameter views for any other class.

Stepping ahead (:mod:`hetstore.optim.step_ahead`). A unit whose master and states are in
host memory can be stepped while backward goes on with the units before it: on a GPU
the host's arithmetic then runs beside the device's. It must not change anything the
model or the user can see before ``optimizer.step()`` says the step is wanted, with these
values, so it runs into *shadows* (double buffering): fresh host buffers for the master
and each state, filled with the live values and stepped in place by the same fused
kernel the ordinary step uses, with the same inputs, so the result is the same bits.
``commit`` makes the shadows the unit's buffers (a swap of references: the inner
optimizer is pointed at the new master's segments, the old buffers go back to the host
pool) and refreshes the compute-dtype copies, as the ordinary step does after stepping.
``discard`` frees them, and the ordinary step runs on the live buffers. Until one of the
two, the shadows hold one more copy of the master and states (4 bytes per parameter per
fp32 array): the step ahead starts one only when the host tier has room for it.

The copy into the shadows is the price of exactness without rollback arithmetic: the
worker reads and writes each array once more than the ordinary step. It pays where the
host is otherwise idle during backward (a GPU computes), not where the host computes
backward itself (a CPU device); see ``overlap_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer

from hetstore.optim.registry import flat_spec
from hetstore.optim.streamed import placeholder_optimizers, step_flat
from hetstore.runtime.unit import Unit
from hetstore.tier import Tier
from hetstore.tiers.accounting import FlatAllocation

__all__ = ["InMemoryUnitStep", "MemoryShadows"]


@dataclass(eq=False)
class MemoryShadows:
    """A speculative step's buffers (host), until committed or discarded: the whole
    master, each segment's per-element states, and (fp16) the unscaled gradients."""

    master: FlatAllocation | None
    states: list[dict[str, FlatAllocation]]
    grad: FlatAllocation | None = None  # the gradients it stepped with (fp16: unscaled)
    fresh: list[bool] = field(default_factory=list)  # torch makes the states (SGD's first)
    hyper: dict[int, dict] = field(default_factory=dict)  # the group values it steps with

    def allocations(self) -> list[FlatAllocation]:
        out = [self.master] if self.master is not None else []
        out += [a for per in self.states for a in per.values()]
        return out + ([self.grad] if self.grad is not None else [])

    def discard(self) -> None:
        """Free what is still the shadows' own (after a commit: nothing)."""
        for allocation in self.allocations():
            allocation.free()
        self.master, self.states, self.grad = None, [], None


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
        Flat: the segments go through :meth:`_step_segments`, as a speculation's do."""
        values = {outer: hyper(outer) for outer in self.groups}
        for inner, outer in zip(self.optimizer.param_groups, self.groups, strict=True):
            inner.update(values[outer])
        if not self.flat:
            self.optimizer.step()
        else:
            unit = self.unit
            live = [self.optimizer.state.get(t, {}) for t in self.tensors]
            states = [
                {k: state[k] for k in self._state_keys(i, values) if k in state}
                for i, state in enumerate(live)
            ]
            fresh = [not s and not self._spec.preallocate_states for s in states]
            grads = [unit.grad[seg.start : seg.end] for seg in unit.segments]
            stepped = self._step_segments(unit.master, states, grads, values, fresh, live)
            for tensor, state, after in zip(self.tensors, live, stepped, strict=True):
                counter = state.get("step")
                if counter is not None and "step" in after:
                    counter.copy_(after["step"])  # (the live counter, moved in place)
                    after = {k: v for k, v in after.items() if k != "step"}
                made = {k: v for k, v in after.items() if k not in state}
                if made:  # the states torch made itself (SGD's first momentum)
                    self.optimizer.state[tensor] = {**state, **made}
        self.unit.refresh_after_step()

    def _step_segments(
        self,
        master: torch.Tensor,
        states: list[dict[str, torch.Tensor]],
        grads: list[torch.Tensor],
        hyper: dict[int, dict],
        fresh: list[bool],
        live: list[dict],
    ) -> list[dict]:
        """Step each param-group segment of ``master`` (the live master, or a
        speculation's shadow) with its ``grads`` and ``states`` (views stepped in place)
        by one fused call, :func:`step_flat`, the counter taken from ``live`` (the inner
        optimizer's state, never moved here): the one kernel call of every flat step in
        memory, ordinary or ahead. Returns the state each call left."""
        if self._placeholders is None:
            self._placeholders = placeholder_optimizers(
                type(self.optimizer), self.optimizer.param_groups
            )
        return [
            step_flat(
                self._placeholders[i],
                hyper[self.groups[i]],
                master[seg.start : seg.end],
                grads[i],
                states[i],
                live[i].get("step"),
                fresh[i],
            )
            for i, seg in enumerate(self.unit.segments)
        ]

    # ------------------------------------------------------------------ step ahead
    def can_speculate(self, flat: bool) -> bool:
        """A flat step of a master in host memory whose states are torch's own fp32
        tensors (``flat``: the segments are stepped by one fused call each). Sharded
        too: a rank steps its own shard, with nothing collective in it."""
        unit = self.unit
        return (
            flat
            and unit.placement.optimizer is Tier.HOST
            and isinstance(unit.master, torch.Tensor)
            and isinstance(unit.grad, torch.Tensor)
            and unit.grad.device.type == "cpu"
        )

    def _state_keys(self, segment: int, hyper: dict[int, dict]) -> tuple[str, ...]:
        """The states segment ``segment`` keeps when stepped with the group values
        ``hyper`` (the user may have turned SGD's momentum on since the last step)."""
        return self._spec.state_keys([hyper[self.groups[segment]]])

    def shadow_bytes(self, hyper: dict[int, dict]) -> int:
        """Host bytes a speculation with the group values ``hyper`` holds until it is
        committed or discarded."""
        per_element = sum(
            (seg.end - seg.start) * len(self._state_keys(i, hyper))
            for i, seg in enumerate(self.unit.segments)
        )
        return (self.unit.master_numel + self.unit.trainable_numel + per_element) * 4

    def begin_speculation(self, hyper: dict[int, dict]) -> MemoryShadows:
        """Main thread: allocate the shadows of a step with the group values ``hyper``
        (raises ``OutOfTierMemory`` when the host tier cannot hold them)."""
        unit = self.unit
        made: list[FlatAllocation] = []

        def new(numel: int, what: str) -> FlatAllocation:
            allocation = unit.new_buffer(Tier.HOST, numel, torch.float32, what)
            made.append(allocation)
            return allocation

        try:
            master = new(unit.master_numel, "master params")
            states = [
                {key: new(seg.end - seg.start, key) for key in self._state_keys(i, hyper)}
                for i, seg in enumerate(unit.segments)
            ]
            grad = new(unit.trainable_numel, "grads read ahead")
        except BaseException:
            for allocation in made:
                allocation.free()
            raise
        fresh = [
            not any(key in self.optimizer.state.get(t, {}) for key in self._state_keys(i, hyper))
            and not self._spec.preallocate_states
            for i, t in enumerate(self.tensors)
        ]
        return MemoryShadows(master, states, grad, fresh, hyper)

    @torch.no_grad()
    def run_speculation(self, shadows: MemoryShadows, factor: float | None) -> None:
        """Any thread: the live master and states into the shadows, then each segment
        stepped there with the shadows' group values and the gradients as they are
        (multiplied by ``factor``, fp16's unscale, into the shadows' own buffer), once
        the gradients' copies to the host have landed (the caller waits for them)."""
        unit = self.unit
        master = shadows.master.data
        master.copy_(unit.master)
        live = [self.optimizer.state.get(t, {}) for t in self.tensors]
        states, grads = [], []
        for i, seg in enumerate(unit.segments):
            per = {key: a.data for key, a in shadows.states[i].items()}
            if not shadows.fresh[i]:
                for key, value in per.items():
                    value.copy_(live[i][key])
            states.append(per)
            # the gradients it steps with, in its own buffer (unscaled by fp16's factor):
            # the live ones' version counter stays the user's (torch's fused kernel
            # declares its gradient mutable), and optimizer.step() can tell by value
            # whether the live ones still are these (grads_unchanged)
            live_grad = unit.grad[seg.start : seg.end]
            grad = shadows.grad.data[seg.start : seg.end]
            if factor is not None:
                torch.mul(live_grad, factor, out=grad)
            else:
                grad.copy_(live_grad)
            grads.append(grad)
        self._step_segments(master, states, grads, shadows.hyper, shadows.fresh, live)

    def grads_unchanged(self, shadows: MemoryShadows) -> bool:
        """Whether the live gradients are, bit for bit, the ones the speculation stepped
        with (not under fp16, whose are unscaled): true after torch's clip_grad_norm_
        that did not bite, or a read of p.grad, which version counters cannot tell from
        a change. Reads the gradients once: far less than stepping again."""
        unit = self.unit
        for seg in unit.segments:
            live = unit.grad[seg.start : seg.end].view(torch.int32)
            if not torch.equal(live, shadows.grad.data[seg.start : seg.end].view(torch.int32)):
                return False
        return True

    @torch.no_grad()
    def commit_speculation(self, shadows: MemoryShadows) -> None:
        """Main thread: the shadows become the unit's master and states; the step
        counters move as the ordinary step moves them; the copies are refreshed."""
        unit = self.unit
        unit.replace_master(shadows.master)
        for i, seg in enumerate(unit.segments):
            old_view = self.tensors[i]
            state = self.optimizer.state.pop(old_view, {})
            for key, allocation in shadows.states[i].items():
                unit.adopt(allocation, state.get(key))
                state[key] = allocation.data
            if "step" in state:
                state["step"] += 1
            elif self._spec.has_step:
                state["step"] = torch.ones((), dtype=torch.float32)
            view = unit.master[seg.start : seg.end]
            view.grad = unit.grad[seg.start : seg.end]
            self.tensors[i] = view
            group = self.optimizer.param_groups[i]
            group.update(shadows.hyper[self.groups[i]])  # as the ordinary step leaves it
            group["params"] = [view]
            if state:
                self.optimizer.state[view] = state
        shadows.master, shadows.states = None, []  # the unit's now
        shadows.discard()  # the gradients it read
        unit.refresh_after_step()  # (moves param_version, as after the ordinary step)
