"""Where a unit's device copy stands, and its movement (the ``DeviceResidency`` part of
a Unit).

``device_flat`` is the compute-dtype copy on the device; every ``nn.Parameter`` of the
unit is a view into it. When the unit is released its *storage* is resized to 0
(FSDP2's trick): the Parameter objects, and autograd's references to them, stay valid;
the bytes go. On a CPU device a home in host memory is not copied: the parameters are
pointed at views of ``home`` itself while fetched (``Residency.IN_PLACE``), and back at
``device_flat``'s byte-less views on release. The device budget is charged the same.

A disk home comes to the device through the unit's ``param_stager``; sharded, a fetch
all-gathers every rank's shard into ``device_flat``.
"""

from __future__ import annotations

import contextlib
from enum import Enum

import torch

from hetstore.errors import OutOfTierMemory
from hetstore.runtime import released, upload
from hetstore.runtime.layout import ParamEntry
from hetstore.tiers.store import read_into, transfers_only

__all__ = ["DeviceResidency", "Residency"]


class Residency(Enum):
    """Where a unit's device copy stands (``Unit.residency``)."""

    RELEASED = "released"  # no bytes: the parameters carry runtime.released's layer
    FETCHING = "fetching"  # bytes allocated, a CUDA copy in flight (``ready_event``)
    PRESENT = "present"  # the parameters are on the device, plain nn.Parameter views
    # on a CPU device, host memory is the device's: the parameters are views of a home
    # there, used in place (``Unit.fetches_in_place``); nothing was copied
    IN_PLACE = "in place"


