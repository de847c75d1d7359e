"""``copy.deepcopy`` of an offloaded model (or of one of its modules) gives a plain model.

``torch.optim.swa_utils.AveragedModel``, timm's ``ModelEmaV2/V3`` and many EMA and
"best model so far" helpers start with ``copy.deepcopy(model)``. A deep copy would copy
hetstore's hooks with everything they reach -- the runtime, its tiers, their IO threads
and memory-mapped files (``TypeError: cannot pickle 'mmap.mmap' object``) -- and even if
it could, two models sharing one set of tiers would corrupt each other.

What plain PyTorch gives is an independent model whose parameters hold the values the
original computes with. That is what the copy is here: every module and buffer copied as
usual, each managed parameter an ordinary parameter of its own class holding its current
value as forward sees it (the fp32 master in the compute dtype, on the compute device:
one read per parameter, from the unit's home), and none of hetstore's hooks or state.
The copy is not offloaded: it is made on the compute device, as plain PyTorch's is,
and needs the memory a plain model of its size needs there.

Mechanism: each module of the offloaded model carries a ``__deepcopy__`` instance
attribute (``copy.deepcopy`` looks it up on the instance). It seeds the copy's memo with
the parameters' plain copies and with hetstore's hooks mapped to themselves (so that
nothing behind them is traversed), copies the module the ordinary way, and takes those
hooks and the model state out of the copy. ``hetstore.release`` removes the attributes.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from hetstore.errors import ConfigError
from hetstore.runtime import released

if TYPE_CHECKING:
    from hetstore.runtime.hooks import OffloadRuntime
    from hetstore.runtime.unit import ParamEntry, Unit

__all__ = ["PlainCopies"]

_ATTR = "__deepcopy__"


class PlainCopies:
    """Makes ``copy.deepcopy`` of ``model`` and of each of its modules a plain copy (see
    the module doc); :meth:`remove` takes that off again (a handle the runtime owns)."""

    def __init__(self, model: nn.Module, units: list[Unit], runtime: OffloadRuntime):
        self._runtime = runtime
        self._where: dict[int, tuple[Unit, ParamEntry]] = {
            id(e.param): (unit, e) for unit in units for e in unit.entries
        }
        self._modules = list(model.modules())
        for module in self._modules:
            module.__dict__[_ATTR] = _Copier(self, module)

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop(_ATTR, None)
        self._modules = []

    def copy(self, module: nn.Module, memo: dict) -> nn.Module:
        # once per top-level copy (each module of it comes here): the memo is that copy's
        if self._runtime.refusal is not None:
            raise ConfigError(self._runtime.refusal)
        hooks = memo.get(id(self))
        if hooks is None:
            hooks = memo[id(self)] = self._runtime.hooks_installed()
            for _, hook, _ in hooks:
                memo.setdefault(id(hook), hook)  # not traversed; taken out of the copy below
        for param in module.parameters():
            if id(param) not in memo and id(param) in self._where:
                memo[id(param)] = self._plain_param(param)
        own = module.__dict__.pop(_ATTR)
        state = module.__dict__.pop("_hetstore", None)  # (only the model's root has one)
        try:
            result = copy.deepcopy(module, memo)
        finally:
            module.__dict__[_ATTR] = own
            if state is not None:
                module.__dict__["_hetstore"] = state
        for copied in result.modules():
            copied.__dict__.pop(_ATTR, None)  # a child copied before its parent returned
        # hetstore's entries out of the copies of torch's hook dicts (found through the
        # memo: a user's own dict with the same integer keys is left alone)
        for hook_id, _, tables in hooks:
            for table in tables:
                copied_table = memo.get(id(table))
                if copied_table is not None and copied_table is not table:
                    copied_table.pop(hook_id, None)
        return result

    def _plain_param(self, param: nn.Parameter) -> nn.Parameter:
        """``param``'s value now, as forward sees it, in an ordinary parameter of the
        class the user gave it (without hetstore's layers)."""
        if released.is_released(param):
            value = released.source_of(param).read()  # refused when sharded or released
        else:
            self._where[id(param)][0].wait_ready()  # a CUDA copy in may still be in flight
            with torch.no_grad(), DisableTorchFunctionSubclass():
                value = param.detach().clone()
        cls = next(
            c
            for c in type(param).__mro__
            if not issubclass(c, released.Released) and "_hetstore_managed" not in c.__dict__
        )
        return cls(value, param.requires_grad)


class _Copier:
    """The ``__deepcopy__`` of one module (an instance attribute: called with the memo)."""

    __slots__ = ("_owner", "_module")

    def __init__(self, owner: PlainCopies, module: nn.Module):
        self._owner, self._module = owner, module

    def __call__(self, memo: dict) -> nn.Module:
        return self._owner.copy(self._module, memo)
