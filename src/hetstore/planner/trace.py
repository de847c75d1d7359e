"""What the planner plans from: per-unit sizes and times, and the machine's rates.

Plain data, saved and loaded as JSON, so a trace taken on one run (or on the meta
device, before the model exists) can be planned again with other capacities, in tests
without any device, or on another machine after swapping the :class:`MachineRates`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path

from hetstore.tier import Tier

__all__ = ["MachineRates", "UnitTrace", "Trace", "StepProfile", "saved_fields"]


@dataclass(frozen=True)
class MachineRates:
    """Measured (or given) speeds; bytes per second unless said otherwise.

    ``to_device`` / ``from_device``: host<->device copy bandwidth (on a CPU "device" the
    memcpy rate). ``copies_overlap``: whether those copies run beside compute (CUDA side
    streams) or stall it (CPU memcpy). ``host_step`` / ``device_step``: optimizer
    elements per second (fused AdamW over flat fp32 buffers). ``state_codec``: state
    elements per second a compact ``optimizer_state_format`` decodes and encodes, on top
    of the step (0 when the states are stepped as they are stored: fp32). ``flops``: the
    device's achieved FLOP/s, used to turn counted FLOPs into time when no time was
    measured. ``spread``: per probe, how much longer its median timed run took than the fastest
    (which gave the rate): ``(("matmul", 0.12), ...)``; empty when not measured here.
    """

    to_device: float
    from_device: float
    disk_read: float
    disk_write: float
    host_step: float
    device_step: float
    flops: float
    copies_overlap: bool = False
    device: str = "cpu"
    state_codec: float = 0.0
    spread: tuple[tuple[str, float], ...] = ()
    # the share of this machine's CPU time (all cores) other processes used while the
    # probes ran, 0 to 1 (Linux: /proc/stat); None when not measured here
    others_busy: float | None = None

    def inward(self, tier: Tier) -> float:
        """Bytes per second from ``tier`` to the next tier toward the device (the host
        tier's: ``to_device``; the disk's: ``disk_read``), as ``Tier.link_rates`` says."""
        return getattr(self, tier.link_rates[0])

    def outward(self, tier: Tier) -> float:
        """Bytes per second into ``tier`` from the next tier toward the device."""
        return getattr(self, tier.link_rates[1])


@dataclass(frozen=True)
class UnitTrace:
    """One unit: its sizes (bytes) and its compute time (seconds) in one step.

    ``saved_bytes``: tensors saved for backward while the unit's forward runs that are
    large enough to offload (the activations the planner places); ``kept_bytes``: the
    smaller ones, always kept; ``temp_bytes``: the peak of everything else the unit
    allocates above that (non-model data that lives only inside the unit; the CPU
    device accounting does not see it, so the planner counts it on CUDA only).
    """

    name: str
    numel: int  # elements of all its parameters
    trainable_numel: int  # elements the optimizer steps
    compute_itemsize: int  # bytes per element of the compute dtype
    # optimizer-state bytes per trainable element (Adam: 8 in fp32, 2.03 in 8-bit)
    state_itemsize: float
    # frozen elements already in the compute dtype: stored only in it, with no fp32
    # master, unless the master is the parameters' home itself (see Unit.master_numel)
    frozen_compute_numel: int = 0
    state_count: int = 2  # per-element states (Adam: 2); a step holds fp32 chunks of each
    saved_bytes: int = 0
    kept_bytes: int = 0  # saved, but below activation_min_bytes: never offloaded
    # every storage saved while its forward runs, as (bytes, the first and the last op
    # that saved it): what saved_bytes, kept_bytes and largest_node_bytes are made from
    # for any activation_min_bytes (at_min_bytes); empty before a batch is traced
    saved_sizes: tuple[tuple[int, int, int], ...] = ()
    largest_saved_bytes: int = 0  # its largest saved storage
    # the most of its offloadable storages restored at once on a CPU device: those one
    # autograd node unpacks together (attention: q, k, v, out), with those an earlier
    # node will unpack again (a storage saved by two nodes)
    largest_node_bytes: int = 0
    temp_bytes: int = 0
    max_param_numel: int = 0  # its largest parameter (one gradient in flight)
    # the trainable elements of each param group (a segment of its flat buffers each)
    segment_numels: tuple[int, ...] = ()
    forward_s: float = 0.0
    backward_s: float = 0.0
    flops: float = 0.0
    is_root: bool = False  # present for the whole step: its parameters never leave

    def at_min_bytes(self, min_bytes: int) -> UnitTrace:
        """The unit with its activations split at ``activation_min_bytes=min_bytes``:
        storages of at least that many bytes are offloadable, the rest kept."""
        if not self.saved_sizes:
            return self
        # Backward runs the ops' nodes last first; an offloaded storage is restored at
        # the last node that saved it and dropped once the first has run, so at op i
        # those with first <= i <= last are restored at once
        saved = kept = 0
        events: dict[int, int] = {}
        for nbytes, first, last in self.saved_sizes:
            if nbytes >= min_bytes:
                saved += nbytes
                events[first] = events.get(first, 0) + nbytes
                events[last + 1] = events.get(last + 1, 0) - nbytes
            else:
                kept += nbytes
        restored = most = 0
        for op in sorted(events):
            restored += events[op]
            most = max(most, restored)
        return replace(self, saved_bytes=saved, kept_bytes=kept, largest_node_bytes=most)

    @cached_property
    def longest_segment_numel(self) -> int:
        return max(self.segment_numels, default=0)

    def chunks(self, chunk_numel: int) -> int:
        """How many chunks of ``chunk_numel`` elements its streamed step makes: each
        segment's own (a chunk never crosses one)."""
        return sum(-(-n // max(chunk_numel, 1)) for n in self.segment_numels)

    @cached_property
    def param_bytes(self) -> int:
        return self.numel * self.compute_itemsize

    @cached_property
    def master_bytes(self) -> int:
        """The fp32 master when it is not the parameters' home (see ``frozen_compute_numel``)."""
        return (self.numel - self.frozen_compute_numel) * 4

    @cached_property
    def grad_bytes(self) -> int:
        return self.trainable_numel * 4

    @cached_property
    def state_bytes(self) -> int:
        return math.ceil(self.trainable_numel * self.state_itemsize)

    @cached_property
    def per_state_itemsize(self) -> float:
        """Bytes per element of one state: 4 in fp32, 2 in bf16, 1 + 1/64 in 8-bit."""
        return self.state_itemsize / max(self.state_count, 1)

    @cached_property
    def compact_states(self) -> bool:
        """States stored narrower than fp32: a step decodes and encodes them."""
        return self.per_state_itemsize < 4

    @cached_property
    def state_arrays(self) -> int:
        """Arrays the states are stored in: one per state, and 8-bit's block scales."""
        return self.state_count * (2 if self.per_state_itemsize < 2 else 1)


@dataclass(frozen=True)
class Trace:
    """Everything one profiling step (or a meta-device dry run) learned."""

    units: tuple[UnitTrace, ...]
    machine: MachineRates | None  # None: model data only, no time can be predicted
    buffer_bytes: int = 0  # module buffers, always on the device
    overhead_s: float = 0.0  # per-step time not explained by the units (calibration)
    measured: bool = False  # times measured on the real model, not from FLOPs
    batch_shapes: tuple = field(default_factory=tuple)
    # the runtime steps disk units during backward (``overlap_step``): the cost model
    # hides what it can of their steps behind backward
    step_overlap: bool = True
    # ``step_in_backward``: those units are stepped inside backward from gradients in
    # memory, which never reach the disk (no gradient bytes there, nor their traffic)
    step_in_backward: bool = False
    # ``step_in_forward``: what is left of the disk units' steps after backward runs on
    # beside the next forward (each before its unit's forward)
    step_in_forward: bool = False
    # on a GPU, host-memory units' ordinary steps too (``step_in_forward=True``, or
    # 'auto' while ``overlap_step`` is not False)
    step_in_forward_memory: bool = False
    # where the units' compute times come from: "flops" (counted FLOPs at the probed
    # matmul rate), "probed" / "partly probed" (planner.probe timed one unit of each
    # kind, or some kinds, for real); ``measured`` (the profiled steps) overrides it
    compute_basis: str = "flops"
    # how much longer the compute probe's median timed run took than its fastest (the
    # largest over the kinds probed); None: no kind was timed more than once
    compute_spread: float | None = None
    # the activation_min_bytes the units' activation figures are split at
    activation_min_bytes: int = 0

    def __post_init__(self) -> None:
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"unit names must be unique, got {names}")

    @property
    def activations_traced(self) -> bool:
        """The units' saved storages are known one by one (a batch was traced), so the
        activations can be split at any ``activation_min_bytes``."""
        return any(u.saved_sizes for u in self.units)

    def at_min_bytes(self, min_bytes: int) -> Trace:
        """The trace with every unit's activations split at ``min_bytes``."""
        units = tuple(u.at_min_bytes(min_bytes) for u in self.units)
        return replace(self, units=units, activation_min_bytes=min_bytes)

    @property
    def steps_in_next_forward(self) -> bool:
        """Some unit's step runs on beside the next forward (disk units', or on a GPU
        host-memory units' too)."""
        return self.step_in_forward or self.step_in_forward_memory

    @cached_property
    def state_bytes(self) -> int:
        """Model states of the whole model: params, master, grads, optimizer states."""
        return sum(
            u.param_bytes + u.master_bytes + u.grad_bytes + u.state_bytes for u in self.units
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Trace:
        data = json.loads(text)
        units = tuple(
            UnitTrace(
                **{
                    k: v
                    for k, v in saved_fields(UnitTrace, u).items()
                    if k not in ("saved_sizes", "segment_numels")
                },
                saved_sizes=tuple(tuple(s) for s in u.get("saved_sizes", ())),
                segment_numels=tuple(u.get("segment_numels", ())),
            )
            for u in data["units"]
        )
        machine = None
        if data.get("machine"):  # (JSON has no tuples)
            rates = data["machine"]
            # (a trace saved by an older version may name a rate, and its probe's
            # spread, no longer kept: the host copy rate, until 2026-11-28)
            spread = tuple(tuple(p) for p in rates.get("spread", ()) if p[0] != "host copy")
            machine = MachineRates(**{**saved_fields(MachineRates, rates), "spread": spread})
        shapes = tuple(tuple(s) for s in data.get("batch_shapes", ()))
        keys = (
            "buffer_bytes",
            "overhead_s",
            "measured",
            "step_overlap",
            "step_in_backward",
            "step_in_forward",
            "step_in_forward_memory",
            "compute_basis",
            "compute_spread",
            "activation_min_bytes",
        )
        rest = {k: data[k] for k in keys if k in data}
        return cls(units=units, machine=machine, batch_shapes=shapes, **rest)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(Path(path).read_text())


@dataclass
class StepProfile:
    """One profiled step's seconds per label (``(unit, phase)``, ``"transfer"``,
    ``"optimizer"``, ...; see runtime.profiler, which measures it) and in all."""

    seconds: dict[tuple[str, str] | str, float] = field(default_factory=dict)
    total_s: float = 0.0

    def unit_s(self, name: str, phase: str) -> float:
        return self.seconds.get((name, phase), 0.0)

    def of(self, label: str) -> float:
        return self.seconds.get(label, 0.0)


def saved_fields(cls: type, data: dict) -> dict:
    """The entries of ``data`` (a dataclass saved as JSON) that ``cls`` still has: a file
    saved by an older version may name a field no longer kept."""
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in known}
