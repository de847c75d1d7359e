"""A placement plan: one :class:`UnitChoice` per unit, a prefetch depth, and what the
cost model predicts for it. Manual settings are a plan too (:meth:`Plan.uniform`), so
``hetstore.offload`` builds every model the same way from one."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hetstore._sizes import format_duration, format_size
from hetstore.planner.cost import Estimate, UnitChoice, consumed, estimate, optimizer_bytes
from hetstore.planner.trace import Trace, saved_fields
from hetstore.tier import TIER_LABELS, Tier, by_label

__all__ = ["Capacities", "Plan", "UnitPlan", "confidence", "spread_line"]


# how far to trust a prediction, by where its compute time came from (Estimate.basis);
# the bounds are what benchmarks/planner.py measured (docs/dev/BENCHMARKS.md)
_STEP_CONFIDENCE = {
    "measured": "within about 5%: compute measured in the profiled steps",
    "probed": "within about 20%: one block of each kind ran for real at the batch's shapes",
    "partly probed": "within about 30%: some blocks ran for real, the others from FLOPs",
    "flops": "to about 40%, usually short: compute from counted FLOPs at a matmul's rate",
}


# a probe whose median run took this much longer than its fastest was disturbed (on the
# idle 2-core machine the cold-cache copies' medians ran up to 36% over their fastest),
# and other processes taking this share of the CPU while probing slow what was probed
_BUSY_SPREAD = 0.5
_BUSY_OTHERS = 0.25


def spread_line(e: Estimate) -> str:
    """One line on how steady the probes behind ``e`` were (empty when none was run
    here): each probe's rate is its fastest run's; a wide spread, or other processes
    busy on the CPU while probing, says the machine was busy, so steps now will likely
    take longer than predicted (many times longer on a small machine: the fastest run of
    a probe slowed all along is slow too, and so is the prediction made from it)."""
    if not e.probe_spread:
        return ""
    worst_name, worst = max(e.probe_spread, key=lambda p: p[1])
    line = "probes: the fastest run of each counts; the median run took longer by " + ", ".join(
        f"{name} +{value:.0%}" for name, value in e.probe_spread
    )
    others = e.others_busy
    if others is not None:
        line += f"; other processes used {others:.0%} of the CPU meanwhile"
    busy_others = (others or 0) > _BUSY_OTHERS
    if worst > _BUSY_SPREAD or busy_others:
        why = f"other processes on {others:.0%} of the CPU" if busy_others else worst_name
        line += (
            f" -- the machine was busy while probing ({why}): the prediction may be off "
            "by several times, either way, until it is as busy while training as it was "
            "while probing"
        )
    return line


def confidence(e: Estimate) -> str:
    """One line: how far to trust the step time and the peaks of ``e``."""
    step = _STEP_CONFIDENCE.get(e.basis, e.basis)
    return (
        f"confidence: step time {step}; peaks within about 10% (model states and staging "
        "as the tiers allocate them, activations as traced for this batch; none before a "
        "batch is traced)"
    )


@dataclass(frozen=True, init=False)
class Capacities:
    """What the planner may fill, in bytes per tier (None: no limit): the tiers'
    capacities times their shares (``hbm_ratio`` / ``cpu_ratio``). ``limits`` is keyed by
    ``Tier``; read one with :meth:`of`."""

    limits: dict[Tier, int | None]

    def __init__(self, *nearest_first: int | None, **by_label: int | None):
        """One limit per tier, the device's first, in ``Tier``'s order
        (``Capacities(device, host, disk)``), or by report name (``Capacities(host=...)``);
        a tier not given has no limit."""
        if len(nearest_first) > len(Tier):
            raise TypeError(f"Capacities takes at most {len(Tier)} limits, one per tier")
        limits: dict[Tier, int | None] = dict.fromkeys(Tier)
        limits.update(zip(Tier, nearest_first, strict=False))  # (the rest: no limit)
        for label, value in by_label.items():
            limits[Tier.from_label(label)] = value
        object.__setattr__(self, "limits", limits)

    def of(self, tier: Tier | str) -> int | None:
        """The capacity of ``tier`` (a ``Tier`` or its report name)."""
        return self.limits[Tier.from_label(tier)]

    def __getattr__(self, name: str) -> int | None:
        # a tier's report name reads its limit (``c.device``, ``c.host``, ``c.disk``), as
        # when each was a field
        return by_label(self, self.__dict__.get("limits"), name)

    def __hash__(self) -> int:  # (frozen, like the three fields it had: usable as a key)
        return hash(tuple(self.limits.items()))

    def less(self, tier: Tier, nbytes: int) -> Capacities:
        """These capacities with ``nbytes`` less of ``tier`` (which has a limit)."""
        return self.with_limit(tier, self.of(tier) - nbytes)

    def with_limit(self, tier: Tier, limit: int | None) -> Capacities:
        """These capacities with ``tier``'s set to ``limit``."""
        return Capacities(**{t.label: limit if t is tier else v for t, v in self.limits.items()})

    def by_label(self) -> dict[str, int | None]:
        """The limits keyed by report name, nearest the device first (the plan's JSON)."""
        return {tier.label: self.limits[tier] for tier in Tier}

    @classmethod
    def from_config(cls, config, available: dict[Tier, int | None] | None = None) -> Capacities:
        """The planner's limits: each tier's configured capacity (``Tier.capacity_key``),
        else what the machine has of it (``available``, given by the caller; no limit
        where it says nothing), times its share (``Tier.share_key``)."""
        available = available or {}
        limits = {}
        for tier in Tier:
            configured = getattr(config, tier.capacity_key)
            limit = configured if configured is not None else available.get(tier)
            if limit is not None and tier.share_key is not None:
                limit = int(limit * getattr(config, tier.share_key))
            limits[tier.label] = limit
        return cls(**limits)


