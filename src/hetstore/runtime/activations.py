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

import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hetstore.config import TIERS as ACTIVATION_TIERS
from hetstore.errors import BACKWARD_AFTER_RELEASE, ConfigError, OutOfTierMemory
from hetstore.tier import Tier
from hetstore.tiers import Tiers
from hetstore.tiers.store import Store, wait_all_quiet

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
        # detached: a node that saves its own output (softmax, tanh) would otherwise hold
        # a record holding the output holding the node, a cycle through autograd's C++
        # that no collector sees. A forward dropped without its backward then leaked its
        # whole graph and the device budget it counted (measured: +823 KiB of
        # 'activations' per dropped forward of a 3-block GPT). Backward needs the values
        # only; the detached tensor shares the storage and its version counter.
        self.tensor = tensor.detach()
        self.counted = counted

    def unpack(self) -> torch.Tensor:
        return self.tensor


class _Storage:
    """One saved storage's bytes, away from the device; restored once for all its views.

    Out (at pack): the bytes are copied into a host-tier buffer -- on CUDA asynchronously
    on the hooks' side stream, the device storage held until :meth:`settle` has seen the
    copy finish -- and, for the disk tier, written from that buffer to a disk region; the
    buffer goes back to the pool once the write is done.

    In (in backward): :meth:`prefetch` starts bringing the bytes closer before they are
    needed (the disk read into host staging; on CUDA the host-to-device copy on the side
    stream); :meth:`restore` finishes whatever is left and makes the device storage all
    the views share. The host and disk copies are given back as soon as it exists.
    """

    def __init__(self, hooks: ActivationHooks, storage: torch.UntypedStorage, tier: str):
        self.hooks = hooks
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self.restored: torch.UntypedStorage | None = None
        self.group = hooks.group_index
        self.disk: Store | None = None
        self._source: torch.UntypedStorage | None = None  # kept while a copy reads it
        self._copied = None  # CUDA event of the copy out
        self._written = None  # disk write in flight from self.host
        self._staged = None  # host buffer a prefetched disk read lands in
        self._read = None
        self._incoming = None  # (device tensor, event) of a prefetched host-to-device copy
        self.host = None
        tiers = hooks.tiers
        self.host = hooks.host_buffer(max(self.nbytes, 1))
        try:
            source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            if hooks.stream is not None:
                hooks.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(hooks.stream):
                    self.host.tensor[: self.nbytes].copy_(source, non_blocking=True)
                    self._copied = torch.cuda.Event()
                    self._copied.record(hooks.stream)
                self._source = storage
            else:
                self.host.tensor[: self.nbytes].copy_(source)
            if tier is Tier.DISK:
                self.disk = tiers.of(tier).allocate_flat(self.nbytes, torch.uint8, _LABEL).data
                if self._copied is None:
                    self._start_write()
        except BaseException:
            self._give_back()
            raise

    # ------------------------------------------------------------------ out
    def _start_write(self) -> None:
        self._written = self.disk.write(self.host.tensor[: self.nbytes])

    def settle(self, wait: bool) -> bool:
        """Move the offload along: once the copy out finished, let the device storage go
        and start the disk write; once the write finished, give the host buffer back.
        With ``wait``, block until both happened. True when nothing is left in flight."""
        if self._copied is not None:
            if not wait and not self._copied.query():
                return False
            self._copied.synchronize()
            self._copied = None
            self._source = None  # the device bytes are free from here
            if self.disk is not None:
                self._start_write()
        if self._written is not None:
            if not wait and not self._written.done():
                return False
            self._written = None
            self.disk.wait_writes()  # raises the write's error, naming the file
            self.hooks.tiers.host.free(self.host)
            self.host = None
        return True

    @property
    def holds_staging(self) -> bool:
        """A host buffer held only until the disk write from it lands."""
        return self.disk is not None and self.host is not None

    # ------------------------------------------------------------------ in
    def prefetch(self, needed: bool = False) -> None:
        """Start bringing the bytes closer (see class doc). Ahead of time (not
        ``needed``) a host without room for the staging skips it: the restore reads
        then, when the saved tensors before have given their room back."""
        if self.restored is not None or self._incoming is not None or self._staged is not None:
            return
        if self.host is None:  # on disk only: read into host staging
            try:
                self._staged = self.hooks.host_buffer(max(self.nbytes, 1))
            except OutOfTierMemory:
                if needed:
                    raise
                return
            self._read = self.disk.read(self._staged.tensor[: self.nbytes])
        elif self.hooks.stream is not None and self._copied is None:
            stream = self.hooks.stream
            with torch.cuda.stream(stream):
                flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                flat.copy_(self.host.tensor[: self.nbytes], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            self._incoming = (flat, event)

    def restore(self) -> torch.UntypedStorage:
        if self.restored is not None:
            return self.restored
        self.settle(wait=True)
        hooks = self.hooks
        hooks.restores += 1
        if self._incoming is not None or self._staged is not None:
            hooks.restored_ahead += 1
        if hooks.count:
            hooks.tiers.device_tier.reserve(self.nbytes, _LABEL)
        try:
            if self._incoming is not None:
                flat, event = self._incoming
                current = torch.cuda.current_stream(self.device)
                current.wait_event(event)
                flat.record_stream(current)  # allocated on the side stream, used here
            else:
                if self.host is not None:
                    source = self.host.tensor
                else:
                    if self._staged is None:
                        self.prefetch(needed=True)
                    self._read.wait()
                    source = self._staged.tensor
                flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                flat.copy_(source[: self.nbytes])  # from host memory: done when it returns
        except BaseException:
            if hooks.count:
                hooks.tiers.device_tier.release(self.nbytes, _LABEL)
            raise
        self.restored = flat.untyped_storage()
        self._give_back()
        return self.restored

    # ------------------------------------------------------------------ lifetime
    def _give_back(self) -> None:
        """Return the host and disk copies (waits for transfers still using them)."""
        pending = [h for h in (self._read, self._written) if h is not None]
        self._read = self._written = None
        wait_all_quiet(pending)
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._source = None
        host = self.hooks.tiers.host
        for buffer in (self.host, self._staged):
            if buffer is not None:
                host.free(buffer)
        self.host = self._staged = None
        if self.disk is not None:
            self.disk.free()
            self.disk = None
        self._incoming = None

    def __del__(self) -> None:
        self._give_back()
        if self.restored is not None and self.hooks.count:
            self.hooks.tiers.device_tier.release(self.nbytes, _LABEL)


class _View:
    __slots__ = ("record", "dtype", "offset", "size", "stride")

    def __init__(self, record: _Storage, tensor: torch.Tensor):
        self.record = record
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tensor.size()
        self.stride = tensor.stride()

    def unpack(self) -> torch.Tensor:
        record = self.record
        record.hooks.backward_reached(record.group)
        storage = record.restore()
        out = torch.empty(0, dtype=self.dtype, device=record.device)
        return out.set_(storage, self.offset, self.size, self.stride)


class ActivationHooks:
    """The saved-tensor hooks of one offloaded model (see module doc).

    ``tier`` is where saved tensors of every unit go; :meth:`set_unit_tier` changes it
    for one unit (the planner's per-unit choice). The runtime's unit hooks call
    :meth:`enter_unit` / :meth:`exit_unit`, which split a forward's saved tensors into
    *groups* (the root's work before the first unit, each unit, the root's work between
    and after units): backward unpacks them group by group in reverse, and reaching a
    group prefetches the ``prefetch_depth`` groups before it.
    """

    def __init__(
        self,
        model: nn.Module,
        units,
        tiers: Tiers,
        tier: Tier | str,
        min_bytes: int,
        prefetch_depth: int = 1,
        stream: torch.cuda.Stream | None = None,
    ):
        self.units = units
        self.tiers = tiers
        self.tier = Tier(tier)
        self.min_bytes = min_bytes
        self.prefetch_depth = prefetch_depth
        self.count = tiers.device.type == "cpu"
        # CUDA: copies out of the device overlap compute, and run beside the parameter
        # copies coming in (runtime.streams.CudaStreams.activations); None on CPU
        self.stream = stream
        self._unit_tiers: dict[str, Tier] = {}
        self.note_buffers(model)
        self._flat_owners: dict[int, list] = {}  # (note_flats)
        self._records: dict[tuple[int, int], tuple[StorageWeakRef, _Storage]] = {}
        self._counted: dict[int, tuple[StorageWeakRef, _Counted]] = {}
        self._context = None
        # eager, never inlined into a torch.compile graph: packing moves bytes and counts
        # them, which a graph would replay wrongly or not at all
        self._eager_hooks = (torch.compiler.disable(self.pack), torch.compiler.disable(self.unpack))
        self._current = tier  # tier of the region forward is in
        # groups of the last forward, as weak references: autograd owns the records
        self._groups: list[list[weakref.ref]] = []
        self._prefetched: set[int] = set()
        self._unsettled: list[_Storage] = []
        self.released = False  # set by hetstore.release: the tiers are closed
        self.packed_bytes = 0  # bytes moved off the device, for tests and stats
        self.restores = 0  # storages brought back ...
        self.restored_ahead = 0  # ... of which a prefetch had started bringing

    @property
    def group_index(self) -> int:
        return len(self._groups) - 1

    def set_unit_tier(self, name: str, tier: str) -> None:
        """Send the saved tensors of unit ``name`` ('root' for work outside units) to
        ``tier``: 'none' (keep on the device), 'cpu' or 'disk'."""
        names = [u.name for u in self.units]
        if name not in names:
            raise ConfigError(f"set_unit_tier: no unit {name!r}; units are {names}")
        if tier not in ACTIVATION_TIERS:
            raise ConfigError(
                f"set_unit_tier: tier {tier!r} for unit {name!r} is not one of {ACTIVATION_TIERS}"
            )
        tier = Tier(tier)
        if tier is Tier.DISK:
            self.tiers.disk  # noqa: B018 - fails now, naming offload_path, not mid-forward
        self._unit_tiers[name] = tier

    def tier_of(self, name: str) -> Tier:
        return self._unit_tiers.get(name, self.tier)

    # ------------------------------------------------------------------ context
    def enter(self) -> None:
        if self._context is None:
            self.note_flats()
            self._groups = [[]]
            self._prefetched = set()
            self._current = self.tier_of("root")
            self._context = torch.autograd.graph.saved_tensors_hooks(*self._eager_hooks)
            self._context.__enter__()

    def exit(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)
            self._records.clear()  # only dedupe within one forward
            self._counted.clear()
            # backward starts from settled records: host memory back, writes checked
            self._settle(keep=len(self._groups), wait=True)

    def enter_unit(self, name: str) -> None:
        if self._context is not None:
            self._new_group(self.tier_of(name))

    def exit_unit(self, name: str) -> None:
        if self._context is not None:
            self._new_group(self.tier_of("root"))

    def _new_group(self, tier: str) -> None:
        self._current = tier
        if self._groups[-1]:  # an empty group (nothing between two units) is reused
            self._groups.append([])
        # the copies out of the group before last have had a unit's compute to finish
        self._settle(keep=len(self._groups) - 2, wait=True)

    def host_buffer(self, nbytes: int):
        """A host buffer for a saved tensor on its way to disk or back. Out of room, the
        writes to disk still in flight are waited for first: their staging buffers are
        held only until the write lands, and the planner counts a bounded window of them,
        not however many a slow disk leaves in flight at that moment."""
        host = self.tiers.host
        if not host.account.would_fit(nbytes) and self._writes_in_flight:
            # before the host's reclaim drops speculative steps, which cost a redo
            self._settle(keep=len(self._groups), wait=True)
        try:
            return host.allocate(nbytes, _LABEL, torch.uint8)
        except OutOfTierMemory:  # (a page-rounded or fragmented request)
            if not self._writes_in_flight:
                raise
        self._settle(keep=len(self._groups), wait=True)
        return host.allocate(nbytes, _LABEL, torch.uint8)

    @property
    def _writes_in_flight(self) -> bool:
        return any(r.holds_staging for r in self._unsettled)

    def _settle(self, keep: int, wait: bool) -> None:
        """Settle the offloads of groups before ``keep``; poll the rest."""
        still = []
        for record in self._unsettled:
            if not record.settle(wait=wait and record.group < keep):
                still.append(record)
        self._unsettled = still

    # ------------------------------------------------------------------ backward
    def backward_reached(self, group: int) -> None:
        """A saved tensor of ``group`` is being unpacked: prefetch the groups before it."""
        if self.released:
            raise ConfigError(BACKWARD_AFTER_RELEASE)
        if group in self._prefetched:
            return
        self._prefetched.add(group)
        for other in range(group - 1, max(group - 1 - self.prefetch_depth, -1), -1):
            if other in self._prefetched or other >= len(self._groups):
                continue
            for ref in self._groups[other]:
                record = ref()
                if record is not None:
                    record.prefetch()

    # ------------------------------------------------------------------ hooks
    def _managed(self, tensor: torch.Tensor) -> bool:
        """A parameter (or a view of a unit's parameters) or a buffer: the model's, not
        an activation. One lookup per saved tensor: a scan of every unit was the largest
        part of hetstore's own time in a forward of small ops (a third of it, at 13
        units)."""
        if isinstance(tensor, nn.Parameter):
            return True
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._buffer_ptrs:
            return True
        units = self._flat_owners.get(storage._cdata)
        return units is not None and any(
            u.materialized and u.compute_flat.untyped_storage()._cdata == storage._cdata
            for u in units
        )

    def note_flats(self) -> None:
        """The storages a unit's parameters can be views of (its device copy and its home,
        the one ``compute_flat`` names while fetched) and their units, by the storage's
        identity (``_cdata``), which fetches, releases, evictions and restores keep: they
        resize a storage, and its address moves. Taken at each forward's start, after the
        batch guard, which alone moves a home (``replan``); homes in host memory are
        slices of shared blocks, so one storage may be several units'."""
        owners: dict[int, list] = {}
        for u in self.units:
            flats = (u.device_flat, u.home)
            for key in {f.untyped_storage()._cdata for f in flats if isinstance(f, torch.Tensor)}:
                owners.setdefault(key, []).append(u)
        self._flat_owners = owners

    def note_buffers(self, model: nn.Module) -> None:
        """Where the model's buffers are (a saved buffer is the model's, not an
        activation): again whenever their storages moved (``hetstore.restore``)."""
        self._buffer_ptrs = {b.untyped_storage().data_ptr() for b in model.buffers()}

    def pack(self, tensor: torch.Tensor):
        # Saved tensors off the compute device stay where they are: they take none of its
        # memory (on CUDA, fused attention saves its random seed and offset on the CPU).
        if tensor.device != self.tiers.device or self._managed(tensor):
            return _Kept(tensor)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if self._current is Tier.DEVICE or nbytes < self.min_bytes:
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
            record = _Storage(self, storage, self._current)
            self._records[key] = (StorageWeakRef(storage), record)
            self._groups[-1].append(weakref.ref(record))
            self._unsettled.append(record)
            self.packed_bytes += nbytes
        return _View(record, tensor)

    def unpack(self, packed) -> torch.Tensor:
        if self.released:  # even a tensor kept on the device: the weights it needs are gone
            raise ConfigError(BACKWARD_AFTER_RELEASE)
        return packed.unpack()
