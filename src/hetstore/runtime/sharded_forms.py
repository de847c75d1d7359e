"""A unit's forms when it is sharded over ranks (ZeRO-3): ``Unit.sharded``.

Sharded (:mod:`hetstore.runtime.sharding`), a unit's ``master`` and ``home`` hold only
this rank's shard of the full layout (elements ``[shard_start, shard_start + numel)``);
the whole unit exists only on the device, gathered by a collective. What the buffers per
role (:class:`~hetstore.runtime.unit_forms.UnitForms`) do over a whole master they do
here over the full layout and keep this rank's shard:

- the initial master is rank 0's values, broadcast (as DDP does at construction);
- an edit or a read of the whole master all-gathers it on the device (a collective: every
  rank edits the same units in the same order);
- storing the full master, or a shard, rewrites this rank's shard and its copies;
- after a step, the compute-dtype copies are refreshed from the shard (the frozen
  tail's offset is a full-layout one, not a shard's).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from hetstore.tiers.store import read_into, transfers_only

if TYPE_CHECKING:
    from hetstore.runtime.unit import Unit

__all__ = ["ShardedForms"]


class ShardedForms:
    """The sharded forms of one unit (see the module doc); ``unit.shards`` is set."""

    def __init__(self, unit: Unit):
        self.unit = unit

    def initialize_master(self) -> None:
        """The master from rank 0's values of the parameters, broadcast."""
        unit = self.unit
        with unit.device_scratch(unit.full_numel, torch.float32, "master broadcast") as full:
            full.zero_()
            for e in unit.entries:
                full[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
            unit.shards.broadcast(full, unit.collective("the initial parameters"))
            self.store_full(full)

    @contextlib.contextmanager
    def edit_master(self):
        """Yield the full unit's fp32 master, all-gathered on the device; on exit this
        rank's shard of it is stored (``UnitForms.edit_master``)."""
        unit = self.unit
        with unit.device_scratch(unit.full_numel, torch.float32, "master gather") as full:
            unit.shards.all_gather(
                full, unit.master_copy().to(unit.device), unit.collective("the master")
            )
            try:
                yield full
            finally:
                self.store_full(full)

    def full_master(self) -> torch.Tensor:
        """The whole unit's fp32 master on the host, all-gathered (a collective)."""
        unit = self.unit
        full = torch.empty(unit.full_numel, dtype=torch.float32, device=unit.device)
        unit.shards.all_gather(
            full, unit.master_copy().to(unit.device), unit.collective("the master")
        )
        return full.cpu()

    def store_full(self, full: torch.Tensor) -> None:
        """Keep this rank's shard of ``full`` (the whole unit) as the master."""
        unit = self.unit
        self.store(full[unit.shard_start : unit.shard_start + unit.numel])

    def store(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (this rank's elements, anywhere) the master; refresh the copies."""
        unit = self.unit
        if unit.has_home_only:  # (its compute-only tail goes to the home alone)
            unit.store_master(shard.to("cpu", copy=shard.device.type == "cpu").contiguous())
            return
        unit.before_state_change()
        if transfers_only(unit.master):
            local = shard.to("cpu", copy=shard.device.type == "cpu").contiguous()
            unit.master.write_all(local)
            unit.sync_home(local)
        else:
            unit.master.copy_(shard)
            unit.sync_home(unit.master)

    def refresh_after_step(self) -> None:
        """``UnitForms.refresh_after_step`` of a shard: ``frozen_start`` is a full-layout
        offset, not a shard's."""
        unit = self.unit
        if unit.has_home_only:  # (the compute-only tail never changes: not read again)
            head = unit.master
            if transfers_only(head):
                head = torch.empty(unit.master_numel, dtype=torch.float32)
                read_into(unit.master, head)
            unit.sync_home(head)  # (the master is the head: [0, master_numel))
        else:
            unit.refresh_from_master()
