"""The planner: a pure function from (trace, capacities, config) to a :class:`Plan`.

No device calls: everything it knows is in the :class:`Trace`. The search:

1. Everything on the device fits: nothing is offloaded.
2. Otherwise three fixed orders of moves are made, each by cost per byte (the added step
   time of the move alone over the bytes it frees), cheapest first:
   - *device moves*: a block unit's parameters to host, a unit's activations to host;
   - *optimizer returns*: a unit's optimizer states (with master and gradients) kept on
     the device instead of host, most time saved per device byte first;
   - *spills*: something on host (a unit's optimizer states, parameters, activations)
     to disk instead.
   For each prefetch depth and each prefix ``j`` of the device moves, the plan takes as
   many optimizer returns ``k`` as the device holds -- within ``gpu_margin_mem_ratio``
   of the margin (device capacity minus everything else's peak) unless every unit's
   states fit -- then the fewest spills ``s`` the host needs, and keeps the fastest of
   all ``(depth, j, k, s)`` that fit every tier.

A greedy pass then undoes moves the search took but did not need (``_bring_closer``),
and on a CPU device moves parameters to host memory where that is faster (a host home is
used in place there). Of two plans, one that leaves the host room to spill activations
later is taken unless it is predicted more than ``HEADROOM_COST`` (25%) slower.

The feasible set only grows with capacity, and the search's moves mostly add time, so
more capacity should not predict a slower step; the greedy pass can, rarely: over 40
seeds of random traces x 3 host sizes, 1 ladder of 120 plans 1.5% slower with more device
(``tests/planner/test_planner.py`` checks seeds that once failed). When nothing fits, the error
names each short tier with the least capacity that would do.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from hetstore._sizes import format_size
from hetstore.errors import OutOfDeviceMemory, OutOfTierMemory
from hetstore.footprints import activation_staging_units
from hetstore.planner.cost import UnitChoice, memory, times
from hetstore.planner.plan import Capacities, Plan
from hetstore.planner.trace import Trace
from hetstore.tier import Tier

__all__ = ["make_plan"]

# The ladder walks ``Tier`` in order: a move off the device goes to the nearest tier
# beside it (host memory), a spill from a tier to the next one away (``Tier.farther``).
_NEAR = Tier.DEVICE.farther
_LAST = tuple(Tier)[-1]
_COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}


def _fits(value: int, cap: int | None) -> bool:
    return cap is None or value <= cap


def _fits_every_tier(used: dict[Tier, int], capacities: Capacities) -> bool:
    """``used``: :func:`memory`'s peaks."""
    return all(_fits(used[t], capacities.of(t)) for t in Tier)


# The costs of the placements a search weighs, each computed once while it runs: the
# search asks for the same ones again and again (planning a 7B GPT on the meta device:
# 88,100 asks of 11,024 placements). Keyed by the trace's identity, and held only inside
# ``_remembered`` (a trace is immutable, so a placement's cost in it never changes).
_REMEMBERED: dict[int, tuple[Trace, dict]] = {}


@contextlib.contextmanager
def _remembered(trace: Trace):
    """Within it, :func:`_time` and :func:`_memory` of ``trace`` remember their answers."""
    key = id(trace)
    if key in _REMEMBERED:  # (a nested search of the same trace)
        yield
        return
    _REMEMBERED[key] = (trace, {})
    try:
        yield
    finally:
        del _REMEMBERED[key]


def _recall(trace: Trace, key, compute):
    entry = _REMEMBERED.get(id(trace))
    if entry is None or entry[0] is not trace:
        return compute()
    answers = entry[1]
    if key not in answers:
        answers[key] = compute()
    return answers[key]


def _time(trace, choices, depth) -> float:
    """The predicted step (not the optimizer's part hidden behind compute)."""
    return _recall(
        trace,
        ("time", tuple(choices), depth),
        lambda: sum(times(trace, choices, depth)[:4]) + trace.overhead_s,
    )


def _memory(trace, choices, depth, chunk) -> dict[Tier, int]:
    """:func:`memory`'s peaks, as remembered: not to be changed by the caller."""
    return _recall(
        trace,
        ("memory", tuple(choices), depth, chunk),
        lambda: memory(trace, choices, depth, chunk),
    )


