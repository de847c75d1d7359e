"""``hetstore.load_weights``: read safetensors weights into an offloaded model, streamed.

Where the weights come from: one ``.safetensors`` file, a sharded checkpoint's index
(``*.safetensors.index.json``, Hugging Face format: ``{"metadata": ..., "weight_map":
{tensor name: shard file}}``, shards relative to the index), or a directory holding
``model.safetensors`` (preferred) or ``model.safetensors.index.json``.

How it streams, so the whole model is never in host memory:

1. Check (nothing written yet). Only the safetensors *headers* are read: every file is
   opened once for its key names, shapes and dtypes. The file's keys are matched against
   the model's parameters (any name of a tied parameter counts: ``head.weight`` or
   ``wte.weight``; when a file holds several, the first in ``named_parameters`` order is
   used) and persistent buffers. Missing or unexpected keys (``strict=True``), a shape
   mismatch or a non-floating dtype for a parameter raise ``ConfigError`` here, so a bad
   checkpoint changes nothing.
2. Load, one unit at a time, in the runtime's unit order. For each unit that has at least
   one key in the file, ``unit.edit_master()`` is entered once: it yields the unit's whole
   fp32 master (on a disk master, a temporary host buffer of the unit's size), every
   entry's tensor is read from its shard (``safe_open(...).get_tensor``, mmapped, cast to
   fp32 by ``copy_``) into its slice, and on exit the master is written back and the
   compute-dtype copies (host, disk, device) are refreshed. Host memory in use is then
   one unit's master (plus, for a disk ``home``, one unit's compute-dtype copy) and one
   tensor read from the file; shard handles are kept in a small LRU cache, so a shard is
   not reopened for every tensor.
3. Persistent buffers (BatchNorm running statistics ...) are copied in place into the
   model's buffer tensors (``buf.copy_``, which casts to the buffer's dtype).

With ``strict=False`` the matching keys are loaded and the others listed in the returned
:class:`LoadResult`; a shape mismatch still raises (as in ``torch.nn.Module.
load_state_dict``). Parameters not loaded keep their current values.

A plain module (not passed to ``hetstore.offload``) is accepted too: each tensor is read
and copied straight into its parameter or buffer (``param.data.copy_``), one at a time.
A plain module with parameters on the meta device has no storage to copy into: that is a
``ConfigError`` telling to call ``hetstore.offload`` first (it materializes them).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hetstore.errors import ConfigError
from hetstore.eviction import refuse_if_evicted
from hetstore.model_state import state_of

__all__ = ["load_weights", "LoadResult"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHOWN_KEYS = 10
_OPEN_SHARDS = 4  # shard handles kept open at once while loading
# safetensors dtype names a parameter may be stored in (cast to fp32 for the master)
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


class LoadResult(NamedTuple):
    """What ``load_weights`` did not match, as in ``torch.nn.Module.load_state_dict``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


@dataclass
class _Target:
    """One distinct model tensor (a parameter or a persistent buffer) and its names."""

    names: list[str]  # every name it has in the model; names[0] is reported as missing
    tensor: torch.Tensor
    is_param: bool
    source: str | None = None  # the file key it is loaded from


