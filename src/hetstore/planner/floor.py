"""The least memory a manual placement will hold in each tier, known before any batch.

A manual placement (``auto_offload=False``, the ``offload_*`` keys) is not searched by
the planner, so nothing used to compare it with the capacities before training: buffers
the runtime makes lazily (the disk paths' host staging, the optimizer step's chunk
buffers and its shadow on disk) then ran out mid-run, in backward or at the first or a
later ``optimizer.step()``. :func:`check_manual_floor` refuses such a configuration at
``offload()``, before anything is built.

The figures here are *floors*, not predictions: each part is a buffer the runtime
certainly holds at the same moment as the others (activations are left out, no batch
is known yet), sized no larger than the runtime sizes it (no alignment padding, the
step's chunk no longer than the unit's largest trainable parameter). A configuration
refused here would fail; one that passes may still run short by its activations, which
the tiers' own errors then name. That is why this is a hard refusal while the cost
model's prediction (within 10%, but on either side) is not used as one.

Parts per tier, at the moment of the optimizer step of the largest disk unit (or, on
the device, while the largest offloaded block runs):

- device: parameters kept on the device (``offload_param='none'``); the master,
  gradients and states of device-optimizer units; else the root unit's working copy
  (held for the whole step) and the largest block's.
- host: parameters homed on host (unless they are the host master); master, states
  and gradients kept on host; the parameter stager's slots of the largest disk home
  (``prefetch_depth + 1`` when the root unit is on disk: its read while the first
  blocks are prefetched; else one); the gradient stager's (3 of the largest disk
  gradient, at most one per unit; one with ``step_in_backward``); one unit's streamed
  step (up to 3 buffer sets of a chunk, ``optimizer_chunk_size``).
- disk: everything homed there, and one step's shadow of the largest disk unit's master
  and states (the step is all-or-nothing: it writes beside the old values).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetstore._sizes import format_size
from hetstore.errors import OutOfDeviceMemory, OutOfTierMemory
from hetstore.footprints import GRAD_STAGING_SLOTS, STREAMED_STEP_SLOT_SETS
from hetstore.optim.registry import flat_spec, flat_steppable
from hetstore.planner.cost import UnitChoice, aliases_master, consumed, master_bytes, paged
from hetstore.planner.trace import Trace
from hetstore.tier import Tier
from hetstore.tiers.flat import BYTE_ALIGN_ELEMENTS

__all__ = ["Floor", "manual_floor", "floor_of_config", "check_manual_floor"]

# the parts a setting other than a tier shrinks (named once: the advice matches on them)
PARAM_STAGING = "parameter staging"
STEP_CHUNKS = "the optimizer step's chunk buffers"
STEP_SHADOW = "the optimizer step's shadow"


@dataclass(frozen=True)
class Floor:
    """Per tier, the parts (what, bytes) held at once; ``total(tier)`` their sum."""

    parts: dict[Tier, list[tuple[str, int]]]

    def total(self, tier: Tier) -> int:
        return sum(n for _, n in self.parts.get(tier, []))


def manual_floor(
    trace: Trace,
    *,
    param: Tier,
    optimizer: Tier,
    grad: Tier,
    depth: int,
    chunk_bytes: int,
    stepped: bool,
    states: bool,
) -> Floor:
    """The floor of the same placement for every unit (see module doc). ``stepped``: an
    optimizer will step the units (their gradients exist); ``states``: its states are
    made at ``offload()`` in the optimizer's tier (the flat families)."""
    choice = UnitChoice(param, optimizer)
    parts: dict[Tier, dict[str, int]] = {t: {} for t in Tier}

    def add(tier: Tier, what: str, nbytes: int) -> None:
        if nbytes > 0:
            parts[tier][what] = parts[tier].get(what, 0) + nbytes

    def stored(tier: Tier, nbytes: int) -> int:
        """Host buffers and disk regions are whole pages; the device counts bytes."""
        return nbytes if tier is Tier.DEVICE else paged(nbytes)

    disk_grads, steps, shadows, blocks = [], [], [], []
    root_params = 0
    root_on_disk = False
    largest_home = 0
    # the step's chunk: optimizer_chunk_size rounded down to a layout alignment (the
    # runtime rounds to its own, 2048 or 4096 elements; the larger one is the lower bound)
    chunk = chunk_bytes // 4
    chunk = chunk // BYTE_ALIGN_ELEMENTS * BYTE_ALIGN_ELEMENTS or chunk
    for u in trace.units:
        aliased = aliases_master(u, choice)
        trainable = stepped and u.trainable_numel > 0
        is_consumed = trainable and consumed(trace, u, choice)
        # the master: always made when it is the home, else for what an optimizer steps
        # (without one, parameters already in the compute dtype have none)
        if aliased or stepped:
            add(optimizer, "master weights", stored(optimizer, master_bytes(u, choice)))
        if trainable and states:  # (unpaged: a compact format's arrays are uneven)
            add(optimizer, "optimizer states", u.state_bytes)
        if trainable and not is_consumed:
            add(grad, "gradients", stored(grad, u.grad_bytes))
        if trainable and not grad.addressable:  # (staged: disk)
            disk_grads.append(u.grad_bytes)
        # the parameters between uses, and their working copy on the device
        if not aliased:
            add(param, "parameters", stored(param, u.param_bytes))
        if not param.addressable:
            largest_home = max(largest_home, u.param_bytes)
            root_on_disk = root_on_disk or u.is_root
        if param is not Tier.DEVICE:
            if u.is_root:
                root_params = u.param_bytes
            else:
                blocks.append(u.param_bytes)
        if trainable and not optimizer.addressable:  # the streamed step
            steps.append(_chunk_sets(u, chunk, param, aliased, states, grad, is_consumed))
            shadows.append(paged(master_bytes(u, choice)) + (u.state_bytes if states else 0))
    add(Tier.DEVICE, "the root unit's working copy", root_params)
    add(Tier.DEVICE, "the largest block's working copy", max(blocks, default=0))
    if largest_home:
        # certain: the root's read while the first ``depth`` blocks are prefetched (a
        # model without a root unit on disk may turn one slot over)
        slots = min(depth, len(blocks)) + 1 if root_on_disk else 1
        add(param.staging, f"{PARAM_STAGING} ({slots} slots)", slots * paged(largest_home))
    if disk_grads:
        # each unit's buffer is written out while the next fills; a step in backward
        # may give one back early
        slots = 1 if trace.step_in_backward else min(GRAD_STAGING_SLOTS, len(disk_grads))
        add(grad.staging, f"gradient staging ({slots} slots)", slots * paged(max(disk_grads)))
    if steps:  # (beside the optimizer's tier, staged where it is staged)
        add(optimizer.staging, STEP_CHUNKS, max(steps))
        add(optimizer, STEP_SHADOW, max(shadows))
    return Floor({t: list(p.items()) for t, p in parts.items() if p})


