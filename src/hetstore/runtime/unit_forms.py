"""A unit's flat buffers per role, on their tiers (the ``UnitForms`` part of a Unit).

Forms (all flat, 1-D, in the layout's order; see :mod:`hetstore.runtime.unit`):
``master`` (fp32, the optimizer's tier), ``home`` (compute dtype, the parameters'
tier; aliases ``master`` when dtype and tier agree) and the gradients (``grad``, owned
by the unit's :class:`~hetstore.runtime.grad_sink.GradSink`). A form on a tier that is
not addressable is a :class:`~hetstore.tiers.store.Store`, else a tensor.

This class owns the buffers (``_owned``: every one it allocated, freed by
:meth:`free_all`), keeps ``home`` equal to ``master`` (``sync_home``), edits and moves
them whole or not at all. It is one of the classes a :class:`~hetstore.runtime.unit.Unit`
is made of; the device copy is :class:`~hetstore.runtime.residency.DeviceResidency`'s.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from hetstore.runtime.grad_sink import GradSink
from hetstore.runtime.sharded_forms import ShardedForms
from hetstore.tier import Tier
from hetstore.tiers import HostBuffer
from hetstore.tiers.accounting import FlatAllocation
from hetstore.tiers.store import FlatBuffer, read_into, transfers_only, write_from

__all__ = ["MasterMove", "UnitForms"]


@dataclass(eq=False)
class MasterMove:
    """A move of a unit's master and gradients under way (``Unit.prepare_master_move``):
    the new buffers, made and written, not yet the unit's."""

    tier: Tier
    master: FlatAllocation
    grads: FlatAllocation | None = None


class UnitForms:
    """The buffers-per-role concern of a :class:`~hetstore.runtime.unit.Unit` (see the
    module doc). State it owns: ``master``, ``home``, ``_owned``, ``home_stale``,
    ``param_version``, ``state_version``; ``sharded`` (a
    :class:`~hetstore.runtime.sharded_forms.ShardedForms`) when sharded over ranks."""

    def init_forms(self) -> None:
        self._owned: list[FlatAllocation] = []  # every buffer allocate() made
        self.home_stale = False  # master changed but a disk ``home`` not yet rewritten
        # counts rewrites of the master or of the optimizer states kept for it (loads,
        # edits, an ordinary streamed step): a step taken ahead from older ones is stale
        # (hetstore.optim.step_ahead)
        self.state_version = 0
        # moves whenever the parameters' values may have changed (a step, a load, an
        # edit): an alias read while released (``p.detach()``) reads them again then
        self.param_version = 0
        # sharded over ranks: the forms over the full layout (runtime.sharded_forms)
        self.sharded = ShardedForms(self) if self.shards is not None else None

    def free_all(self) -> None:
        """Free every buffer the unit allocated (``close``)."""
        for owned in self._owned:
            owned.free()
        self._owned.clear()

    def allocate(self, tier: Tier, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A flat buffer on ``tier`` (a tensor; a ``Store`` on disk) owned by this
        unit and freed by ``close()``; the optimizer keeps its states here too."""
        owned = self.new_buffer(tier, numel, dtype, what)
        self._owned.append(owned)
        return owned.data

    def buffers_on(self, tier: Tier) -> list[object]:
        """The unit's own buffers that ``tier`` made (``hetstore.evict`` moves the
        device's)."""
        return [owned.data for owned in self._owned if owned.tier is tier]

    def new_buffer(self, tier: Tier, numel: int, dtype: torch.dtype, what: str) -> FlatAllocation:
        """A flat buffer on ``tier`` labelled for this unit but not yet owned by it: the
        caller frees it."""
        return self.tiers.of(Tier(tier)).allocate_flat(numel, dtype, self.label(what))

    def free_buffer(self, data: object) -> None:
        """Free the unit's buffer ``data`` now (nothing if the unit does not own it)."""
        old = next((o for o in self._owned if o.data is data), None)
        if old is not None:
            self._owned.remove(old)
            old.free()

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

    def initialize_master(self) -> None:
        """The master from the parameters' current values; sharded, rank 0's values (as
        DDP does at construction, so ranks that initialized differently agree)."""
        if self.sharded is not None:
            self.sharded.initialize_master()
            return
        with self.edit_master() as master:
            for e in self.entries:
                master[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))

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
        if self.sharded is not None:
            with self.sharded.edit_master() as full:
                yield full
            return
        if not transfers_only(self.master) and not self.has_home_only:
            self.before_state_change()
            try:
                yield self.master
            finally:  # even a half-done edit: the copies must match the master
                self.sync_home(self.master)
            return
        scratch = self.scratch(self.numel, torch.float32, "master scratch")
        try:
            flat = scratch.tensor[: self.numel]
            self.read_master_into(flat)
            yield flat
            self.store_master(flat)
        finally:
            self.tiers.host.free(scratch)

    @property
    def has_home_only(self) -> bool:
        """True when some frozen parameters have no fp32 master (see ``master_numel``)."""
        return self.master_numel < self.numel

    def read_master_into(self, flat: torch.Tensor) -> None:
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
        self.read_master_into(flat)
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
        self.sync_home(flat)

    def full_master(self) -> torch.Tensor:
        """The whole unit's fp32 master on the host (all-gathered when sharded: a
        collective); hand it back changed with :meth:`store_full_master`."""
        if self.sharded is None:
            return self.master_copy()
        return self.sharded.full_master()

    def store_full_master(self, full: torch.Tensor) -> None:
        """Make ``full`` (from :meth:`full_master`, changed) the master; keeps this rank's shard."""
        if self.sharded is None:
            self.store_master(full)
        else:
            self.sharded.store_full(full)

    def sync_home(self, master: torch.Tensor) -> None:
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
                self.copy_cast(self.home[:n], master)
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

    def refresh_after_step(self) -> None:
        """After the optimizer changed an in-memory master: refresh the compute-dtype
        copies of the trainable head ``[0, frozen_start)`` only. Frozen parameters sit
        after it (from an aligned offset) and never change, so a LoRA model's frozen base
        on disk is read by fetches and never rewritten by a step."""
        if self.sharded is not None:  # frozen_start is a full-layout offset, not a shard's
            self.sharded.refresh_after_step()
        else:
            self.sync_home(self.master[: self.frozen_start])

    def refresh_from_master(self) -> None:
        """After ``master`` changed: update the compute-dtype copies (a disk ``home`` is
        rewritten whole, atomically)."""
        self.sync_home(self.master_copy())

    @property
    def grad(self) -> FlatBuffer | None:
        """The fp32 gradient buffer (``grads``, runtime.grad_sink, owns it and its state)."""
        return self.grads.buffer
