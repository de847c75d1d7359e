"""The cost model: what a placement costs in memory per tier and in step time.

Pure arithmetic over a :class:`~hetstore.planner.trace.Trace` and one
:class:`UnitChoice` per unit; no device calls. It mirrors what the runtime does:

Memory (peak bytes per tier, during a step)
  device: buffers; parameters kept on the device; the fetched working set
  (``prefetch_depth + 1`` of the largest offloaded unit, plus the root unit, which stays
  for the whole step once fetched); master, gradients and states of device-optimizer
  units (a fp32 model's parameters alias its master); one parameter's gradient in
  flight; saved activations (see ``_activation_peak``: kept ones, and offloaded ones
  restored as they are needed) and those too small to offload; the largest
  unit's temporaries (CUDA only: the CPU device accounting counts model data and saved
  tensors, not temporaries).
  host: parameters homed on host (unless they alias a host master), host-optimizer
  master/states/gradients, and the staging the disk paths use (parameters ``depth + 1``
  units, gradients 3 units); plus the larger of two phases: forward/backward
  (see ``_staged_activation_peak``: activations sent to host, and the host staging of
  activations on disk, at their peak moment) and the optimizer step (the streamed
  step's chunk buffers: up to 3 sets of one chunk per array).
  disk: everything homed on disk, plus the larger of activations sent to disk (forward
  to backward) and one unit's shadow of its optimizer state (the all-or-nothing step
  writes the new state beside the old one), or their sum when units are stepped inside
  backward.

Time (seconds per step)
  compute (measured per unit or FLOPs / rate) + the trace's calibrated overhead
  + copies that stall compute (every host<->device copy on a CPU "device" but a host
  home's fetch, which uses it in place; gradient
  copies everywhere, as the runtime does them synchronously)
  + overlappable transfers beyond the compute they hide behind (CUDA copies with
  prefetch, disk reads and writes), plus one unit's transfer to fill the pipeline,
  divided by the prefetch depth; activations' disk traffic stalls compute on a CPU
  device or without prefetch
  + the optimizer step per unit: device rate, host rate (plus a compact state format's
  decode and encode), or for disk that host time or the disk's read+write time,
  whichever is longer (the chunks are pipelined).
  Units whose states and parameters are on disk are stepped during backward
  (``overlap_step``, :mod:`hetstore.optim.step_ahead`): one worker takes them in the
  order backward finishes them, each as soon as it is final; what the worker has not
  finished when backward ends is left to the step (always the root's step: backward
  finishes it last). On a CPU device the worker's arithmetic takes cores from backward,
  so it is not counted as hidden. ``optimizer_s`` is what is left; ``optimizer_hidden_s``
  what the overlap took off the step.
  Which units' steps run in backward, in the next forward or read ahead is the step
  policy's (:mod:`hetstore.optim.policy`), the rules the runtime arranges its steps by,
  asked here of each traced unit and its placement (:func:`step_site`, :func:`step_modes`).
  With ``step_in_forward`` what is left of those units' steps (all of them without
  ``overlap_step``, else the root's) runs on beside the next forward, in its order: each
  unit's forward waits for its own step, so the root's (first) hides behind nothing.
  On a CPU device the worker's arithmetic again counts against it. Such a step leaves
  its unit's new parameters in a staging buffer, so a disk home is read once a step
  (in backward), not twice. On a GPU, units whose states and parameters are in host
  memory run their ordinary step beside the next forward the same way; they are never
  stepped in backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from hetstore.footprints import (
    GRAD_STAGING_SLOTS,
    activation_staging_units,
    grad_staging_bytes,
    param_staging_bytes,
    streamed_step_bytes,
)
from hetstore.optim import policy
from hetstore.optim.policy import StepModes, StepSite
from hetstore.planner.trace import MachineRates, Trace, UnitTrace
from hetstore.tier import Tier, by_label
from hetstore.tiers.hostmem import PAGE_SIZE, round_up

__all__ = [
    "UnitChoice",
    "Estimate",
    "estimate",
    "optimizer_bytes",
    "step_modes",
    "step_site",
    "TIERS",
]

TIERS = tuple(Tier)


@dataclass(frozen=True)
class UnitChoice:
    """Where one unit's pieces live. Gradients follow the optimizer (they are consumed
    where it steps)."""

    param: Tier = Tier.DEVICE
    optimizer: Tier = Tier.DEVICE
    activations: Tier = Tier.DEVICE

    def __post_init__(self):  # config spellings ('none', 'cpu', 'disk') are accepted
        for name in ("param", "optimizer", "activations"):
            object.__setattr__(self, name, Tier(getattr(self, name)))


@dataclass(frozen=True)
class Estimate:
    """Predicted per-tier peaks (bytes) and step time with its parts (seconds).

    ``peaks``: one per tier, keyed by ``Tier``; read one with :meth:`peak` (a ``Tier``
    or its report name), or as the attribute of its report name (``e.host``)."""

    peaks: dict[Tier, int]
    compute_s: float
    stall_s: float  # copies that stop compute
    exposed_s: float  # overlappable transfers compute could not hide
    optimizer_s: float  # the step time left after backward
    overhead_s: float
    # stepped beside backward (overlap_step) or the next forward (step_in_forward)
    optimizer_hidden_s: float = 0.0
    # where compute_s comes from: "flops", "probed", "partly probed" or "measured" (the
    # profiled steps); see Trace.compute_basis and the plan's confidence line
    basis: str = "flops"
    # disk bytes of the shadows of units stepped ahead beyond the one ``disk`` counts:
    # a speculation keeps its shadow until optimizer.step() commits it, and the worker
    # takes one wherever the disk keeps an ordinary step's room free, so with room to
    # spare several are held while earlier units' activations are still on disk; not
    # in ``disk``: none is taken where the room is not there
    disk_shadows: int = 0
    # a gradient clip that bites (every step, early in training): the speculations in
    # backward roll back and the disk units' steps are left after it. The step seconds
    # then, as configured and with step_in_forward; None when no unit is stepped ahead
    # on disk (or step_in_backward, which refuses a clip)
    clip_bites_s: tuple[float, float] | None = None
    # host bytes read ahead during backward for the first units' steps when none is
    # taken in backward (a clip that bites), at most; not in ``host``: only where the
    # host has room, and given back first when it has none
    host_read_ahead: int = 0
    # per probe the prediction rests on, how much longer its median timed run took
    # than the fastest, which it counts (MachineRates.spread, and the compute probe's
    # "block forward+backward" where compute was probed); empty when not measured here
    probe_spread: tuple[tuple[str, float], ...] = ()
    # the share of the CPU other processes took while the machine was probed
    # (MachineRates.others_busy); None when not measured here
    others_busy: float | None = None

    @property
    def step_s(self) -> float:
        return self.compute_s + self.stall_s + self.exposed_s + self.optimizer_s + self.overhead_s

    @property
    def step_without_overlap_s(self) -> float:
        """The step time with ``overlap_step=False``: every unit stepped after backward."""
        return self.step_s + self.optimizer_hidden_s

    def peak(self, tier: Tier | str) -> int:
        """The predicted peak of ``tier`` (a ``Tier`` or its report name)."""
        return self.peaks[Tier.from_label(tier)]

    def __getattr__(self, name: str) -> int:
        # a tier's report name reads its peak (``e.device``, ``e.host``, ``e.disk``)
        return by_label(self, self.__dict__.get("peaks"), name)


def aliases_master(u: UnitTrace, c: UnitChoice) -> bool:
    """Whether the unit's home is its fp32 master: one tier for both, computing in fp32."""
    return c.param == c.optimizer and u.compute_itemsize == 4