def _chunk_sets(u, chunk: int, param, aliased, states, grad, is_consumed) -> int:
    """The buffer sets of the unit's streamed step (optim.streamed), each of its longest
    chunk: the chunk size or, when shorter, its longest segment (one param group's
    trainable parameters; a chunk never crosses one). Per element: the fp32 master, each
    state (fp32, or stored compact plus its fp32 scratch), the gradient when read from
    disk, and the home's cast when it is a disk array of its own that holds no frozen
    compute-dtype part."""
    numel = min(chunk, u.longest_segment_numel)
    # sets pipelined: up to 3, no more than its chunks (each segment's own; a frozen
    # tail's chunks aside: at least this many)
    sets = min(STREAMED_STEP_SLOT_SETS, u.chunks(chunk))
    per_state = 4 if u.per_state_itemsize >= 4 else 4 + int(u.per_state_itemsize)
    per_element = 4 + (u.state_count * per_state if states else 0)
    per_element += 4 if not grad.addressable and not is_consumed else 0
    if not param.addressable and not aliased and not u.frozen_compute_numel:
        per_element += u.compute_itemsize
    return sets * numel * per_element


def _remedy(tier: Tier, what: str, config) -> str | None:
    """The setting that moves part ``what`` off ``tier`` or shrinks it, if one does."""
    further = tier.farther.value if tier.farther is not None else None  # (its config value)
    if what == "parameters" and further:
        return f"offload_param='{further}' moves"
    if what in ("master weights", "optimizer states") and further:
        return f"offload_optimizer='{further}' moves"
    if what == "gradients" and further:  # they follow the optimizer unless set apart
        if config.offload_grad is None or config.offload_optimizer is tier:
            return f"offload_optimizer='{further}' moves"
        return f"offload_grad='{further}' moves"
    if what.startswith(PARAM_STAGING) and config.prefetch_depth:
        return f"a lower prefetch_depth (now {config.prefetch_depth}) shrinks"
    if what == STEP_CHUNKS:
        return (
            f"a lower optimizer_chunk_size (now {format_size(config.optimizer_chunk_size)}) shrinks"
        )
    if what == STEP_SHADOW:
        return "offload_optimizer='cpu' moves"
    return None


