"""Checkpoints of a model sharded over ranks (ZeRO-3): each rank writes its own shard.

A save with N ranks writes one version directory (on a filesystem every rank sees):

- rank 0 starts the version (cleans up partial ones, makes the directory) and tells the
  others its name;
- every rank streams the parameters and states of its shard into its own files,
  ``unit-NNNNN-rankRRRRR.safetensors``, a parameter cut by a shard boundary as two
  pieces (flat, in the files of two ranks);
- every rank reports its files (sizes, CRC-32) and pieces to rank 0, or its error: if
  any rank failed, every rank raises and rank 0 removes the version;
- rank 0 writes the shared files (buffers, optimizer header, extra) and commits: the
  index lists every rank's files and, per parameter, its pieces
  (``{"file", "start", "numel"}`` in the parameter's flattened elements), so a load with
  any number of ranks (one process too) finds each element by name and range.

The reports travel with ``all_gather_object``, i.e. pickles between the ranks of the
running job; nothing pickled is ever written to or read from the checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from hetstore.checkpoint.files import CheckpointError, CheckpointWriter
from hetstore.runtime.sharding import ShardGroup

__all__ = ["start_save", "gather_reports", "commit_on_rank0", "shard_pieces"]


class _JoinedWriter(CheckpointWriter):
    """A writer of a version that rank 0 started: adds its files, never commits, and on
    an error removes only its own files."""

    def __init__(self, path: str | os.PathLike, version: str):  # noqa: D107 - no super()
        self.root = Path(path)
        self.version = version
        self.dir = self.root / version
        if not self.dir.is_dir():
            raise CheckpointError(
                f"checkpoint version {str(self.dir)!r} that rank 0 made is not visible here: "
                "every rank must see the same checkpoint path (a shared filesystem)"
            )
        self.files = {}
        self.committed = False
        self._staging = None

    def commit(self, meta=None) -> Path:  # pragma: no cover - guarded by the caller
        raise RuntimeError("only rank 0 commits a sharded checkpoint")

    def abort(self) -> None:
        for name in list(self.files):
            (self.dir / name).unlink(missing_ok=True)


def _broadcast(shards: ShardGroup, value):
    box = [value]
    try:
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(shards.group, 0), group=shards.group
        )
    except (RuntimeError, ValueError) as exc:
        raise shards.error("broadcast of the checkpoint's status", exc) from exc
    return box[0]


def start_save(path, shards: ShardGroup) -> CheckpointWriter:
    """Rank 0 starts a new version; the others join it."""
    if shards.rank == 0:
        try:
            writer = CheckpointWriter(path)
        except BaseException as exc:
            _broadcast(shards, ("error", f"{type(exc).__name__}: {exc}"))
            raise
        _broadcast(shards, ("ok", writer.version))
        return writer
    status, value = _broadcast(shards, None)
    if status != "ok":
        raise CheckpointError(f"rank 0 could not start the checkpoint at {str(path)!r}: {value}")
    return _JoinedWriter(path, value)


def agree_to_load(shards: ShardGroup, path, failure: BaseException | None) -> None:
    """Every rank's verdict on the checkpoint it verified. If any rank refused it, every
    rank raises (its own error, or one naming the rank that refused) before any rank
    changes its model: no rank is left waiting in the load's collectives for one that
    has already given up (which would end only at the process group's timeout)."""
    report = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports: list = [None] * shards.world_size
    try:
        dist.all_gather_object(reports, report, group=shards.group)
    except (RuntimeError, ValueError) as exc:
        raise shards.error("agreeing on the checkpoint's verification", exc) from exc
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return
    if failure is not None:
        raise failure
    rank, message = failed[0]
    raise CheckpointError(
        f"rank {rank} refused the checkpoint at {str(path)!r} ({message}); no rank changed "
        "its model or optimizer"
    )


def gather_reports(
    writer: CheckpointWriter, shards: ShardGroup, params: dict, failure: BaseException | None
) -> dict:
    """Every rank's files and pieces to rank 0 (merged into ``writer.files`` and the
    returned parameter index there; other ranks get ``{}``). If any rank failed, every
    rank raises: its own error, or one naming the rank that failed."""
    report = (
        None if failure is None else f"{type(failure).__name__}: {failure}",
        writer.files,
        params,
    )
    reports: list = [None] * shards.world_size
    try:
        dist.all_gather_object(reports, report, group=shards.group)
    except (RuntimeError, ValueError) as exc:
        raise shards.error("gathering the checkpoint's files", exc) from exc
    failed = [(rank, r[0]) for rank, r in enumerate(reports) if r[0] is not None]
    if failed:
        if shards.rank == 0:
            shutil.rmtree(writer.dir, ignore_errors=True)
        if failure is not None:
            raise failure
        rank, message = failed[0]
        raise CheckpointError(
            f"rank {rank} failed to save its shard ({message}); nothing was committed, the "
            "previous checkpoint is unchanged"
        )
    if shards.rank != 0:
        return {}
    merged: dict[str, dict] = {}
    for _, files, rank_params in reports:
        writer.files.update(files)
        for name, meta in rank_params.items():
            into = merged.setdefault(name, {"shape": meta["shape"], "states": [], "pieces": []})
            into["states"] += [k for k in meta["states"] if k not in into["states"]]
            into["pieces"] += meta["pieces"]
            if "values" in meta:
                into.setdefault("values", meta["values"])
    for meta in merged.values():
        meta["pieces"].sort(key=lambda piece: piece["start"])
    return merged


def commit_on_rank0(shards: ShardGroup, writer: CheckpointWriter, finish) -> Path:
    """Rank 0 runs ``finish()`` (shared files, then the commit) and tells the others."""
    if shards.rank == 0:
        try:
            result = finish()
        except BaseException as exc:
            _broadcast(shards, ("error", f"{type(exc).__name__}: {exc}"))
            raise
        _broadcast(shards, ("ok", str(result)))
        return result
    status, value = _broadcast(shards, None)
    if status != "ok":
        raise CheckpointError(
            f"rank 0 failed to commit the checkpoint ({value}); the previous one is unchanged"
        )
    writer.committed = True
    return Path(value)


def shard_pieces(unit) -> list[tuple[object, int, int]]:
    """``(entry, a, b)``: the part ``[a, b)`` (full-layout offsets) of each of ``unit``'s
    parameters that lies in this rank's shard."""
    start, end = unit.shard_start, unit.shard_start + unit.numel
    out = []
    for entry in unit.entries:
        a, b = max(entry.offset, start), min(entry.offset + entry.numel, end)
        if a < b:
            out.append((entry, a, b))
    return out
