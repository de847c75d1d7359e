"""One unit's parameters in every form, and their movement between tiers.

A unit is split by concern:

- **layout** (:mod:`hetstore.runtime.layout`, ``Unit.layout``): where each parameter
  sits in the flat buffers, a pure function of the parameters, fixed at construction;
- **buffers per role** (here): the forms below, each allocated on its tier;
- **residency** (here): ``fetch`` / ``release`` / ``prefetch`` of the device copy, with
  ``ready_event`` naming an in-flight CUDA copy, and reads of a released parameter;
- **the gradient sink** (:mod:`hetstore.runtime.grad_sink`, ``Unit.grads``): where
  backward's gradients go and the state of filling them.

Forms of a unit's parameters (all flat, 1-D, one element per parameter element, in the
layout's order):

- ``master``: fp32, on the optimizer's tier (device, host or disk). The source of truth
  for elements ``[0, master_numel)``: every parameter except frozen ones that are already
  in the compute dtype, which sit last in the layout and live only in ``home`` (a LoRA
  model's bf16 base has no fp32 copy; nothing ever changes it).
- ``home``: compute dtype, where the parameters live between uses (``offload_param``);
  aliases ``master`` when dtype and tier agree (fp32 on host, say), so nothing is stored twice.
- ``device_flat``: compute dtype on the device; every ``nn.Parameter`` of the unit is a
  view into it. When the unit is released its *storage* is resized to 0 (FSDP2's trick):
  the Parameter objects, and autograd's references to them, stay valid; the bytes go.
  On a CPU device a home in host memory is not copied: the parameters are pointed at
  views of ``home`` itself while fetched (``Residency.IN_PLACE``), and back at
  ``device_flat``'s byte-less views on release. The device budget is charged the same.
- ``grad`` (``grads.buffer``): fp32 on the gradient tier, accumulated across micro-batches.

On a tier that is not addressable (disk) a form is a
:class:`~hetstore.tiers.store.Store`, not a tensor:
parameters come to the device through the runtime's :class:`ParamStager`, gradients go
out through its :class:`GradStager`, and the optimizer streams master and states.

Sharded over ranks (ZeRO-3, :mod:`hetstore.runtime.sharding`): the *full* layout (see
runtime.layout) is what ``device_flat`` holds; ``master``, ``home``, ``grad`` and the
optimizer states hold only this rank's shard, so the optimizer steps a shard exactly as
it steps a whole unit. ``fetch`` all-gathers the shards into ``device_flat``; gradients
are gathered whole in a device bucket and reduce-scattered (averaged) by
:meth:`GradSink.reduce` when the unit's backward is done.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetstore.runtime import released
from hetstore.runtime.events import Event, Events
from hetstore.runtime.grad_sink import GradSink
from hetstore.runtime.layout import ParamEntry, Segment, UnitLayout
from hetstore.runtime.rewrite import ChunkedRewrite
from hetstore.tier import Tier
from hetstore.tiers import HostBuffer, Tiers
from hetstore.tiers.accounting import FlatAllocation
from hetstore.tiers.flat import ALIGN_ELEMENTS
from hetstore.tiers.store import FlatBuffer, read_into, transfers_only, write_from

if TYPE_CHECKING:
    from hetstore.runtime.sharding import ShardGroup
    from hetstore.runtime.staging import GradStager, ParamStager

__all__ = ["MasterMove", "ParamEntry", "Placement", "Residency", "Segment", "Unit"]


class Residency(Enum):
    """Where a unit's device copy stands (``Unit.residency``)."""

    RELEASED = "released"  # no bytes: the parameters carry runtime.released's layer
    FETCHING = "fetching"  # bytes allocated, a CUDA copy in flight (``ready_event``)
    PRESENT = "present"  # the parameters are on the device, plain nn.Parameter views
    # on a CPU device, host memory is the device's: the parameters are views of a home
    # there, used in place (``Unit.fetches_in_place``); nothing was copied
    IN_PLACE = "in place"


@dataclass(eq=False)
class MasterMove:
    """A move of a unit's master and gradients under way (``Unit.prepare_master_move``):
    the new buffers, made and written, not yet the unit's."""

    tier: Tier
    master: FlatAllocation
    grads: FlatAllocation | None = None


