"""Where each parameter sits in a unit's flat buffers: a pure function of the parameters.

Order: trainable parameters grouped by optimizer param group (each group one contiguous
:class:`Segment`), then frozen parameters wider than the compute dtype (they keep an fp32
master: rounding them would change what ``state_dict()`` gives back), then frozen ones
already in the compute dtype (stored only in it: a LoRA model's bf16 base has no fp32
copy, see ``master_numel``). Each run of one kind starts at a multiple of ``align``
elements, so chunks of different segments never share a disk page.

Sharded over ranks, the full layout is padded to a multiple of ``world_size * align`` and
this rank holds elements ``[shard_start, shard_start + numel)`` of it: ``numel``,
``segments`` and ``trainable_numel`` then describe the shard, ``entries`` keep their
full-layout offsets.

The layout is computed once, from the parameters and the placement, and never changes;
:class:`~hetstore.runtime.unit.Unit` builds its buffers from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hetstore.runtime.sharding import ShardGroup

__all__ = ["ParamEntry", "Segment", "UnitLayout"]


@dataclass
class ParamEntry:
    param: nn.Parameter = field(repr=False)  # no bytes while released: never print it
    name: str
    offset: int
    numel: int
    shape: torch.Size
    group: int | None  # optimizer param group index; None when not optimized
    has_grad: bool = False  # (the gradient sink's: set as this backward's gradient lands)


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one param group's parameters inside a unit's flat buffers."""

    group: int
    start: int
    end: int


@dataclass(frozen=True)
class UnitLayout:
    """One unit's layout (see the module doc)."""

    entries: list[ParamEntry]
    # read on every step and backward, so kept rather than recomputed
    trainable_entries: list[ParamEntry]
    # parameters autograd may still read after the unit's gradients are in (frozen ones,
    # or trainable ones outside the optimizer): their release waits for backward to leave
    # the unit (runtime.hooks)
    has_untracked_params: bool
    # where frozen parameters begin (a segment start, so aligned): a step rewrites the
    # compute-dtype copies of [0, frozen_start) only
    frozen_start: int
    full_numel: int  # the whole layout (padded when sharded): what a fetch puts on the device
    shard_start: int
    numel: int  # this rank's elements (all of them in one process)
    segments: list[Segment]  # this rank's, in its own offsets
    trainable_numel: int
    # the fp32 master covers [0, master_numel): all of it, except frozen parameters
    # already in the compute dtype (stored only in the compute dtype)
    master_numel: int

    @classmethod
    def build(
        cls,
        params: list[tuple[str, nn.Parameter, int | None]],
        compute_dtype: torch.dtype,
        *,
        align: int,
        shards: ShardGroup | None,
        master_is_home: bool,
    ) -> UnitLayout:
        """``params`` as ``(name, parameter, optimizer group or None)``. ``master_is_home``:
        the fp32 master also serves as the compute-dtype home (same tier, fp32 compute),
        so no parameter can live in the home only."""

        def kind(item) -> tuple[int, int]:
            _, param, group = item
            if group is not None:
                return (0, group)
            return (1 if param.dtype != compute_dtype else 2, 0)

        entries: list[ParamEntry] = []
        offset = 0
        previous_kind: object = object()
        compute_only_start = None
        for item in sorted(params, key=kind):
            name, param, group = item
            if kind(item) != previous_kind and offset % align:
                offset += align - offset % align  # a segment starts aligned
            previous_kind = kind(item)
            if previous_kind[0] == 2 and compute_only_start is None:
                compute_only_start = offset
            entries.append(ParamEntry(param, name, offset, param.numel(), param.shape, group))
            offset += param.numel()
        trainable = [e for e in entries if e.group is not None]
        full_segments: list[Segment] = []
        for entry in trainable:
            last = full_segments[-1] if full_segments else None
            if last is not None and last.group == entry.group and last.end == entry.offset:
                full_segments[-1] = Segment(last.group, last.start, entry.offset + entry.numel)
            else:
                full_segments.append(Segment(entry.group, entry.offset, entry.offset + entry.numel))
        if shards is None:
            full_numel, shard_start, numel = offset, 0, offset
            segments = full_segments
        else:
            quantum = shards.world_size * align
            full_numel = -(-offset // quantum) * quantum
            shard_start, numel = shards.shard_range(full_numel)
            segments = _shard_segments(full_segments, shard_start, numel)
        # not when the master is the home (nothing is stored twice then)
        master_numel = numel
        if compute_only_start is not None and not master_is_home:
            # the compute-only parameters are the layout's tail, so a shard's part of them
            # is its own tail
            master_numel = max(0, min(numel, compute_only_start - shard_start))
        return cls(
            entries=entries,
            trainable_entries=trainable,
            has_untracked_params=len(trainable) < len(entries),
            frozen_start=next((e.offset for e in entries if e.group is None), offset),
            full_numel=full_numel,
            shard_start=shard_start,
            numel=numel,
            segments=segments,
            trainable_numel=segments[-1].end if segments else 0,
            master_numel=master_numel,
        )


def _shard_segments(segments: list[Segment], start: int, size: int) -> list[Segment]:
    """The parts of ``segments`` (full-layout offsets) inside ``[start, start + size)``,
    in shard offsets."""
    local = []
    for seg in segments:
        a, b = max(seg.start, start), min(seg.end, start + size)
        if a < b:
            local.append(Segment(seg.group, a - start, b - start))
    return local
