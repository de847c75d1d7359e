"""The optimizer states' side of the offloaded optimizer: ``state_dict()`` /
``load_state_dict()`` in torch's format over the original parameters, and the per-unit
accessors the checkpoints use (``segment_states``, ``export_param_state``,
``import_param_state``, ``reset_unit_state``).

One of the classes :class:`~hetstore.optim.offloaded.OffloadedOptimizer` is made of. It
reads the unit steps (``unit_step_of``, ``_entry_of``) and writes states only through
them.
"""

from __future__ import annotations

import torch

from hetstore.errors import ConfigError
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.streamed import StreamedUnitStep, UnitStates
from hetstore.runtime.unit import ParamEntry, Unit
from hetstore.tiers.flat import DiskSlice

__all__ = ["StateIO"]


class StateIO:
    """States in torch's format and per unit (module doc)."""

    def _locate(self, param) -> tuple[InMemoryUnitStep, int, torch.Tensor, ParamEntry]:
        unit, entry = self._entry_of[id(param)]
        unit_step = self.unit_step_of(unit)
        if isinstance(unit_step, UnitStates):
            return unit_step, entry.offset, None, entry
        if unit_step is not None and self._flat:
            for seg, tensor in zip(unit.segments, unit_step.tensors, strict=True):
                if seg.start <= entry.offset < seg.end:
                    return unit_step, entry.offset - seg.start, tensor, entry
        elif unit_step is not None:
            # by identity: dataclass == would compare the parameters (storage-less)
            view_index = next(i for i, e in enumerate(unit.trainable_entries) if e is entry)
            return unit_step, 0, unit_step.tensors[view_index], entry
        raise KeyError(f"parameter {entry.name!r} is not stepped by this optimizer")

    def _refuse_sharded(self, what: str) -> None:
        if self.shards is not None:
            raise RuntimeError(
                f"optimizer.{what}() in torch's format needs every parameter's whole state, "
                f"but each of the {self.shards.world_size} ranks holds a shard of it; save "
                "and load sharded training state with hetstore.save / hetstore.load"
            )

    def state_dict(self) -> dict:
        """Torch's format over the original parameters (indices in param_groups order)."""
        self._check_alive("state_dict")
        self.finish_steps_in_forward()
        self._refuse_sharded("state_dict")
        state: dict[int, dict] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            ids = []
            for param in group["params"]:
                values = self._param_state(param, copy=True)
                if values:
                    state[index] = values
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        out = {"state": state, "param_groups": groups}
        if not self.state_format.exact:  # states decoded to fp32; loads check the format
            out["state_format"] = self.state_format.name
        return out

    @staticmethod
    def _has_started(inner_state: dict) -> bool:
        step = inner_state.get("step")
        return step is None or float(step) > 0

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_alive("load_state_dict")
        if self.step_ahead is not None:  # (step_in_backward: those steps are taken)
            self.step_ahead.refuse_dropping("optimizer.load_state_dict()")
        self.finish_steps_in_forward()
        self._refuse_sharded("load_state_dict")
        saved_format = state_dict.get("state_format", "fp32")
        if saved_format != self.state_format.name:
            raise ValueError(
                f"optimizer.load_state_dict(): the states were saved with "
                f"optimizer_state_format={saved_format!r} and this run keeps them as "
                f"{self.state_format.name!r}; to convert them (rounding them to this run's "
                f"format), set state_dict['state_format'] = {self.state_format.name!r} first"
            )
        if self.step_ahead is not None:
            self.step_ahead.discard_all()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(s["params"])
            for g, s in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "loaded optimizer state has a different param group layout than this optimizer: "
                f"{[len(g['params']) for g in groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]} parameters per group"
            )
        for saved, group in zip(groups, self.param_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        saved_state = state_dict["state"]
        streamed: dict[UnitStates, tuple[dict, list]] = {}
        for saved, group in zip(groups, self.param_groups, strict=True):
            for index, param in zip(saved["params"], group["params"], strict=True):
                if index not in saved_state and str(index) not in saved_state:
                    continue
                values = saved_state.get(index, saved_state.get(str(index)))
                unit_step, start, _, entry = self._locate(param)
                if isinstance(unit_step, UnitStates):
                    slices, steps = streamed.setdefault(unit_step, ({}, []))
                    for key, value in values.items():
                        if key == "step":
                            steps.append(float(value))
                        elif key in unit_step.states:
                            slices.setdefault(key, []).append((start, value))
                    continue
                self.import_param_state(param, values)
        for unit_step, (slices, steps) in streamed.items():
            unit_step.write_states(slices, max(steps) if steps else None)

    def check_between_steps(self) -> None:
        """Refuse to checkpoint in the middle of a step: one that failed part-way, or one
        that a backward took in part (``step_in_backward``) and ``optimizer.step()`` has
        not finished (the root's, and each unit's step count, would be a step behind)."""
        self.finish_steps_in_forward()
        if self.step_ahead is not None:
            self.step_ahead.refuse_dropping("hetstore.save")
        if self._resume_at:
            raise RuntimeError(
                "a step() failed part-way (some units are stepped, others not): call step() "
                "again to finish it before saving a checkpoint"
            )

    def streamed_step_of(self, unit: Unit) -> UnitStates | None:
        """The step that owns ``unit``'s states chunk by chunk (on disk, or in a compact
        format in memory), else None."""
        self.finish_steps_in_forward()
        unit_step = self.unit_step_of(unit)
        return unit_step if isinstance(unit_step, UnitStates) else None

    def export_param_state(self, param) -> dict:
        """``param``'s state without copies: per-element states as views of the flat
        buffers (memory) or :class:`DiskSlice` (disk), the rest as torch keeps it. Empty
        before the parameter's first step, as in torch."""
        self.finish_steps_in_forward()
        return self._param_state(param, copy=False)

    def _param_state(self, param, copy: bool) -> dict:
        """``param``'s state in torch's keys: copies (``state_dict()``), or views and
        :class:`DiskSlice` (a compact format's are decoded copies either way)."""
        unit_step, start, tensor, entry = self._locate(param)
        if isinstance(unit_step, UnitStates):
            if not unit_step.stepped:
                return {}
            segment = next(
                i for i, s in enumerate(unit_step.unit.segments) if s.start <= entry.offset < s.end
            )
            out: dict = {}
            if unit_step.has_step:
                step = unit_step.steps[segment]
                out["step"] = step.clone() if copy else step
            for key, array in unit_step.states.items():
                if copy or not self.state_format.exact:
                    value = unit_step.read_state(key, entry.offset, entry.numel)
                    out[key] = value.view(entry.shape)
                else:
                    out[key] = DiskSlice(array, entry.offset, entry.numel, entry.shape)
            return out
        inner_state = unit_step.optimizer.state.get(tensor)
        if not inner_state or not self._has_started(inner_state):
            return {}
        out = {}
        for key, value in inner_state.items():
            if isinstance(value, torch.Tensor):
                if self._flat and value.dim() > 0:
                    value = value[start : start + entry.numel].view(entry.shape)
                value = value.clone() if copy else value
            out[key] = value
        return out

    def segment_states(self, unit: Unit, *, create: tuple[str, ...] = ()) -> list[dict]:
        """The states of each of ``unit``'s optimizer segments (of this rank's shard), in
        order, without copies, for checkpoints of sharded runs: ``{"segment", "base",
        "step", "states", "stepped"}``, where element ``i`` of the shard's flat layout is
        ``states[key][i - base]`` (a tensor in memory, a ``Store`` on disk) and
        ``step`` the segment's counter (None for SGD). ``create``: per-element keys made
        as zeros where torch has not made them yet (SGD's momentum before its first step).
        Flat optimizers in the fp32 format only (compact states are refused here: each
        element's value needs decoding)."""
        self.finish_steps_in_forward()
        unit_step = self.unit_step_of(unit)
        if unit_step is None:
            return []
        if isinstance(unit_step, UnitStates) and not unit_step.format.exact:
            raise ConfigError(
                f"unit {unit.name!r} keeps its optimizer states as "
                f"{unit_step.format.name!r}: their per-segment views exist only in fp32 "
                "(optimizer_state_format='fp32')"
            )
        if isinstance(unit_step, StreamedUnitStep):
            return [
                {
                    "segment": segment,
                    "base": 0,
                    "step": unit_step.steps[i] if unit_step.has_step else None,
                    "states": dict(unit_step.states),
                    "stepped": unit_step.stepped,
                }
                for i, segment in enumerate(unit.segments)
            ]
        out = []
        for segment, tensor in zip(unit.segments, unit_step.tensors, strict=True):
            inner = unit_step.optimizer.state.setdefault(tensor, {})
            for key in create:
                if key not in inner:
                    inner[key] = torch.zeros_like(tensor)
            states = {k: v for k, v in inner.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
            out.append(
                {
                    "segment": segment,
                    "base": segment.start,
                    "step": inner.get("step"),
                    "states": states,
                    "stepped": bool(inner) and self._has_started(inner),
                }
            )
        return out

    @torch.no_grad()
    def reset_unit_state(self, unit: Unit) -> None:
        """Make the in-memory states of ``unit`` fresh (as before any step) before a
        checkpoint's are imported; states on disk are rewritten whole by the loader."""
        unit_step = self.unit_step_of(unit)
        if unit_step is None or isinstance(unit_step, UnitStates):
            return
        unit.before_state_change()  # a step taken ahead from these states goes first
        for tensor in unit_step.tensors:
            state = unit_step.optimizer.state.get(tensor)
            if not state:
                continue
            if self._flat and self._spec.preallocate_states:
                for value in state.values():  # preallocated: keep the buffers
                    value.zero_()
            else:
                for value in state.values():  # (a step taken ahead made it the unit's)
                    unit.free_buffer(value)
                state.clear()

    @torch.no_grad()
    def import_param_state(self, param, values: dict) -> None:
        """Set ``param``'s state from ``values`` (torch's keys; tensors copied in)."""
        unit_step, start, tensor, entry = self._locate(param)
        unit_step.unit.before_state_change()  # a step taken ahead from these goes first
        inner = unit_step.optimizer.state.setdefault(tensor, {})
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if self._flat and tensor.dim() == 1:
                    if key not in inner:
                        inner[key] = torch.zeros_like(tensor, dtype=value.dtype)
                    inner[key][start : start + entry.numel].copy_(value.reshape(-1))
                else:
                    inner[key] = value.to(tensor.device, copy=True)
            elif isinstance(value, torch.Tensor):
                inner[key] = value.to(dtype=torch.float32, device=tensor.device, copy=True)
            else:
                inner[key] = value