def master_bytes(u: UnitTrace, c: UnitChoice) -> int:
    """A home that is the master holds every element, frozen ones too."""
    return u.numel * 4 if aliases_master(u, c) else u.master_bytes


def optimizer_bytes(u: UnitTrace, c: UnitChoice, consumed: bool = False) -> int:
    """Master, gradients and states in the optimizer's tier; ``consumed``: the unit is
    stepped inside backward (``step_in_backward``), its gradients never stored there."""
    return master_bytes(u, c) + (0 if consumed else u.grad_bytes) + u.state_bytes


def paged(nbytes: int, arrays: int = 1) -> int:
    """``nbytes`` held in ``arrays`` equal arrays, each rounded up to whole 4 KiB pages,
    as host buffers and disk regions are (page-aligned for direct IO)."""
    if nbytes <= 0:
        return 0
    return arrays * round_up(-(-nbytes // arrays), PAGE_SIZE)


def _stored_optimizer_bytes(u: UnitTrace, c: UnitChoice, consumed: bool) -> int:
    """:func:`optimizer_bytes` as host buffers or disk regions hold them: master,
    gradients and each state array (8-bit states: values and block scales) paged."""
    return (
        paged(master_bytes(u, c))
        + (0 if consumed else paged(u.grad_bytes))
        + paged(u.state_bytes, u.state_arrays)
    )


def consumed(trace: Trace, u: UnitTrace, c: UnitChoice) -> bool:
    """``step_in_backward`` steps this unit inside backward (``StepSite.streamed``)."""
    return trace.step_in_backward and step_site(u, c).streamed


def _max(values) -> int:
    return max(values, default=0)


# (the tier helpers below are cached: the search asks millions of times, a few per unit
# per placement it weighs, of a handful of tiers)
@functools.cache
def _in_memory(tier: Tier) -> bool:
    """A memory tier beside the device (host memory): addressable, not the device."""
    return tier is not Tier.DEVICE and tier.addressable


@functools.cache
def _hop_into_device(tier: Tier) -> Tier:
    """The tier on ``tier``'s way to the device whose next tier is the device: the one
    whose link to it a copy takes (host memory, for disk too: it is staged there)."""
    while tier.closer is not Tier.DEVICE:
        tier = tier.closer
    return tier


@functools.cache
def _hops_beyond(tier: Tier) -> tuple[Tier, ...]:
    """The tiers on ``tier``'s way to the device before :func:`_hop_into_device`'s,
    each priced at its own link (``MachineRates.inward`` / ``outward``): ``(disk,)`` for
    disk, none for host memory."""
    hops = []
    while tier.closer not in (None, Tier.DEVICE):
        hops.append(tier)
        tier = tier.closer
    return tuple(hops)


def memory(
    trace: Trace, choices: list[UnitChoice], depth: int, chunk_bytes: int, *, timeline=False
) -> dict[Tier, int]:
    """Peak bytes of ``choices`` per tier, keyed by ``Tier`` (see module doc).

    The device's activations and its blocks' copies peak at different moments (the end
    of forward holds every kept activation and no block; a block's backward holds its
    copy and the activations before it). The planner's search fits with their sum, a
    bound that falls with every move off the device on its own, so the search's orders
    and its "more capacity is never slower" hold (with the moments apart a larger device
    once planned 1.4% slower, tests/planner/test_planner.py seed 5); the plan reports the
    moments apart (``timeline=True``, :func:`estimate`)."""
    peaks = dict.fromkeys(Tier, 0)
    device = trace.buffer_bytes
    fetched_blocks = []
    for u, c in zip(trace.units, choices, strict=True):
        aliased = aliases_master(u, c)
        # parameters between uses, and their working copy on the device
        if c.param == Tier.DEVICE:
            device += 0 if aliased else u.param_bytes
        else:
            if u.is_root:
                device += u.param_bytes
            else:
                fetched_blocks.append(u.param_bytes)
            if not aliased:
                peaks[c.param] += paged(u.param_bytes)
        is_consumed = consumed(trace, u, c)
        if c.optimizer == Tier.DEVICE:
            device += optimizer_bytes(u, c, is_consumed)
        else:
            peaks[c.optimizer] += _stored_optimizer_bytes(u, c, is_consumed)
    units = list(zip(trace.units, choices, strict=True))
    working = ahead = 0  # blocks' device copies while a block runs / prefetched only
    if fetched_blocks:
        at_once = _fetched_at_once(trace, choices, depth, len(fetched_blocks))
        working, ahead = at_once * max(fetched_blocks), (at_once - 1) * max(fetched_blocks)
    device += sum(u.kept_bytes for u in trace.units)
    prefetched = trace.machine is not None and trace.machine.copies_overlap
    if timeline:
        device += _activation_peak(units, depth, prefetched, working, ahead)
    else:
        device += working + _activation_peak(units, depth, prefetched)
    if trace.machine is not None and trace.machine.device != "cpu":
        device += _max(u.temp_bytes for u in trace.units)
    peaks[Tier.DEVICE] += device
    # the staging of the tiers that are not addressable (disk), in the tier that holds
    # it (host memory: runtime.staging, optim.streamed, activations). Activations in
    # memory and the activations' write staging exist during forward and backward only;
    # the streamed step's chunk buffers during the optimizer step only.
    persistent, step = dict.fromkeys(Tier, 0), dict.fromkeys(Tier, 0)
    workers = {}
    for tier in Tier:
        if tier.addressable:
            continue
        staging = tier.staging
        # every home there is read through the parameter stager, the master too when it
        # is the home (runtime.staging)
        homes = [u.param_bytes for u, c in units if c.param == tier]
        if homes:
            persistent[staging] += param_staging_bytes(depth, paged(max(homes)))
        streamed = [(u, c) for u, c in units if c.optimizer == tier]
        stepped_ahead, shadow_bytes = False, 0
        if streamed:
            persistent[staging] += grad_staging_bytes(
                paged(_max(u.grad_bytes for u, _ in streamed))
            )
            chunks = _max(
                streamed_step_bytes(
                    master_bytes(u, c) // 4,
                    u.state_count,
                    chunk_bytes // 4,
                    state_itemsize=u.per_state_itemsize,
                    grad_on_disk=True,  # the planner puts gradients in the optimizer's tier
                    home_itemsize=u.compute_itemsize
                    if c.param == tier and not aliases_master(u, c)
                    else 0,
                )
                for u, c in streamed
            )
            step[staging] += chunks
            in_backward = trace.step_overlap or trace.step_in_backward
            stepped = [i for i, (u, c) in enumerate(units) if step_site(u, c).streamed]
            stepped_ahead = in_backward and bool(stepped)
            if stepped_ahead:  # the step-ahead worker's, during backward, from the first
                workers[staging] = (stepped[-1], chunks)  # it steps: the last in order
            # the shadow of a step; inside backward, the one being stepped and one done
            # awaiting its commit
            shadows = 2 if any(consumed(trace, u, c) for u, c in streamed) else 1
            shadow_bytes = shadows * _one_shadow(streamed)
        # activations there live from their forward to their backward; a step's shadows
        # after backward (optimizer.step()), or during it when units are stepped ahead
        saved = sum(u.saved_bytes for u, c in units if c.activations == tier)
        if stepped_ahead:
            peaks[tier] += saved + shadow_bytes
        else:
            peaks[tier] += max(saved, shadow_bytes)
    for tier in Tier:
        if _in_memory(tier):
            forward_backward = _staged_activation_peak(units, tier, depth, workers.get(tier))
            peaks[tier] += persistent[tier] + max(forward_backward, step[tier])
    return peaks


def _staged_activation_peak(
    units, tier: Tier, depth: int, worker: tuple[int, int] | None = None
) -> int:
    """Peak bytes of saved activations (runtime.activations) in the memory tier ``tier``
    (host memory), units in execution order (the root last). Those on ``tier`` stay from
    their unit's forward to its backward. Those on a tier staged in it (disk) pass
    through its staging, a window of units ending at the one running
    (``footprints.activation_staging_units``). Both are counted at each unit k: the host
    units resident then are those up to k, in forward and in backward alike. (Summing
    every host unit with a full window, as before, over-predicted the host peak of disk
    placements 1.6x: 113.7 MiB predicted against 70.7 measured, benchmarks/planner.py.)

    ``worker``: ``(j, nbytes)``: the step-ahead worker holds ``nbytes`` of chunk buffers
    from the end of unit ``j``'s backward, so beside the backward of the units before
    ``j`` only (adding them to the forward's peak, as before, over-predicted a GPT's
    host peak by 12 MiB of 106)."""
    on_host = [u.saved_bytes if c.activations == tier else 0 for u, c in units]
    on_disk = [u.saved_bytes if c.activations.staging == tier else 0 for u, c in units]
    reach = activation_staging_units(depth) - 1  # units before the running one
    j, held = worker if worker is not None else (-1, 0)
    peak = held  # (after backward: the worker alone)
    resident = 0
    for k in range(len(units)):
        resident += on_host[k]
        here = resident + sum(on_disk[max(0, k - reach) : k + 1])
        peak = max(peak, here + (held if k < j else 0))
    return peak


def _fetched_at_once(trace: Trace, choices: list[UnitChoice], depth: int, blocks: int) -> int:
    """Blocks' device copies held at once: the one in use, plus the ``depth`` prefetched
    ahead where a prefetch lands on the device: a host home on CUDA, copied on the side
    stream (``runtime.prefetch.Prefetch``). A disk home's prefetch is a read into host
    staging, and on a CPU device nothing is copied ahead. Without a machine probe, the
    device is not known: every prefetch is counted there."""
    machine = trace.machine
    ahead = depth
    if machine is not None:
        host_homes = any(
            _in_memory(c.param) and not u.is_root for u, c in zip(trace.units, choices, strict=True)
        )
        ahead = depth if machine.copies_overlap and host_homes else 0
    return min(1 + ahead, blocks)


def _activation_peak(units, depth: int, prefetched: bool, working: int = 0, ahead: int = 0) -> int:
    """Peak device bytes of saved activations, with the blocks' device copies where they
    are given (``memory(timeline=True)``): ``ahead`` bytes prefetched for backward at the
    end of forward, when every kept group is there and no block runs; in the backward of
    unit k, ``working`` when k is a block fetched to run, else ``ahead``. In the backward
    of unit k: the kept groups of units up to k (units in
    execution order; the root's saved tensors, the loss and head, count as last), and of
    the offloaded ones, with ``prefetched`` (CUDA: whole groups come back ahead) the
    groups of units k-depth..k, else (a CPU device restores each tensor as autograd
    unpacks a node's and drops them after it) what unit k's largest node saved; and the
    gradient autograd has just made for unit k's largest parameter, on the device until
    the runtime moves it to the unit's gradient buffer (none exists at the end of
    forward: counting the model's largest one there too over-predicted a GPT's device
    peak by 1 MiB of 9)."""
    kept = [u.saved_bytes if c.activations == Tier.DEVICE else 0 for u, c in units]
    moved = [u.saved_bytes if c.activations != Tier.DEVICE else 0 for u, c in units]
    peak = sum(kept) + ahead
    prefix = 0
    for k, (u, c) in enumerate(units):
        prefix += kept[k]
        grad = u.max_param_numel * u.compute_itemsize
        if prefetched:
            restored = sum(moved[max(0, k - depth) : k + 1]) + grad
        elif c.activations != Tier.DEVICE:
            # a CPU device restores one node's storages at a time and drops them once
            # the node has run, before autograd accumulates the gradients it made (its
            # AccumulateGrad nodes come next), which the runtime then counts and moves
            # out: a node's storages and a gradient are never counted at once
            # (a trace without the storages one by one: its largest storage, at least)
            node = (
                u.largest_node_bytes
                if u.saved_sizes
                else max(u.largest_saved_bytes, u.largest_node_bytes)
            )
            restored = max(node, grad)
        else:
            restored = grad
        copies = working if c.param != Tier.DEVICE and not u.is_root else ahead
        peak = max(peak, prefix + restored + copies)
    return peak


def _compute_s(u: UnitTrace, trace: Trace) -> float:
    if trace.measured or u.forward_s or u.backward_s:
        return u.forward_s + u.backward_s
    return u.flops / trace.machine.flops if trace.machine.flops else 0.0


def _backward_s(u: UnitTrace, trace: Trace) -> float:
    if trace.measured or u.backward_s:
        return u.backward_s
    return _compute_s(u, trace) * 2 / 3  # from FLOPs: backward is twice forward


def _host_step_s(u: UnitTrace, m) -> float:
    """Seconds of the host's arithmetic for ``u``'s step: the fused kernel, and a compact
    state format's decode and encode of each state around it."""
    n = u.trainable_numel
    codec = n * u.state_count / m.state_codec if m.state_codec and u.compact_states else 0.0
    return n / m.host_step + codec


def step_site(u: UnitTrace, c: UnitChoice) -> StepSite:
    """What the step policy (optim.policy) asks of a unit, for ``u`` placed as ``c``: a
    disk unit has its states and its parameters on disk (every copy then goes through
    shadows); a host-memory one, fp32 states there (stepped flat)."""
    return _site(c.param, c.optimizer, u.compact_states, u.trainable_numel > 0)


@functools.lru_cache(maxsize=256)
def _site(param: Tier, optimizer: Tier, compact: bool, trainable: bool) -> StepSite:
    # (a few dozen kinds: the search asks millions of times, once per unit per placement)
    return StepSite(
        streamed=not optimizer.addressable and param == optimizer,
        in_memory=_in_memory(optimizer) and not compact,
        params_in_memory=_in_memory(param),
        exact=not compact,
        trainable=trainable,
    )


def step_modes(trace: Trace) -> StepModes:
    """The trace's step keys as the step policy takes them."""
    cuda = trace.machine is not None and trace.machine.device == "cuda"
    return StepModes(
        overlap_disk=trace.step_overlap,
        in_backward=trace.step_in_backward,
        in_forward=trace.step_in_forward,
        in_forward_memory=trace.step_in_forward_memory and cuda,
    )


def _fetched_in_place(c: UnitChoice, m: MachineRates) -> bool:
    """On a CPU device a home in host memory is used in place by a fetch, not copied
    (``Unit.fetches_in_place``)."""
    return _in_memory(c.param) and m.device == "cpu"


def stepped_in_backward(
    u: UnitTrace, c: UnitChoice, trace: Trace, modes: StepModes | None = None
) -> bool:
    """The policy's rules for a step during backward: a disk unit's, or a host-memory
    unit's in place (``step_in_backward``) where it can start on the worker then
    (``InMemoryUnitStep.can_step_on_worker``): not the root's nor a unit's with frozen
    weights, still resident when its gradients are final, nor on a CPU device, whose
    parameters are the home itself. ``modes``: ``step_modes(trace)``, when the caller
    has them (the search asks once per unit per placement)."""
    site, modes = step_site(u, c), modes or step_modes(trace)
    return policy.streamed_in_backward(site, modes) or (
        policy.memory_in_backward(site, modes)
        and not u.is_root
        and u.trainable_numel == u.numel
        and trace.machine is not None  # (no rates: nothing to price)
        and not _fetched_in_place(c, trace.machine)
    )


def _hidden_behind_backward(trace: Trace, choices, steps: list[float]) -> float:
    """Seconds of the steps taken during backward that backward hides (module doc),
    never below 0: on a CPU device the worker's arithmetic takes backward's cores, and
    what it does not finish by backward's end is what the ordinary step would have done
    anyway."""
    units, m, modes = trace.units, trace.machine, step_modes(trace)
    work = [0.0] * len(units)  # what the worker spends on it, and takes off the step
    arithmetic = 0.0  # all it computes
    for k, (u, c) in enumerate(zip(units, choices, strict=True)):
        if stepped_in_backward(u, c, trace, modes):
            work[k] = steps[k]
            arithmetic += _host_step_s(u, m)
    if not any(work):
        return 0.0
    backward = [_backward_s(u, trace) for u in units]
    order = [k for k in reversed(range(len(units))) if not units[k].is_root]
    order += [k for k, u in enumerate(units) if u.is_root]  # its gradients come last
    clock = worker = 0.0
    for k in order:
        clock += backward[k]
        if work[k]:
            worker = max(clock, worker) + work[k]
    hidden = sum(work) - max(0.0, worker - clock)
    if m.device == "cpu":  # the worker's arithmetic shares backward's cores
        hidden -= arithmetic
    return max(0.0, hidden)


def _forward_order(units) -> list[int]:
    """Unit indices in the order forward fetches them: the root first."""
    return [k for k, u in enumerate(units) if u.is_root] + [
        k for k, u in enumerate(units) if not u.is_root
    ]


def _read_ahead(trace: Trace, choices: list[UnitChoice], bitten: bool = False) -> list[int]:
    """The units whose masters and states are read into host memory during backward
    for their steps (optim.step_ahead) when no step is taken in backward: a clip that
    bites (``bitten``: see ``clip_bites_s``), or ``step_in_forward`` without
    ``overlap_step``. The first ``READ_AHEAD_UNITS`` stepped ahead, in the order they
    are stepped (the next forward's with ``step_in_forward``, else the units'); fp32
    states only."""
    if not bitten and (trace.step_overlap or not trace.step_in_forward):
        return []
    units = trace.units
    order = _forward_order(units) if trace.step_in_forward else list(range(len(units)))
    found = policy.read_ahead([step_site(units[k], choices[k]) for k in order])
    return [order[i] for i in found]


def _grads_kept(trace: Trace, choices: list[UnitChoice]) -> list[int]:
    """The units whose gradients on disk a step in the next forward borrows from the
    gradient stager's buffers instead of reading them back (``GradStager.lend_written``):
    those whose backward ended last, the root's (it holds a buffer through the whole
    backward) and the first others the next forward uses, as many as the stager has
    buffers."""
    units = trace.units
    on_disk = [
        k
        for k in _forward_order(units)
        if units[k].trainable_numel and not choices[k].optimizer.addressable
    ]
    return on_disk[:GRAD_STAGING_SLOTS]


def _read_ahead_s(u: UnitTrace, c: UnitChoice, m: MachineRates) -> float:
    """The disk seconds of the master and states a read ahead takes off a step."""
    return (master_bytes(u, c) + u.state_bytes) / m.inward(c.optimizer)


def read_ahead_bytes(trace: Trace, choices: list[UnitChoice]) -> int:
    """Host bytes read ahead during backward after a clip that bites (``_read_ahead``),
    at most: beside the host peak, only where the host has room."""
    return sum(
        paged(master_bytes(trace.units[k], choices[k]))
        + paged(trace.units[k].state_bytes, trace.units[k].state_arrays)
        for k in _read_ahead(trace, choices, bitten=True)
    )


def _hidden_behind_forward(trace: Trace, choices, steps: list[float]) -> float:
    """Seconds of the steps left after backward that the next forward hides
    (``step_in_forward``; module doc): disk units', and on a GPU host-memory units'.
    May be negative on a CPU device."""
    units, m = trace.units, trace.machine
    modes = step_modes(trace)
    left = [0.0] * len(units)
    arithmetic = 0.0
    for k, (u, c) in enumerate(zip(units, choices, strict=True)):
        site = step_site(u, c)
        if stepped_in_backward(u, c, trace, modes):
            continue
        if policy.memory_in_forward(site, modes) or policy.streamed_in_forward(site, modes):
            left[k] = steps[k]
            arithmetic += _host_step_s(u, m)
    if not any(left):
        return 0.0
    order = _forward_order(units)
    work = list(left)
    for k in _read_ahead(trace, choices):  # their reads hidden behind backward's idle disk
        u, c = units[k], choices[k]
        work[k] = max(_host_step_s(u, m), left[k] - _read_ahead_s(u, c, m))
    for k in _grads_kept(trace, choices):  # their gradients still in the stager's buffers
        u, c = units[k], choices[k]
        if work[k]:
            work[k] = max(_host_step_s(u, m), work[k] - u.grad_bytes / m.inward(c.optimizer))
    clock = worker = waited = 0.0
    for k in order:
        if work[k]:
            worker += work[k]  # the worker starts when optimizer.step() returns
            waited += max(0.0, worker - clock)
            clock = max(clock, worker)
        clock += _compute_s(units[k], trace) - _backward_s(units[k], trace)
    hidden = sum(left) - waited
    if m.device == "cpu":  # its arithmetic shares the forward's cores
        hidden -= arithmetic
    return hidden


def times(
    trace: Trace,
    choices: list[UnitChoice],
    depth: int,
    overlap: bool | None = None,
    bitten: bool = False,
) -> tuple[float, ...]:
    """(compute, stall, exposed, optimizer left after backward, optimizer hidden behind
    it) seconds of ``choices`` (see module doc); ``overlap`` (``overlap_step``) defaults
    to the trace's. ``bitten``: a clip bites, and the steps left in ``optimizer.step()``
    read the first units' states read ahead during backward."""
    if overlap is None:
        overlap = trace.step_overlap or trace.step_in_backward or trace.steps_in_next_forward
    m, modes = trace.machine, step_modes(trace)
    compute = stall = overlappable = 0.0
    fill = 0.0
    steps: list[float] = []
    for u, c in zip(trace.units, choices, strict=True):
        steps.append(0.0)
        compute += _compute_s(u, trace)
        fetches = 1 if u.is_root else 2  # the root stays from forward through backward
        unit_transfer = 0.0
        if c.param != Tier.DEVICE:
            into = _hop_into_device(c.param)
            copy = 0.0 if _fetched_in_place(c, m) else fetches * u.param_bytes / m.inward(into)
            if m.copies_overlap and depth > 0 and not u.is_root:
                unit_transfer += copy
            else:
                stall += copy
            for hop in _hops_beyond(c.param):  # (a master that is the home is read as well)
                reads = fetches
                if u.frozen_compute_numel == 0 and policy.streamed_in_forward(
                    step_site(u, c), modes
                ):
                    reads -= 1  # forward's fetch takes what the step left in staging
                read = reads * u.param_bytes / m.inward(hop)
                if depth > 0 and not u.is_root:
                    unit_transfer += read
                else:
                    stall += read
        if c.optimizer != Tier.DEVICE and u.trainable_numel:
            # gradients leave the device in the gradient hook, synchronously
            out = m.outward(_hop_into_device(c.optimizer))
            stall += u.trainable_numel * u.compute_itemsize / out
        if c.optimizer != Tier.DEVICE and not consumed(trace, u, c):
            for hop in _hops_beyond(c.optimizer):  # written on from the staging
                unit_transfer += u.grad_bytes / m.outward(hop)
        if c.activations != Tier.DEVICE:
            into = _hop_into_device(c.activations)
            copies = u.saved_bytes / m.outward(into) + u.saved_bytes / m.inward(into)
            if m.copies_overlap:
                unit_transfer += copies
            else:
                stall += copies
            for hop in _hops_beyond(c.activations):
                disk_io = u.saved_bytes / m.outward(hop) + u.saved_bytes / m.inward(hop)
                if m.copies_overlap and depth > 0:
                    unit_transfer += disk_io
                else:
                    # without prefetch backward waits for each read; on a CPU device
                    # the disk paths' staging copies and completions share the cores
                    # compute runs on (measured: a unit whose activations go to disk
                    # took 1.3x its forward and 2x its backward; benchmarks/planner.py)
                    stall += disk_io
        overlappable += unit_transfer
        fill = max(fill, unit_transfer)
        # the optimizer step
        n = u.trainable_numel
        if not n:
            continue
        if c.optimizer == Tier.DEVICE:
            steps[-1] += n / m.device_step
        elif c.optimizer.addressable:  # stepped in place in memory
            steps[-1] += _host_step_s(u, m)
            if c.param == Tier.DEVICE:  # (at the commit too: not hidden)
                back = m.inward(_hop_into_device(c.optimizer))
                steps[-1] += u.param_bytes / back  # updated weights back
        else:  # streamed through its staging, chunk by chunk
            read = u.state_bytes
            read += 0 if consumed(trace, u, c) else u.grad_bytes
            read += master_bytes(u, c)
            write = master_bytes(u, c) + u.state_bytes
            if c.param == c.optimizer and not aliases_master(u, c):
                write += u.master_bytes // 4 * u.compute_itemsize  # the home's head
            io = read / m.inward(c.optimizer) + write / m.outward(c.optimizer)
            steps[-1] += max(_host_step_s(u, m), io)
            if c.param == Tier.DEVICE:
                steps[-1] += u.param_bytes / m.inward(_hop_into_device(c.optimizer))
    exposed = max(0.0, overlappable - compute) + (fill / depth if depth else 0.0)
    if bitten and not trace.step_in_forward:  # (in forward: _hidden_behind_forward)
        for k in _read_ahead(trace, choices, bitten=True):
            u, c = trace.units[k], choices[k]
            steps[k] = max(_host_step_s(u, m), steps[k] - _read_ahead_s(u, c, m))
    hidden = 0.0
    if overlap:
        hidden = _hidden_behind_backward(trace, choices, steps)
        if trace.steps_in_next_forward:
            hidden += _hidden_behind_forward(trace, choices, steps)
    return compute, stall, exposed, sum(steps) - hidden, hidden


def estimate(
    trace: Trace,
    choices: list[UnitChoice],
    depth: int,
    chunk_bytes: int = 32 << 20,
    overlap: bool | None = None,
) -> Estimate:
    peaks = memory(trace, choices, depth, chunk_bytes, timeline=True)
    compute, stall, exposed, optimizer, hidden = times(trace, choices, depth, overlap)
    basis = "measured" if trace.measured else trace.compute_basis
    clip_bites = None if overlap is False else _when_a_clip_bites(trace, choices, depth)
    spread = trace.machine.spread if trace.machine is not None else ()
    if not trace.measured and trace.compute_spread is not None:
        spread = (*spread, ("block forward+backward", round(trace.compute_spread, 4)))
    return Estimate(
        peaks,
        compute,
        stall,
        exposed,
        optimizer,
        trace.overhead_s,
        hidden,
        basis,
        disk_shadows=0 if overlap is False else _more_disk_shadows(trace, choices),
        clip_bites_s=clip_bites,
        host_read_ahead=0 if clip_bites is None else read_ahead_bytes(trace, choices),
        probe_spread=spread,
        others_busy=trace.machine.others_busy if trace.machine is not None else None,
    )


def _when_a_clip_bites(
    trace: Trace, choices: list[UnitChoice], depth: int
) -> tuple[float, float] | None:
    """See ``Estimate.clip_bites_s``: nothing is hidden behind backward; what is left
    runs after it, or with ``step_in_forward`` beside the next forward. None unless
    units are stepped ahead on disk (by ``overlap_step`` or ``step_in_forward``), not
    inside backward (``step_in_backward`` refuses a clip)."""
    pairs = zip(trace.units, choices, strict=True)
    if (
        trace.step_in_backward
        or not (trace.step_overlap or trace.step_in_forward)
        or not any(step_site(u, c).streamed and u.trainable_numel for u, c in pairs)
    ):
        return None
    bitten = replace(trace, step_overlap=False)

    def step_s(t: Trace) -> float:
        compute, stall, exposed, optimizer, _ = times(
            t, choices, depth, t.steps_in_next_forward, bitten=True
        )
        return compute + stall + exposed + optimizer + t.overhead_s

    return step_s(bitten), step_s(
        replace(bitten, step_in_forward=True, step_in_forward_memory=True)
    )


def _more_disk_shadows(trace: Trace, choices: list[UnitChoice]) -> int:
    """Disk bytes of speculations' shadows beyond what :func:`memory` counts (one
    shadow beside every activation on disk), at the worst moment of backward: right
    after unit k's backward, the activations of the units before k are still on disk
    and every unit from k on stepped ahead holds its shadow (the worker keeping up).
    Steps in backward commit as they go (two shadows, counted in ``memory``)."""
    units = list(zip(trace.units, choices, strict=True))
    if not trace.step_overlap or trace.step_in_backward:
        return 0
    shadow = [
        _stored_optimizer_bytes(u, c, consumed=True) if step_site(u, c).streamed else 0
        for u, c in units
    ]
    if not any(shadow):
        return 0
    saved = [u.saved_bytes if not c.activations.addressable else 0 for u, c in units]
    worst = max(sum(saved[:k]) + sum(shadow[k:]) for k in range(len(units) + 1))
    counted = _one_shadow([(u, c) for u, c in units if not c.optimizer.addressable])
    return max(0, worst - (sum(saved) + counted))


def _one_shadow(disk_opt) -> int:
    """Disk bytes of the largest shadow of a step among the ``(unit, choice)`` pairs with
    states on disk (a shadow holds the master and states, never gradients)."""
    return _max(_stored_optimizer_bytes(u, c, consumed=True) for u, c in disk_opt)