@dataclass(frozen=True)
class Placement:
    """Where one unit's pieces live."""

    param: Tier
    optimizer: Tier
    grad: Tier

    def __post_init__(self):  # config spellings ('none', 'cpu', 'disk') are accepted
        for name in ("param", "optimizer", "grad"):
            object.__setattr__(self, name, Tier(getattr(self, name)))


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
        *,
        shards: ShardGroup | None = None,
        align: int = ALIGN_ELEMENTS,
        defer_disk_grad: bool = False,
        events: Events | None = None,
    ):
        self.index = index
        # the model's bus (runtime.events): the unit publishes reads and rewrites on it
        self.events = events if events is not None else Events()
        self.shards = shards
        # segment starts (and shard sizes) are multiples of this: 4096 bytes of the
        # narrowest array the unit keeps (BYTE_ALIGN_ELEMENTS with 8-bit states)
        self.align = align
        self.name = name
        self.placement = placement
        self.tiers = tiers
        self.device = tiers.device
        self.compute_dtype = compute_dtype

        aliased = placement.param == placement.optimizer and compute_dtype == torch.float32
        self.layout = UnitLayout.build(
            params, compute_dtype, align=align, shards=shards, master_is_home=aliased
        )
        self._owned: list[FlatAllocation] = []  # every buffer allocate() made
        self.residency = Residency.RELEASED
        self.ready_event = None  # CUDA event guarding an in-flight fetch (FETCHING)
        # set by the runtime when some form lives on disk
        self.param_stager: ParamStager | None = None
        self.grad_stager: GradStager | None = None
        self.home_stale = False  # master changed but a disk ``home`` not yet rewritten
        # counts rewrites of the master or of the optimizer states kept for it (loads,
        # edits, an ordinary streamed step): a step taken ahead from older ones is stale
        # (hetstore.optim.step_ahead)
        self.state_version = 0
        # moves whenever the parameters' values may have changed (a step, a load, an
        # edit): an alias read while released (``p.detach()``) reads them again then
        self.param_version = 0
        # set by whoever queued work that changes the unit (its optimizer step running
        # on during the next forward): every use of the unit's parameters, master,
        # states or gradients goes through barrier() first, which lands that work
        self.work_pending = False
        # the root: backward releases it only once it is over (not when its gradients
        # are final), so its device copy is never lent away before that
        self.released_after_backward = False
        self._build(defer_disk_grad)

    def barrier(self) -> None:
        """The one way a reader waits for pending work on this unit (a step still running
        for it during the next forward): publishes ``UNIT_READ``, and whoever queued the
        work lands it before this returns. Every read of the parameters, master, states
        or gradients, and every rewrite, calls it first."""
        if self.work_pending:
            self.events.publish(Event.UNIT_READ, self)

    @property
    def closed(self) -> bool:
        """``close()`` freed every buffer (``hetstore.release``)."""
        return self.master is None

    @property
    def materialized(self) -> bool:
        """The device copy has its bytes (present, or being copied in on a CUDA stream:
        the compute stream waits with :meth:`wait_ready` before use)."""
        return self.residency is not Residency.RELEASED

    # ------------------------------------------------------------------ the layout
    # (runtime.layout: fixed at construction; read everywhere, hence these names)
    @property
    def entries(self) -> list[ParamEntry]:
        return self.layout.entries

    @property
    def trainable_entries(self) -> list[ParamEntry]:
        return self.layout.trainable_entries

    @property
    def has_untracked_params(self) -> bool:
        """Whether autograd may still read some of its parameters once its gradients are
        in: ones outside the optimizer, or the optimizer's frozen since ``offload()`` (as
        the last forward ran: a user freezes and unfreezes between steps)."""
        return self.layout.has_untracked_params or not all(self.grads.tracked)

    @property
    def expected_grads(self) -> int:
        """How many of its optimized parameters required grad as the last forward ran:
        the gradients a backward that uses them all brings."""
        return sum(self.grads.tracked)

    @property
    def frozen_start(self) -> int:
        return self.layout.frozen_start

    @property
    def full_numel(self) -> int:
        return self.layout.full_numel

    @property
    def shard_start(self) -> int:
        return self.layout.shard_start

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def segments(self) -> list[Segment]:
        return self.layout.segments

    @property
    def trainable_numel(self) -> int:
        return self.layout.trainable_numel

    @property
    def master_numel(self) -> int:
        return self.layout.master_numel

    # ------------------------------------------------------------------ construction
    def label(self, what: str) -> str:
        return f"{what} {self.name}"

    def collective(self, what: str) -> str:
        return f"{what} of unit {self.name!r}"

    def allocate(self, tier: Tier, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A flat buffer on ``tier`` (a tensor; a ``Store`` on disk) owned by this
        unit and freed by ``close()``; the optimizer keeps its states here too."""
        owned = self.new_buffer(tier, numel, dtype, what)
        self._owned.append(owned)
        return owned.data

    def new_buffer(self, tier: Tier, numel: int, dtype: torch.dtype, what: str) -> FlatAllocation:
        """A flat buffer on ``tier`` labelled for this unit but not yet owned by it: the
        caller frees it, or hands it to :meth:`adopt` (a speculative step's shadows)."""
        return self.tiers.of(Tier(tier)).allocate_flat(numel, dtype, self.label(what))

    def adopt(self, new: FlatAllocation, replacing: object | None) -> None:
        """Make ``new`` one of the unit's buffers in place of ``replacing`` (freed now if
        the unit owns it; a tensor torch made itself, SGD's first momentum, just goes)."""
        if replacing is not None:
            self.free_buffer(replacing)
        self._owned.append(new)

    def free_buffer(self, data: object) -> None:
        """Free the unit's buffer ``data`` now (nothing if the unit does not own it)."""
        old = next((o for o in self._owned if o.data is data), None)
        if old is not None:
            self._owned.remove(old)
            old.free()

    def replace_master(self, new: FlatAllocation) -> None:
        """Make ``new`` (an in-memory fp32 buffer of the whole master, a step taken ahead
        into it) the master, and the home when the master is the home; the old one is
        freed. The caller refreshes the compute-dtype copies (``refresh_after_step``)."""
        old = self.master
        if self.home is old:
            self.home = new.data
            if self.residency is Residency.IN_PLACE:
                self._point_params(self.home)  # the old one is freed below
        self.master = new.data
        self.adopt(new, old)

    @contextlib.contextmanager
    def freed_on_failure(self):
        """Buffers the unit comes to own inside the block are freed if it raises (a
        failure part-way through making several leaves none behind)."""
        mark = len(self._owned)
        try:
            yield
        except BaseException:
            for owned in self._owned[mark:]:
                owned.free()
            del self._owned[mark:]
            raise

    def scratch(self, numel: int, dtype: torch.dtype, what: str) -> HostBuffer:
        """A temporary host buffer (free it with ``tiers.host.free``)."""
        return self.tiers.host.allocate(max(numel, 1) * dtype.itemsize, self.label(what), dtype)

    def _build(self, defer_disk_grad: bool) -> None:
        p = self.placement
        fp32 = torch.float32
        self.master = self.allocate(p.optimizer, self.master_numel, fp32, "master params")
        same_dtype = self.compute_dtype == fp32
        if p.param == p.optimizer and same_dtype:
            self.home = self.master
        else:
            self.home = self.allocate(p.param, self.numel, self.compute_dtype, "params")
        with torch.no_grad():
            self._initialize_master()
        if p.param is Tier.DEVICE and self.shards is None:
            self.device_flat = self.home
            self.residency = Residency.PRESENT
        else:
            self.device_flat = torch.empty(
                self.full_numel, dtype=self.compute_dtype, device=self.device
            )
        # step_in_backward: gradients on disk get their disk array only when one must
        # persist; those the step in backward consumes never do (GradSink.region)
        deferred = (
            defer_disk_grad
            and p.grad is Tier.DISK
            and self.shards is None
            # master and every parameter copy written through shadows: a step in backward
            and ChunkedRewrite.can_speculate(self)
        )
        self.grads = GradSink(self, deferred=deferred)
        refusal = (
            None
            if self.shards is None
            else "sharded over ranks, its value is read by a collective: call "
            "model.state_dict() on every rank"
        )
        self._take_flat_views()
        for e, view in zip(self.entries, self._flat_views, strict=True):
            e.param.data = view
            released.attach(e.param, released.ParamSource(self, e, refusal))
        if not self.materialized:
            self.device_flat.untyped_storage().resize_(0)
            self.conceal_params()

    def _take_flat_views(self) -> None:
        """Each parameter's view of ``device_flat``, kept: a view can be taken only while
        its storage has bytes, and the parameters come back to these after an in-place
        use or a lent copy."""
        self._flat_views = [
            self.device_flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries
        ]

    def _initialize_master(self) -> None:
        """The master from the parameters' current values; sharded, rank 0's values (as
        DDP does at construction, so ranks that initialized differently agree)."""
        if self.shards is None:
            with self.edit_master() as master:
                for e in self.entries:
                    master[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
            return
        with self.device_scratch(self.full_numel, torch.float32, "master broadcast") as full:
            full.zero_()
            for e in self.entries:
                full[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
            self.shards.broadcast(full, self.collective("the initial parameters"))
            self._store_shard(full[self.shard_start : self.shard_start + self.numel])

    @contextlib.contextmanager
    def device_scratch(self, numel: int, dtype: torch.dtype, what: str):
        """A transient device tensor, counted against the device budget while it lives."""
        nbytes, label = numel * dtype.itemsize, self.label(what)
        self.tiers.device_tier.reserve(nbytes, label)
        try:
            yield torch.empty(numel, dtype=dtype, device=self.device)
        finally:
            self.tiers.device_tier.release(nbytes, label)

    def before_state_change(self) -> None:
        """Before the master or the optimizer states are written: a step taken ahead
        from the old ones goes first (its worker must not read arrays being written),
        and the version moves even if the write then fails."""
        self.barrier()
        self.state_version += 1
        self.events.publish(Event.STATE_CHANGE, self)

    def _store_shard(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (this rank's elements, anywhere) the master; refresh the copies."""
        self.before_state_change()
        if transfers_only(self.master):
            local = shard.to("cpu", copy=shard.device.type == "cpu").contiguous()
            self.master.write_all(local)
            self._sync_home(local)
        else:
            self.master.copy_(shard)
            self._sync_home(self.master)

    @property
    def device_bytes(self) -> int:
        """Bytes of the full unit in the compute dtype: what a fetch puts on the device."""
        return self.full_numel * self.compute_dtype.itemsize

    @property
    def home_bytes(self) -> int:
        """Bytes of this rank's compute-dtype parameters (all of them in one process)."""
        return self.numel * self.compute_dtype.itemsize

    @contextlib.contextmanager
    def edit_master(self):
        """Yield the whole fp32 master as a tensor to read or change in place; on exit the
        change is written back (disk) and the compute-dtype copies are refreshed.

        A disk-resident master passes through one temporary host buffer of the unit's
        size, so loading or initializing a model holds one unit in host memory at a time.

        Sharded, it yields the full unit (all-gathered on the device; a collective, so
        every rank must edit the same units in the same order) and keeps this rank's shard.
        """
        if self.shards is not None:
            with self.device_scratch(self.full_numel, torch.float32, "master gather") as full:
                self.shards.all_gather(
                    full, self.master_copy().to(self.device), self.collective("the master")
                )
                try:
                    yield full
                finally:
                    self._store_shard(full[self.shard_start : self.shard_start + self.numel])
            return
        if not transfers_only(self.master) and not self.has_home_only:
            self.before_state_change()
            try:
                yield self.master
            finally:  # even a half-done edit: the copies must match the master
                self._sync_home(self.master)
            return
        scratch = self.scratch(self.numel, torch.float32, "master scratch")
        try:
            flat = scratch.tensor[: self.numel]
            self._read_master_into(flat)
            yield flat
            self.store_master(flat)
        finally:
            self.tiers.host.free(scratch)

    @property
    def has_home_only(self) -> bool:
        """True when some frozen parameters have no fp32 master (see ``master_numel``)."""
        return self.master_numel < self.numel

    def _read_master_into(self, flat: torch.Tensor) -> None:
        """The whole layout in fp32 into ``flat`` (host): the master, and the frozen
        parameters that live only in ``home``, widened."""
        read_into(self.master, flat[: self.master_numel])  # a never-written one reads zeros
        if not self.has_home_only:
            return
        tail = flat[self.master_numel :]
        if transfers_only(self.home):
            with self.edit_home_only(write_back=False) as staged:  # read in its dtype
                tail.copy_(staged)
        else:  # widened straight from memory, no staging copy
            tail.copy_(self.home[self.master_numel :])

    @contextlib.contextmanager
    def edit_home_only(self, write_back: bool = True):
        """Yield the frozen parameters that have no master (elements ``[master_numel,
        numel)``) as a host tensor in the compute dtype; on exit (``write_back``) they
        are written into ``home`` and a materialized device copy.

        That part of a disk home is whole even when ``home_stale``: a failed rewrite
        touches only the head (in place), or a shadow that was thrown away."""
        start, n = self.master_numel, self.numel - self.master_numel
        staged = self.scratch(n, self.compute_dtype, "frozen params scratch")
        try:
            tail = staged.tensor[:n]
            read_into(self.home, tail, start)
            yield tail
            if not write_back:
                return
            self.param_version += 1
            if self.param_stager is not None:
                self.param_stager.forget(self)
            with torch.no_grad():
                write_from(self.home, tail, start)
                self.write_device_copy(tail, start)
        finally:
            self.tiers.host.free(staged)

    def master_copy(self) -> torch.Tensor:
        """This rank's parameters in fp32 as a tensor over the whole layout: the master
        buffer itself when that is all of it in memory, else a fresh host copy."""
        self.barrier()  # (step_in_forward) a step still running on lands first
        if not transfers_only(self.master) and not self.has_home_only:
            return self.master
        flat = torch.empty(self.numel, dtype=torch.float32)
        self._read_master_into(flat)
        return flat

    def store_master(self, flat: torch.Tensor) -> None:
        """Make ``flat`` (from :meth:`master_copy`, changed) the master and refresh the
        copies (the frozen parameters without a master go to ``home`` only)."""
        head = flat[: self.master_numel]
        self.before_state_change()
        if transfers_only(self.master):
            self.master.write_all(head)
        elif self.master.data_ptr() != head.data_ptr():
            self.master.copy_(head)
        self._sync_home(flat)

    def full_master(self) -> torch.Tensor:
        """The whole unit's fp32 master on the host (all-gathered when sharded: a
        collective); hand it back changed with :meth:`store_full_master`."""
        if self.shards is None:
            return self.master_copy()
        full = torch.empty(self.full_numel, dtype=torch.float32, device=self.device)
        self.shards.all_gather(
            full, self.master_copy().to(self.device), self.collective("the master")
        )
        return full.cpu()

    def store_full_master(self, full: torch.Tensor) -> None:
        """Make ``full`` (from :meth:`full_master`, changed) the master; keeps this rank's shard."""
        if self.shards is None:
            self.store_master(full)
        else:
            self._store_shard(full[self.shard_start : self.shard_start + self.numel])

    def _sync_home(self, master: torch.Tensor) -> None:
        """Make ``home`` (and a materialized device copy) equal ``master``, cast.
        ``master`` may be a prefix of the layout (the trainable head after a step, see
        :meth:`refresh_after_step`): only that much is rewritten."""
        self.param_version += 1
        if self.param_stager is not None:
            self.param_stager.forget(self)  # a staged read must not race a rewrite in place
        n = master.numel()
        with torch.no_grad():
            if transfers_only(self.home):
                if self.home is not self.master:
                    self._write_home(master)
            elif self.home.data_ptr() != master.data_ptr():  # else home is the master
                self.home[:n].copy_(master)
            if self.materialized and self.shards is not None:
                self.release()  # the next fetch gathers every rank's new shard
            else:
                self.write_device_copy(master)

    def _write_home(self, master: torch.Tensor) -> None:
        """Write ``master`` cast to the compute dtype into the disk ``home``. The whole
        layout goes into a shadow region, committed only when complete; a prefix (the
        trainable head: the frozen tail after it never changes) is written in place.
        Either way ``home_stale`` is set until the write is done, and a fetch of a stale
        unit rebuilds the home whole from the master."""
        self.home_stale = True
        staged = self.scratch(master.numel(), self.compute_dtype, "params scratch")
        shadow = self.home.shadow() if master.numel() == self.numel else None
        try:
            staged.tensor.copy_(master)
            self.home.write(staged.tensor, 0, into=shadow)
            if shadow is None:
                self.home.wait_writes()
            else:
                self.home.commit(shadow)
        except BaseException:
            if shadow is not None:
                shadow.discard()
            raise
        finally:
            self.tiers.host.free(staged)
        self.home_stale = False

    def move_home(self, tier: Tier) -> None:
        """Move the compute-dtype parameters kept on the device to ``tier`` (host or
        disk): the plan made without a batch is refined at the first forward
        (``planner.plan_first_batch``). The values are copied once; the device bytes go,
        and the unit is fetched like any offloaded one from then on. A disk home needs
        ``param_stager`` set first. Not for sharded units (their device home is a shard)."""
        if self.placement.param is not Tier.DEVICE or tier is Tier.DEVICE or self.shards:
            raise ValueError(
                f"unit {self.name!r}: only unsharded parameters kept on the device move, "
                f"from {self.placement.param.label} to {tier.label}"
            )
        old = self.home
        owned = next(o for o in self._owned if o.data is old)
        # fp32 on the master's tier: the master is the home (it holds the same values)
        aliased = (
            tier is self.placement.optimizer
            and self.compute_dtype == torch.float32
            and not self.has_home_only
        )
        new = self.master
        if not aliased:
            new = self.allocate(tier, self.numel, self.compute_dtype, "params")
            if transfers_only(new):
                staged = self.scratch(self.numel, self.compute_dtype, "params scratch")
                try:
                    staged.tensor.copy_(old)
                    write_from(new, staged.tensor)
                finally:
                    self.tiers.host.free(staged)
            else:
                new.copy_(old)
        # the device bytes now count as a fetched copy (same label and size), which
        # release() gives back; device_flat (old) keeps the parameters' views
        self._owned.remove(owned)
        self.home = new
        self.placement = replace(self.placement, param=tier)
        self.release()

    def prepare_master_move(self, tier: Tier) -> MasterMove:
        """The first half of moving the fp32 master and the gradients from host memory to
        ``tier`` (disk): the plan made without a batch is refined at the first forward
        when the batch's activations need the host room (``planner.plan_first_batch``).
        Only before any gradient exists. The master is written to its new place and the
        gradients' buffer made there; nothing of the unit changes or is freed yet, so a
        failure (the disk full) leaves it as it was: :meth:`discard_master_move` gives
        the new buffers back, :meth:`commit_master_move` makes them the unit's. Not for
        sharded units."""
        if self.placement.optimizer is not Tier.HOST or tier is not Tier.DISK or self.shards:
            raise ValueError(
                f"unit {self.name!r}: only an unsharded master in host memory moves to disk, "
                f"not from {self.placement.optimizer.label} to {tier.label}"
            )
        if self.grads.any() or self.grads.pending:
            raise ValueError(f"unit {self.name!r}: its master moves before any gradient")
        self.before_state_change()  # (a step taken ahead from the old master goes first)
        move = MasterMove(
            tier, self.new_buffer(tier, self.master_numel, torch.float32, "master params")
        )
        try:
            write_from(move.master.data, self.master)
            # (the home stays in memory, so no step in backward consumes the gradients:
            # their disk array is made now, not deferred)
            if self.trainable_numel:
                move.grads = self.new_buffer(tier, self.trainable_numel, torch.float32, "grads")
        except BaseException:
            self.discard_master_move(move)
            raise
        return move

    @staticmethod
    def discard_master_move(move: MasterMove) -> None:
        """Give back what :meth:`prepare_master_move` made (the unit never owned it)."""
        for made in (move.master, move.grads):
            if made is not None:
                made.free()

    def commit_master_move(self, move: MasterMove) -> None:
        """The second half (see :meth:`prepare_master_move`); allocates nothing, so it
        cannot run out of room. A home that was the master keeps the old master's buffer,
        accounted as parameters from now on; otherwise that buffer is freed, and so is the
        old gradient buffer (nothing was in it). The optimizer's states move with
        ``OffloadedOptimizer.prepare_states_move`` / ``commit_states_move``; a disk
        gradient needs ``grad_stager`` set before the next backward."""
        old = self.master
        self._owned.append(move.master)
        self.master = move.master.data
        if self.home is old:
            kept = next(o for o in self._owned if o.data is old)
            kept.rename(self.label("params"))
        else:
            self.free_buffer(old)
        old_grads = self.grads.buffer
        self.grads.close()
        if old_grads is not None:
            self.free_buffer(old_grads)
        self.placement = replace(self.placement, optimizer=move.tier, grad=move.tier)
        if move.grads is not None:
            self._owned.append(move.grads)
        self.grads = GradSink(
            self, deferred=False, buffer=None if move.grads is None else move.grads.data
        )

    # ------------------------------------------------------------------ movement
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
            self._point_params(self.home)
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

    def _point_params(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of ``flat`` (the home, used in place)."""
        for e in self.entries:
            e.param.data = flat[e.offset : e.offset + e.numel].view(e.shape)

    def _point_params_at_device_flat(self) -> None:
        """Make every parameter its view of ``device_flat`` again (bytes or none)."""
        for e, view in zip(self.entries, self._flat_views, strict=True):
            e.param.data = view

    def restore_param_views(self) -> None:
        """Point the parameters back at the unit's own bytes after something pointed
        them elsewhere (state_dict's master views); a released unit's are concealed."""
        if self.residency is Residency.IN_PLACE:
            self._point_params(self.home)
            return
        self._point_params_at_device_flat()
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
            self._point_params_at_device_flat()  # no bytes: the home is not theirs to keep
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
    def lends_device_copy(self) -> bool:
        """The device copy holds the master's values in host memory, so a step right
        after backward can read them from it instead of from disk: a CPU device (its
        memory is host memory), one process, an fp32 home that is the master on disk
        (the copy is its values exactly), fetched by copy, and nothing frozen that
        backward may still read."""
        return (
            self.device.type == "cpu"
            and self.shards is None
            and self.home is self.master
            and transfers_only(self.master)
            and self.residency is Residency.PRESENT  # (fetched by copy: a disk home)
            and not self.home_stale
            and not self.has_untracked_params
            and not self.released_after_backward
        )

    def lend_device_copy(self) -> torch.Tensor:
        """Release the unit, handing the device copy's bytes to the caller instead of
        freeing them: its first ``master_numel`` elements, the master's values. The unit
        gets a new, empty device copy for its next fetch (the parameters point at it);
        the device budget is given back here, and the caller counts the bytes it keeps
        (see ``lends_device_copy``)."""
        if not self.lends_device_copy:
            raise ValueError(f"unit {self.name!r} has no device copy to lend")
        lent = self.device_flat
        # untouched pages of a fresh allocation cost nothing; its views are taken while
        # it has bytes, then they go
        self.device_flat = torch.empty_like(lent)
        self._take_flat_views()
        self.device_flat.untyped_storage().resize_(0)
        self._point_params_at_device_flat()
        self._mark_released()
        return lent[: self.master_numel]

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
        self.device_flat[start : start + values.numel()].copy_(values)

    def refresh_after_step(self) -> None:
        """After the optimizer changed an in-memory master: refresh the compute-dtype
        copies of the trainable head ``[0, frozen_start)`` only. Frozen parameters sit
        after it (from an aligned offset) and never change, so a LoRA model's frozen base
        on disk is read by fetches and never rewritten by a step."""
        if self.shards is not None:  # frozen_start is a full-layout offset, not a shard's
            self.refresh_from_master()
        else:
            self._sync_home(self.master[: self.frozen_start])

    def refresh_from_master(self) -> None:
        """After ``master`` changed: update the compute-dtype copies (a disk ``home`` is
        rewritten whole, atomically)."""
        self._sync_home(self.master_copy())

    # ------------------------------------------------------------------ gradients
    @property
    def grad(self) -> FlatBuffer | None:
        """The fp32 gradient buffer (``grads``, runtime.grad_sink, owns it and its state)."""
        return self.grads.buffer

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        self.release()
        self.grads.close()
        for owned in self._owned:
            owned.free()
        self._owned.clear()
        # a closed unit holds no buffer, so its bytes go now even if something still
        # references the unit (a reference cycle awaiting the collector)
        self.master = self.home = self.device_flat = None
        self.param_stager = self.grad_stager = None
