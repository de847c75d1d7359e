"""Which step each unit has, and which of them run ahead: the unit steps of an
offloaded optimizer (in memory, compact, streamed from disk), the step machinery built
over them (``StepAhead``, the clip's ``RecordedNorms``), and the move of a unit's states
from host memory to disk before training (the first batch's plan).

One of the classes :class:`~hetstore.optim.offloaded.OffloadedOptimizer` is made of. It
owns ``_unit_steps``, ``step_ahead`` and ``grad_norms``.
"""

from __future__ import annotations

import functools

import torch

from hetstore.optim import policy
from hetstore.optim.compact import CompactUnitStep
from hetstore.optim.grad_norms import RecordedNorms
from hetstore.optim.in_backward import site_of
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.policy import OverlapTrial
from hetstore.optim.registry import FLAT_NAMES
from hetstore.optim.step_ahead import StepAhead
from hetstore.optim.streamed import StreamedUnitStep, UnitStates
from hetstore.runtime.unit import Unit
from hetstore.tiers.store import transfers_only

__all__ = ["StepArrangement"]


class StepArrangement:
    """The unit steps and the step machinery over them (module doc)."""

    def arrange_steps(self) -> None:
        """Which unit steps run ahead of ``step()`` and which record the clip's norms in
        backward, from the unit steps as they are now (at construction, and again when
        units' states moved before training: :meth:`commit_states_move`). The new
        ``step_ahead`` and ``grad_norms`` subscribe to the runtime's events themselves
        (the old ones unsubscribe as they close); ``offload()`` tells the step ahead the
        next forward's order."""
        modes = self.modes
        if self.step_ahead is not None:
            self.step_ahead.close()
        # the clip's norms of disk gradients, taken in backward (the runtime's
        # GRADS_FINAL event); with or without the step ahead, and told before it
        if self.grad_norms is not None:
            self.grad_norms.close()
        streamed = [s for s in self._unit_steps if isinstance(s, StreamedUnitStep)]
        self.grad_norms = RecordedNorms(streamed) if self.shards is None and streamed else None
        # where each unit's step may run is the step policy's (optim.policy), which the
        # planner asks too: disk units stepped ahead, and host units whose ordinary step
        # runs on in place during backward (step_in_backward) or the next forward (a
        # GPU); sharded too: a rank steps its own shard, with nothing collective in it
        sites = [(s, site_of(s)) for s in self._unit_steps]
        ahead = [s for s, site in sites if policy.streamed_ahead(site, modes)]
        # (where the parameters are is asked as each starts: site_of)
        in_place = [
            s
            for s, site in sites
            if policy.memory_in_forward(site, modes) or policy.memory_in_backward(site, modes)
        ]
        # whether overlap pays, measured ('auto'): on every rank when sharded, each
        # ending every step and voting, whether or not it holds a unit stepped ahead (a
        # rank's shards may have nothing trainable), so that the votes always meet
        if (
            self._trial_overlap
            and self.overlap_trial is None
            and (ahead or in_place or self.shards is not None)
        ):
            agree = None
            if self.shards is not None:  # (no bound method: no cycle through the trial)
                agree = functools.partial(_summed_over_ranks, self.shards, self.units[0].device)
            self.overlap_trial = OverlapTrial(agree=agree)
        self.step_ahead = None
        if ahead or in_place:
            self.step_ahead = StepAhead(
                ahead,
                self._hyper,
                self.loss_scaler,
                modes,
                trial=self.overlap_trial,
                in_place=in_place,
            )

    def unit_step_of(self, unit: Unit) -> InMemoryUnitStep | UnitStates | None:
        """``unit``'s step; None where this optimizer steps none of it."""
        return next((s for s in self._unit_steps if s.unit is unit), None)

    @property
    def can_move_states(self) -> bool:
        """Units' states in host memory can move to disk before training
        (:meth:`prepare_states_move`): a flat optimizer in the exact format, unsharded."""
        return self._flat and self.state_format.exact and self.shards is None

    @torch.no_grad()
    def prepare_states_move(self, unit: Unit) -> StreamedUnitStep | None:
        """The first half of moving ``unit``'s optimizer states to disk along with its
        master (``Unit.prepare_master_move``, before its first gradient): the streamed
        step that will own them, its disk arrays made and, for states that hold values
        (a checkpoint loaded before training), written with each segment's step counter;
        fresh ones are the arrays' zeros. The unit's current step is untouched, so a
        failure changes nothing (the new arrays are given back). None: nothing trainable.
        :meth:`commit_states_move` makes it the unit's, then :meth:`arrange_steps`."""
        self._check_alive("move_states")
        old = self.unit_step_of(unit)
        if old is None:
            return None
        if not isinstance(old, InMemoryUnitStep) or not self.can_move_states:
            raise ValueError(f"unit {unit.name!r}: only flat fp32 states in memory move to disk")
        inner = [old.optimizer.state.get(t) or {} for t in old.tensors]
        started = [bool(state) and self._has_started(state) for state in inner]
        keys = self._spec.state_keys(self.param_groups)
        with unit.freed_on_failure():  # (the arrays made before a failure)
            new = StreamedUnitStep(
                unit, self.optimizer_class, self._hyper, keys, self._chunk_numel, self.state_format
            )
            if any(started):
                values: dict[str, list] = {}
                for segment, state, begun in zip(unit.segments, inner, started, strict=True):
                    for key in new.states:
                        if begun and key in state:
                            values.setdefault(key, []).append((segment.start, state[key]))
                new.write_states(values, None)
                new.mark_loaded([float(state.get("step", 0)) for state in inner])
        return new

    def commit_states_move(self, unit: Unit, new: StreamedUnitStep | None) -> None:
        """The second half (see :meth:`prepare_states_move`), once the unit's master is on
        disk: the streamed step replaces the in-memory one and the host states go."""
        if new is None:
            return
        index = next(i for i, s in enumerate(self._unit_steps) if s.unit is unit)
        old = self._unit_steps[index]
        for tensor in old.tensors:
            state = old.optimizer.state.get(tensor) or {}
            for value in state.values():
                unit.free_buffer(value)  # (the unit's only: not torch's step counter)
            state.clear()
        self._unit_steps[index] = new

    def _build_unit_step(self, unit: Unit) -> InMemoryUnitStep | UnitStates:
        on_disk = transfers_only(unit.master)
        if on_disk and not self._flat:
            raise TypeError(
                f"offload_optimizer='disk' streams the states of {FLAT_NAMES}; "
                f"{self.optimizer_class.__name__} is not supported there"
            )
        # compact states in memory: checked at offload() to be a flat optimizer's
        if on_disk or not self.state_format.exact:
            chunked = StreamedUnitStep if on_disk else CompactUnitStep
            keys = self._spec.state_keys(self.param_groups)
            return chunked(
                unit, self.optimizer_class, self._hyper, keys, self._chunk_numel, self.state_format
            )
        inner_groups, tensors, owners = [], [], []
        if self._flat:
            for seg in unit.segments:
                master = unit.master[seg.start : seg.end]
                master.grad = unit.grad[seg.start : seg.end]
                inner_groups.append({**self._hyper(seg.group), "params": [master]})
                tensors.append(master)
                owners.append(seg.group)
        else:
            by_group: dict[int, list[torch.Tensor]] = {}
            for e in unit.trainable_entries:
                view = unit.master[e.offset : e.offset + e.numel].view(e.shape)
                view.grad = unit.grad[e.offset : e.offset + e.numel].view(e.shape)
                by_group.setdefault(e.group, []).append(view)
                tensors.append(view)
            for group_index, views in by_group.items():
                inner_groups.append({**self._hyper(group_index), "params": views})
                owners.append(group_index)
        inner = self.optimizer_class(inner_groups)
        step = InMemoryUnitStep(unit, inner, tensors, owners, flat=self._flat)
        if self._flat and self._spec.preallocate_states:
            self._preallocate_states(step)
        return step

    def _preallocate_states(self, step: InMemoryUnitStep) -> None:
        """Allocate the states (Adam's moments) in the unit's optimizer tier now, so a
        placement that cannot hold them is refused before training starts, not at the
        first step."""
        unit = step.unit
        for group, master in zip(step.optimizer.param_groups, step.tensors, strict=True):
            keys = self._spec.state_keys([group])
            state = {"step": torch.zeros((), dtype=torch.float32, device=master.device)}
            for key in keys:
                tensor = unit.allocate(unit.placement.optimizer, master.numel(), torch.float32, key)
                tensor.zero_()
                state[key] = tensor
            step.optimizer.state[master] = state


def _summed_over_ranks(shards, device, *values: float) -> tuple[float, ...]:
    """``values`` summed over the ranks of ``shards`` (the overlap trial's votes: every
    rank then keeps the same way)."""
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    shards.all_reduce(summed, "sum", "the overlap trial's votes")
    return tuple(summed.tolist())
