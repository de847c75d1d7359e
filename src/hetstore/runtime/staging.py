"""Bounded host staging for disk-resident units.

Two pools, both of a fixed number of equal host buffers allocated lazily from the host
tier, so the host memory a disk placement needs does not grow with the model:

- :class:`ParamStager`: compute-dtype parameters on their way disk -> host -> device,
  ``prefetch_depth + 1`` buffers of the largest unit's parameter bytes. A fetch gives
  its buffer back after the upload, so the host copy is dropped right after it; a step
  in the next forward borrows free ones (:meth:`ParamStager.lend`).
- :class:`GradStager`: fp32 gradients of units whose gradients live on disk, gathered in
  a host buffer while the unit's backward runs and written out (asynchronously) when the
  unit has all its gradients. Three buffers of the largest unit's trainable bytes: one
  being filled, one being written, one for the root unit, whose gradients (embeddings)
  complete only at the end of backward. When all are busy, a unit waits for the oldest
  write or writes out the oldest partial unit and re-reads it later (accumulation makes
  that exact), so any model order works. A step in or after backward reads a unit's
  gradients from its buffer, not from disk (:meth:`GradStager.hand_over`, ``lend``,
  ``lend_written``).

Neither knows who borrows its buffers: it publishes on the model's event bus
(:mod:`hetstore.runtime.events`) when a buffer comes free and when it finds every one
lent, and the borrower (the optimizer's step ahead) subscribes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.footprints import GRAD_STAGING_SLOTS
from hetstore.runtime.events import Event, Events
from hetstore.tiers import HostBuffer, HostTier
from hetstore.tiers.hostmem import PAGE_SIZE, round_up
from hetstore.tiers.store import Done

if TYPE_CHECKING:
    from hetstore.runtime.unit import Unit

__all__ = ["ParamStager", "GradStager", "stagers_of"]


def stagers_of(units) -> list:
    """The distinct parameter and gradient stagers of ``units`` (a model shares one of
    each among its disk units)."""
    found = {}
    for unit in units:
        for stager in (unit.param_stager, unit.grad_stager):
            if stager is not None:
                found[id(stager)] = stager
    return list(found.values())


def _grads_in(slot: torch.Tensor, unit: Unit) -> torch.Tensor:
    """The fp32 view of ``unit``'s gradients at the head of a gradient staging buffer."""
    return slot[: unit.trainable_numel * 4].view(torch.float32)


class _Slots:
    """``count`` host buffers of ``nbytes`` each, allocated on first use."""

    def __init__(self, host: HostTier, nbytes: int, count: int, label: str):
        self.host = host
        self.nbytes = max(nbytes, 1)
        self.count = count
        self.label = label
        self._buffers: list[HostBuffer] = []
        self.free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        if len(self._buffers) < self.count:
            buffer = self.host.allocate(self.nbytes, f"{self.label} {len(self._buffers)}")
            self._buffers.append(buffer)
            return buffer.tensor
        return None

    def give(self, slot: torch.Tensor) -> None:
        self.free.append(slot)

    def take_back(self, slot: torch.Tensor) -> bool:
        """Take ``slot`` itself out of the free ones; False when it is not free."""
        for i, free in enumerate(self.free):
            if free is slot:
                del self.free[i]
                return True
        return False

    @property
    def spare(self) -> int:
        """Buffers :meth:`take` gives without one coming back first."""
        return len(self.free) + self.count - len(self._buffers)

    @property
    def unmade_bytes(self) -> int:
        """Host bytes the buffers not yet made will take when first used."""
        return (self.count - len(self._buffers)) * round_up(self.nbytes, PAGE_SIZE)

    def close(self) -> None:
        for buffer in self._buffers:
            self.host.free(buffer)
        self._buffers.clear()
        self.free.clear()


