"""The optimizers hetstore steps flat, and what state each keeps.

One place answers, for the optimizer (``OffloadedOptimizer``), the disk tier's streamed
step, the placement checks in ``offload()`` and the planner's tracer alike: can this
optimizer be stepped over flat fp32 segments (one fused call per contiguous group, and
chunk by chunk from disk), which per-element states does it keep for given param groups,
does it keep a step counter, and how many state bytes per parameter does that make.
Any other ``torch.optim.Optimizer`` still works with states in memory: it is stepped
per parameter, as torch would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetstore.optim.state_format import state_format

__all__ = [
    "FlatOptimizer",
    "flat_spec",
    "flat_steppable",
    "state_count",
    "state_itemsize",
    "FLAT_NAMES",
]


@dataclass(frozen=True)
class FlatOptimizer:
    """One family of optimizers hetstore steps flat."""

    classes: tuple[type, ...]
    # the per-element state tensors kept for these param groups, in a fixed order
    _states: Callable[[list[dict]], tuple[str, ...]]
    has_step: bool  # a 0-d step counter per segment, as torch keeps per parameter
    # torch's fused step accepts states allocated ahead (zeros), so they are placed in
    # their tier at offload() and a placement that cannot hold them fails before step 1
    preallocate_states: bool

    def state_keys(self, groups: list[dict]) -> tuple[str, ...]:
        return self._states(groups)

    def state_bytes_per_element(self, groups: list[dict], fmt: str = "fp32") -> float:
        return state_format(fmt).bytes_per_element() * len(self.state_keys(groups))


def _adam_states(groups: list[dict]) -> tuple[str, ...]:
    amsgrad = any(g.get("amsgrad") for g in groups)
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def _sgd_states(groups: list[dict]) -> tuple[str, ...]:
    return ("momentum_buffer",) if any(g.get("momentum", 0) for g in groups) else ()


_FLAT = (
    FlatOptimizer(
        (torch.optim.Adam, torch.optim.AdamW), _adam_states, has_step=True, preallocate_states=True
    ),
    FlatOptimizer((torch.optim.SGD,), _sgd_states, has_step=False, preallocate_states=False),
)
FLAT_NAMES = "torch.optim.Adam, AdamW and SGD"  # for messages: what the specs above cover


def flat_spec(optimizer: torch.optim.Optimizer | type) -> FlatOptimizer | None:
    """The spec of ``optimizer`` (an instance or a class), None if it is not stepped flat."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return next((spec for spec in _FLAT if issubclass(cls, spec.classes)), None)


def flat_steppable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether flat segments (and the disk tier's streamed step) can run ``optimizer``: one
    of the families above, not differentiable (its step must not be part of a graph)."""
    return flat_spec(optimizer) is not None and not any(
        g.get("differentiable") for g in optimizer.param_groups
    )


def state_count(optimizer: torch.optim.Optimizer | None) -> int:
    """Per-element states of ``optimizer`` (2, as AdamW, for None or an unknown class)."""
    spec = flat_spec(optimizer) if optimizer is not None else None
    return len(spec.state_keys(optimizer.param_groups)) if spec is not None else 2


def state_itemsize(optimizer: torch.optim.Optimizer | None, fmt: str = "fp32") -> float:
    """Optimizer-state bytes per trainable parameter, for the planner: exact for the flat
    families in ``fmt`` (``optimizer_state_format``), AdamW's with no optimizer (what
    training will most likely use), and two fp32 states for an unknown one (as most
    adaptive optimizers keep; compact formats apply to the flat families only)."""
    if optimizer is None:
        return _FLAT[0].state_bytes_per_element([], fmt)
    spec = flat_spec(optimizer)
    return spec.state_bytes_per_element(optimizer.param_groups, fmt) if spec is not None else 8