def floor_of_config(trace: Trace, config, optimizer) -> Floor:
    """:func:`manual_floor` of the placement ``config``'s ``offload_*`` keys give."""
    spec = flat_spec(optimizer) if optimizer is not None and flat_steppable(optimizer) else None
    return manual_floor(
        trace,
        param=config.offload_param,
        optimizer=config.offload_optimizer,
        grad=config.grad_tier,
        depth=config.prefetch_depth,
        chunk_bytes=config.optimizer_chunk_size,
        stepped=optimizer is not None,
        states=spec is not None and spec.preallocate_states,
    )


def check_manual_floor(
    floor: Floor,
    capacities: dict[Tier, int | None],
    config,
    *,
    machine: frozenset[Tier] = frozenset(),
) -> None:
    """Raise ``OutOfDeviceMemory`` / ``OutOfTierMemory`` naming the capacity key when a
    tier's floor is over its capacity (``None``: not limited, not checked). A tier in
    ``machine`` has no key set: its capacity is the machine's (RAM, the free space at
    ``offload_path``), and the advice is about the machine, not a key to raise."""
    for tier in Tier:
        need, capacity = floor.total(tier), capacities.get(tier)
        if capacity is None or need <= capacity:
            continue
        key = tier.capacity_key
        held = ", ".join(f"{what} {format_size(n)}" for what, n in floor.parts[tier])
        if tier not in machine:
            given = f"{key} is {format_size(capacity)}"
            advice = [f"raise {key} to at least {format_size(need)}"]
        elif tier.path_key is not None:  # sized by the free space of a directory
            path = tier.path_key
            given = (
                f"only {format_size(capacity)} is free at {path} {getattr(config, path)!r} "
                f"({key} is not set)"
            )
            advice = [
                f"free space there, or point {path} at a disk with at least "
                f"{format_size(need)} free"
            ]
        else:
            given = f"this machine has {format_size(capacity)} of RAM ({key} is not set)"
            advice = [
                "keep more on disk (offload_param='disk', offload_optimizer='disk'), or use "
                f"a machine with more than {format_size(need)} of RAM"
            ]
        remedies: dict[str, int] = {}
        for what, nbytes in floor.parts[tier]:
            remedy = _remedy(tier, what, config)
            if remedy:
                remedies[remedy] = remedies.get(remedy, 0) + nbytes
        advice += [f"{remedy} {format_size(n)} of it" for remedy, n in remedies.items()]
        advice.append("or set auto_offload=True to let the planner place each unit")
        error = OutOfDeviceMemory if tier is Tier.DEVICE else OutOfTierMemory
        raise error(
            f"hetstore: out of {tier.label} memory, refused before training: this placement "
            f"holds at least {format_size(need)} there at once, activations aside ({held}), "
            f"and {given}. To fix: " + "; ".join(advice),
            tier=tier.label,
            requested=need,
            capacity=capacity,
        )