def _order(trace: Trace, base: list[UnitChoice], moves, depth, chunk, tier: Tier, sign=1):
    """Sort ``moves`` (unit index, field, value) by added time per byte freed on
    ``tier``, each measured alone against ``base``."""
    t0 = _time(trace, base, depth)
    m0 = _memory(trace, base, depth, chunk)[tier]
    keyed = []
    for i, field_, value in moves:
        trial = list(base)
        trial[i] = replace(trial[i], **{field_: value})
        freed = sign * (m0 - _memory(trace, trial, depth, chunk)[tier])
        added = sign * (_time(trace, trial, depth) - t0)
        keyed.append((added / freed if freed > 0 else float("inf"), i, field_, value))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [(i, f, v) for _, i, f, v in keyed]


def _apply(choices: list[UnitChoice], moves) -> list[UnitChoice]:
    out = list(choices)
    for i, field_, value in moves:
        out[i] = replace(out[i], **{field_: value})
    return out


def _spill(choices, spills, s):
    """The first ``s`` spills that apply (an item still on the tier next to the one it
    spills to goes there: host memory to disk)."""
    out = list(choices)
    for i, field_, value in spills[:s]:
        if getattr(out[i], field_) == value.closer:
            out[i] = replace(out[i], **{field_: value})
    return out