class DeviceResidency:
    """The residency concern of a :class:`~hetstore.runtime.unit.Unit` (see the module
    doc). State it owns: ``residency``, ``ready_event``, ``device_flat``,
    ``_flat_views``."""

    def init_residency(self) -> None:
        self.residency = Residency.RELEASED
        self.ready_event = None  # CUDA event guarding an in-flight fetch (FETCHING)

    @property
    def materialized(self) -> bool:
        """The device copy has its bytes (present, or being copied in on a CUDA stream:
        the compute stream waits with :meth:`wait_ready` before use)."""
        return self.residency is not Residency.RELEASED

    def take_flat_views(self) -> None:
        """Each parameter's view of ``device_flat``, kept: a view can be taken only while
        its storage has bytes, and the parameters come back to these after an in-place
        use or a lent copy."""
        self._flat_views = [
            self.device_flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries
        ]

    @property
    def device_bytes(self) -> int:
        """Bytes of the full unit in the compute dtype: what a fetch puts on the device."""
        return self.full_numel * self.compute_dtype.itemsize

    def fetch(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make the parameters present on the device (idempotent).

        With a CUDA ``stream`` the copy is issued there and ``ready_event`` records it;
        ``wait_ready`` makes the compute stream wait before use.
        """
        self.barrier()
        if self.materialized:
            return
        if self.home_stale:  # a failed step left the disk copy behind the master
            self.refresh_from_master()
        self.tiers.device_tier.reserve(self.device_bytes, self.label("params"))
        if self.fetches_in_place:
            self.residency = Residency.IN_PLACE
            self.expose_params()
            self.point_params(self.home)
            return
        try:
            source, slot = self.home, None
            if transfers_only(self.home):
                slot, source = self.param_stager.take(self)
            storage = self.device_flat.untyped_storage()
            if stream is not None:
                # Allocated on the compute stream, where the parameters are used and
                # freed: one pool, whose freed blocks the next fetch reuses. A block
                # allocated on the copy stream stays cached in that stream's pool, out of
                # compute's reach: on an H100 the demo stopped over its budget with 95 MiB
                # stranded so. The copy waits for compute queued before it, which may
                # still be using the block's previous tenant.
                storage.resize_(self.device_bytes)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._fill_device_flat(source, non_blocking=True)
                    self.ready_event = torch.cuda.Event()
                    self.ready_event.record(stream)
            else:
                storage.resize_(self.device_bytes)
                self._fill_device_flat(source, non_blocking=False)
        except BaseException:
            self.device_flat.untyped_storage().resize_(0)
            self.tiers.device_tier.release(self.device_bytes, self.label("params"))
            raise
        if slot is not None:
            self.param_stager.give_back(slot, self.ready_event)
        self.residency = Residency.PRESENT if self.ready_event is None else Residency.FETCHING
        self.expose_params()

    @property
    def fetches_in_place(self) -> bool:
        """A fetch points the parameters at ``home`` instead of copying it into
        ``device_flat``: on a CPU device a home in host memory is in the device's memory
        already (DeepSpeed uses its CPU tensors in place too). A copy there cost a
        freshly page-faulted buffer and a memcpy per fetch, two fetches a step. The
        device budget is still charged while fetched, so plans and budgets are those of
        an accelerator. (A disk home's staging buffer is not used so: it serves other
        units after the release, and the planner's host peak does not allow for one
        held through the unit's compute.)"""
        return (
            self.device.type == "cpu"
            and self.shards is None
            and self.device_flat is not self.home
            and not transfers_only(self.home)
        )

    @property
    def compute_flat(self) -> torch.Tensor:
        """The flat tensor the parameters are views of while fetched."""
        return self.home if self.residency is Residency.IN_PLACE else self.device_flat

    def point_params(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of ``flat`` (the home, used in place)."""
        for e in self.entries:
            e.param.data = flat[e.offset : e.offset + e.numel].view(e.shape)

    def point_params_at_device_flat(self) -> None:
        """Make every parameter its view of ``device_flat`` again (bytes or none)."""
        for e, view in zip(self.entries, self._flat_views, strict=True):
            e.param.data = view

    def restore_param_views(self) -> None:
        """Point the parameters back at the unit's own bytes after something pointed
        them elsewhere (state_dict's master views); a released unit's are concealed."""
        if self.residency is Residency.IN_PLACE:
            self.point_params(self.home)
            return
        self.point_params_at_device_flat()
        if not self.materialized:
            self.conceal_params()

    def expose_params(self) -> None:
        """The parameters are plain ``nn.Parameter`` views of ``device_flat`` (its bytes
        are there, or the caller points them elsewhere: state_dict's master views)."""
        for e in self.entries:
            released.expose(e.param)

    def conceal_params(self) -> None:
        """``device_flat`` has no bytes: reads of the parameters are served from home,
        writes refused (:mod:`hetstore.runtime.released`), instead of touching freed memory."""
        for e in self.entries:
            released.conceal(e.param)

    def read_param(self, entry: ParamEntry) -> torch.Tensor:
        """One parameter's current value as forward sees it (compute dtype, on the
        device, a fresh tensor), for a read while the unit is released: from ``home``
        (from the master while a disk home is behind it)."""
        self.barrier()
        start, n = entry.offset, entry.numel
        source, dtype = self.home, self.compute_dtype
        if self.home_stale and start < self.master_numel:
            source, dtype = self.master, torch.float32
        if not transfers_only(source):
            value = source[start : start + n]
            return value.to(self.device, self.compute_dtype, copy=True).view(entry.shape)
        staged = self.scratch(n, dtype, "parameter read")
        try:
            value = staged.tensor[:n]
            read_into(source, value, start)
            return value.to(self.device, self.compute_dtype, copy=True).view(entry.shape)
        finally:
            self.tiers.host.free(staged)

    def _fill_device_flat(self, source: torch.Tensor, non_blocking: bool) -> None:
        """Copy ``source`` (this rank's compute-dtype parameters) into ``device_flat``;
        sharded, all-gather every rank's into it (on the current stream)."""
        if self.shards is None:
            self.device_flat.copy_(source, non_blocking=non_blocking)
            return
        shard = source.to(self.device, non_blocking=non_blocking)
        self.shards.all_gather(self.device_flat, shard, self.collective("the parameters"))

    def prefetch(self) -> None:
        """Start bringing the parameters closer without waiting: a disk read into staging."""
        if (
            transfers_only(self.home)
            and not self.materialized
            and not self.home_stale
            and not self.work_pending  # its home is about to change: read it after
        ):
            self.param_stager.prefetch(self)

    def wait_ready(self) -> None:
        if self.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready_event)
            self.ready_event = None
            self.residency = Residency.PRESENT

    def release(self) -> None:
        """Free the device copy unless the parameters live on the device."""
        if self.residency is Residency.IN_PLACE:
            self.point_params_at_device_flat()  # no bytes: the home is not theirs to keep
            self._mark_released()
            return
        if not self.has_device_copy:
            return
        self.wait_ready()
        # allocated on the compute stream and freed there (see fetch): the allocator
        # reuses the block only for work queued after what used it
        self.device_flat.untyped_storage().resize_(0)
        self._mark_released()

    def _mark_released(self) -> None:
        """The device copy's bytes are gone (freed, lent, or never copied): give the
        device budget back and conceal the parameters."""
        self.tiers.device_tier.release(self.device_bytes, self.label("params"))
        self.residency = Residency.RELEASED
        self.conceal_params()

    @property
    def has_device_copy(self) -> bool:
        """The parameters are fetched into a device copy apart from ``home`` (not used in
        place, and ``home`` is not on the device itself), which writes to ``home`` must
        update too."""
        return self.materialized and self.compute_flat is not self.home

    def write_device_copy(self, values: torch.Tensor, start: int = 0) -> None:
        """Write ``values`` (compute dtype or castable) into the device copy from element
        ``start``, if there is one. A fetch still copying in on a CUDA stream would land
        over them: the write waits for it first."""
        if not self.has_device_copy:
            return
        self.wait_ready()
        self.copy_cast(self.device_flat[start : start + values.numel()], values)

    def copy_cast(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """``dst.copy_(values)``; host values cast onto the device go through pinned host
        scratch of ``dst``'s dtype (runtime.upload: torch's own way is a pageable,
        synchronous copy after a cast on the host, 4x slower)."""
        host = self.tiers.host
        nbytes = upload.staging_numel(values.numel()) * dst.dtype.itemsize
        staged = None
        # pageable staging would gain nothing; with no room in the host budget, torch's
        # way (slower) rather than taking back memory held to save time, or failing
        if upload.needs_staging(dst, values) and host.pinned and host.account.would_fit(nbytes):
            with contextlib.suppress(OutOfTierMemory):
                staged = host.allocate(
                    nbytes, self.label("upload staging"), dst.dtype, transient=True
                )
        if staged is None:
            dst.copy_(values)
            return
        try:
            upload.upload_cast(dst, values, staged.tensor)
        finally:
            host.free(staged)

    @contextlib.contextmanager
    def device_scratch(self, numel: int, dtype: torch.dtype, what: str):
        """A transient device tensor, counted against the device budget while it lives."""
        nbytes, label = numel * dtype.itemsize, self.label(what)
        self.tiers.device_tier.reserve(nbytes, label)
        try:
            yield torch.empty(numel, dtype=dtype, device=self.device)
        finally:
            self.tiers.device_tier.release(nbytes, label)
