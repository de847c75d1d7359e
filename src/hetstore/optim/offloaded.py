"""``OffloadedOptimizer``: the user's optimizer, stepping flat fp32 master buffers.

Built from the user's optimizer instance (its class and every ``param_groups`` entry).
Per unit, each param group's parameters are one contiguous segment of the unit's fp32
master; Adam/AdamW/SGD step a segment with torch's fused kernel in one call (measured
at the memory-bandwidth ceiling on CPU, at parity with DeepSpeed's CPUAdam). Any other
``torch.optim`` class steps per-parameter views of the same buffers.

``param_groups`` are the user's groups, live: an LR scheduler edits them, and every
step copies their hyper-parameters into the per-unit inner optimizers.
``state_dict()`` / ``load_state_dict()`` speak torch's format over the original
parameters, so states move to and from a plain torch optimizer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.optim import Optimizer

from hetstore.optim.loss_scaler import DynamicLossScaler
from hetstore.runtime.unit import ParamEntry, Unit

__all__ = ["OffloadedOptimizer"]

_FUSED_FLAT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_ADAM_STATES = ("exp_avg", "exp_avg_sq")


class _UnitStep:
    """The inner optimizer of one unit and the tensors it steps."""

    def __init__(self, unit: Unit, optimizer: Optimizer, tensors: list[torch.Tensor], groups):
        self.unit = unit
        self.optimizer = optimizer
        self.tensors = tensors  # stepped tensors (segments or per-parameter views)
        self.groups = groups  # outer group index of each inner group


class OffloadedOptimizer(Optimizer):
    """Steps the model's fp32 master weights on the tier that holds them."""

    def __init__(
        self,
        original: Optimizer,
        units: list[Unit],
        *,
        loss_scaler: DynamicLossScaler | None = None,
        on_step: Callable[[], None] | None = None,
    ):
        # Optimizer.__init__ gives us live param_groups over the original parameters,
        # which LR schedulers and user code read and edit.
        groups = [dict(g) for g in original.param_groups]
        super().__init__(groups, dict(original.defaults))
        self.optimizer_class = type(original)
        self.units = units
        self.loss_scaler = loss_scaler
        self._on_step = on_step
        self._flat = isinstance(original, _FUSED_FLAT) and not any(
            g.get("differentiable") for g in groups
        )
        self._entry_of: dict[int, tuple[Unit, ParamEntry]] = {}
        for unit in units:
            for entry in unit.entries:
                self._entry_of[id(entry.param)] = (unit, entry)
        self._unit_steps = [self._build_unit_step(u) for u in units if u.trainable_numel]
        self._unscaled = False
        self._warned_missing: set[str] = set()

    # ------------------------------------------------------------------ construction
    def _hyper(self, group_index: int) -> dict:
        group = self.param_groups[group_index]
        hyper = {k: v for k, v in group.items() if k != "params"}
        if self._flat:
            hyper.update(foreach=False, fused=True)
        return hyper

    def _build_unit_step(self, unit: Unit) -> _UnitStep:
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
        step = _UnitStep(unit, inner, tensors, owners)
        if self._flat and self.optimizer_class is not torch.optim.SGD:
            self._preallocate_adam_states(step)
        return step

    def _preallocate_adam_states(self, step: _UnitStep) -> None:
        """Allocate Adam's moments in the unit's optimizer tier now, so a placement that
        cannot hold them is refused before training starts, not at the first step."""
        unit = step.unit
        for group, master in zip(step.optimizer.param_groups, step.tensors, strict=True):
            keys = _ADAM_STATES + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
            state = {"step": torch.zeros((), dtype=torch.float32, device=master.device)}
            for key in keys:
                tensor = unit.allocate(unit.placement.optimizer, master.numel(), torch.float32, key)
                tensor.zero_()
                state[key] = tensor
            step.optimizer.state[master] = state

    # ------------------------------------------------------------------ gradients
    def _all_grad_views(self) -> list[torch.Tensor]:
        """Gradient views of the parameters that have one, in param_groups order (torch's
        order, so norms are summed in the same order as ``clip_grad_norm_``'s)."""
        views = []
        for group in self.param_groups:
            for param in group["params"]:
                unit, entry = self._entry_of[id(param)]
                if entry.has_grad:
                    views.append(unit.grad[entry.offset : entry.offset + entry.numel])
        return views

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` under fp16 dynamic loss scaling, else ``loss`` unchanged.

        Usage with ``compute_dtype="fp16"``: ``optimizer.scale_loss(loss).backward()``
        (or ``optimizer.backward(loss)``), then ``optimizer.step()`` as usual.
        """
        if self.loss_scaler is None:
            return loss
        return loss * self.loss_scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.scale_loss(loss).backward(**kwargs)

    def _unscale(self) -> bool:
        """Divide gradients by the loss scale once per step; return True if any is inf/NaN."""
        if self.loss_scaler is None or self._unscaled:
            return False
        self._unscaled = True
        inv = 1.0 / self.loss_scaler.scale
        found = False
        for unit in self.units:
            if unit.grad is not None and unit.any_grad():
                unit.grad.mul_(inv)
                found = found or not bool(torch.isfinite(unit.grad).all())
        self._found_inf = found
        return found

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the global gradient norm over every gradient, wherever it lives.

        Same semantics and return value as ``torch.nn.utils.clip_grad_norm_`` over the
        original parameters (norms per parameter, then the norm of those norms).
        """
        self._unscale()
        grads = self._all_grad_views()
        if not grads:
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        per_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            per_device.setdefault(g.device, []).append(g)
        norms = []
        for group in per_device.values():
            norms.extend(torch._foreach_norm(group, norm_type))
        target = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(target) for n in norms]), norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} for gradients is non-finite, so it "
                "cannot be clipped; set error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device, group in per_device.items():
            torch._foreach_mul_(group, coef.to(device))
        return total

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadedOptimizer.step does not take a closure")
        found_inf = self._unscale()
        self._unscaled = False
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return None
        for unit_step in self._unit_steps:
            unit = unit_step.unit
            if not unit.any_grad():
                continue  # like torch: parameters without a gradient are not stepped
            missing = unit.fill_missing_grads()
            self._warn_missing(missing)
            for inner, outer in zip(
                unit_step.optimizer.param_groups, unit_step.groups, strict=True
            ):
                for key, value in self._hyper(outer).items():
                    inner[key] = value
            unit_step.optimizer.step()
            unit.refresh_from_master()
        if self._on_step is not None:
            self._on_step()
        return None

    def _warn_missing(self, names: list[str]) -> None:
        new = [n for n in names if n not in self._warned_missing]
        if new:
            self._warned_missing.update(new)
            warnings.warn(
                f"parameters {new} got no gradient but share a flat buffer with parameters "
                "that did: they are stepped with a zero gradient (plain PyTorch would skip "
                "them; with weight decay or momentum they move). Put them in their own unit "
                "with units=[...] or freeze them.",
                stacklevel=3,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (the buffers stay allocated for the next step)."""
        self._unscaled = False
        for unit in self.units:
            unit.clear_grads()

    # ------------------------------------------------------------------ state dict
    def _locate(self, param) -> tuple[_UnitStep, int, torch.Tensor, ParamEntry]:
        unit, entry = self._entry_of[id(param)]
        for unit_step in self._unit_steps:
            if unit_step.unit is unit:
                if self._flat:
                    for seg, tensor in zip(unit.segments, unit_step.tensors, strict=True):
                        if seg.start <= entry.offset < seg.end:
                            return unit_step, entry.offset - seg.start, tensor, entry
                else:
                    view_index = unit.trainable_entries.index(entry)
                    return unit_step, 0, unit_step.tensors[view_index], entry
        raise KeyError(f"parameter {entry.name!r} is not stepped by this optimizer")

    def state_dict(self) -> dict:
        """Torch's format over the original parameters (indices in param_groups order)."""
        state: dict[int, dict] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            ids = []
            for param in group["params"]:
                unit_step, start, tensor, entry = self._locate(param)
                inner_state = unit_step.optimizer.state.get(tensor)
                if inner_state and self._has_started(inner_state):
                    state[index] = {
                        key: self._export_value(value, tensor, start, entry)
                        for key, value in inner_state.items()
                    }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _has_started(inner_state: dict) -> bool:
        step = inner_state.get("step")
        return step is None or float(step) > 0

    def _export_value(self, value, tensor: torch.Tensor, start: int, entry: ParamEntry):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() == tensor.numel() and tensor.dim() == 1 and self._flat:
                return value[start : start + entry.numel].view(entry.shape).clone()
            return value.clone()
        return value.clone() if isinstance(value, torch.Tensor) else value

    def load_state_dict(self, state_dict: dict) -> None:
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
        for saved, group in zip(groups, self.param_groups, strict=True):
            for index, param in zip(saved["params"], group["params"], strict=True):
                if index not in saved_state and str(index) not in saved_state:
                    continue
                values = saved_state.get(index, saved_state.get(str(index)))
                self._import_param_state(param, values)

    @torch.no_grad()
    def _import_param_state(self, param, values: dict) -> None:
        unit_step, start, tensor, entry = self._locate(param)
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
