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
from collections.abc import Callable
from dataclasses import replace

from hetstore._sizes import format_size
from hetstore._warn import warn_at_caller
from hetstore.planner.plan import Plan
from hetstore.planner.planner import plan_first_batch, refit_activations
from hetstore.planner.trace import Trace
from hetstore.planner.tracer import batch_shapes
from hetstore.tier import Tier

__all__ = ["BatchGuard", "scaled_trace"]


def scaled_trace(trace: Trace, scale: float) -> Trace:
    """``trace`` with every saved-tensor figure times ``scale``."""
    units = tuple(
        replace(
            u,
            saved_bytes=math.ceil(u.saved_bytes * scale),
            kept_bytes=math.ceil(u.kept_bytes * scale),
            largest_saved_bytes=math.ceil(u.largest_saved_bytes * scale),
            largest_node_bytes=math.ceil(u.largest_node_bytes * scale),
            saved_sizes=tuple((math.ceil(n * scale), a, b) for n, a, b in u.saved_sizes),
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
    """Called with each training forward's arguments (see module doc). ``apply(plan)``
    puts a re-made plan into effect; ``plan`` is the one in effect.

    Made without a batch (``auto_offload`` with no ``example_inputs``), the guard plans
    at the first training forward instead: ``trace_batch(args, kwargs)`` traces that
    batch on fake tensors, before any activation exists, and
    :func:`~hetstore.planner.planner.plan_first_batch` places its activations (and moves
    parameters off the device, or optimizer states from host to disk, when they must make
    room)."""

    def __init__(
        self,
        trace: Trace,
        plan: Plan,
        config,
        apply: Callable[[Plan], None],
        *,
        trace_batch: Callable[[tuple, dict], Trace] | None = None,
        move_params: bool = True,
        move_states: bool = False,
    ):
        self.trace = trace
        self.plan = plan
        self.config = config
        self.apply = apply
        self.trace_batch = trace_batch
        self.move_params = move_params  # may the first batch move parameters off the device
        self.move_states = move_states  # ... and optimizer states from host to disk
        self.allowed = 1.0  # the growth over the traced batch the plan in effect covers

    @property
    def waiting_for_first_batch(self) -> bool:
        return not self.trace.batch_shapes and self.trace_batch is not None

    def __call__(self, args, kwargs=None) -> None:
        kwargs = kwargs or {}
        shapes = list(batch_shapes(args, kwargs))
        unseen = self.trace_batch is not None and len(shapes) > len(self.trace.batch_shapes)
        if self.waiting_for_first_batch or unseen:
            # the first batch, or one with tensors the trace never saw (example_inputs
            # without the targets a training forward also takes: the loss's saved
            # tensors were not counted): trace this batch and plan for it
            what = "the first batch" if self.waiting_for_first_batch else "a batch with more inputs"
            try:
                trace = self.trace_batch(args, kwargs)
            except Exception as exc:  # noqa: BLE001 - any failure of the meta run
                self._without_a_trace(exc, what)
                return
            plan = plan_first_batch(
                trace,
                self.plan,
                self.config,
                batch=f"a batch of shapes {shapes}",
                move_params=self.move_params,
                # only before anything trained: states that have stepped, or gradients
                # being accumulated, stay where they are
                move_states=self.move_states and self.waiting_for_first_batch,
            )
            self._put_in_effect(plan, f"{what} (shapes {shapes})", "planned")
            self.trace = trace
            self.allowed = 1.0
            return
        scale = _growth(shapes, self.trace.batch_shapes)
        if scale <= self.allowed:
            return
        batch = (
            f"a batch of shapes {shapes} ({scale:.2f}x the traced {list(self.trace.batch_shapes)})"
        )
        plan = refit_activations(
            scaled_trace(self.trace, scale), self.plan, self.config, batch=batch
        )
        self._put_in_effect(plan, batch, "re-planned")
        self.allowed = scale

    def _without_a_trace(self, exc: Exception, what: str) -> None:
        """The forward cannot run on fake tensors (data-dependent Python control flow,
        such as a branch on a tensor's values): offload every unit's activations
        to host, the placement that needs no figures, and say so. Parameters stay."""
        self.trace_batch = None  # tried once; later batches are not compared
        near = Tier.DEVICE.farther  # host memory
        choices = [replace(u.choice, activations=near) for u in self.plan.units]
        plan = Plan.build(
            self.trace,
            choices,
            self.plan.prefetch_depth,
            self.plan.capacities,
            self.plan.source,
            self.config.optimizer_chunk_size,
        )
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warn_at_caller(
            f"hetstore: auto_offload could not trace {what} on fake tensors "
            f"({type(exc).__name__}: {reason}); every unit's activations go to host memory "
            "instead of a plan made for them. Pass example_inputs (meta tensors of the "
            "batch's shapes) to hetstore.offload() for a plan made for the batch",
            UserWarning,
        )
        self.apply(plan)
        self.plan = plan

    def _put_in_effect(self, plan: Plan, batch: str, verb: str) -> None:
        moved = [
            f"{new.name} {what}: {getattr(old.choice, field).label} -> "
            f"{getattr(new.choice, field).label}"
            for old, new in zip(self.plan.units, plan.units, strict=True)
            for field, what in (
                ("param", "params"),
                ("optimizer", "optimizer states"),
                ("activations", "activations"),
            )
            if getattr(old.choice, field) != getattr(new.choice, field)
        ]
        configured = self.config.activation_min_bytes
        if plan.activation_min_bytes is not None and plan.activation_min_bytes < configured:
            moved.append(
                f"activation_min_bytes: {format_size(configured)} -> "
                f"{format_size(plan.activation_min_bytes)}"
            )
        if moved:
            warn_at_caller(
                f"hetstore: {batch} {verb} the placement ({', '.join(moved)})", UserWarning
            )
        self.apply(plan)
        self.plan = plan
