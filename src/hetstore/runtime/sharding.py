"""ZeRO-3 sharding over ``torch.distributed``: which process group, and its collectives.

Each unit's flat buffers are padded to a multiple of ``world_size * ALIGN_ELEMENTS``
and cut into ``world_size`` equal shards; rank ``r`` keeps shard ``r`` of the fp32
master, of the gradients and of the optimizer states (and of the compute-dtype
parameters) in its own tiers. Before a unit runs, the shards are all-gathered into the
full device buffer; after its backward, the full gradient is reduce-scattered (averaged,
as DDP does) and each rank keeps only its shard.

Every collective goes through :class:`ShardGroup`, which turns the backend's error (a
dead peer, a timeout, a mismatched call) into a :class:`~hetstore.errors.DistributedError`
naming this rank, the operation and the unit. A rank that hangs is detected only by the
process group's own timeout (``init_process_group(timeout=...)``): hetstore adds none.

Collectives are called in the same order on every rank because every rank runs the same
hooks in the same order: that needs the same model, the same units and the same set of
parameters receiving gradients on every rank (true unless the graph depends on the data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetstore.errors import ConfigError, DistributedError

__all__ = ["ShardGroup", "rank_device", "resolve_process_group"]


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a model is sharded over, and the collectives the runtime needs."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str

    def shard_range(self, numel: int) -> tuple[int, int]:
        """``(start, size)`` of this rank's shard of a flat buffer of ``numel`` elements
        (``numel`` already padded to a multiple of ``world_size``)."""
        size = numel // self.world_size
        return self.rank * size, size

    def error(self, what: str, exc: BaseException) -> DistributedError:
        """The error to raise when collective ``what`` failed with ``exc``."""
        return DistributedError(
            f"rank {self.rank} of {self.world_size}: {what} failed ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}). Another rank "
            "has probably died, hung, or taken a different path through the model; a hung "
            "rank is only noticed after the process group's timeout "
            "(torch.distributed.init_process_group(timeout=...))"
        )

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, what: str) -> None:
        """``out`` (``world_size`` times ``shard``'s size) = every rank's ``shard``, in rank order."""
        try:
            _all_gather(out, shard, group=self.group)
        except (RuntimeError, ValueError) as exc:
            raise self.error(f"all-gather of {what}", exc) from exc

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``out`` = this rank's shard of the mean over ranks of ``full`` (changes ``full``).

        Each rank divides before the sum, as DDP does: the sum of fp16 gradients cannot
        overflow where the mean does not.
        """
        full.div_(self.world_size)
        try:
            _reduce_scatter(out, full, group=self.group)
        except (RuntimeError, ValueError) as exc:
            raise self.error(f"reduce-scatter of {what}", exc) from exc

    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> None:
        """In place, ``op`` one of 'sum', 'max'."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        try:
            dist.all_reduce(tensor, op=ops[op], group=self.group)
        except (RuntimeError, ValueError) as exc:
            raise self.error(f"all-reduce of {what}", exc) from exc

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Rank 0's ``tensor`` to every rank (in place)."""
        try:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        except (RuntimeError, ValueError) as exc:
            raise self.error(f"broadcast of {what}", exc) from exc


# torch 2.13 renamed these (the old names are kept, deprecated); older torch lacks the new
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_process_group(process_group, device: torch.device) -> ShardGroup | None:
    """The :class:`ShardGroup` to shard over, or None for one process.

    ``process_group``: None (the default process group when one is initialized with more
    than one rank), a ``ProcessGroup``, a one-dimensional ``DeviceMesh``, or ``False``
    (never shard, e.g. to run one copy per rank).
    """
    if process_group is False:
        return None
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    elif _is_device_mesh(process_group):
        if process_group.ndim != 1:
            raise ConfigError(
                f"process_group: a DeviceMesh of {process_group.ndim} dimensions; hetstore "
                "shards over one, pass mesh[dim_name] for the data-parallel dimension"
            )
        group = process_group.get_group()
    elif isinstance(process_group, dist.ProcessGroup):
        group = process_group
    else:
        raise ConfigError(
            "process_group must be None (the default group, if initialized), a "
            "torch.distributed ProcessGroup, a one-dimensional DeviceMesh or False; got "
            f"{type(process_group).__name__}"
        )
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and device.type != "cuda":
        raise ConfigError(
            f"process_group: an NCCL group needs device='cuda', got device={device.type!r}; "
            "use a gloo group on CPU"
        )
    if "gloo" in backend and device.type == "cuda":
        raise ConfigError(
            "process_group: a gloo group with device='cuda'; use NCCL on GPU "
            "(init_process_group('nccl')), gloo for device='cpu'"
        )
    return ShardGroup(group, dist.get_rank(group), world_size, backend)


def rank_device(device: torch.device) -> torch.device:
    """A CUDA device without an index becomes this rank's (``LOCAL_RANK``, as torchrun
    sets it, else the current device)."""
    if device.type != "cuda" or device.index is not None:
        return device
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def _is_device_mesh(value) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(value, DeviceMesh)
