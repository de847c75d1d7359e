"""Giving a model built on the meta device real parameters, one module at a time.

``with torch.device("meta"): model = Net()`` allocates nothing. ``hetstore.offload``
then walks ``model.modules()`` in order and, for each module that directly owns meta
parameters or buffers, swaps them for host tensors (``torch.utils.swap_tensors``: the
``Parameter`` objects the optimizer and tied modules refer to stay the same objects),
runs ``reset_parameters()`` and then the user's ``init_fn(module)``, and builds each
unit as soon as all of its modules are done, which copies it into its tiers and drops
the host tensors. Host memory at creation is therefore one unit (plus the root unit's
modules, which finish last) rather than the model.

Order: modules are initialized in ``model.modules()`` order, which for the usual
``__init__`` that creates submodules in registration order is the order an eager
construction would have drawn random numbers in; a model whose initialization is
``reset_parameters()`` alone gets the same weights as an eager build on the same seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hetstore.errors import ConfigError

__all__ = ["owns_meta", "materialize_module", "has_meta"]


def owns_meta(module: nn.Module) -> bool:
    """True if ``module`` itself (not its children) holds a meta parameter or buffer."""
    tensors = list(module._parameters.values()) + list(module._buffers.values())
    return any(t is not None and t.is_meta for t in tensors)


def has_meta(model: nn.Module) -> bool:
    return any(owns_meta(m) for m in model.modules())


def materialize_module(
    module: nn.Module, name: str, init_fn: Callable[[nn.Module], None] | None
) -> None:
    """Give ``module``'s own meta tensors host storage and initialize them.

    Called for every module that owned a meta tensor when creation began, even if a
    tied parameter was materialized by an earlier module: an eager build would have run
    its initialization too.
    """
    label = f"module {name or '<root>'!r} ({type(module).__name__})"
    if init_fn is None and module._parameters and not hasattr(module, "reset_parameters"):
        raise ConfigError(
            f"{label} has parameters on the meta device and no reset_parameters(); pass "
            "init_fn= to hetstore.offload to initialize them (or create them on a real device)"
        )
    buffers = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
    if buffers and init_fn is None and not type(module).__module__.startswith("torch.nn"):
        raise ConfigError(
            f"{label} has buffers on the meta device ({', '.join(buffers)}) whose values "
            "hetstore cannot recompute; pass init_fn= to fill them, or create the buffers "
            "on a real device (e.g. under torch.device('cpu') inside __init__)"
        )
    params = [p for p in module._parameters.values() if p is not None and p.is_meta]
    for param in params:
        real = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad
        )
        torch.utils.swap_tensors(param, real)
    for key in buffers:
        buffer = module._buffers[key]
        module._buffers[key] = torch.zeros(buffer.shape, dtype=buffer.dtype)
    with torch.no_grad():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if init_fn is not None:
            init_fn(module)
