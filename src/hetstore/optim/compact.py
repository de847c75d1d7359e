"""The optimizer step of a unit whose master is in memory and whose states are compact.

With ``optimizer_state_format`` "bf16" or "8bit" and the states on the device or in
host memory, the states are kept in their format beside the fp32 master (see
:mod:`hetstore.optim.state_format`) and the step goes chunk by chunk, the same chunks
as the disk tier's streamed step: decode a chunk's states into fp32 scratch, one fused
step of the chunk (torch's kernel, the group's values), encode them back. The scratch is
one chunk per state, on the master's device, counted in its tier while the step runs.

Chunks start at multiples of the chunk size from each segment start (multiples of the
8-bit block), so the result is the same whatever the chunk size and the same as the
streamed step's from disk: a unit moved between tiers, or resumed from a checkpoint,
steps bit for bit as it would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from hetstore.optim.state_format import (
    StateFormat,
    covering,
    decode,
    encode,
    scales_of,
)
from hetstore.optim.streamed import UnitStates, chunks_of, step_flat
from hetstore.runtime.unit import Unit

__all__ = ["CompactUnitStep"]


class CompactUnitStep(UnitStates):
    """Owns the compact states of a unit whose master is in memory, and steps them."""

    def __init__(
        self,
        unit: Unit,
        optimizer_class: type,
        hyper: Callable[[int], dict],
        state_keys: tuple[str, ...],
        chunk_numel: int,
        fmt: StateFormat,
    ):
        device = unit.master.device
        tier = unit.placement.optimizer
        super().__init__(unit, optimizer_class, hyper, state_keys, chunk_numel, fmt, tier, device)
        for array in [*self.states.values(), *self.scales.values()]:
            array.view(torch.uint8).zero_()  # fresh states are zeros in every format
        self._chunks = [c for c in chunks_of(unit, self.chunk_numel) if c.state_end > c.start]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, grad_multipliers: list) -> None:
        """Step every segment (``grad_multipliers``: unused, gradients in memory are
        scaled in place before the step)."""
        unit = self.unit
        unit.grads.fill_missing()
        # (unit steps are made only for units with something trainable: never empty)
        longest = max(c.state_end - c.start for c in self._chunks)
        hyper = {s.group: self.hyper(s.group) for s in unit.segments}
        with self._scratch(longest) as scratch:
            for c in self._chunks:
                n_state = c.state_end - c.start
                values = {key: buffer[:n_state] for key, buffer in scratch.items()}
                self._decode(c.start, values)
                if c.segment is not None and c.step_end > c.start:
                    n = c.step_end - c.start
                    segment = unit.segments[c.segment]
                    step_flat(
                        self._inner[c.segment],
                        hyper[segment.group],
                        unit.master[c.start : c.step_end],
                        unit.grad[c.start : c.step_end],
                        {key: value[:n] for key, value in values.items()},
                        self.steps[c.segment] if self.has_step else None,
                        self.states_absent,
                    )
                self._encode(c.start, values)
        self._count_step()
        unit.refresh_after_step()

    @contextlib.contextmanager
    def _scratch(self, numel: int):
        """One fp32 chunk per state on the master's device, counted in its tier."""
        unit = self.unit
        with contextlib.ExitStack() as stack:
            scratch = {}
            for key in self.states:
                label = f"{key} step scratch"
                if unit.master.device.type == "cpu":
                    buffer = unit.scratch(numel, torch.float32, label)
                    stack.callback(unit.tiers.host.free, buffer)
                    scratch[key] = buffer.tensor[:numel]
                else:
                    scratch[key] = stack.enter_context(
                        unit.device_scratch(numel, torch.float32, label)
                    )
            yield scratch

    def _decode(self, start: int, values: dict[str, torch.Tensor]) -> None:
        """``values[key]`` = state ``key``'s elements from ``start`` (a block boundary)."""
        for key, out in values.items():
            if self.states_absent:
                out.zero_()
                continue
            end = start + out.numel()
            scales = scales_of(self.scales.get(key), start, out.numel())
            decode(self.format, key, self.states[key][start:end], scales, out)

    def _encode(self, start: int, values: dict[str, torch.Tensor]) -> None:
        for key, value in values.items():
            end = start + value.numel()
            scales = scales_of(self.scales.get(key), start, value.numel())
            encode(self.format, key, value, self.states[key][start:end], scales)

    # ------------------------------------------------------------------ state dict
    def read_state(self, key: str, start: int, numel: int) -> torch.Tensor | None:
        """Elements ``[start, start+numel)`` of state ``key``, decoded to fp32 (None
        before the first step)."""
        if not self.stepped:
            return None
        a, b = covering(start, numel, self.states[key].numel())
        out = torch.empty(b - a, dtype=torch.float32, device=self.states[key].device)
        self._decode(a, {key: out})
        return out[start - a : start - a + numel].cpu()

    @torch.no_grad()
    def write_states(
        self, values: dict[str, list[tuple[int, torch.Tensor]]], step, *, from_zeros=False
    ) -> None:
        """Overwrite slices of the states (``values[key] = [(start, flat tensor), ...]``,
        fp32, encoded here), the rest kept (or zeros with ``from_zeros``: a checkpoint's
        states replace them all); every segment's counter becomes ``step`` when given."""
        self.unit.before_state_change()
        n = self.unit.trainable_numel
        for key in self.states:
            flat = torch.zeros(n, dtype=torch.float32, device=self.states[key].device)
            if self.stepped and not from_zeros:
                self._decode(0, {key: flat})
            for start, value in values.get(key, []):
                flat[start : start + value.numel()].copy_(value.reshape(-1))
            self._encode(0, {key: flat})
        if step is not None:
            for counter in self.steps:
                counter.fill_(float(step))
        self.stepped = True
