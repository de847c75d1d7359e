"""Refuse a parameter unfrozen after ``offload()`` that hetstore laid out as frozen.

A unit's flat buffers are laid out once, at ``offload()``: a parameter the optimizer
holds gets an fp32 master, a gradient slot and optimizer states there only if it
requires grad then. One frozen at that moment (``requires_grad=False``) is stored as a
frozen weight, with no room for any of those; were it unfrozen later, its gradient would
be dropped and it would never be stepped, silently. Torch's optimizer would create its
state at its first step with a gradient and train it.

Laying out states for every frozen parameter the optimizer holds would honour it, but
costs 16 bytes per parameter that most of them never use (PEFT's examples hand the
whole model, frozen base included, to AdamW). So the first forward that would train
such a parameter is refused, naming it and the way out: leave it trainable when
``offload()`` runs and freeze it right after (a parameter frozen after ``offload()``
keeps its states and is not stepped while it has no gradient, as in torch).
"""

from __future__ import annotations

import torch
from torch import nn

from hetstore.errors import HetstoreError
from hetstore.runtime.layout import ParamEntry

__all__ = ["RefuseUnfrozen"]


class RefuseUnfrozen:
    """A forward pre-hook over the optimizer's parameters laid out as frozen."""

    def __init__(self, entries: list[ParamEntry]):
        self._entries = entries

    def __call__(self, module: nn.Module, args) -> None:
        if not torch.is_grad_enabled():  # evaluation trains nothing
            return
        unfrozen = [e.name for e in self._entries if e.param.requires_grad]
        if unfrozen:
            shown = ", ".join(repr(n) for n in unfrozen[:4])
            more = f" and {len(unfrozen) - 4} more" if len(unfrozen) > 4 else ""
            raise HetstoreError(
                f"parameters {shown}{more} were frozen (requires_grad=False) when "
                "hetstore.offload() laid out the model, so hetstore keeps no fp32 master, "
                "gradient or optimizer state for them, and they were unfrozen since: "
                "training them now would silently leave them untrained. Leave them "
                "trainable when calling hetstore.offload() and freeze them right after "
                "(freezing after offload() is honoured: no step while they have no "
                "gradient, and their first step with one starts their state, as in torch)"
            )

    @staticmethod
    def install(model: nn.Module, entries: list[ParamEntry]):
        """The hook on ``model``, first of its pre-hooks (before anything is fetched)."""
        return model.register_forward_pre_hook(RefuseUnfrozen(entries), prepend=True)
