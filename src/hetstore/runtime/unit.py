"""One unit's parameters in every form, and their movement between tiers.

Forms of a unit's parameters (all flat, 1-D, one element per parameter element, in the
order of ``entries``: trainable parameters grouped by optimizer param group, then frozen):

- ``master``: fp32, on the optimizer's tier (device or host). The source of truth.
- ``home``: compute dtype, where the parameters live between uses (``offload_param``);
  aliases ``master`` when dtype and tier agree (fp32 on host, say), so nothing is stored twice.
- ``device_flat``: compute dtype on the device; every ``nn.Parameter`` of the unit is a
  view into it. When the unit is released its *storage* is resized to 0 (FSDP2's trick):
  the Parameter objects, and autograd's references to them, stay valid; the bytes go.
- ``grad``: fp32 on the gradient tier, accumulated across micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hetstore.tiers import HostBuffer, Tiers

__all__ = ["ParamEntry", "Segment", "Unit", "Placement"]


@dataclass(frozen=True)
class Placement:
    """Where one unit's pieces live: each 'none' (device) or 'cpu' (host)."""

    param: str
    optimizer: str
    grad: str


@dataclass
class ParamEntry:
    param: nn.Parameter
    name: str
    offset: int
    numel: int
    shape: torch.Size
    group: int | None  # optimizer param group index; None when not optimized
    has_grad: bool = False


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one param group's parameters inside a unit's flat buffers."""

    group: int
    start: int
    end: int


class Unit:
    """A group of parameters moved, stepped and accounted together."""

    def __init__(
        self,
        index: int,
        name: str,
        params: list[tuple[str, nn.Parameter, int | None]],
        placement: Placement,
        tiers: Tiers,
        compute_dtype: torch.dtype,
    ):
        self.index = index
        self.name = name
        self.placement = placement
        self.tiers = tiers
        self.device = tiers.device
        self.compute_dtype = compute_dtype

        # trainable first, ordered by group so each group is one contiguous segment
        ordered = sorted(params, key=lambda item: (item[2] is None, item[2] or 0))
        self.entries: list[ParamEntry] = []
        offset = 0
        for name_, param, group in ordered:
            self.entries.append(ParamEntry(param, name_, offset, param.numel(), param.shape, group))
            offset += param.numel()
        self.numel = offset
        # fixed from here on; read on every step and backward, so computed once
        self.trainable_entries = [e for e in self.entries if e.group is not None]
        self.segments: list[Segment] = []
        for entry in self.entries:
            if entry.group is None:
                continue
            last = self.segments[-1] if self.segments else None
            if last is not None and last.group == entry.group and last.end == entry.offset:
                self.segments[-1] = Segment(last.group, last.start, entry.offset + entry.numel)
            else:
                self.segments.append(Segment(entry.group, entry.offset, entry.offset + entry.numel))
        self.trainable_numel = self.segments[-1].end if self.segments else 0
        self._host_buffers: list[HostBuffer] = []
        self._device_persistent: list[tuple[torch.Tensor, str]] = []
        self.materialized = False
        self.ready_event = None  # CUDA event guarding an in-flight fetch
        self.pending_grads = 0
        self._build()

    # ------------------------------------------------------------------ construction
    def _label(self, what: str) -> str:
        return f"{what} {self.name}"

    def allocate(self, tier: str, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A flat tensor on ``tier`` ('none' = device, 'cpu' = host) owned by this unit
        and freed by ``close()``; the optimizer keeps its states here too."""
        label = self._label(what)
        if tier == "none":
            tensor = self.tiers.device_tier.empty(numel, dtype, label)
            self._device_persistent.append((tensor, label))
            return tensor
        if tier == "cpu":
            buffer = self.tiers.host.allocate(numel * dtype.itemsize, label, dtype)
            self._host_buffers.append(buffer)
            return buffer.tensor
        raise NotImplementedError(
            f"tier {tier!r} for {what} of unit {self.name!r} is not supported by this runtime yet"
        )

    def _build(self) -> None:
        p = self.placement
        fp32 = torch.float32
        self.master = self.allocate(p.optimizer, self.numel, fp32, "master params")
        with torch.no_grad():
            for e in self.entries:
                self.master[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
        same_dtype = self.compute_dtype == fp32
        if p.param == p.optimizer and same_dtype:
            self.home = self.master
        else:
            self.home = self.allocate(p.param, self.numel, self.compute_dtype, "params")
            self.home.copy_(self.master)
        if p.param == "none":
            self.device_flat = self.home
            self.materialized = True
        else:
            self.device_flat = torch.empty(self.numel, dtype=self.compute_dtype, device=self.device)
        self.grad = (
            self.allocate(p.grad, self.trainable_numel, fp32, "grads")
            if self.trainable_numel
            else None
        )
        for e in self.entries:
            view = self.device_flat[e.offset : e.offset + e.numel].view(e.shape)
            e.param.data = view
        if not self.materialized:
            self.device_flat.untyped_storage().resize_(0)

    @property
    def device_bytes(self) -> int:
        return self.numel * self.compute_dtype.itemsize

    # ------------------------------------------------------------------ movement
    def fetch(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make the parameters present on the device (idempotent).

        With a CUDA ``stream`` the copy is issued there and ``ready_event`` records it;
        ``wait_ready`` makes the compute stream wait before use.
        """
        if self.materialized:
            return
        self.tiers.device_tier.reserve(self.device_bytes, self._label("params"))
        storage = self.device_flat.untyped_storage()
        if stream is not None:
            with torch.cuda.stream(stream):
                storage.resize_(self.device_bytes)
                self.device_flat.copy_(self.home, non_blocking=True)
                self.ready_event = torch.cuda.Event()
                self.ready_event.record(stream)
        else:
            storage.resize_(self.device_bytes)
            self.device_flat.copy_(self.home)
        self.materialized = True

    def wait_ready(self) -> None:
        if self.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready_event)
            self.ready_event = None

    def release(self) -> None:
        """Free the device copy unless the parameters live on the device."""
        if not self.materialized or self.placement.param == "none":
            return
        self.wait_ready()
        if self.device.type == "cuda":
            # the block was allocated on the copy stream; do not reuse it before compute is done
            self.device_flat.record_stream(torch.cuda.current_stream(self.device))
        self.device_flat.untyped_storage().resize_(0)
        self.tiers.device_tier.release(self.device_bytes, self._label("params"))
        self.materialized = False

    def refresh_from_master(self) -> None:
        """After the optimizer changed ``master``: update the compute-dtype copies."""
        with torch.no_grad():
            if self.home is not self.master:
                self.home.copy_(self.master, non_blocking=True)
            if self.materialized and self.device_flat is not self.home:
                self.device_flat.copy_(self.home, non_blocking=True)

    # ------------------------------------------------------------------ gradients
    def accumulate_grad(self, entry: ParamEntry, grad: torch.Tensor) -> None:
        """Move ``grad`` into the fp32 gradient buffer (no clone kept on the device)."""
        target = self.grad[entry.offset : entry.offset + entry.numel]
        source = grad.reshape(-1)
        if source.device != target.device:
            source = source.to(target.device, non_blocking=False)
        if entry.has_grad:
            target.add_(source)
        else:
            target.copy_(source)  # first micro-batch: a copy replaces a zero-fill
            entry.has_grad = True

    def clear_grads(self) -> None:
        for entry in self.entries:
            entry.has_grad = False

    def fill_missing_grads(self) -> list[str]:
        """Zero the slices of parameters that got no gradient; return their names."""
        missing = []
        for entry in self.trainable_entries:
            if not entry.has_grad:
                self.grad[entry.offset : entry.offset + entry.numel].zero_()
                missing.append(entry.name)
        return missing

    def any_grad(self) -> bool:
        return any(e.has_grad for e in self.trainable_entries)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        self.release()
        for buffer in self._host_buffers:
            self.tiers.host.free(buffer)
        self._host_buffers.clear()
        for tensor, label in self._device_persistent:
            self.tiers.device_tier.release(tensor.numel() * tensor.element_size(), label)
        self._device_persistent.clear()
