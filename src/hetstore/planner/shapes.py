"""Batches larger than the traced one: re-plan the activations, or refuse with figures.

The plan was made for the batch the tracer saw (``example_inputs``). A later forward
with more elements saves more for backward; :class:`BatchGuard` sees it before the
forward starts, scales the traced activations by the growth in input elements (what
they are proportional to in a transformer or a CNN: batch size, and sequence length with
memory-efficient attention; quadratic attention grows faster, which the device
accounting still catches as ``OutOfDeviceMemory`` before anything overruns), and asks
the planner where the activations should go now (:func:`refit_activations`). Parameters
and optimizer states stay where they were built. If nothing fits, the forward is
refused with the figures, before it allocates anything.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils._pytree import tree_flatten

from hetstore.planner.plan import Plan
from hetstore.planner.planner import refit_activations
from hetstore.planner.trace import Trace

__all__ = ["BatchGuard", "scaled_trace"]


def scaled_trace(trace: Trace, scale: float) -> Trace:
    """``trace`` with every saved-tensor figure times ``scale``."""
    units = tuple(
        replace(
            u,
            saved_bytes=math.ceil(u.saved_bytes * scale),
            kept_bytes=math.ceil(u.kept_bytes * scale),
            largest_saved_bytes=math.ceil(u.largest_saved_bytes * scale),
            temp_bytes=math.ceil(u.temp_bytes * scale),
        )
        for u in trace.units
    )
    return replace(trace, units=units)


def _growth(shapes, traced) -> float:
    """How many times more elements the batch has than the traced one: the largest
    ratio over the traced arguments' positions (arguments the trace did not see, such as
    targets passed only in training, are left out)."""
    ratios = [
        math.prod(s) / math.prod(t) for s, t in zip(shapes, traced, strict=False) if math.prod(t)
    ]
    return max(ratios, default=1.0)


class BatchGuard:
    """Called with each forward's positional arguments (see module doc). ``apply(plan)``
    puts a re-made plan into effect; ``plan`` is the one in effect."""

    def __init__(self, trace: Trace, plan: Plan, config, apply: Callable[[Plan], None]):
        self.trace = trace
        self.plan = plan
        self.config = config
        self.apply = apply
        self.allowed = 1.0  # the growth over the traced batch the plan in effect covers

    def __call__(self, args) -> None:
        shapes = [tuple(t.shape) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        scale = _growth(shapes, self.trace.batch_shapes)
        if scale <= self.allowed:
            return
        batch = (
            f"a batch of shapes {shapes} ({scale:.2f}x the traced {list(self.trace.batch_shapes)})"
        )
        plan = refit_activations(
            scaled_trace(self.trace, scale), self.plan, self.config, batch=batch
        )
        moved = [
            f"{new.name}: {old.choice.activations} -> {new.choice.activations}"
            for old, new in zip(self.plan.units, plan.units, strict=True)
            if old.choice.activations != new.choice.activations
        ]
        if moved:
            warnings.warn(
                f"hetstore: {batch} re-planned the activations ({', '.join(moved)})",
                stacklevel=2,
            )
            self.apply(plan)
        self.plan = plan
        self.allowed = scale
