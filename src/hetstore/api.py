"""``hetstore.offload``: the one call that turns a model and optimizer into offloaded ones."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn
from torch.optim import Optimizer

from hetstore._sizes import format_size
from hetstore.config import OffloadConfig
from hetstore.errors import ConfigError
from hetstore.optim import DynamicLossScaler, OffloadedOptimizer
from hetstore.runtime.hooks import OffloadRuntime
from hetstore.runtime.state_dict import install_state_dict_hooks
from hetstore.runtime.unit import Placement, Unit
from hetstore.runtime.units import find_units
from hetstore.tiers import Tiers

__all__ = ["offload"]


def offload(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    config: OffloadConfig | None = None,
    *,
    units: Sequence[nn.Module] | None = None,
) -> tuple[nn.Module, OffloadedOptimizer | None]:
    """Offload ``model``'s parameters, gradients and optimizer states per ``config``.

    The model is changed in place (its parameters become views into hetstore's buffers)
    and returned with an optimizer to use instead of ``optimizer``. A plain PyTorch
    training loop then works unchanged. ``units`` overrides the default grouping of
    parameters (one unit per repeated block plus one for the rest).

    Raises ``ConfigError`` for a bad configuration and ``OutOfDeviceMemory`` /
    ``OutOfTierMemory`` when the model states cannot be placed, before any training.
    """
    config = config if config is not None else OffloadConfig()
    if not isinstance(config, OffloadConfig):
        raise ConfigError(f"config must be a hetstore.OffloadConfig, got {type(config).__name__}")
    if getattr(model, "_hetstore_runtime", None) is not None:
        raise ConfigError("this model was already passed to hetstore.offload()")
    if config.auto_offload:
        raise NotImplementedError(
            "auto_offload=True needs the planner, which this version does not have yet; "
            "set offload_param / offload_optimizer explicitly"
        )
    for key in ("offload_param", "offload_optimizer", "offload_activations"):
        if getattr(config, key) == "disk":
            raise NotImplementedError(f"{key}='disk' is not supported by this version yet")
    if config.grad_tier == "disk":
        raise NotImplementedError("offload_grad='disk' is not supported by this version yet")
    if config.offload_activations != "none":
        raise NotImplementedError("offload_activations is not supported by this version yet")

    device = config.resolved_device()
    groups_of = _group_index(model, optimizer)
    specs = find_units(model, units)
    placement = Placement(
        param=config.offload_param, optimizer=config.offload_optimizer, grad=config.grad_tier
    )
    unit_list: list[Unit] = []

    def advice(tier: str, nbytes: int) -> list[str]:
        return _placement_advice(config, unit_list, tier)

    tiers = Tiers(config, device=device, advice=advice)
    compute_dtype = config.torch_compute_dtype
    for spec in specs:
        params = []
        for module, attr, qualified in spec.params:
            param = module._parameters[attr]
            if not param.is_floating_point():
                raise ConfigError(
                    f"parameter {qualified!r} has dtype {param.dtype}; hetstore manages "
                    "floating-point parameters only"
                )
            params.append((qualified, param, groups_of.get(id(param))))
        unit_list.append(Unit(len(unit_list), spec.name, params, placement, tiers, compute_dtype))
    _move_buffers(model, tiers)

    root = next((u for u, s in zip(unit_list, specs, strict=True) if s.is_root), None)
    unit_modules = {u.index: s.module for u, s in zip(unit_list, specs, strict=True)}
    runtime = OffloadRuntime(
        model,
        unit_list,
        unit_modules,
        root,
        prefetch_depth=config.prefetch_depth if device.type == "cuda" else 0,
    )
    unoptimized = [
        e.param for u in unit_list for e in u.entries if e.param.requires_grad and e.group is None
    ]
    if unoptimized and optimizer is not None:
        warnings.warn(
            f"{len(unoptimized)} parameters require grad but are not in the optimizer; their "
            "gradients are dropped after backward (set requires_grad=False to silence)",
            stacklevel=2,
        )
        runtime.drop_grads_of(unoptimized)
    runtime.adopt(install_state_dict_hooks(model, unit_list))
    model._hetstore_tiers = tiers
    model._hetstore_runtime = runtime

    wrapped = None
    if optimizer is not None:
        scaler = DynamicLossScaler() if config.compute_dtype == "fp16" else None
        wrapped = OffloadedOptimizer(optimizer, unit_list, loss_scaler=scaler)
        # the user's optimizer held the original parameters; its state is meaningless now
        optimizer.state.clear()
    return model, wrapped


def _group_index(model: nn.Module, optimizer: Optimizer | None) -> dict[int, int]:
    """Parameter id -> index of its optimizer param group; checks the optimizer's params."""
    if optimizer is None:
        return {}
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    model_params = {id(p) for p in model.parameters()}
    index: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in model_params:
                raise ConfigError(
                    f"optimizer param group {g} holds a parameter of shape {tuple(param.shape)} "
                    "that is not in the model; build the optimizer over model.parameters()"
                )
            if param.requires_grad:
                index[id(param)] = g
    if any(float(st.get("step", 0)) > 0 for st in optimizer.state.values()):
        warnings.warn(
            "the optimizer already has state (it has stepped); hetstore starts from fresh "
            "state. Load saved state with optimizer.load_state_dict() after offload().",
            stacklevel=3,
        )
    return index


def _move_buffers(model: nn.Module, tiers: Tiers) -> None:
    total = 0
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if buffer.device != tiers.device:
                module._buffers[name] = buffer.to(tiers.device)
            total += buffer.numel() * buffer.element_size()
    if total:
        tiers.device_tier.reserve(total, "module buffers")


def _placement_advice(config: OffloadConfig, units: list[Unit], tier: str) -> list[str]:
    """What setting would make the states fit, from the units built so far."""
    if tier != "device" or not units:
        return []
    lines = []
    numel = sum(u.numel for u in units)
    if config.offload_param == "none":
        saved = numel * units[0].compute_dtype.itemsize
        lines.append(
            f"  offload_param='cpu' would keep only the running unit's parameters on the "
            f"device (frees about {format_size(saved)} of parameters so far)"
        )
    if config.offload_optimizer == "none":
        lines.append(
            f"  offload_optimizer='cpu' would move fp32 master weights, gradients and "
            f"optimizer states to host memory (about {format_size(numel * 16)} so far for Adam)"
        )
    return lines