class ParamStager:
    """Staging buffers for reading compute-dtype parameters from disk (see module doc)."""

    def __init__(self, host: HostTier, nbytes: int, count: int, events: Events):
        self._slots = _Slots(host, nbytes, count, "param staging")
        self._events = events  # (the model's: buffers come free, or all are lent)
        self._staged: OrderedDict[Unit, tuple[torch.Tensor, object]] = OrderedDict()
        self._uploading: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        # fetches that found their read already started (prefetched) / had to start it
        self.prefetched = 0
        self.unprefetched = 0
        self.lent = 0  # buffers a step in the next forward is filling (lend)

    @property
    def unmade_bytes(self) -> int:
        return self._slots.unmade_bytes

    @property
    def slot_bytes(self) -> int:
        """The largest compute-dtype home one slot holds."""
        return self._slots.nbytes

    def _reclaim_uploads(self, block: bool) -> None:
        still = []
        for slot, event in self._uploading:
            if block or event.query():
                event.synchronize()
                self._slots.give(slot)
            else:
                still.append((slot, event))
        self._uploading = still

    def _take(self, block: bool) -> torch.Tensor | None:
        self._reclaim_uploads(block=False)
        slot = self._slots.take()
        if slot is None and self._uploading and block:
            self._reclaim_uploads(block=True)
            slot = self._slots.take()
        if slot is None and not self._staged and block and self.lent:
            # a step finished in forward stages (or returns) the buffer it borrowed
            self._events.publish(Event.PARAM_BUFFERS_LENT)
            slot = self._slots.take()
        if slot is None and self._staged and block:
            _, (slot, handle) = self._staged.popitem(last=False)  # drop the oldest prefetch
            handle.wait()
        if slot is None and block:
            raise RuntimeError(
                f"hetstore: no parameter staging buffer came free ({self._slots.count} "
                f"made, {self.lent} lent to steps in the next forward): this is a bug"
            )
        return slot

    def view(self, slot: torch.Tensor, unit: Unit) -> torch.Tensor:
        """``unit``'s compute-dtype parameters at the head of ``slot``."""
        return slot[: unit.home_bytes].view(unit.compute_dtype)

    def prefetch(self, unit: Unit) -> None:
        """Start reading ``unit``'s parameters from disk if a buffer is free; never waits."""
        if unit in self._staged or unit.materialized:
            return
        slot = self._take(block=False)
        if slot is not None:
            self._staged[unit] = (slot, unit.home.read(self.view(slot, unit)))

    def take(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """``(buffer, parameters)``: ``unit``'s parameters read (or waited for) now into a
        host buffer; hand ``buffer`` to :meth:`give_back` after the upload."""
        staged = self._staged.pop(unit, None)
        if staged is None:
            self.unprefetched += 1
            slot = self._take(block=True)
            staged = (slot, unit.home.read(self.view(slot, unit)))
        else:
            self.prefetched += 1
        slot, handle = staged
        try:
            handle.wait()
        except BaseException:
            self._slots.give(slot)
            raise
        return slot, self.view(slot, unit)

    def give_back(self, slot: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        """Return a buffer from :meth:`take`; with ``event``, once that copy has finished."""
        if event is None:
            self._slots.give(slot)
            self._events.publish(Event.PARAM_BUFFER_FREE)  # (a borrower may lend it on)
        else:
            self._uploading.append((slot, event))

    @property
    def spare(self) -> int:
        """Buffers :meth:`lend` could hand out now (free, or not made yet)."""
        self._reclaim_uploads(block=False)
        return self._slots.spare

    def lend(self) -> torch.Tensor | None:
        """A free buffer for another thread to fill with a unit's new parameters (a step
        in the next forward); never waits, never drops a prefetch. Comes back through
        :meth:`stage` or :meth:`unlend`; until then a fetch finding no buffer publishes
        ``Event.PARAM_BUFFERS_LENT``."""
        self._reclaim_uploads(block=False)
        try:
            slot = self._slots.take()
        except OutOfTierMemory:  # its first use, and the pool cannot grow: not now
            return None
        if slot is not None:
            self.lent += 1
        return slot

    def unlend(self, slot: torch.Tensor) -> None:
        """A lent buffer back, unused (its filler is done with it)."""
        self.lent -= 1
        self._slots.give(slot)

    def stage(self, unit: Unit, slot: torch.Tensor) -> None:
        """A lent buffer now holds ``unit``'s current parameters (the step that filled it
        was committed): the unit's next fetch takes it as a finished prefetch."""
        self.forget(unit)
        self.lent -= 1
        self._staged[unit] = (slot, Done())

    def forget(self, unit: Unit) -> None:
        """Drop a prefetch that is stale (the unit's parameters changed on disk)."""
        staged = self._staged.pop(unit, None)
        if staged is not None:
            staged[1].wait()
            self._slots.give(staged[0])

    def close(self) -> None:
        for _slot, handle in self._staged.values():
            try:
                handle.wait()
            except BaseException:  # noqa: BLE001 - closing: the data is not needed
                pass
        self._staged.clear()
        self._reclaim_uploads(block=True)
        self._slots.close()


class GradStager:
    """Host buffers gathering fp32 gradients of disk-gradient units (see module doc)."""

    def __init__(
        self, host: HostTier, nbytes: int, count: int = GRAD_STAGING_SLOTS, *, events: Events
    ):
        self._slots = _Slots(host, nbytes, count, "grad staging")
        self._events = events  # (the model's: asks a borrower for a buffer back)
        # unit -> (gradient view, the whole buffer it is a prefix of)
        self._holders: OrderedDict[Unit, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._writing: list[tuple[Unit, torch.Tensor]] = []  # (unit, whole buffer)
        # buffers lent to the optimizer's step ahead, which steps their unit from them
        # (no read back from disk): unit -> whole buffer; they come back by give_back()
        self._lent: dict[Unit, torch.Tensor] = {}
        # unit -> the buffer its gradients were last written from, while it still holds
        # them (no unit has taken it since): lent after backward (lend_written)
        self._written: dict[Unit, torch.Tensor] = {}

    @property
    def slot_bytes(self) -> int:
        return self._slots.nbytes

    def buffer_for(self, unit: Unit) -> torch.Tensor:
        """The host buffer gathering ``unit``'s gradients (its accumulated ones read in)."""
        held = self._holders.get(unit)
        if held is not None:
            return held[0]
        slot = self._slots.take()
        while slot is None:
            if self._writing:
                self._finish_oldest_write()
            # (step_in_backward: the oldest step in backward gives its buffer back)
            elif not (self._lent and self._events.publish(Event.GRAD_BUFFERS_LENT)):
                # (never all lent: see lend; and what lend_written lends after backward
                # comes back when the next one starts, before its first buffer_for)
                self.flush(next(iter(self._holders)))
            slot = self._slots.take()
        self._written.pop(unit, None)  # (accumulating: its sums on disk are about to move)
        for other in [u for u, s in self._written.items() if s is slot]:
            del self._written[other]
        view = _grads_in(slot, unit)
        if unit.grads.any():  # accumulating: earlier micro-batches' sums are on disk
            try:
                unit.grads.region().read(view).wait()
            except BaseException:
                self._slots.give(slot)
                raise
        self._holders[unit] = (view, slot)
        return view

    @property
    def unmade_bytes(self) -> int:
        return self._slots.unmade_bytes

    def _finish_oldest_write(self) -> None:
        unit, slot = self._writing.pop(0)
        try:
            unit.grad.wait_writes()
        except BaseException:
            if self._written.get(unit) is slot:  # the disk does not hold what it does
                del self._written[unit]
            raise
        finally:
            if self._lent.get(unit) is not slot:
                self._slots.give(slot)

    def lend(self, unit: Unit) -> torch.Tensor | None:
        """The buffer holding ``unit``'s gradients, just flushed, for reading until
        :meth:`give_back` (its write to disk goes on: a rollback reads that); None when
        it is not at hand."""
        slot = self._written_slot(unit)
        # at most count - 2 lent: two buffers keep turning over (one gathering, one
        # being written), so backward never waits for the worker to give one back
        # (measured: with every buffer lendable, backward slowed to the worker's pace)
        if slot is None or unit in self._lent or len(self._lent) >= self._slots.count - 2:
            return None
        self._lent[unit] = slot
        return _grads_in(slot, unit)

    def lend_written(self, unit: Unit, has_grad: tuple[bool, ...] | None) -> torch.Tensor | None:
        """After backward, every write finished (:meth:`finish`): the buffer ``unit``'s
        gradients were last written from, lent while no other unit has taken it since
        (each may be: none is gathering; the next backward's start lands the steps that
        hold them first): the bytes its gradient array holds, for a step after backward
        to read there instead of back from disk; None when it is not at hand. The parameters
        without a gradient (by ``has_grad``, else the live flags) are zeroed in it, as the
        step zeroes them in what it reads. Lent once: what the borrower did to it is not
        the disk's any more."""
        slot = self._written.get(unit)
        if slot is None or not self._slots.take_back(slot):  # (being written, or lent)
            return None
        del self._written[unit]
        self._lent[unit] = slot
        grads = _grads_in(slot, unit)
        unit.grads.fill_missing(grads, 0, has_grad)
        return grads

    def peek(self, unit: Unit) -> torch.Tensor | None:
        """``unit``'s gradients in the buffer just flushed, to read now, before the
        stager may reuse it (it does only when another unit needs a buffer); None when
        it is not at hand."""
        slot = self._written_slot(unit)
        return None if slot is None else _grads_in(slot, unit)

    def _written_slot(self, unit: Unit) -> torch.Tensor | None:
        """The buffer ``unit``'s last flush is writing from, if still in flight."""
        return next((s for u, s in reversed(self._writing) if u is unit), None)

    def hand_over(self, unit: Unit) -> torch.Tensor | None:
        """``unit``'s gathered gradients, taken out of the stager for a step in backward
        that consumes them: never written to disk. The buffer comes back by
        :meth:`give_back`, or is written out after all by :meth:`flush_lent`."""
        held = self._holders.pop(unit, None)
        if held is None:
            return None
        view, slot = held
        self._lent[unit] = slot
        return view

    def flush_lent(self, unit: Unit) -> None:
        """A handed-over buffer's step did not happen: write its gradients to disk after
        all (the ordinary step reads them there)."""
        slot = self._lent[unit]
        unit.grads.region().write(_grads_in(slot, unit), 0)
        del self._lent[unit]
        self._writing.append((unit, slot))
        self._written[unit] = slot

    def give_back(self, unit: Unit) -> None:
        slot = self._lent.pop(unit, None)
        if slot is None:
            return
        if all(s is not slot for _, s in self._writing):  # its write is already done
            self._slots.give(slot)

    def flush(self, unit: Unit) -> None:
        """Start writing ``unit``'s gathered gradients to disk (no-op if none gathered)."""
        if unit not in self._holders:
            return
        region = unit.grads.region()  # (a deferred one may not fit: the buffer stays held)
        view, slot = self._holders.pop(unit)
        region.write(view, 0)
        self._writing.append((unit, slot))
        self._written[unit] = slot

    def flush_all(self) -> None:
        for unit in list(self._holders):
            self.flush(unit)

    def finish(self) -> None:
        """Wait for every gradient write (before the step reads them)."""
        self.flush_all()
        first = None
        while self._writing:
            try:
                self._finish_oldest_write()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        self._holders.clear()
        self._written.clear()
        try:
            self.finish()
        except BaseException:  # noqa: BLE001 - closing
            pass
        self._slots.close()
