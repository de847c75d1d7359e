"""Where one unit's gradients go: its fp32 gradient buffer, and the state of filling it.

Backward hands each parameter's gradient to the runtime, which moves it here
(:meth:`GradSink.accumulate`: no clone is kept on the device) and summed across
micro-batches. The buffer lives on the gradient tier (``Placement.grad``):

- in memory (device or host), gradients are added into it directly;
- on disk, they gather in the gradient stager's host buffer (:mod:`runtime.staging`),
  which the runtime writes out when the unit's backward is done. With the step in
  backward (``step_in_backward``) the disk array is made only when a gradient must
  persist (accumulation under ``no_sync``, a step that could not run in backward): a
  *deferred* buffer (:meth:`region` makes it);
- sharded over ranks, the full gradient gathers in a device bucket, averaged over the
  ranks and reduced to this rank's shard by :meth:`reduce` when the unit's backward is
  done (a collective).

What the sink tracks for the rest of the runtime: which parameters got a gradient
(``ParamEntry.has_grad``), gradients still expected this backward (``pending``), a
version that moves with every gradient added (a disk array has no version counter of its
own, and the optimizer's step ahead must tell a later micro-batch's gradients from
none), and whether the step in backward already consumed them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hetstore.runtime.layout import ParamEntry
from hetstore.tier import Tier
from hetstore.tiers.store import FlatBuffer, Store, transfers_only

if TYPE_CHECKING:
    from hetstore.runtime.unit import Unit

__all__ = ["GradSink", "GradState"]


class GradState(NamedTuple):
    """What tells a later change of a unit's gradients (compare two with ``==``)."""

    added: int  # gradients added in (``GradSink.version``: another micro-batch's backward)
    in_place: int | None  # a buffer in memory's version counter (clipping, p.grad hooks)
    has_grad: tuple[bool, ...]  # which trainable parameters have one


