"""``hetstore.named_weights``: the model's current weights as ``(name, tensor)``, unit by unit.

What an inference engine's ``load_weights(iterable)`` takes for the per-step weight sync
of colocated RL, and what a hand-off to another process needs: the names and values of
``model.state_dict()`` (a tied weight once, under its first name; persistent buffers
included), each a fresh CPU tensor, in the compute dtype (or ``dtype``).

It streams: the units are read in the runtime's order, one at a time. A master in host
memory is read where it is; a master on disk (or one whose frozen parameters live only in
the compute-dtype copy) is read into one host buffer of the unit's size, accounted in the
host tier and given back before the next unit. So the host memory it holds is at most one
unit's fp32 master beside the tensors the consumer still holds (at most about one more
unit, for a consumer that copies each tensor as it comes). A step still running for a
unit (``step_in_forward``) lands before the unit is read.

Sharded over ranks, each unit's master is all-gathered (a collective): every rank must
iterate, in the same order, and each gets the whole weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from hetstore.errors import ConfigError
from hetstore.eviction import refuse_if_evicted
from hetstore.model_state import is_released, state_of
from hetstore.runtime.unit import Unit
from hetstore.tiers.store import addressable
from hetstore.weights import targets_of

__all__ = ["named_weights"]


def named_weights(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight of ``model`` (see the module doc).

    ``dtype``: a floating dtype for the parameters; None: the offload config's compute
    dtype (a plain module: each parameter's own). Buffers keep their own dtype.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"named_weights() takes an nn.Module, got {type(model).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"named_weights: dtype={dtype!r}; use a floating torch dtype or None")
    if is_released(model):
        raise ConfigError(
            "named_weights: this model was released by hetstore.release() and its weights "
            "freed; there is nothing to read"
        )
    refuse_if_evicted(model, "named_weights")
    return _weights(model, dtype)


def _weights(model: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    targets = targets_of(model)
    state = state_of(model)
    if state is None:  # a plain module: its tensors as they are
        for target in targets:
            value = target.tensor.detach()
            cast = dtype if target.is_param and dtype is not None else value.dtype
            yield target.names[0], value.to("cpu", cast, copy=True)
        return
    units = state.runtime.units
    out = dtype if dtype is not None else units[0].compute_dtype
    first_name = {id(t.tensor): t.names[0] for t in targets}
    for unit in units:
        # (again per unit: a generator taken before hetstore.evict is read after it)
        refuse_if_evicted(model, "named_weights")
        yield from _unit_weights(unit, first_name, out)
    refuse_if_evicted(model, "named_weights")
    for target in targets:
        if not target.is_param:
            yield target.names[0], target.tensor.detach().to("cpu", copy=True)


def _unit_weights(unit: Unit, names: dict[int, str], dtype: torch.dtype):
    """One unit's parameters, cut from its whole fp32 master."""
    if unit.shards is not None:
        flat = unit.full_master()  # (a collective; a fresh host tensor)
        yield from _cut(unit, flat, names, dtype)
        return
    unit.barrier()  # (a step still running on lands first)
    if addressable(unit.master) and not unit.has_home_only:
        yield from _cut(unit, unit.master, names, dtype)
        return
    scratch = unit.scratch(unit.numel, torch.float32, "named weights")
    try:
        flat = scratch.tensor[: unit.numel]
        unit.read_master_into(flat)
        yield from _cut(unit, flat, names, dtype)
    finally:
        unit.tiers.host.free(scratch)


def _cut(unit: Unit, flat: torch.Tensor, names: dict[int, str], dtype: torch.dtype):
    for entry in unit.entries:
        value = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
        yield names[id(entry.param)], value.to("cpu", dtype, copy=True)