@dataclass(frozen=True)
class UnitPlan:
    name: str
    choice: UnitChoice
    param_bytes: int
    optimizer_bytes: int  # fp32 master + gradients + optimizer states
    saved_bytes: int


@dataclass(frozen=True)
class Plan:
    units: tuple[UnitPlan, ...]
    prefetch_depth: int
    estimate: Estimate | None  # None for a manual plan made without machine rates
    capacities: Capacities
    source: str  # "auto" (the planner) or "manual" (the offload_* keys)
    # the activation_min_bytes it was made at (the planner may lower the configured one);
    # None: made before a batch was traced, the configured one holds
    activation_min_bytes: int | None = None

    @classmethod
    def build(
        cls,
        trace: Trace,
        choices: list[UnitChoice],
        depth: int,
        capacities: Capacities,
        source: str,
        chunk_bytes: int = 32 << 20,
    ) -> Plan:
        units = tuple(
            UnitPlan(
                u.name,
                c,
                u.param_bytes,
                optimizer_bytes(u, c, consumed(trace, u, c)),
                u.saved_bytes,
            )
            for u, c in zip(trace.units, choices, strict=True)
        )
        predicted = estimate(trace, choices, depth, chunk_bytes) if trace.machine else None
        min_bytes = trace.activation_min_bytes if trace.activations_traced else None
        return cls(units, depth, predicted, capacities, source, min_bytes)

    @classmethod
    def uniform(
        cls, trace: Trace, choice: UnitChoice, depth: int, capacities: Capacities, **kw
    ) -> Plan:
        """The manual plan: the same choice for every unit."""
        return cls.build(trace, [choice] * len(trace.units), depth, capacities, "manual", **kw)

    def reestimated(self, trace: Trace, chunk_bytes: int = 32 << 20) -> Plan:
        """The same placement, its prediction re-made from ``trace`` (e.g. calibrated
        with measured steps, see :mod:`hetstore.planner.calibrate`)."""
        choices = [u.choice for u in self.units]
        predicted = estimate(trace, choices, self.prefetch_depth, chunk_bytes)
        return replace(self, estimate=predicted if trace.machine else None)

    def choice_of(self, name: str) -> UnitChoice:
        for unit in self.units:
            if unit.name == name:
                return unit.choice
        raise KeyError(f"the plan has no unit {name!r}; it has {[u.name for u in self.units]}")

    @property
    def offloads_anything(self) -> bool:
        return any(u.choice != UnitChoice() for u in self.units)

    # ------------------------------------------------------------------ display
    def table(self) -> str:
        """The plan as text: per unit, per tier, and the predicted step time."""
        rows = [("unit", "params", "where", "optimizer", "where", "activations", "where")]
        for u in self.units:
            c = u.choice
            rows.append(
                (
                    u.name,
                    format_size(u.param_bytes),
                    c.param.label,
                    format_size(u.optimizer_bytes),
                    c.optimizer.label,
                    format_size(u.saved_bytes),
                    c.activations.label,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        e = self.estimate
        if e is None:
            lines.append(
                f"(manual placement, prefetch_depth={self.prefetch_depth}; "
                "hetstore.plan() predicts peaks and step time)"
            )
            return "\n".join(lines)
        lines.append("")
        lines.append(f"{'tier':<7} {'predicted peak':>15} {'may use':>12}")
        for tier in TIER_LABELS:
            cap = self.capacities.of(tier)
            limit = "no limit" if cap is None else format_size(cap)
            lines.append(f"{tier:<7} {format_size(e.peak(tier)):>15} {limit:>12}")
        lines.append("")
        lines.append(
            f"predicted step {format_duration(e.step_s)} = compute "
            f"{format_duration(e.compute_s)} + stalled copies {format_duration(e.stall_s)}"
            f" + unhidden transfers {format_duration(e.exposed_s)} + optimizer "
            f"{format_duration(e.optimizer_s)} + overhead {format_duration(e.overhead_s)}"
            f"  (prefetch_depth={self.prefetch_depth}, {self.source} plan)"
        )
        lines.append(confidence(e))
        if spread_line(e):
            lines.append(spread_line(e))
        if self.activation_min_bytes is not None:
            lines.append(
                f"tensors saved for backward of at least "
                f"{format_size(self.activation_min_bytes)} follow their unit's activations "
                f"placement (activation_min_bytes); smaller ones stay on the device"
            )
        if e.optimizer_hidden_s > 0:
            lines.append(
                f"stepping units beside backward (overlap_step) or the next forward "
                f"(step_in_forward) hides "
                f"{format_duration(e.optimizer_hidden_s)} of the optimizer step; without it the "
                f"step would take {format_duration(e.step_without_overlap_s)}"
            )
        elif e.optimizer_hidden_s < 0:
            lines.append(
                f"stepping units beside the next forward (step_in_forward) costs "
                f"{format_duration(-e.optimizer_hidden_s)} here: on a CPU device the worker "
                "shares the forward's cores; "
                f"without it the step would take {format_duration(e.step_without_overlap_s)}"
            )
        if e.clip_bites_s is not None:
            after, in_forward = e.clip_bites_s
            if in_forward >= after * 0.99:  # step_in_forward is on, or would not pay
                lines.append(
                    "a gradient clip that bites (often every step early in training) rolls "
                    f"back the steps taken in backward: predicted step {format_duration(after)}"
                )
            else:
                lines.append(
                    "a gradient clip that bites (often every step early in training) rolls "
                    "back the steps taken in backward and leaves them after it: predicted "
                    f"step {format_duration(after)}; with step_in_forward=True they finish "
                    f"during the next forward: {format_duration(in_forward)}"
                )
        if e.host_read_ahead:
            lines.append(
                "when a clip bites, the first units' masters and states are read during "
                f"backward for their steps: up to {format_size(e.host_read_ahead)} of host "
                "memory beside the peak above, where the host has room"
            )
        if e.disk_shadows:
            lines.append(
                f"steps taken ahead keep their disk shadows until optimizer.step(): up to "
                f"{format_size(e.disk_shadows)} of disk beside the peak above, where the "
                "disk has room"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        data = asdict(self)
        if self.estimate is not None:  # the peaks by report name, as the capacities
            del data["estimate"]["peaks"]
            data["estimate"] = {
                **{tier.label: self.estimate.peak(tier) for tier in Tier},
                **data["estimate"],
            }
        data["capacities"] = self.capacities.by_label()
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        units = tuple(UnitPlan(**{**u, "choice": UnitChoice(**u["choice"])}) for u in data["units"])
        predicted = data["estimate"]
        if predicted and predicted.get("clip_bites_s") is not None:  # (JSON has no tuples)
            predicted["clip_bites_s"] = tuple(predicted["clip_bites_s"])
        if predicted:
            predicted["probe_spread"] = tuple(tuple(p) for p in predicted.get("probe_spread", ()))
            predicted["peaks"] = {tier: predicted.pop(tier.label) for tier in Tier}
            # (a plan saved by an older version may name a figure no longer kept: the host
            # shadows and lent masters, until 2026-11-28)
            predicted = saved_fields(Estimate, predicted)
        return cls(
            units,
            data["prefetch_depth"],
            Estimate(**predicted) if predicted else None,
            Capacities(**data["capacities"]),
            data["source"],
            data.get("activation_min_bytes"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())
