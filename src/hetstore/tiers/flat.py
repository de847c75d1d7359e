"""``DiskArray``: a flat array whose elements live in a disk-tier region (the disk
tier's :class:`~hetstore.tiers.store.Store`).

What a unit keeps on disk (fp32 master, optimizer moments, gradients, compute-dtype
parameters) is one ``DiskArray`` each. Elements move in and out through host buffers
with :meth:`read` / :meth:`write`, asynchronously.

Updates that must not be left half-done (the optimizer step of a unit) write into a
*shadow*: a second region of the same size, made the array's region by
:meth:`commit` once every write into it has finished, or thrown away by
:meth:`DiskArray.discard`. A failure in the middle of writing a unit's new state
therefore leaves the old state whole; the disk cost is one unit's states, and the
shadow's file is the old region's file of the previous commit (the disk tier recycles
freed files of the same size), so steady-state steps allocate nothing new.

Element ranges read or written at once must start at a multiple of
:data:`ALIGN_ELEMENTS` (except at the array's end) when another transfer could touch
the neighbouring range at the same time: the disk tier's writes own the rest of their
last 4096-byte page. Units lay out their flat buffers so that every optimizer segment
starts at such a multiple.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetstore.tiers.aio import IOHandle
from hetstore.tiers.disk import DiskRegion, DiskTier
from hetstore.tiers.store import Done, Store, wait_all_quiet

__all__ = ["ALIGN_ELEMENTS", "BYTE_ALIGN_ELEMENTS", "DiskArray", "DiskSlice"]

# 4096 bytes of the narrowest dtype a unit stores (2-byte compute dtypes)
ALIGN_ELEMENTS = 2048
# the same with 1-byte arrays (8-bit optimizer states): units that keep them align so
BYTE_ALIGN_ELEMENTS = 4096


class DiskArray(Store):
    """``numel`` elements of ``dtype`` in one region of ``disk``: the disk tier's
    :class:`~hetstore.tiers.store.Store`."""

    # called before every read while a step that will replace this array's contents
    # runs on another thread (hetstore.optim.step_ahead, step_in_forward): it lets that
    # step land first, so no reader sees the values it replaces
    before_read: Callable[[], None] | None = None

    def __init__(self, disk: DiskTier, numel: int, dtype: torch.dtype, label: str):
        self.disk = disk
        self.numel = numel
        self.dtype = dtype
        self.label = label
        self.region: DiskRegion = disk.allocate(numel * dtype.itemsize, label)
        self._writes: list[tuple[IOHandle, DiskRegion, int, int]] = []
        # a read waits for the array's writes; the optimizer's step-ahead thread reads
        # arrays (gradients) that this thread writes, so the list changes under a lock
        self._writes_lock = threading.Lock()
        self.written = False  # False until the first full write: reads give zeros

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def reserved_bytes(self) -> int:
        """What a region of this size takes of the disk tier's capacity (allocations are
        rounded up to its alignment): what a shadow of it needs room for."""
        return self.disk.reserved_size(self.nbytes)

    def _check(self, buffer: torch.Tensor, start: int) -> None:
        if buffer.dtype != self.dtype:
            raise TypeError(f"{self.label}: buffer dtype {buffer.dtype}, array dtype {self.dtype}")
        if start < 0 or start + buffer.numel() > self.numel:
            raise ValueError(
                f"{self.label}: elements [{start}, {start + buffer.numel()}) outside 0..{self.numel}"
            )

    # ------------------------------------------------------------------ IO
    def read(self, buffer: torch.Tensor, start: int = 0):
        """Start reading elements ``[start, start + buffer.numel())`` into ``buffer``.

        An array never written reads as zeros (no IO). Writes still running are waited
        for first, so a read always sees the last write.
        """
        self._check(buffer, start)
        if self.before_read is not None:
            self.before_read()
        self.wait_writes()
        if not self.written:
            buffer.zero_()
            return Done()
        return self.disk.read(self.region, buffer, start * self.dtype.itemsize)

    def write(self, buffer: torch.Tensor, start: int = 0, *, into: DiskArray | None = None):
        """Start writing ``buffer`` at element ``start`` of this array, or of the shadow
        ``into`` (made by :meth:`shadow`). Keep ``buffer`` unchanged until it is done."""
        self._check(buffer, start)
        target = into if into is not None else self
        region = target.region
        offset = start * self.dtype.itemsize
        handle = self.disk.write(region, buffer, offset)
        with target._writes_lock:
            target._writes.append(
                (handle, region, offset, offset + buffer.numel() * self.dtype.itemsize)
            )
        if start == 0 and buffer.numel() == self.numel:
            target.written = True
        return handle

    def write_all(self, buffer: torch.Tensor) -> None:
        """Write the whole array from ``buffer`` and wait (construction, loading)."""
        self.write(buffer, 0)
        self.wait_writes()

    def wait_writes(self) -> None:
        """Wait for this array's writes; a failed one raises and its bytes become unreadable.

        Two threads may wait at once (the step-ahead worker reading gradients that
        backward's stager is writing): each waits for every write it saw, and a write
        leaves the list only once it is done, so neither returns while one it saw is
        still running (a stager that reused its buffer then would corrupt the write)."""
        with self._writes_lock:
            writes = list(self._writes)
        first: BaseException | None = None
        for handle, region, a, b in writes:
            try:
                handle.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                region.forget_written(a, b)
                first = first or exc
        done = {id(w) for w in writes}
        with self._writes_lock:
            self._writes = [w for w in self._writes if id(w) not in done]
        if first is not None:
            raise first

    # ------------------------------------------------------------------ shadows
    def shadow(self) -> DiskArray:
        """A fresh region of the same size to write a new version into (see module doc)."""
        twin = DiskArray.__new__(DiskArray)
        twin.disk, twin.numel, twin.dtype = self.disk, self.numel, self.dtype
        twin.label = self.label
        twin.region = self.disk.allocate(self.nbytes, self.label)
        twin._writes = []
        twin._writes_lock = threading.Lock()
        twin.written = False
        return twin

    def commit(self, shadow: DiskArray) -> None:
        """Make ``shadow`` (fully written, its writes finished) this array's contents."""
        shadow.wait_writes()
        self.wait_writes()
        old = self.region
        self.region = shadow.region
        self.written = True
        shadow.region = None
        self.disk.free(old)

    def discard(self) -> None:
        """Give a shadow (or any array) back without committing; waits for its IO."""
        with self._writes_lock:
            writes, self._writes = self._writes, []
        wait_all_quiet([handle for handle, _, _, _ in writes])
        if self.region is not None and not self.region.freed:
            self.disk.free(self.region)
        self.region = None

    def free(self) -> None:
        if self.region is not None and not self.region.freed and not self.disk.closed:
            self.discard()

    def __repr__(self) -> str:
        return f"DiskArray({self.label!r}, {self.numel} x {self.dtype}, {self.region!r})"


@dataclass(frozen=True)
class DiskSlice:
    """Elements ``[start, start + numel)`` of a ``DiskArray``, seen as a tensor of ``shape``:
    how a parameter's state on disk is handed out without reading it (checkpoints
    stream it in pieces)."""

    array: DiskArray
    start: int
    numel: int
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return self.array.dtype
