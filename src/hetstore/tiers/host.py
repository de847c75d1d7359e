"""The host tier: a pool of page-aligned blocks sub-allocated into slices.

Blocks of ``host_mem_block_size`` are mapped lazily, never past ``offload_cpu_size``
(the last block shrinks to fit), and carved into page-aligned slices with a first-fit
free list that coalesces neighbours on free. Page alignment makes every slice a valid
O_DIRECT buffer for the disk tier. A request larger than half a block gets a block of
its own, of its exact size: in a shared block it would leave a tail that later large
requests cannot use, and under a capacity the sum of those tails is what a plan counted
on (measured on a 10B Llama under a 12 GiB budget: its 772 MiB and 1000 MiB buffers,
one to a 1 GiB block, stranded tails until 'grad staging 2' found no room with 1.17 GiB
of the budget unused). When the room for a new block is short, fully free blocks kept
as spares are unmapped first.

Lifetimes: buffers that live for the run (staging, masters, states) are carved from the
bottom of the free ranges, and *transient* ones that one step or one scan makes and
frees again (the optimizer step's chunk buffers, the worker's, a read ahead) from the
top. Mixed in one first-fit order, the transient ones left holes between persistent
ones that the next step's equal-sized sets no longer fitted in (measured: an all-on-disk
GPT under a 512 MiB budget, 47.75 MiB free in pieces, failed its first step asking for
32 MiB).

Pinning: with a CUDA device and ``enable_pinned_mem`` ``'auto'`` (the default) or True,
each block is registered with ``cudaHostRegister`` as a whole, so reserved == what the
user asked for (PyTorch's pinned caching allocator rounds to powers of two: 20 GiB asked
can pin 32 GiB). Without an accelerator blocks stay pageable: silently under ``'auto'``
(pinning only speeds up copies to an accelerator), with one warning when True was asked
for. When registration fails (memlock limit) they stay pageable with one warning. Both
warnings point at the user's line (hetstore._warn).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetstore._sizes import format_size
from hetstore._warn import warn_at_caller
from hetstore.errors import OutOfTierMemory
from hetstore.tier import Tier
from hetstore.tiers.accounting import FlatAllocation, MemoryAccount, TierUsage
from hetstore.tiers.hostmem import PAGE_SIZE, MappedBlock, round_up

__all__ = ["HostTier", "HostBuffer", "PinnedMemoryWarning"]


class PinnedMemoryWarning(UserWarning):
    """Host memory could not be pinned; copies to the device will be slower."""


@dataclass(eq=False)
class _Block:
    mapping: MappedBlock
    # Free ranges as parallel sorted lists of offsets and sizes.
    free_offsets: list[int] = field(default_factory=list)
    free_sizes: list[int] = field(default_factory=list)
    used: int = 0

    @property
    def nbytes(self) -> int:
        return self.mapping.nbytes

    def take(self, size: int) -> int | None:
        """First-fit: carve ``size`` bytes from the lowest free range that holds them."""
        for i, free in enumerate(self.free_sizes):
            if free >= size:
                offset = self.free_offsets[i]
                if free == size:
                    del self.free_offsets[i], self.free_sizes[i]
                else:
                    self.free_offsets[i] += size
                    self.free_sizes[i] -= size
                self.used += size
                return offset
        return None

    def take_top(self, size: int) -> int | None:
        """Last-fit: carve ``size`` bytes from the top of the highest free range that
        holds them (transient buffers: see the module doc)."""
        for i in range(len(self.free_sizes) - 1, -1, -1):
            free = self.free_sizes[i]
            if free >= size:
                offset = self.free_offsets[i] + free - size
                if free == size:
                    del self.free_offsets[i], self.free_sizes[i]
                else:
                    self.free_sizes[i] -= size
                self.used += size
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        """Return a range, merging it with the free neighbours on either side."""
        i = bisect.bisect_left(self.free_offsets, offset)
        if i > 0 and self.free_offsets[i - 1] + self.free_sizes[i - 1] == offset:
            i -= 1
            self.free_sizes[i] += size
        else:
            self.free_offsets.insert(i, offset)
            self.free_sizes.insert(i, size)
        nxt = i + 1
        if (
            nxt < len(self.free_offsets)
            and self.free_offsets[i] + self.free_sizes[i] == (self.free_offsets[nxt])
        ):
            self.free_sizes[i] += self.free_sizes[nxt]
            del self.free_offsets[nxt], self.free_sizes[nxt]
        self.used -= size


def own_version_counter(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as ``tensor`` under a version counter of its own.

    A view shares its base's counter, so every buffer carved out of one host block would
    count every in-place change of every other; the step ahead
    (:mod:`hetstore.optim.step_ahead`) reads a gradient buffer's counter to tell whether
    anyone changed it, and its own fused step (torch declares the gradients mutable)
    must not move it either."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


@dataclass(eq=False)
class HostBuffer:
    """A slice of the host pool. ``tensor`` is valid until ``HostTier.free(buffer)``."""

    tensor: torch.Tensor
    nbytes: int  # bytes asked for (the slice is rounded up to a page)
    label: str
    _block: _Block
    _offset: int
    _size: int


class HostTier:
    """Host memory pool with capacity, accounting and optional pinning."""

    def __init__(
        self,
        *,
        capacity: int | None,
        block_size: int,
        pin: bool | str,
        device: torch.device,
        context: Callable[[str, int], list[str]] | None = None,
    ):
        self.block_size = round_up(block_size, PAGE_SIZE)
        self.account = MemoryAccount(Tier.HOST, capacity, context=context)
        self._blocks: list[_Block] = []
        self._reserved = 0
        self._pin = pin in (True, "auto") and device.type == "cuda"
        if pin is True and device.type != "cuda":
            warn_at_caller(
                "enable_pinned_mem=True but the compute device is "
                f"{device.type!r}: host blocks stay pageable (pinning only speeds up "
                "host<->accelerator copies; the default 'auto' pins on CUDA only)",
                PinnedMemoryWarning,
            )
        self.pinned = self._pin
        # set by the optimizer's step ahead: gives back host memory held only to save
        # time (speculative steps' shadows); True when it freed some
        # memory held only to save time, given back when room runs out: each returns
        # True when it freed something (the step engine's lent buffers, evict's copies)
        self.reclaimers: list[Callable[[], bool]] = []

    @property
    def capacity(self) -> int | None:
        return self.account.capacity

    @property
    def reserved(self) -> int:
        """Bytes mapped from the OS (blocks), as opposed to ``account.current`` (slices in use)."""
        return self._reserved

    def stats(self) -> dict[str, int | None]:
        usage = self.account.usage()
        return {**usage.as_dict(), "reserved": self._reserved, "blocks": len(self._blocks)}

    def allocate(
        self,
        nbytes: int,
        label: str,
        dtype: torch.dtype = torch.uint8,
        *,
        transient: bool = False,
    ) -> HostBuffer:
        """A page-aligned slice of at least ``nbytes``, viewed as ``nbytes // itemsize`` dtype.
        ``transient``: freed again within a step (carved from the top, see module doc).
        Out of room, memory held only to save time is given back first (``reclaimers``)."""
        while True:
            try:
                return self._allocate(nbytes, label, dtype, transient)
            except OutOfTierMemory:
                if not any(reclaim() for reclaim in list(self.reclaimers)):
                    raise

    def _allocate(self, nbytes: int, label: str, dtype: torch.dtype, transient: bool) -> HostBuffer:
        if nbytes % dtype.itemsize:
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
        size = round_up(max(nbytes, 1), PAGE_SIZE)
        self.account.reserve(size, label)
        try:
            block, offset = self._find_or_grow(size, label, transient)
        except BaseException:
            self.account.release(size, label)
            raise
        view = own_version_counter(block.mapping.tensor[offset : offset + nbytes].view(dtype))
        return HostBuffer(view, nbytes, label, block, offset, size)

    def allocate_flat(self, numel: int, dtype: torch.dtype, label: str) -> FlatAllocation:
        """A flat ``numel``-element tensor owned until the allocation's ``free``."""
        buffer = self.allocate(numel * dtype.itemsize, label, dtype)
        return FlatAllocation(
            buffer.tensor,
            lambda: self.free(buffer),
            lambda new: self.rename(buffer, new),
            tier=Tier.HOST,
        )

    def rename(self, buffer: HostBuffer, label: str) -> None:
        """Account ``buffer``'s bytes under ``label`` from now on (same bytes: it fits)."""
        self.account.release(buffer._size, buffer.label)
        self.account.reserve(buffer._size, label)
        buffer.label = label

    def usage(self) -> TierUsage:
        return self.account.usage()

    def free(self, buffer: HostBuffer) -> None:
        if buffer._block is None:
            raise ValueError(f"host buffer {buffer.label!r} was already freed")
        block = buffer._block
        block.give_back(buffer._offset, buffer._size)
        self.account.release(buffer._size, buffer.label)
        buffer._block = None
        buffer.tensor = None
        if block.used == 0:
            self._retire_spare_blocks(keep=block)

    def close(self) -> None:
        for block in self._blocks:
            block.mapping.release()
        self._blocks.clear()
        self._reserved = 0

    # ------------------------------------------------------------------ internals
    def _find_or_grow(self, size: int, label: str, transient: bool) -> tuple[_Block, int]:
        blocks = reversed(self._blocks) if transient else self._blocks
        for block in blocks:
            offset = block.take_top(size) if transient else block.take(size)
            if offset is not None:
                return block, offset
        block = self._grow(size, label)
        offset = block.take_top(size) if transient else block.take(size)
        assert offset is not None
        return block, offset

    def _grow(self, size: int, label: str) -> _Block:
        want = size if 2 * size > self.block_size else self.block_size
        if self.capacity is not None:
            if self.capacity - self._reserved < size:
                self._retire_spare_blocks(keep=None)
            room = self.capacity - self._reserved
            if room < size:
                err = self.account.overflow_error(size, label)
                err.args = (
                    err.args[0] + f"\n  host pool: {format_size(self._reserved)} reserved in "
                    f"{len(self._blocks)} blocks, {format_size(self.account.current)} used "
                    "(the rest is fragmentation or a partly filled last block)",
                )
                raise err
            want = min(want, room - room % PAGE_SIZE)
        mapping = MappedBlock(want)
        if self._pin:
            try:
                mapping.register_cuda()
            except RuntimeError as exc:
                warn_at_caller(
                    f"could not pin a {format_size(want)} host block ({exc}); continuing with "
                    "pageable memory. Raise the memlock limit (ulimit -l) or set "
                    "enable_pinned_mem=False to silence this.",
                    PinnedMemoryWarning,
                )
                self._pin = False
                self.pinned = False
        block = _Block(mapping, [0], [mapping.nbytes])
        self._blocks.append(block)
        self._reserved += mapping.nbytes
        return block

    def _retire_spare_blocks(self, keep: _Block | None) -> None:
        """Unmap fully free blocks except ``keep``, kept so a free/allocate cycle does not
        remap (None: every free block, to make room for a new one)."""
        for block in [b for b in self._blocks if b.used == 0 and b is not keep]:
            self._blocks.remove(block)
            self._reserved -= block.nbytes
            block.mapping.release()