class GradSink:
    """The gradients of one :class:`~hetstore.runtime.unit.Unit` (see the module doc)."""

    def __init__(self, unit: Unit, *, deferred: bool, buffer: FlatBuffer | None = None):
        """``buffer``: one the unit already owns on the gradient tier (else made here)."""
        self._unit = unit
        self.deferred = deferred and bool(unit.trainable_numel)
        if buffer is None and unit.trainable_numel and not self.deferred:
            buffer = unit.allocate(
                unit.placement.grad, unit.trainable_numel, torch.float32, "grads"
            )
        self.buffer: FlatBuffer | None = buffer
        if isinstance(self.buffer, torch.Tensor):
            self.buffer.zero_()  # padding between segments must be finite for overflow checks
        self.version = 0  # moves with every gradient added (see the module doc)
        self.pending = 0  # gradients still expected this backward (set by the runtime)
        # which trainable entries required grad when the last forward began: autograd
        # brings gradients by the graph that forward recorded, whatever a parameter's
        # requires_grad is by the time backward runs (see track_requires_grad)
        self.tracked: tuple[bool, ...] = ()
        self.track_requires_grad()
        # the step in backward took the gradients: none to read until cleared
        self.consumed = False
        self._bucket: torch.Tensor | None = None  # sharded: the full gradient, gathering
        self._copies: torch.cuda.Event | None = None  # the last copy to the host in flight
        self._bucket_bytes = 0

    @property
    def staged(self) -> bool:
        """Gradients gather in the gradient stager's host buffer (they belong on disk)."""
        return self.deferred or transfers_only(self.buffer)

    def region(self) -> Store:
        """The gradients' disk array; a deferred one is made now (raises
        :class:`OutOfTierMemory` naming it when the disk has no room)."""
        unit = self._unit
        if self.buffer is None and self.deferred:
            self.buffer = unit.allocate(Tier.DISK, unit.trainable_numel, torch.float32, "grads")
        return self.buffer

    def _gathering(self) -> torch.Tensor:
        """Where backward sums the gradients: the stager's host buffer when they belong
        on disk, else the buffer itself."""
        unit = self._unit
        return unit.grad_stager.buffer_for(unit) if self.staged else self.buffer

    def accumulate(
        self, entry: ParamEntry, grad: torch.Tensor, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Move ``grad`` into the fp32 gradients (sharded: into the full device bucket,
        see :meth:`reduce`). With a CUDA ``stream``, a first gradient bound for host
        memory is copied there on that stream without waiting (:meth:`wait_copies`)."""
        self.version += 1
        if self._unit.shards is not None:
            if self._bucket is None:
                self._bucket = self._new_bucket(grad.dtype)
            self._bucket[entry.offset : entry.offset + entry.numel].copy_(grad.reshape(-1))
            return
        target = self._gathering()[entry.offset : entry.offset + entry.numel]
        source = grad.reshape(-1)
        if entry.has_grad:  # a later micro-batch: summed on the target's device
            self.wait_copies()
            if source.device != target.device:
                source = source.to(target.device, non_blocking=False)
            target.add_(source)
            return
        if stream is not None and source.is_cuda and target.device.type == "cpu":
            self._copy_to_host(target, source, stream)
        else:
            target.copy_(source)  # first micro-batch: a copy replaces a zero-fill
        entry.has_grad = True

    def _copy_to_host(
        self, target: torch.Tensor, source: torch.Tensor, stream: torch.cuda.Stream
    ) -> None:
        """Start copying a device gradient into host ``target`` on ``stream`` and return:
        backward goes on computing while it crosses (into pinned memory the copy is
        truly asynchronous). The cast to fp32 runs on ``stream`` too (its result is
        allocated there, so that stream's order protects it), and autograd's ``source``,
        allocated on the compute stream, is recorded on ``stream`` so the allocator does
        not hand its memory to a later kernel before the cast or copy has read it."""
        stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            target.copy_(source.to(target.dtype), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        source.record_stream(stream)
        self._copies = event  # copies on one stream finish in order: the last covers all

    def copies_in_flight(self) -> torch.cuda.Event | None:
        """The event of the last gradient copy to the host still in flight, or None: a
        step on another thread waits for it there instead of blocking backward's."""
        return self._copies

    def wait_copies(self) -> None:
        """Block until every gradient copy to the host issued so far has landed. Called
        before anything reads or changes the buffer (the runtime when the unit's
        backward is done and at the end of backward, ``p.grad``, ``zero_grad``)."""
        if self._copies is not None:
            self._copies.synchronize()
            self._copies = None

    def _new_bucket(self, dtype: torch.dtype) -> torch.Tensor:
        unit = self._unit
        nbytes = unit.full_numel * dtype.itemsize
        unit.tiers.device_tier.reserve(nbytes, unit.label("grad bucket"))
        self._bucket_bytes = nbytes
        # zeros: parameters without a gradient this backward count as a zero gradient
        return torch.zeros(unit.full_numel, dtype=dtype, device=unit.device)

    @property
    def has_bucket(self) -> bool:
        return self._bucket is not None

    def reduce(self) -> None:
        """Sharded: average the unit's full gradient over the ranks (reduce-scatter) and
        add this rank's shard into the fp32 gradients; the bucket is freed.

        A collective: every rank calls it for the same units in the same order (the
        runtime does so when a unit's backward is done). Afterwards every trainable entry
        that requires grad counts as having a gradient: a rank cannot tell which
        parameters got one elsewhere.
        """
        unit = self._unit
        bucket = self._bucket  # the runtime calls this only for units with a bucket
        try:
            shard = torch.empty(unit.numel, dtype=bucket.dtype, device=unit.device)
            unit.shards.reduce_scatter_mean(shard, bucket, unit.collective("the gradients"))
        finally:
            del bucket
            self._free_bucket()
        if unit.trainable_numel:
            target = self._gathering()[: unit.trainable_numel]
            source = shard[: unit.trainable_numel].to(target.device)
            if self.any():
                target.add_(source)
            else:
                target.copy_(source)
        # (a parameter frozen at the forward got none anywhere)
        for entry, tracked in zip(unit.trainable_entries, self.tracked, strict=True):
            entry.has_grad = tracked

    def track_requires_grad(self) -> None:
        """A forward begins: take each trainable entry's requires_grad as it runs with."""
        self.tracked = tuple(e.param.requires_grad for e in self._unit.trainable_entries)

    def _free_bucket(self) -> None:
        self._bucket = None
        self._unit.tiers.device_tier.release(self._bucket_bytes, self._unit.label("grad bucket"))

    def clear(self) -> None:
        self.wait_copies()  # a copy landing after the clear would bring old values back
        for entry in self._unit.entries:
            entry.has_grad = False
        self.consumed = False

    def fill_missing(
        self,
        grad: torch.Tensor | None = None,
        start: int = 0,
        has_grad: tuple[bool, ...] | None = None,
    ) -> list[str]:
        """Zero the slices of parameters that got no gradient; return their names.

        ``grad`` is the gradient buffer, or a chunk of it starting at element ``start``.
        ``has_grad``: the flags as they were when a step was started (``state().has_grad``;
        ``zero_grad`` may clear the live ones while a step in the next forward runs).
        """
        grad = self.buffer if grad is None else grad
        end = start + grad.numel()
        entries = self._unit.trainable_entries
        flags = has_grad if has_grad is not None else [e.has_grad for e in entries]
        missing = []
        for entry, present in zip(entries, flags, strict=True):
            if not present:
                a, b = max(entry.offset, start), min(entry.offset + entry.numel, end)
                if a < b:
                    grad[a - start : b - start].zero_()
                missing.append(entry.name)
        return missing

    def state(self) -> GradState:
        buffer = self.buffer
        return GradState(
            self.version,
            buffer._version if isinstance(buffer, torch.Tensor) else None,
            tuple(e.has_grad for e in self._unit.trainable_entries),
        )

    def any(self) -> bool:
        return any(e.has_grad for e in self._unit.trainable_entries)

    def close(self) -> None:
        """Give back a bucket a failed backward left (the buffer is the unit's to free)."""
        self.wait_copies()
        if self._bucket is not None:
            self._free_bucket()
        self.buffer = None