def load_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> LoadResult:
    """Load safetensors weights from ``path`` into ``model``, one unit at a time.

    ``model`` is a model returned by ``hetstore.offload`` (or a plain module, loaded
    tensor by tensor). ``path`` is a ``.safetensors`` file, a ``*.safetensors.index.json``
    of a sharded checkpoint, or a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json``.

    With ``strict=True`` (default) the file's keys must match the model's parameters and
    persistent buffers exactly (a tied parameter may appear under any of its names), else
    ``ConfigError`` is raised before anything is written. A shape mismatch always raises.
    Returns ``LoadResult(missing_keys, unexpected_keys)``.

    Raises ``FileNotFoundError`` for a missing path or shard and ``ConfigError`` for a file
    that is not safetensors or an index without a ``weight_map``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_weights() takes an nn.Module, got {type(model).__name__}")
    refuse_if_evicted(model, "load_weights")
    location = Path(os.fspath(path))
    files = _resolve(location)
    tensors = _read_headers(files)
    targets = targets_of(model)

    # ------------------------------------------------------------------ check
    by_name = {name: target for target in targets for name in target.names}
    unexpected = [key for key in tensors if key not in by_name]
    missing: list[str] = []
    mismatched: list[str] = []
    for target in targets:
        present = [name for name in target.names if name in tensors]  # model order
        if not present:
            missing.append(target.names[0])
            continue
        target.source = present[0]
        for name in present:
            info = tensors[name]
            if info.shape != tuple(target.tensor.shape):
                mismatched.append(
                    f"{name!r}: shape {list(info.shape)} in {info.file.name}, "
                    f"{list(target.tensor.shape)} in the model"
                )
            elif target.is_param and info.dtype not in _FLOAT_DTYPES:
                mismatched.append(
                    f"{name!r}: dtype {info.dtype} in {info.file.name}; a parameter is loaded "
                    "from a floating-point tensor"
                )
    if mismatched:
        raise ConfigError(
            f"load_weights({str(location)!r}): {len(mismatched)} tensor(s) do not fit the "
            f"model, nothing was loaded: "
            + "; ".join(mismatched[:_SHOWN_KEYS])
            + _more(len(mismatched))
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s) {_show(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) {_show(unexpected)}")
        raise ConfigError(
            f"load_weights({str(location)!r}): the checkpoint does not match the model, "
            f"nothing was loaded: {'; '.join(parts)}. Pass strict=False to load the keys "
            "that match and get the others listed"
        )

    # ------------------------------------------------------------------ load
    state = state_of(model)
    runtime = state.runtime if state is not None else None
    loaded = [t for t in targets if t.source is not None]
    with _Shards() as shards:

        def read(target: _Target) -> torch.Tensor:
            return shards.get(tensors[target.source].file).get_tensor(target.source)

        with torch.no_grad():
            done: set[int] = set()
            if runtime is not None:
                done = _load_units(runtime.units, loaded, read)
            for target in loaded:
                if id(target.tensor) not in done:
                    target.tensor.data.copy_(read(target))
    return LoadResult(missing, unexpected)


# ---------------------------------------------------------------------- model side
def targets_of(model: nn.Module) -> list[_Target]:
    """Every distinct parameter and persistent buffer with all its names, in model order."""
    targets: dict[int, _Target] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        _add(targets, name, param, is_param=True)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, buffer in module._buffers.items():
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            _add(targets, f"{prefix}.{attr}" if prefix else attr, buffer, is_param=False)
    meta = [t.names[0] for t in targets.values() if t.tensor.is_meta]
    if meta and state_of(model) is None:
        raise ConfigError(
            f"load_weights: the model has tensors on the meta device ({_show(meta)}) and was "
            "not passed to hetstore.offload(); call hetstore.offload(model, optimizer, config) "
            "first, which gives them storage in their tiers, then load_weights"
        )
    return list(targets.values())


def _add(targets: dict[int, _Target], name: str, tensor: torch.Tensor, *, is_param: bool) -> None:
    target = targets.get(id(tensor))
    if target is None:
        targets[id(tensor)] = _Target([name], tensor, is_param)
    elif name not in target.names:
        target.names.append(name)


def _load_units(units, loaded: list[_Target], read) -> set[int]:
    """Write every loaded parameter that a unit manages into its unit's master, one unit
    at a time; return the ids of the parameters written."""
    wanted = {id(t.tensor): t for t in loaded if t.is_param}
    done: set[int] = set()
    for unit in units:
        work = [(e, wanted[id(e.param)]) for e in unit.entries if id(e.param) in wanted]
        if not work:
            continue  # nothing of this unit in the file: leave its master untouched
        with unit.edit_master() as flat:
            for entry, target in work:
                tensor = read(target)
                flat[entry.offset : entry.offset + entry.numel].copy_(tensor.reshape(-1))
                del tensor
        done.update(id(entry.param) for entry, _ in work)
    return done


# ---------------------------------------------------------------------- file side
def _resolve(location: Path) -> list[tuple[Path, list[str] | None]]:
    """The safetensors files to read, each with the keys to take from it (None: all)."""
    if not location.exists():
        raise FileNotFoundError(
            2, "load_weights: no such safetensors file, index or directory", str(location)
        )
    if location.is_dir():
        if (location / SINGLE_FILE).is_file():
            return [(location / SINGLE_FILE, None)]
        if (location / INDEX_FILE).is_file():
            return _read_index(location / INDEX_FILE)
        raise FileNotFoundError(
            2,
            f"load_weights: the directory holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
            "pass the file or index path instead",
            str(location),
        )
    if location.name.endswith(".json"):
        return _read_index(location)
    return [(location, None)]


def _read_index(index: Path) -> list[tuple[Path, list[str] | None]]:
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"load_weights: {str(index)!r} is not a JSON index: {err}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ConfigError(
            f"load_weights: {str(index)!r} has no weight_map {{tensor name: shard file}}; "
            "a sharded checkpoint's index looks like "
            '{"metadata": {...}, "weight_map": {"wte.weight": "model-00001-of-00002.safetensors"}}'
        )
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    files = []
    for shard, keys in shards.items():
        file = index.parent / shard
        if not file.is_file():
            raise FileNotFoundError(
                2, f"load_weights: shard {shard!r} named by {str(index)!r} is missing", str(file)
            )
        files.append((file, keys))
    return files


def _read_headers(files: list[tuple[Path, list[str] | None]]) -> dict[str, _TensorInfo]:
    """Key -> file, shape and dtype, from the headers only (no tensor data is read)."""
    tensors: dict[str, _TensorInfo] = {}
    for file, keys in files:
        with _open(file) as handle:
            present = set(handle.keys())
            if keys is None:
                keys = sorted(present)
            absent = [k for k in keys if k not in present]
            if absent:
                raise ConfigError(
                    f"load_weights: the index maps {_show(absent)} to {file.name}, which "
                    "does not hold them; the index and its shards disagree"
                )
            for key in keys:
                piece = handle.get_slice(key)
                tensors[key] = _TensorInfo(file, tuple(piece.get_shape()), piece.get_dtype())
    return tensors


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as err:
        raise ConfigError(
            f"load_weights: {str(file)!r} is not a safetensors file ({err})"
        ) from None


class _Shards:
    """Open shard handles, the last few used kept open (LRU)."""

    def __init__(self, keep: int = _OPEN_SHARDS):
        self.keep = keep
        self.handles: OrderedDict[Path, object] = OrderedDict()

    def get(self, file: Path):
        handle = self.handles.get(file)
        if handle is not None:
            self.handles.move_to_end(file)
            return handle
        handle = _open(file).__enter__()
        self.handles[file] = handle
        if len(self.handles) > self.keep:
            _, oldest = self.handles.popitem(last=False)
            oldest.__exit__(None, None, None)
        return handle

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, *exc) -> None:
        while self.handles:
            _, handle = self.handles.popitem()
            handle.__exit__(None, None, None)


def _show(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:_SHOWN_KEYS]) + _more(len(keys))


def _more(count: int) -> str:
    return f" and {count - _SHOWN_KEYS} more" if count > _SHOWN_KEYS else ""
