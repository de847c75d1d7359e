"""Tensors saved for backward: counted against the device budget, and offloaded.

``torch.autograd.graph.saved_tensors_hooks`` are entered for the whole forward of the
model (a forward hook with ``always_call`` leaves them even if forward raises). Every
tensor autograd saves passes through :meth:`ActivationHooks.pack`:

- parameters and module buffers (or views of them), which hetstore manages already, are
  kept as they are and not counted (their bytes are counted as model data);
- on a CPU "device", every other tensor kept on the device is **counted** against
  ``max_device_memory`` from the moment it is saved until autograd drops it (after its
  backward node ran, or when the graph is freed). That is what "activations" means in
  the CPU device accounting: exactly the bytes saved for backward, once per storage
  (temporaries that are freed inside forward are not counted; on CUDA the allocator
  enforces the budget and nothing is counted here);
- with ``offload_activations='cpu'|'disk'``, tensors of at least ``activation_min_bytes``
  are copied to the host tier (or through it to the disk tier) and their device copy is
  dropped; in backward they come back when unpacked.

A storage saved twice (a tensor used by two ops, or several views of one base, such as
the q/k/v split of an attention projection) is copied once: records are keyed by the
storage (checked alive with a weak reference) and its version counter, and each saved
view is rebuilt with its own offset, size and stride on the one restored storage, so
aliasing survives. Regions under ``torch.utils.checkpoint`` (non-reentrant) enter their
own hooks inside ours, so what they save is theirs: not copied twice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hetstore.runtime.flat import DiskArray
from hetstore.tiers import Tiers

__all__ = ["ActivationHooks"]

_LABEL = "activations"


class _Counted:
    """Device bytes of one kept storage, reserved while any saved reference to it lives."""

    __slots__ = ("tiers", "nbytes")

    def __init__(self, tiers: Tiers, nbytes: int):
        self.tiers = None  # a failed reserve leaves nothing to release
        tiers.device_tier.reserve(nbytes, _LABEL)
        self.tiers = tiers
        self.nbytes = nbytes

    def __del__(self) -> None:
        if self.tiers is not None:
            self.tiers.device_tier.release(self.nbytes, _LABEL)


class _Kept:
    """A saved tensor left on the device (with its storage's count, if counted)."""

    __slots__ = ("tensor", "counted")

    def __init__(self, tensor: torch.Tensor, counted: _Counted | None = None):
        self.tensor = tensor
        self.counted = counted

    def unpack(self) -> torch.Tensor:
        return self.tensor


class _Storage:
    """One saved storage's bytes, away from the device; restored once for all its views."""

    def __init__(self, storage: torch.UntypedStorage, tiers: Tiers, tier: str, count: bool):
        self.tiers = tiers
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self.count = count  # reserve device bytes while restored (CPU accounting)
        self.restored: torch.UntypedStorage | None = None
        source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        self.host = tiers.host.allocate(max(self.nbytes, 1), _LABEL, torch.uint8)
        self.host.tensor[: self.nbytes].copy_(source)
        self.disk: DiskArray | None = None
        if tier == "disk":
            self.disk = DiskArray(tiers.disk, self.nbytes, torch.uint8, _LABEL)
            try:
                self.disk.write_all(self.host.tensor[: self.nbytes])
            finally:
                tiers.host.free(self.host)
                self.host = None

    def restore(self) -> torch.UntypedStorage:
        if self.restored is None:
            if self.count:
                self.tiers.device_tier.reserve(self.nbytes, _LABEL)
            flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            if self.disk is not None:
                staging = self.tiers.host.allocate(max(self.nbytes, 1), _LABEL, torch.uint8)
                try:
                    self.disk.read(staging.tensor[: self.nbytes]).wait()
                    flat.copy_(staging.tensor[: self.nbytes])
                finally:
                    self.tiers.host.free(staging)
            else:
                flat.copy_(self.host.tensor[: self.nbytes])
            self.restored = flat.untyped_storage()
        return self.restored

    def __del__(self) -> None:
        if self.host is not None:
            self.tiers.host.free(self.host)
        if self.disk is not None:
            self.disk.free()
        if self.restored is not None and self.count:
            self.tiers.device_tier.release(self.nbytes, _LABEL)


class _View:
    __slots__ = ("record", "dtype", "offset", "size", "stride")

    def __init__(self, record: _Storage, tensor: torch.Tensor):
        self.record = record
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tensor.size()
        self.stride = tensor.stride()

    def unpack(self) -> torch.Tensor:
        storage = self.record.restore()
        out = torch.empty(0, dtype=self.dtype, device=self.record.device)
        return out.set_(storage, self.offset, self.size, self.stride)


class ActivationHooks:
    """The saved-tensor hooks of one offloaded model (see module doc)."""

    def __init__(self, model: nn.Module, units, tiers: Tiers, tier: str, min_bytes: int):
        self.units = units
        self.tiers = tiers
        self.tier = tier
        self.min_bytes = min_bytes
        self.count = tiers.device.type == "cpu"
        self._buffer_ptrs = {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._records: dict[tuple[int, int], tuple[StorageWeakRef, _Storage]] = {}
        self._counted: dict[int, tuple[StorageWeakRef, _Counted]] = {}
        self._context = None
        self.packed_bytes = 0  # bytes moved off the device, for tests and stats

    # ------------------------------------------------------------------ context
    def enter(self) -> None:
        if self._context is None:
            self._context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._context.__enter__()

    def exit(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)
            self._records.clear()  # only dedupe within one forward
            self._counted.clear()

    # ------------------------------------------------------------------ hooks
    def _managed(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter):
            return True
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self._buffer_ptrs:
            return True
        return any(
            u.materialized and u.device_flat.untyped_storage().data_ptr() == ptr for u in self.units
        )

    def pack(self, tensor: torch.Tensor):
        if tensor.device.type == "meta" or self._managed(tensor):
            return _Kept(tensor)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if self.tier == "none" or nbytes < self.min_bytes:
            if not self.count:
                return _Kept(tensor)
            found = self._counted.get(storage.data_ptr())
            if found is not None and not found[0].expired():
                counted = found[1]
            else:
                counted = _Counted(self.tiers, nbytes)
                self._counted[storage.data_ptr()] = (StorageWeakRef(storage), counted)
            return _Kept(tensor, counted)
        key = (storage.data_ptr(), tensor._version)
        found = self._records.get(key)
        if found is not None and not found[0].expired():
            record = found[1]
        else:
            record = _Storage(storage, self.tiers, self.tier, self.count)
            self._records[key] = (StorageWeakRef(storage), record)
            self.packed_bytes += nbytes
        return _View(record, tensor)

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        return packed.unpack()
