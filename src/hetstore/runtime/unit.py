"""One unit's parameters in every form, and their movement between tiers.

A unit is split by concern:

- **layout** (:mod:`hetstore.runtime.layout`, ``Unit.layout``): where each parameter
  sits in the flat buffers, a pure function of the parameters, fixed at construction;
- **buffers per role** (:mod:`hetstore.runtime.unit_forms`, :class:`UnitForms`): the
  forms below, each allocated on its tier, edited and moved whole or not at all;
- **residency** (:mod:`hetstore.runtime.residency`, :class:`DeviceResidency`):
  ``fetch`` / ``release`` / ``prefetch`` of the device copy, with ``ready_event`` naming
  an in-flight CUDA copy, and reads of a released parameter;
- **pending work** (here): :meth:`Unit.barrier`, the one wait for work queued on the
  unit, and the events it publishes (:mod:`hetstore.runtime.events`);
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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetstore.runtime import released
from hetstore.runtime.events import Event, Events
from hetstore.runtime.grad_sink import GradSink
from hetstore.runtime.layout import ParamEntry, Segment, UnitLayout
from hetstore.runtime.residency import DeviceResidency, Residency
from hetstore.runtime.rewrite import ChunkedRewrite
from hetstore.runtime.unit_forms import MasterMove, UnitForms
from hetstore.tier import Tier
from hetstore.tiers import Tiers
from hetstore.tiers.flat import ALIGN_ELEMENTS

if TYPE_CHECKING:
    from hetstore.runtime.sharding import ShardGroup
    from hetstore.runtime.staging import GradStager, ParamStager

__all__ = ["MasterMove", "ParamEntry", "Placement", "Residency", "Segment", "Unit"]
# (MasterMove and Residency live with their concern; named here for the unit's users)


@dataclass(frozen=True)
class Placement:
    """Where one unit's pieces live."""

    param: Tier
    optimizer: Tier
    grad: Tier

    def __post_init__(self):  # config spellings ('none', 'cpu', 'disk') are accepted
        for name in ("param", "optimizer", "grad"):
            object.__setattr__(self, name, Tier(getattr(self, name)))


class Unit(UnitForms, DeviceResidency):
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
        events: Events,
    ):
        self.index = index
        # the model's bus (runtime.events): the unit publishes reads and rewrites on it
        self.events = events
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
        self.init_forms()
        self.init_residency()
        # set by the runtime when some form lives on disk
        self.param_stager: ParamStager | None = None
        self.grad_stager: GradStager | None = None
        # set by whoever queued work that changes the unit (its optimizer step running
        # on during the next forward): every use of the unit's parameters, master,
        # states or gradients goes through barrier() first, which lands that work
        self.work_pending = False
        # why its parameters cannot be read now (hetstore.evict took the device's bytes),
        # said by a read of a concealed parameter; None when they can
        self.refusal: str | None = None
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
            self.initialize_master()
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
        self.take_flat_views()
        for e, view in zip(self.entries, self._flat_views, strict=True):
            e.param.data = view
            released.attach(e.param, released.ParamSource(self, e, refusal))
        if not self.materialized:
            self.device_flat.untyped_storage().resize_(0)
            self.conceal_params()

    def before_state_change(self) -> None:
        """Before the master or the optimizer states are written: a step taken ahead
        from the old ones goes first (its worker must not read arrays being written),
        and the version moves even if the write then fails."""
        self.barrier()
        self.state_version += 1
        self.events.publish(Event.STATE_CHANGE, self)

    # ------------------------------------------------------------------ movement

    # ------------------------------------------------------------------ gradients

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        self.release()
        self.grads.close()
        self.free_all()
        # a closed unit holds no buffer, so its bytes go now even if something still
        # references the unit (a reference cycle awaiting the collector)
        self.master = self.home = self.device_flat = None
        self._flat_views = []  # (views of the home where it is used in place)
        self.param_stager = self.grad_stager = None
