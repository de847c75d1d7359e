"""``model.state_dict()`` / ``load_state_dict()`` on an offloaded model.

A released parameter has no storage, so neither reading nor copying into it is safe.
Around both calls every managed parameter is pointed at its fp32 master value (the
source of truth): ``state_dict`` then returns the original keys and shapes at full
precision, each parameter in a storage of its own (a copy: tied parameters keep one),
and ``load_state_dict`` writes straight into the master; afterwards the parameters go
back to their device views and the compute-dtype copies are refreshed.
A master on disk is read into a host copy for the call (and written back after a load):
``state_dict()`` of a model bigger than host memory cannot work, stream it instead.

Sharded over ranks, the masters are all-gathered unit by unit, so every rank gets the
full weights (a collective: call ``state_dict()`` / ``load_state_dict()`` on every rank);
a load keeps each rank's shard of what it is given.
"""

from __future__ import annotations

import torch
from torch import nn

from hetstore.errors import ConfigError, OffloadedParameterError
from hetstore.runtime.unit import Unit

__all__ = ["install_state_dict_hooks"]


class _MasterViews:
    def __init__(self, units: list[Unit], refusal):
        self.units = units
        self.refusal = refusal  # () -> why the weights cannot be read now, or None
        self.depth = 0
        self.masters: list[torch.Tensor] | None = None

    def enter(self, for_load: bool) -> None:
        """Point every parameter at its fp32 master value. For a load, views into the
        unit's master, written back on exit; for a save, one tensor per parameter, so
        no two state-dict entries share a storage unless the model ties them (tools that
        take shared storage for tied weights -- accelerate's and safetensors' savers --
        would otherwise drop or refuse entries)."""
        why = self.refusal()
        if why is not None:
            raise ConfigError(why)
        if for_load and self.depth == 0:  # (before anything: a subscriber may refuse it)
            for unit in self.units:
                unit.before_state_change()
        self.depth += 1
        if self.depth > 1:
            return
        self.masters = [] if for_load else None
        for unit in self.units:
            master = unit.full_master()
            if for_load:
                self.masters.append(master)
            unit.expose_params()  # their .data is set here, which a released one refuses
            for e in unit.entries:
                value = master[e.offset : e.offset + e.numel].view(e.shape)
                e.param.data = value if for_load else value.clone()

    def exit(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for unit in self.units:
            unit.restore_param_views()
        masters, self.masters = self.masters, None
        if masters is not None:  # a load: the changed masters become the source of truth
            for unit, master in zip(self.units, masters, strict=True):
                unit.store_full_master(master)


def install_state_dict_hooks(model: nn.Module, units: list[Unit], refusal) -> list:
    """The hooks (their handles) that serve both calls; ``refusal() -> str | None``
    says why the weights cannot be read now (an evicted model), refused before any."""
    views = _MasterViews(units, refusal)

    def before_save(module, prefix, keep_vars):
        views.enter(for_load=False)

    def after_save(module, state_dict, prefix, local_metadata):
        views.exit()

    def before_load(
        module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        if local_metadata.get("assign_to_params_buffers"):
            raise OffloadedParameterError(
                "load_state_dict(..., assign=True) on an offloaded model: it would make "
                "the given tensors the model's parameters, which hetstore does not manage "
                "(forward would use them, their gradients would reach no optimizer, and "
                "training would silently change nothing). Load without assign=True: the "
                "values are copied into hetstore's fp32 master and every copy of them; "
                "nothing was loaded"
            )
        views.enter(for_load=True)

    def after_load(module, incompatible_keys):
        with torch.no_grad():
            views.exit()

    # On every module, not just the root: a user may call ``model.blocks[0].state_dict()``,
    # and its parameters have no storage outside their unit's use. The depth counter in
    # _MasterViews makes the nested calls of a whole-model state_dict() cheap and safe.
    handles = []
    for module in model.modules():
        handles += [
            module.register_state_dict_pre_hook(before_save),
            module.register_state_dict_post_hook(after_save),
            module.register_load_state_dict_pre_hook(before_load),
            module.register_load_state_dict_post_hook(after_load),
        ]
    return handles
