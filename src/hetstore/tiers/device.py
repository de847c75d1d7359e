"""The device tier: the accelerator's memory, or the CPU itself when there is none.

On CPU the budget (``max_device_memory``) is enforced by this accounting alone: every
device allocation hetstore makes (parameters, gradients, optimizer states on device) and
every byte saved for backward that its hooks see is reserved here first. On CUDA the
same accounting runs and ``torch.cuda.set_per_process_memory_fraction`` makes the
allocator itself refuse to pass the budget, catching memory hetstore does not see.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from hetstore.config import cuda_with_index
from hetstore.tier import Tier
from hetstore.tiers.accounting import FlatAllocation, MemoryAccount, TierUsage

__all__ = ["DeviceTier"]


class DeviceTier:
    """Allocates compute-device tensors against the device budget."""

    def __init__(
        self,
        device: torch.device,
        capacity: int | None,
        *,
        context: Callable[[str, int], list[str]] | None = None,
    ):
        device = cuda_with_index(device)
        self.device = device
        self._fraction: _FractionSet | None = None
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            if capacity is not None:
                if capacity > total:
                    capacity = total
                # Why: memory hetstore does not allocate itself (the user's activations,
                # cuBLAS workspaces) must fail inside the same budget.
                self._fraction = _FractionSet(device, capacity, total)
            else:
                capacity = total
        self.account = MemoryAccount(Tier.DEVICE, capacity, context=context)

    @property
    def capacity(self) -> int | None:
        return self.account.capacity

    def close(self) -> None:
        """Give the process its CUDA memory fraction back (``hetstore.release``)."""
        if self._fraction is not None:
            self._fraction.restore()
            self._fraction = None

    def empty(self, numel: int, dtype: torch.dtype, label: str) -> torch.Tensor:
        """An uninitialised 1-D device tensor, reserved against the budget first."""
        nbytes = numel * dtype.itemsize
        self.account.reserve(nbytes, label)
        try:
            return torch.empty(numel, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError:
            self.account.release(nbytes, label)
            raise

    def allocate_flat(self, numel: int, dtype: torch.dtype, label: str) -> FlatAllocation:
        """A flat device tensor counted against the budget until the allocation's
        ``free`` (which gives the bytes back; the storage goes with the last reference,
        since views of it, a unit's parameters, may outlive the owner's bookkeeping)."""
        tensor = self.empty(numel, dtype, label)
        nbytes = numel * dtype.itemsize
        return FlatAllocation(tensor, lambda: self.release(nbytes, label), tier=Tier.DEVICE)

    def usage(self) -> TierUsage:
        return self.account.usage()

    def free(self, tensor: torch.Tensor, label: str) -> None:
        """Release ``tensor``'s bytes from the budget and free its storage now."""
        self.account.release(tensor.numel() * tensor.element_size(), label)
        tensor.untyped_storage().resize_(0)

    def reserve(self, nbytes: int, label: str) -> None:
        self.account.reserve(nbytes, label)

    def release(self, nbytes: int, label: str) -> None:
        self.account.release(nbytes, label)


class _FractionSet:
    """The process-wide CUDA memory fraction this tier set, and the one it replaced.

    Restored when the model is released or garbage-collected, but only if nobody set
    another since (a later model's budget, or the user): the fraction is one per process,
    so the newest setting wins and is never undone by an older model going away.
    """

    def __init__(self, device: torch.device, capacity: int, total: int):
        previous = _fraction_of(device)
        torch.cuda.set_per_process_memory_fraction(capacity / total, device)
        self.restore = weakref.finalize(
            self, _restore_fraction, device, capacity, total, 1.0 if previous is None else previous
        )
        self.restore.atexit = False


def _fraction_of(device: torch.device) -> float | None:
    """The fraction in force (None on a torch too old to tell)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return None if getter is None else getter(device)


def _restore_fraction(device: torch.device, capacity: int, total: int, previous: float) -> None:
    now = _fraction_of(device)
    # the allocator keeps the fraction as whole bytes (fraction x total, truncated), so
    # compare in bytes, within the truncation
    if now is not None and abs(now * total - capacity) > 2:
        return  # set again since: not ours to undo
    torch.cuda.set_per_process_memory_fraction(previous, device)
