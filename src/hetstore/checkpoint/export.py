"""``hetstore.export_weights``: the model's weights as consolidated safetensors, streamed.

The output is what ``transformers``' ``save_pretrained`` writes and what plain PyTorch
reads with ``safetensors.torch.load_file``: ``model.safetensors``, or when the weights
exceed ``max_shard_size``, ``model-00001-of-0000N.safetensors`` ... plus
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``).
Keys are ``model.state_dict()``'s: every name of a tied parameter is written (so
``load_state_dict(strict=True)`` accepts the file), persistent buffers included.

Streaming: the fp32 masters are read unit by unit from their tier in chunks, cast to the
requested dtype chunk by chunk and appended to the file, so the host memory in use is a
few chunk buffers whatever the model's size. Each file is written under a temporary
name, fsynced and renamed into place; the index is renamed last, so a reader never sees
an index naming a file that is not complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hetstore._safefs import check_shared_root
from hetstore._sizes import parse_size
from hetstore.checkpoint.files import DirectFile, Staging, fsync_dir, write_durable
from hetstore.checkpoint.safetensors_stream import SafetensorsStreamWriter, TensorSpec
from hetstore.checkpoint.training import (
    Buffers,
    Item,
    OffloadReadFailed,
    host_of,
    master_of,
    runtime_of,
    stream,
)
from hetstore.errors import ConfigError
from hetstore.eviction import refuse_if_evicted
from hetstore.model_state import state_of
from hetstore.tiers.flat import DiskSlice
from hetstore.weights import targets_of

__all__ = ["export_weights"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def export_weights(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = "5GB",
) -> list[Path]:
    """Write ``model``'s weights to the directory ``path`` as safetensors.

    ``dtype``: ``torch.float32`` (default, the fp32 masters), a floating dtype such as
    ``torch.bfloat16``, or ``"compute"`` for the offload config's compute dtype. Buffers
    keep their own dtype. ``max_shard_size`` (bytes or a string like ``"2GB"``) splits
    the weights into shards with a Hugging Face index. With a model's config saved
    beside (``model.config.save_pretrained(path)``), ``from_pretrained(path)`` loads it.
    Returns the files written.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_weights() takes an nn.Module, got {type(model).__name__}")
    refuse_if_evicted(model, "export_weights")
    ranks = state.shards if (state := state_of(model)) is not None else None
    if ranks is not None:
        raise ConfigError(
            f"export_weights: the model is sharded over {ranks.world_size} ranks; save it with "
            "hetstore.save (every rank), then export from one process: hetstore.load the "
            "checkpoint into an unsharded model (process_group=False) and export that"
        )
    dtype = _export_dtype(model, dtype)
    try:
        shard_bytes = parse_size(max_shard_size)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"export_weights: max_shard_size={max_shard_size!r}: {exc}") from None
    if shard_bytes <= 0:
        raise ConfigError(f"export_weights: max_shard_size={max_shard_size!r} must be positive")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"export_weights: {str(root)!r} exists and is not a directory")

    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in _tensors(model, dtype):
        nbytes = len(tensor.names) * _numel(tensor.source) * tensor.dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    count = len(shards)
    file_names = (
        [SINGLE_FILE]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )

    root.mkdir(parents=True, exist_ok=True)
    check_shared_root(os.stat(root), str(root), "export path")  # see CheckpointWriter._start
    for file_name in [*file_names, INDEX_FILE]:  # this pid's own leftovers, from a crash
        (root / f".{file_name}.tmp-{os.getpid()}").unlink(missing_ok=True)
    temps: list[tuple[Path, Path]] = []
    weight_map: dict[str, str] = {}
    total = 0
    buffers = Buffers(host_of(model))
    staging = Staging()
    try:
        for file_name, shard in zip(file_names, shards, strict=True):
            temp = root / f".{file_name}.tmp-{os.getpid()}"
            temps.append((temp, root / file_name))
            total += _write_shard(temp, shard, buffers, staging)
            for tensor in shard:
                weight_map.update(dict.fromkeys(tensor.names, file_name))
        if count > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            temp = root / f".{INDEX_FILE}.tmp-{os.getpid()}"
            temps.append((temp, root / INDEX_FILE))
            write_durable(temp, json.dumps(index, indent=2, sort_keys=True).encode())
        for temp, final in temps:
            os.replace(temp, final)
        fsync_dir(root)
    except BaseException as exc:
        for temp, _ in temps:
            temp.unlink(missing_ok=True)
        if isinstance(exc, OffloadReadFailed):
            raise exc.error(f"no file in {str(root)!r} was written or replaced") from exc.cause
        raise
    finally:
        staging.close()
        buffers.close()
    return [final for _, final in temps]


def _export_dtype(model: nn.Module, dtype) -> torch.dtype:
    if dtype == "compute":
        runtime = runtime_of(model)
        units = runtime.units if runtime is not None else []
        return units[0].compute_dtype if units else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            f"export_weights: dtype={dtype!r}; use a floating torch dtype or 'compute'"
        )
    return dtype


@dataclass
class _Tensor:
    names: list[str]  # every state_dict name it has (tied parameters: several)
    source: torch.Tensor | DiskSlice  # a parameter's fp32 master, or a buffer
    dtype: torch.dtype  # as written


def _tensors(model: nn.Module, dtype: torch.dtype) -> list[_Tensor]:
    """Every distinct parameter and persistent buffer with all its state_dict names
    (``load_weights``' walk of the model); parameters in the runtime's unit order, so
    disk is read front to back. Parameters are written in ``dtype``, buffers (integer
    counters too) in their own."""
    targets = targets_of(model)
    names = {id(t.tensor): t.names for t in targets}
    runtime = runtime_of(model)
    if runtime is not None:
        out = [
            _Tensor(names[id(e.param)], master_of(unit, e), dtype)
            for unit in runtime.units
            for e in unit.entries
        ]
    else:
        out = [_Tensor(t.names, t.tensor.detach(), dtype) for t in targets if t.is_param]
    out += [
        _Tensor(t.names, t.tensor, t.tensor.dtype)
        for t in targets
        if not t.is_param and not t.tensor.is_meta
    ]
    return out


def _numel(source) -> int:
    return source.numel() if isinstance(source, torch.Tensor) else source.numel


def _write_shard(temp: Path, shard: list[_Tensor], buffers: Buffers, staging: Staging) -> int:
    # a tied parameter's bytes once per name; one stream, so disk reads run ahead
    items, dtypes = [], {}
    for tensor in shard:
        for name in tensor.names:
            items.append(Item(name, tensor.source))
            dtypes[name] = tensor.dtype
    specs = [TensorSpec(i.key, dtypes[i.key], tuple(i.data.shape)) for i in items]
    out = DirectFile(temp, staging)  # O_DIRECT from staging blocks, as checkpoints
    try:
        writer = SafetensorsStreamWriter(out, specs, {"format": "pt"})
        for item, piece in stream(items, buffers):
            dtype = dtypes[item.key]
            writer.write(piece if piece.dtype == dtype else piece.to(dtype))
        writer.finish()
        out.finish()
    except BaseException:
        out.abort()
        raise
    return writer.total