def _largest_true(predicate, low: int, high: int) -> int:
    """Largest k in [low, high] with predicate(k), assuming true-then-false; low - 1 if none."""
    if not predicate(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if predicate(mid):
            low = mid
        else:
            high = mid - 1
    return low


# activation_min_bytes the planner may lower the configured one to, when that fits where
# the configured one does not, or is predicted faster by more than MIN_BYTES_GAIN (smaller
# storages offloaded leave the device room; each costs a copy and a hook call the cost
# model does not count, so the configured one wins ties)
LOWER_MIN_BYTES = (64 << 10, 4 << 10, 0)
MIN_BYTES_GAIN = 0.02


def _at_each_min_bytes(trace: Trace, config, plan_at) -> Plan:
    """``plan_at(trace)`` with the activations split at the configured
    ``activation_min_bytes`` and at each lower one of ``LOWER_MIN_BYTES``: the fastest
    plan that fits (the plan records the one it was made at); a refusal only when none
    fits, with the figures of the lowest. Before a batch is traced there is nothing to
    split: ``plan_at(trace)``."""
    if not trace.activations_traced:
        with _remembered(trace):
            return plan_at(trace)
    start = config.activation_min_bytes
    best, refusal = None, None
    for min_bytes in [start] + [t for t in LOWER_MIN_BYTES if t < start]:
        split = trace.at_min_bytes(min_bytes)
        try:
            with _remembered(split):
                plan = plan_at(split)
        except OutOfTierMemory as exc:  # (OutOfDeviceMemory too)
            refusal = exc
            continue
        if best is None or _step_s(plan) < _step_s(best) * (1 - MIN_BYTES_GAIN):
            best = plan
    if best is None:
        raise refusal
    return best


def make_plan(trace: Trace, capacities: Capacities, config, *, disk_optimizer: bool = True) -> Plan:
    """The fastest predicted placement within ``capacities``, ``activation_min_bytes``
    included (see :func:`_at_each_min_bytes`)."""
    return _at_each_min_bytes(
        trace, config, lambda t: _make_plan_roomy(t, capacities, config, disk_optimizer)
    )


def _make_plan_roomy(trace: Trace, capacities: Capacities, config, disk_optimizer: bool) -> Plan:
    """The fastest predicted placement within ``capacities`` (see module doc).
    ``disk_optimizer=False``: the optimizer cannot be streamed from disk (not Adam,
    AdamW or SGD), so its states never spill there.

    Where it can, the placement leaves host room for activations to spill later
    (:func:`_spill_headroom`): a first training batch with more tensors than the trace
    saw (``example_inputs`` without the labels), or a larger batch, is re-planned by
    moving activations only, as optimizer states built on host stay there. Without that
    room such a batch is refused (measured: a Llama planned at 100% of its states on
    host was 1.75 MiB short at its first batch once the host peak was predicted
    within 10%)."""
    headroom = _spill_headroom(trace, config)
    near = capacities.of(_NEAR)
    roomy_fits = bool(headroom) and near is not None and near > headroom
    full = _make_plan(
        trace, capacities, config, disk_optimizer, keep_host=headroom if roomy_fits else 0
    )
    if roomy_fits:
        try:
            roomy = _make_plan(trace, capacities.less(_NEAR, headroom), config, disk_optimizer)
        except OutOfTierMemory:  # (and OutOfDeviceMemory): then without the room
            pass
        else:
            if _step_s(roomy) <= _step_s(full) * (1 + HEADROOM_COST):
                return replace(roomy, capacities=capacities)  # (the estimate is the same)
    return full


# how much slower a plan that leaves the host room to spill activations later may be
# predicted than the fastest, and still be chosen. That room is what lets a batch larger
# than the traced one (a longer sequence, hours into training) be re-planned instead of
# refused, so it is worth a good deal; but a plan 43% slower had been chosen for it, with
# more device than a faster plan needed. Over 40 seeds of random traces, 25% keeps the
# room in all but 5 of 960 plans where it was kept before (2% and 10%: all but 15)
HEADROOM_COST = 0.25


def _step_s(plan: Plan) -> float:
    return plan.estimate.step_s if plan.estimate is not None else 0.0


def spill_headroom(trace: Trace, config) -> int:
    """The host bytes a plan keeps free so that any unit's activations can go to disk later."""
    return _spill_headroom(trace, config)


def _spill_headroom(trace: Trace, config) -> int:
    """Host bytes that let any unit's activations go to disk later: the disk staging
    window of the largest unit's."""
    largest = max((u.saved_bytes for u in trace.units), default=0)
    return activation_staging_units(config.prefetch_depth) * largest


def _make_plan(
    trace: Trace, capacities: Capacities, config, disk_optimizer: bool, keep_host: int = 0
) -> Plan:
    chunk = config.optimizer_chunk_size
    n = len(trace.units)
    everything = [UnitChoice()] * n
    if _fits_every_tier(_memory(trace, everything, config.prefetch_depth, chunk), capacities):
        return Plan.build(trace, everything, config.prefetch_depth, capacities, "auto", chunk)

    trainable = [i for i, u in enumerate(trace.units) if u.trainable_numel]
    device_cap = capacities.of(Tier.DEVICE)
    best: tuple[float, list[UnitChoice], int] | None = None
    for depth in sorted({0, 1, 2, config.prefetch_depth}):
        host_opt = [
            replace(c, optimizer=_NEAR) if i in trainable else c for i, c in enumerate(everything)
        ]
        device_moves = _order(
            trace,
            host_opt,
            [(i, "param", _NEAR) for i, u in enumerate(trace.units) if not u.is_root]
            + [(i, "activations", _NEAR) for i, u in enumerate(trace.units) if u.saved_bytes],
            depth,
            chunk,
            Tier.DEVICE,
        )
        for j in range(len(device_moves) + 1):
            base = _apply(host_opt, device_moves[:j])
            device_base = _memory(trace, base, depth, chunk)[Tier.DEVICE]
            if not _fits(device_base, device_cap):
                continue
            # optimizer states back on the device, most time saved per byte first
            returns = _order(
                trace,
                base,
                [(i, "optimizer", Tier.DEVICE) for i in trainable],
                depth,
                chunk,
                Tier.DEVICE,
                -1,
            )
            candidates = []
            all_back = _apply(base, returns)
            if _fits(_memory(trace, all_back, depth, chunk)[Tier.DEVICE], device_cap):
                candidates.append(all_back)
            else:
                margin = (device_cap - device_base) * config.gpu_margin_mem_ratio

                def within(
                    k,
                    base=base,
                    returns=returns,
                    device_base=device_base,
                    margin=margin,
                    depth=depth,
                ):
                    used = _memory(trace, _apply(base, returns[:k]), depth, chunk)[Tier.DEVICE]
                    return used - device_base <= margin

                k = _largest_true(within, 0, len(returns))
                candidates.append(_apply(base, returns[: max(k, 0)]))
            for choices in candidates:
                plan = _fit_beyond(trace, choices, depth, chunk, capacities, disk_optimizer)
                if plan is None:
                    continue
                t = _time(trace, plan, depth)
                if best is None or t < best[0] - 1e-12:
                    best = (t, plan, depth)
    if best is None:
        raise _refusal(trace, capacities, config, disk_optimizer)
    choices = _bring_closer(trace, best[1], best[2], chunk, capacities, config.gpu_margin_mem_ratio)
    choices = _params_to_host(trace, choices, best[2], chunk, capacities, keep_host)
    return Plan.build(trace, choices, best[2], capacities, "auto", chunk)


def _within_margin(trace, choices, depth, chunk, capacities, ratio) -> bool:
    """Optimizer states kept on the device stay within ``ratio`` of the margin (device
    capacity minus everything else's peak), unless every unit's states are there."""
    kept = [
        i
        for i, c in enumerate(choices)
        if c.optimizer == Tier.DEVICE and trace.units[i].trainable_numel
    ]
    trainable = [i for i, u in enumerate(trace.units) if u.trainable_numel]
    cap = capacities.of(Tier.DEVICE)
    if cap is None or not kept or len(kept) == len(trainable):
        return True
    without = [replace(c, optimizer=_NEAR) if i in kept else c for i, c in enumerate(choices)]
    rest = _memory(trace, without, depth, chunk)[Tier.DEVICE]
    used = _memory(trace, choices, depth, chunk)[Tier.DEVICE]
    return used - rest <= (cap - rest) * ratio


def _bring_closer(trace, choices, depth, chunk, capacities, ratio) -> list[UnitChoice]:
    """Undo moves the search made but did not need: the move orders are fixed, so a
    prefix that frees enough may also carry moves that buy nothing (a cheap parameter
    move taken along with the activation moves that were the point). Each piece is
    tried one tier closer to the device (disk to host, host to device; optimizer states
    only disk to host, the device's share being ``gpu_margin_mem_ratio``'s); the change is
    kept when every tier still fits and the predicted step is no slower. Only lowers
    the predicted time, and leaves less offloaded at equal time."""
    current = list(choices)
    t_current = _time(trace, current, depth)
    for _ in range(2):  # a second pass catches what the first one's changes made room for
        changed = False
        for i in reversed(range(len(current))):
            for field_ in ("param", "activations", "optimizer"):
                closer = getattr(current[i], field_).closer
                if closer is None or (field_ == "param" and trace.units[i].is_root):
                    continue
                if field_ == "optimizer" and closer == Tier.DEVICE:
                    continue  # the device margin's share is gpu_margin_mem_ratio's to set
                trial = list(current)
                trial[i] = replace(trial[i], **{field_: closer})
                if not _fits_every_tier(
                    _memory(trace, trial, depth, chunk), capacities
                ) or not _within_margin(trace, trial, depth, chunk, capacities, ratio):
                    continue
                t_trial = _time(trace, trial, depth)
                if t_trial <= t_current + 1e-12:
                    current, t_current, changed = trial, t_trial, True
        if not changed:
            break
    return current


def _params_to_host(trace, choices, depth, chunk, capacities, keep_host) -> list[UnitChoice]:
    """On a CPU device, each unit's parameters from the device to host memory where that
    is faster: a host home is used in place there and the step writes no copy back, so
    the search, whose moves are taken as adding time, can leave on the device what a
    smaller device would have moved, and been faster for. A move leaves ``keep_host``
    bytes of the host free (the room to spill activations later) unless it gains more
    than ``HEADROOM_COST``."""
    m = trace.machine
    if m is None or m.device != "cpu":
        return choices
    current = list(choices)
    t_current = _time(trace, current, depth)
    for i in reversed(range(len(current))):
        if current[i].param != Tier.DEVICE or trace.units[i].is_root:
            continue
        trial = list(current)
        trial[i] = replace(trial[i], param=_NEAR)
        t_trial = _time(trace, trial, depth)
        if not t_trial < t_current - 1e-12:
            continue
        room = capacities
        near = capacities.of(_NEAR)
        if keep_host and near is not None and t_trial > t_current * (1 - HEADROOM_COST):
            room = capacities.less(_NEAR, keep_host)
        if _fits_every_tier(_memory(trace, trial, depth, chunk), room):
            current, t_current = trial, t_trial
    return current


def _fit_beyond(
    trace, choices, depth, chunk, capacities, disk_optimizer=True, tier: Tier = _NEAR
) -> list[UnitChoice] | None:
    """From ``tier`` (host memory) outward, one tier at a time: the fewest spills from it
    to the next tier away that make it fit, then the same from that one, until the last
    tier, which must fit as it is; None if one cannot. ``disk_optimizer=False``: optimizer
    states never spill to a tier that is not addressable (they are not streamed)."""
    farther = tier.farther
    if farther is None:
        return (
            choices
            if _fits(_memory(trace, choices, depth, chunk)[tier], capacities.of(tier))
            else None
        )
    spills = _order(
        trace,
        choices,
        [
            (i, field_, farther)
            for i, c in enumerate(choices)
            for field_ in ("optimizer", "param", "activations")
            if getattr(c, field_) == tier
            and (disk_optimizer or field_ != "optimizer" or farther.addressable)
        ],
        depth,
        chunk,
        tier,
    )

    def short(s: int) -> bool:
        used = _memory(trace, _spill(choices, spills, s), depth, chunk)[tier]
        return not _fits(used, capacities.of(tier))

    # use falls as spills grow: find the first s where it fits
    last_short = _largest_true(short, 0, len(spills))
    s = last_short + 1
    if s > len(spills):
        return None
    return _fit_beyond(
        trace, _spill(choices, spills, s), depth, chunk, capacities, disk_optimizer, farther
    )


def _refusal(trace: Trace, capacities: Capacities, config, disk_optimizer=True) -> OutOfTierMemory:
    """Name every tier that is short, with the least capacity that would fit."""
    chunk = config.optimizer_chunk_size
    lean = [
        UnitChoice(
            param=Tier.DEVICE if u.is_root else _NEAR,
            optimizer=_NEAR,
            activations=_NEAR,
        )
        for u in trace.units
    ]
    # the farthest tier optimizer states may go to (not streamed: the last in memory)
    states_last = _LAST if disk_optimizer else [t for t in Tier if t.addressable][-1]
    on_last = [
        UnitChoice(
            param=Tier.DEVICE if u.is_root else _LAST,
            optimizer=states_last,
            activations=_LAST,
        )
        for u in trace.units
    ]
    # the device: at the leanest plan; the others: with everything as far as it goes
    needs = {Tier.DEVICE: _memory(trace, lean, 0, chunk)[Tier.DEVICE]}
    far = _memory(trace, on_last, 0, chunk)
    needs.update((tier, far[tier]) for tier in Tier if tier is not Tier.DEVICE)
    # the last: what spills there when the tiers before it hold all they may, at the
    # leanest device plan
    between = [t for t in Tier if t not in (Tier.DEVICE, _LAST)]
    if any(capacities.of(t) is not None for t in between):
        held = Capacities(**{t.label: capacities.of(t) for t in between})
        plan = _fit_beyond(trace, lean, 0, chunk, held, disk_optimizer)
        if plan is not None:
            needs[_LAST] = _memory(trace, plan, 0, chunk)[_LAST]
    lines = []
    short = []
    for tier, need in needs.items():
        cap = capacities.of(tier)
        if cap is not None and need > cap:
            short.append(tier)
            ratio, key = tier.share_key, tier.capacity_key
            path = tier.path_key
            if path is not None and getattr(config, key, None) is None:
                # the machine's free space, not a key to raise (see floor.check_manual_floor)
                lines.append(
                    f"  {tier.label}: needs at least {format_size(need)}, only "
                    f"{format_size(cap)} is free at {path} {getattr(config, path)!r} ({key} is "
                    f"not set); free space there, or point {path} at a disk with at least "
                    f"{format_size(need)} free"
                )
                continue
            share = f" x {ratio} {getattr(config, ratio)}" if ratio else ""
            lines.append(
                f"  {tier.label}: needs at least {format_size(need)}, may use {format_size(cap)} "
                f"({key}{share}); raise {key}" + (f" or {ratio}" if ratio else "")
            )
    if not short:  # each tier alone would do; together they do not
        short = [_NEAR]
        keys = " or ".join(t.capacity_key for t in Tier if t is not Tier.DEVICE)
        lines.append(
            "  no single tier is short, but no placement fits all "
            f"{_COUNTS.get(len(Tier), len(Tier))} at once; raise {keys}"
        )
    message = (
        f"hetstore cannot place this model (model states {format_size(trace.state_bytes)}) "
        "within the capacities, even offloading everything it can:\n" + "\n".join(lines)
    )
    tier = short[0]
    cls = OutOfDeviceMemory if tier is Tier.DEVICE else OutOfTierMemory
    return cls(message, tier=tier.label, requested=needs[tier], capacity=capacities.of(tier))


def refit_activations(trace: Trace, plan: Plan, config, *, batch: str = "this batch") -> Plan:
    """At each ``activation_min_bytes`` the planner may use (:func:`_at_each_min_bytes`):
    ``plan`` for a trace whose activations grew (a larger batch): parameters and
    optimizer states stay where they were built; activations kept on the device move to
    host, cheapest per byte first, until the device fits, then from host to disk until
    the host does. Raises ``OutOfDeviceMemory`` / ``OutOfTierMemory`` with the figures
    when even that cannot fit."""
    return _at_each_min_bytes(
        trace,
        config,
        lambda t: _fit_moving(
            t,
            plan,
            _activations_off_the_device(t, plan),
            config,
            batch=batch,
            offloaded=f"every unit's activations "
            f"({format_size(sum(u.saved_bytes for u in t.units))} saved for backward)",
            advice="Lower the batch size, or pass the largest batch as example_inputs to "
            "hetstore.offload() so the plan is made for it",
        ),
    )


def plan_first_batch(
    trace: Trace,
    plan: Plan,
    config,
    *,
    batch: str = "the first batch",
    move_params: bool = True,
    move_states: bool = True,
) -> Plan:
    """The plan made at ``offload()`` without a batch (model states only) completed for
    the first batch's activations (``trace`` has them): activations kept on the device
    and, with ``move_params``, parameters kept there (not the root's) move to host,
    least added time per byte freed first, until the device fits; then from host to disk
    until the host does: activations, the parameters just moved and, with
    ``move_states``, optimizer states built on host (with their master and gradients;
    nothing has stepped yet, so they move once, before training). Raises
    ``OutOfDeviceMemory`` / ``OutOfTierMemory`` naming the capacity that would fit,
    before the batch's forward allocates anything. At each ``activation_min_bytes`` the
    planner may use (:func:`_at_each_min_bytes`)."""
    return _at_each_min_bytes(
        trace,
        config,
        lambda t: _first_batch_at(t, plan, config, batch, move_params, move_states),
    )


def _first_batch_at(trace, plan, config, batch, move_params, move_states) -> Plan:
    moves = _activations_off_the_device(trace, plan)
    if move_params:
        moves += [
            (i, "param", _NEAR)
            for i, (u, p) in enumerate(zip(trace.units, plan.units, strict=True))
            if p.choice.param == Tier.DEVICE and not u.is_root
        ]
    return _fit_moving(
        trace,
        plan,
        moves,
        config,
        batch=batch,
        offloaded="every unit's activations and every block's parameters",
        advice="Lower the batch size or raise max_device_memory",
        spill_states=move_states,
        spill_advice=(
            ""
            if move_states
            else ", or pass example_inputs to hetstore.offload() so the optimizer "
            "states are placed knowing the activations (on disk if need be)"
        ),
    )


def _holes_slack(trace: Trace, before: list[UnitChoice], after: list[UnitChoice]) -> int:
    """Host room kept free when optimizer states leave host memory in a running model:
    the buffers they free are holes between buffers still in use, each smaller than
    some requests that follow, so the host pool cannot place every byte the account
    allows. One of the largest saved tensors is kept free for that (measured: a plan at
    99% of the host's capacity failed its second forward 140 KiB short of a 256 KiB
    activation in a fragmented pool; the same plan fit at 105%)."""
    moved = any(
        b.optimizer == _NEAR and a.optimizer != _NEAR for b, a in zip(before, after, strict=True)
    )
    return max((u.largest_saved_bytes for u in trace.units), default=0) if moved else 0


def _activations_off_the_device(trace: Trace, plan: Plan) -> list:
    """Moves to host of every unit's activations kept on the device (and saved at all)."""
    return [
        (i, "activations", _NEAR)
        for i, (u, p) in enumerate(zip(trace.units, plan.units, strict=True))
        if p.choice.activations == Tier.DEVICE and u.saved_bytes
    ]


def _fit_moving(
    trace: Trace,
    plan: Plan,
    moves,
    config,
    *,
    batch,
    offloaded,
    advice,
    spill_states=False,
    spill_advice="",
) -> Plan:
    """``plan`` with the shortest prefix of ``moves`` (each to host; ordered by added time
    per device byte freed) that fits the device, then the moved items spilled from host to
    disk, cheapest first, until host and disk fit; with ``spill_states``, optimizer states
    on host may spill too. ``advice`` ends the device refusal, ``spill_advice`` the host
    or disk one."""
    chunk = config.optimizer_chunk_size
    depth = plan.prefetch_depth
    capacities = plan.capacities
    choices = [u.choice for u in plan.units]
    moves = _order(trace, choices, moves, depth, chunk, Tier.DEVICE)
    device_cap = capacities.of(Tier.DEVICE)

    def device_fits(j: int) -> bool:
        used = _memory(trace, _apply(choices, moves[:j]), depth, chunk)[Tier.DEVICE]
        return _fits(used, device_cap)

    first_fit = next((j for j in range(len(moves) + 1) if device_fits(j)), None)
    if first_fit is None:
        need = _memory(trace, _apply(choices, moves), depth, chunk)[Tier.DEVICE]
        raise OutOfDeviceMemory(
            f"{batch} needs more device memory than the plan allows: with {offloaded} "
            f"offloaded the device would hold {format_size(need)} ({need} bytes), and it "
            f"may use {format_size(device_cap)} (max_device_memory). {advice}",
            tier="device",
            requested=need,
            capacity=device_cap,
        )
    grown = _apply(choices, moves[:first_fit])
    # any activations on host may spill; parameters only if moved here (a home built on
    # host stays there)
    moved_params = {i for i, f, _ in moves[:first_fit] if f == "param"}
    beyond = _NEAR.farther
    spills = _order(
        trace,
        grown,
        [(i, "activations", beyond) for i, c in enumerate(grown) if c.activations == _NEAR]
        + [(i, "param", beyond) for i in sorted(moved_params)]
        + [
            (i, "optimizer", beyond)
            for i, c in enumerate(grown)
            if spill_states and c.optimizer == _NEAR and trace.units[i].state_bytes
        ],
        depth,
        chunk,
        _NEAR,
    )
    for s in range(len(spills) + 1):
        candidate = _spill(grown, spills, s)
        used = dict(_memory(trace, candidate, depth, chunk))
        used[_NEAR] += _holes_slack(trace, choices, candidate)
        short = [t for t in Tier if t is not Tier.DEVICE and not _fits(used[t], capacities.of(t))]
        if not short:
            return Plan.build(trace, candidate, depth, capacities, plan.source, chunk)
    tier = short[0]
    need = used[tier]
    raise OutOfTierMemory(
        f"{batch}: its activations do not fit the {tier.label} tier: it would hold "
        f"{format_size(need)} and may use {format_size(capacities.of(tier))} "
        f"({tier.capacity_key}). Lower the batch size or raise {tier.capacity_key}"
        f"{spill_advice}",
        tier=tier.label,
        requested=need,
        capacity=capacities.of(tier),
    )
