"""``hetstore.save`` / ``hetstore.load``: the whole training state, streamed unit by unit.

What is saved: every parameter's fp32 master, every optimizer state (moments, step
counters, SGD momentum ...), the optimizer's param groups (learning rates and the rest,
as an LR scheduler left them), the fp16 loss scaler, the model's persistent buffers and
whatever the caller passes as ``extra`` (the LR scheduler's ``state_dict()``, RNG states).
Gradients are not: a checkpoint is taken between steps.

Layout (inside one version of :mod:`hetstore.checkpoint.files`, so it is atomic and
verified):

- ``unit-NNNNN.safetensors``: one per unit of the saving run. Each parameter's master
  under its name (``blocks.0.attn.weight``, shaped like the parameter, fp32) and each of
  its states under ``name/key`` (``blocks.0.attn.weight/exp_avg``). A unit file loads
  with ``safetensors.torch.load_file``, names and shapes as in ``model.state_dict()``.
- ``buffers.safetensors``, ``optimizer.json``, ``extra.json`` (+ ``extra.safetensors``).
- The index's ``meta``: per parameter, the file it is in, its shape and its state keys.

Sharded over N ranks (see :mod:`hetstore.checkpoint.sharded`), each rank writes the
pieces of its shard into its own unit files and the index lists, per parameter, its
pieces (file, element range); a load with any number of ranks reads by name and range.

Why safetensors and not ``torch.distributed.checkpoint`` (DCP): DCP wants the state as
in-memory tensors (``state_dict()``), which for states on disk means reading a unit whole
into host memory, and its ``.metadata`` file is a pickle, so loading an untrusted DCP
checkpoint can run code. Safetensors files are read by every tool of the field, and
with a header we write ourselves they are streamed in both directions. The measured
side-by-side is in ``benchmarks/checkpoint.py``.

Placement independence: files are keyed by parameter names, not by the saving run's
units, tiers or offsets. A load looks each of its own units' parameters up by name and
writes them into whatever tier its plan chose: masters and states on disk are rebuilt
chunk by chunk into shadow regions and committed per unit (a failure leaves that unit as
it was); in memory they are read straight into their flat buffers.

Memory: a save holds two chunk buffers (double-buffered disk reads) besides what is
already in memory; a load one chunk per array of a unit (master, compute-dtype copy,
each state).

Verify, then apply: a load first reads and checks everything (the index against its
CRC-32 in ``LATEST``, every file's size and CRC-32, every header and tensor against the
index, the checkpoint against the model and the optimizer, ``extra`` decoded) and only
then writes into the model and optimizer; a damaged or crafted checkpoint is refused
with the file (and tensor or key) named and changes nothing. A save says which side
failed: a read of the offload disk names the offload file, a write the checkpoint file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer

from hetstore.checkpoint import sharded, tagged
from hetstore.checkpoint.files import CheckpointError, CheckpointReader, CheckpointWriter
from hetstore.checkpoint.safetensors_stream import SafetensorsFile, TensorSpec
from hetstore.config import STATE_FORMATS
from hetstore.errors import ConfigError, DiskIOError
from hetstore.eviction import refuse_if_evicted
from hetstore.model_state import state_of
from hetstore.optim.loss_scaler import DynamicLossScaler
from hetstore.optim.offloaded import OffloadedOptimizer
from hetstore.runtime.rewrite import ChunkedRewrite, Span
from hetstore.runtime.unit import Unit
from hetstore.tiers.flat import DiskSlice
from hetstore.tiers.store import Store, transfers_only, wait_all_quiet

__all__ = ["save", "load"]

KIND = "training-state"
CHUNK_ELEMENTS = 8 * 2**20  # 32 MiB of fp32 per buffer: past the disk's ceiling (BENCHMARKS)
_SHOWN = 10


# ---------------------------------------------------------------------- shared helpers
def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name (``named_parameters`` order; tied ones once)."""
    return {id(p): name for name, p in model.named_parameters()}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by name (what ``state_dict()`` holds besides parameters)."""
    out = {}
    for prefix, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is not None and attr not in module._non_persistent_buffers_set:
                out[f"{prefix}.{attr}" if prefix else attr] = buffer
    return out


def runtime_of(model: nn.Module):
    """The offload runtime of ``model``; ``None`` for a model not offloaded."""
    state = state_of(model)
    return state.runtime if state is not None else None


def _check_optimizer(optimizer, model: nn.Module) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
    if runtime_of(model) is not None and not isinstance(optimizer, OffloadedOptimizer):
        raise ConfigError(
            "optimizer: pass the optimizer hetstore.offload() returned for this model, not the "
            f"original {type(optimizer).__name__} (its parameters now live in hetstore's tiers)"
        )


def _optimizer_class(optimizer: Optimizer) -> type:
    return getattr(optimizer, "optimizer_class", type(optimizer))


def host_of(model: nn.Module):
    """The host tier of an offloaded ``model``; ``None`` for a model not offloaded."""
    state = state_of(model)
    return state.tiers.host if state is not None else None


class Buffers:
    """Host buffers for chunks, accounted in the host tier of an offloaded model and
    reused from unit to unit (a fresh mapping per unit paid its page faults every time:
    a quarter of a load's time). :meth:`close` gives them all back."""

    def __init__(self, host):
        self.host = host
        self.free: dict[tuple[int, torch.dtype], list] = {}
        self.taken: list = []

    def take(self, numel: int, dtype: torch.dtype, label: str):
        pool = self.free.setdefault((numel, dtype), [])
        if pool:
            return pool.pop()
        if self.host is None:
            pair = None, torch.empty(numel, dtype=dtype)
        else:
            buffer = self.host.allocate(numel * dtype.itemsize, label, dtype)
            pair = buffer, buffer.tensor
        self.taken.append(pair[0])
        return pair

    def give(self, pairs) -> None:
        for pair in pairs:
            self.free[(pair[1].numel(), pair[1].dtype)].append(pair)

    def close(self) -> None:
        for buffer in self.taken:
            if buffer is not None:
                self.host.free(buffer)
        self.taken.clear()
        self.free.clear()


# ---------------------------------------------------------------------- save
@dataclass(frozen=True)
class DecodedSlice:
    """Elements ``[start, start + numel)`` of a compact (bf16, 8-bit) state ``key`` of a
    unit's chunked step, seen as an fp32 tensor of ``shape``: decoded a chunk at a time as
    the file is written, never whole."""

    states: object  # the unit's UnitStates (read_state decodes)
    key: str
    start: int
    numel: int
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def read(self, at: int, n: int) -> torch.Tensor:
        return self.states.read_state(self.key, self.start + at, n)


@dataclass
class Item:
    """One tensor written to a file: its key and its data, in memory or on the offload
    disk (or a compact state, decoded as it is written)."""

    key: str
    data: torch.Tensor | DiskSlice | DecodedSlice

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.key, self.data.dtype, tuple(self.data.shape))


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    extra=None,
) -> Path:
    """Save ``model``'s weights, ``optimizer``'s state and ``extra`` to ``path``.

    ``model`` is a model returned by ``hetstore.offload`` (or a plain module) and
    ``optimizer`` the optimizer it returned (or a plain torch optimizer, or None).
    ``extra`` is any value made of tensors, numpy arrays, numbers, strings, lists, tuples
    and dicts: typically ``{"scheduler": scheduler.state_dict(), "rng":
    torch.get_rng_state(), "step": step}``; :func:`load` returns it.

    Each unit's states are streamed from the tier that holds them into their own file
    (host memory in use: two 32 MiB buffers). The new checkpoint replaces the one at
    ``path`` only once every file is written and fsynced; a crash or error before leaves
    the previous one loadable. Returns the directory of the new version.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save() takes an nn.Module, got {type(model).__name__}")
    refuse_if_evicted(model, "hetstore.save")
    _check_optimizer(optimizer, model)
    if isinstance(optimizer, OffloadedOptimizer):
        optimizer.check_between_steps()
    runtime = runtime_of(model)
    names = _param_names(model)
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_json = None if extra is None else tagged.encode(extra, extra_tensors)
    groups_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = None
    if optimizer is not None:
        optimizer_json = _optimizer_header(optimizer, names, groups_tensors)
    if runtime is not None and any(u.grads.any() for u in runtime.units):
        warnings.warn(
            "save(): gradients accumulated since the last optimizer step are not saved",
            stacklevel=2,
        )

    shards = state.shards if (state := state_of(model)) is not None else None
    files = _file_plan(model, optimizer, runtime, names, shards)
    try:
        return _save_files(
            path, model, files, shards, optimizer_json, groups_tensors, extra_json, extra_tensors
        )
    except OffloadReadFailed as failed:
        raise failed.error(
            f"the new checkpoint was discarded and the previous one at {str(path)!r} is "
            "unchanged and loadable"
        ) from failed.cause


def _save_files(
    path, model, files, shards, optimizer_json, groups_tensors, extra_json, extra_tensors
) -> Path:
    buffers = Buffers(host_of(model))
    writer = CheckpointWriter(path) if shards is None else sharded.start_save(path, shards)
    with contextlib.closing(buffers), writer:
        failure = None
        try:
            params_meta = _write_unit_files(writer, files, buffers, groups_tensors)
        except Exception as exc:
            if shards is None:
                raise
            failure, params_meta = exc, {}
        if shards is not None:  # every rank's files to rank 0, or every rank raises
            params_meta = sharded.gather_reports(writer, shards, params_meta, failure)

        def finish() -> Path:
            writer.write_tensors(
                "buffers.safetensors", {k: v for k, v in _buffers(model).items() if not v.is_meta}
            )
            if optimizer_json is not None:
                writer.write_json("optimizer.json", optimizer_json)
            if groups_tensors:
                writer.write_tensors("optimizer.safetensors", groups_tensors)
            if extra_json is not None:
                writer.write_json("extra.json", extra_json)
                writer.write_tensors("extra.safetensors", extra_tensors)
            world = 1 if shards is None else shards.world_size
            return writer.commit({"kind": KIND, "world_size": world, "params": params_meta})

        if shards is None:
            return finish()
        return sharded.commit_on_rank0(shards, writer, finish)


def _write_unit_files(writer, files, buffers: Buffers, groups_tensors: dict) -> dict:
    """Stream every planned unit file; return the index's per-parameter entries."""
    params_meta: dict[str, dict] = {}
    for file_name, items, values, pieces in files:
        for item in items:
            name, _, key = item.key.partition("/")
            meta = params_meta.setdefault(name, {"states": []})
            if name in pieces:  # a shard's piece of the parameter
                meta.setdefault("pieces", [{"file": file_name, **pieces[name]}])
            else:
                meta["file"] = file_name
            if not key:
                meta["shape"] = list(pieces[name]["shape"] if name in pieces else item.data.shape)
            else:
                meta["states"].append(key)
        for name, state_values in values.items():
            params_meta[name]["values"] = tagged.encode(
                state_values, groups_tensors, f"state of {name}"
            )
        with writer.stream_tensors(file_name, [item.spec for item in items]) as out:
            for _, piece in stream(items, buffers):
                out.write(piece)
    for meta in params_meta.values():
        for piece in meta.get("pieces", ()):
            piece.pop("shape", None)
    return params_meta


def _optimizer_header(optimizer: Optimizer, names: dict[int, str], tensors: dict) -> dict:
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ConfigError(
                f"optimizer.param_groups[{i}] holds {len(missing)} parameter(s) that are not "
                "the model's: a checkpoint names parameters by their place in the model"
            )
        groups.append(
            {
                "params": [names[id(p)] for p in group["params"]],
                "hyper": tagged.encode(hyper, tensors, f"param_groups[{i}]"),
            }
        )
    scaler = getattr(optimizer, "loss_scaler", None)
    return {
        "class": _optimizer_class(optimizer).__qualname__,
        "param_groups": groups,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        # the states' values are saved in fp32 whatever the format; a load into another
        # format would round them, so it must be asked for (load(convert_state_format=))
        "state_format": _state_format_of(optimizer),
    }


def _state_format_of(optimizer) -> str:
    fmt = getattr(optimizer, "state_format", None)
    return fmt.name if fmt is not None else "fp32"


def _file_plan(model, optimizer, runtime, names, shards=None) -> list[tuple]:
    """Per file: the tensors in write order (masters, then each state key, each in the
    unit's element order, so disk arrays are read front to back), non-tensor states, and
    (sharded) each parameter's piece."""
    if shards is not None:
        return [
            _shard_file(unit, index, optimizer, names, shards.rank)
            for index, unit in enumerate(runtime.units)
            if sharded.shard_pieces(unit)
        ]
    if runtime is not None:
        groups = [
            [(names[id(e.param)], e.param, master_of(unit, e)) for e in unit.entries]
            for unit in runtime.units
            if unit.entries
        ]
    else:
        groups = [[(names[id(p)], p, p.detach()) for p in dict.fromkeys(model.parameters())]]
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
    plan = []
    for index, entries in enumerate(groups):
        items = [Item(name, master) for name, _, master in entries]
        by_key: dict[str, list[Item]] = {}
        values: dict[str, dict] = {}
        for name, param, _ in entries:
            state = _param_state(optimizer, param) if id(param) in optimized else {}
            for key, value in state.items():
                if isinstance(value, (torch.Tensor, DiskSlice)):
                    by_key.setdefault(key, []).append(Item(f"{name}/{key}", value))
                else:
                    values.setdefault(name, {})[key] = value
        for key_items in by_key.values():
            items += key_items
        plan.append((f"unit-{index:05d}.safetensors", items, values, {}))
    return plan


def _shard_file(unit: Unit, index: int, optimizer, names, rank: int) -> tuple:
    """This rank's file of ``unit``: the piece of each parameter inside its shard (shaped
    like the parameter when whole, flat when cut) and the same range of its states."""
    start = unit.shard_start
    segments = []
    if isinstance(optimizer, OffloadedOptimizer) and unit.trainable_numel:
        segments = [s for s in _shard_segment_states(unit, optimizer) if s["stepped"]]
    items: list[Item] = []
    by_key: dict[str, list[Item]] = {}
    pieces: dict[str, dict] = {}
    for entry, a, b in sharded.shard_pieces(unit):
        name = names[id(entry.param)]
        whole = (a, b) == (entry.offset, entry.offset + entry.numel)
        shape = entry.shape if whole else torch.Size([b - a])
        pieces[name] = {"start": a - entry.offset, "numel": b - a, "shape": list(entry.shape)}
        local = a - start
        # a parameter outside the optimizer in the compute dtype has no master: its
        # compute-dtype home is saved (a load casts), as in one process (master_of)
        source = unit.master if local < unit.master_numel else unit.home
        if transfers_only(source):
            items.append(Item(name, DiskSlice(source, local, b - a, shape)))
        else:
            items.append(Item(name, source[local : local + b - a].view(shape)))
        if entry.group is None:
            continue
        segment = next(
            (s for s in segments if s["segment"].start <= local < s["segment"].end), None
        )
        if segment is None:
            continue  # fresh states (before the first step) are not saved, as in torch
        if segment["step"] is not None:
            by_key.setdefault("step", []).append(Item(f"{name}/step", segment["step"]))
        for key, data in segment["states"].items():
            at = local - segment["base"]
            if data is None:  # a compact state, decoded as the file is written
                piece = DecodedSlice(segment["compact"], key, at, b - a, shape)
            elif transfers_only(data):
                piece = DiskSlice(data, at, b - a, shape)
            else:
                piece = data[at : at + b - a].view(shape)
            by_key.setdefault(key, []).append(Item(f"{name}/{key}", piece))
    for key_items in by_key.values():
        items += key_items
    return f"unit-{index:05d}-rank{rank:05d}.safetensors", items, {}, pieces


def _shard_segment_states(unit: Unit, optimizer: OffloadedOptimizer) -> list[dict]:
    """``optimizer.segment_states(unit)``; for states in a compact format (bf16, 8-bit),
    their keys with no array (``None``) and the step that decodes them (``"compact"``):
    a checkpoint keeps fp32 states, as in one process (the format is recorded and a load
    encodes them again, exactly), decoded a chunk at a time as the file is written."""
    streamed = optimizer.streamed_step_of(unit)
    if streamed is None or streamed.format.exact:
        return optimizer.segment_states(unit)
    return [
        {
            "segment": segment,
            "base": 0,
            "step": streamed.steps[i] if streamed.has_step else None,
            "states": dict.fromkeys(streamed.states),  # (None: decoded from "compact")
            "compact": streamed,
            "stepped": streamed.stepped,
        }
        for i, segment in enumerate(unit.segments)
    ]


def master_of(unit: Unit, entry) -> torch.Tensor | DiskSlice:
    """A parameter's saved value: its fp32 master, or for a frozen parameter without one
    its compute-dtype ``home`` (saved in that dtype; a load casts). A step still running
    on (``step_in_forward``) lands first."""
    unit.barrier()
    source = unit.master if entry.offset < unit.master_numel else unit.home
    if transfers_only(source):
        return DiskSlice(source, entry.offset, entry.numel, entry.shape)
    return source[entry.offset : entry.offset + entry.numel].view(entry.shape)


def _param_state(optimizer, param) -> dict:
    if isinstance(optimizer, OffloadedOptimizer):
        return optimizer.export_param_state(param)
    return optimizer.state.get(param, {})


class OffloadReadFailed(Exception):
    """Reading the model's state from the offload disk failed while a checkpoint or an
    export was being written: the offload side is at fault, not the file being written.
    Not an ``OSError``, so the writer does not take it for a failed write of its file;
    :meth:`error` turns it into the :class:`DiskIOError` the caller sees."""

    def __init__(self, cause: DiskIOError, key: str):
        super().__init__(str(cause))
        self.cause = cause
        self.key = key

    def error(self, consequence: str) -> DiskIOError:
        cause = self.cause
        return DiskIOError(
            f"reading {self.key!r} back from the offload disk failed: {cause}. The failing "
            f"side is the offload file {cause.path!r} (under offload_path), not the "
            f"destination being written; {consequence}. The model's state in that file "
            "may be lost: check that disk (dmesg) before training on",
            path=cause.path,
            offset=cause.offset,
            errno=cause.errno,
        )


def stream(items: list[Item], buffers: Buffers) -> Iterator[tuple[Item, torch.Tensor]]:
    """Each item's data in order, in pieces of at most a chunk, with the item it belongs
    to. Memory pieces are views; disk pieces are read one ahead into two alternating
    chunk buffers (a piece is valid until the next one is asked for). A failed read of
    the offload disk raises :class:`OffloadReadFailed`."""
    jobs: list[tuple[Item, torch.Tensor | tuple[Store, int, int]]] = []
    owners: list[Item] = []  # the item of each disk job
    for item in items:
        data = item.data
        if isinstance(data, DecodedSlice):  # decoded when its turn comes, not now
            for a in range(0, data.numel, CHUNK_ELEMENTS):
                n = min(CHUNK_ELEMENTS, data.numel - a)
                jobs.append((item, functools.partial(data.read, a, n)))
        elif isinstance(data, DiskSlice):
            for a in range(0, data.numel, CHUNK_ELEMENTS):
                n = min(CHUNK_ELEMENTS, data.numel - a)
                jobs.append((item, (data.array, data.start + a, n)))
                owners.append(item)
        else:
            flat = data.detach().reshape(-1)
            for a in range(0, max(flat.numel(), 1), CHUNK_ELEMENTS):
                jobs.append((item, flat[a : a + CHUNK_ELEMENTS].cpu()))  # a device home: host
    disk = [job for _, job in jobs if isinstance(job, tuple)]
    if not disk:
        for item, job in jobs:
            yield item, job() if callable(job) else job
        return
    numel = max(n for _, _, n in disk)
    taken: dict[torch.dtype, list] = {}  # two alternating chunk buffers per dtype
    for array, _, _ in disk:
        if array.dtype not in taken:
            taken[array.dtype] = [
                buffers.take(numel, array.dtype, f"checkpoint chunk {k}") for k in range(2)
            ]
    pending: dict[int, object] = {}

    def chunk(k: int) -> torch.Tensor:
        array, _, n = disk[k]
        return taken[array.dtype][k % 2][1][:n]

    def issue(k: int) -> None:
        array, start, _ = disk[k]
        try:
            pending[k] = array.read(chunk(k), start)
        except DiskIOError as exc:
            raise OffloadReadFailed(exc, owners[k].key) from exc

    try:
        issue(0)
        k = 0
        for item, job in jobs:
            if not isinstance(job, tuple):
                yield item, job() if callable(job) else job
                continue
            try:
                pending.pop(k).wait()
            except DiskIOError as exc:
                raise OffloadReadFailed(exc, item.key) from exc
            if k + 1 < len(disk):
                issue(k + 1)
            yield item, chunk(k)
            k += 1
    finally:
        wait_all_quiet(list(pending.values()))
        for pairs in taken.values():
            buffers.give(pairs)


# ---------------------------------------------------------------------- load
# A load is two phases. Verify (:func:`_verify`) reads and checks everything and changes
# nothing: LATEST, the index (its CRC-32 is in LATEST), every file's size and CRC-32,
# every tensor file's header, each parameter's master and states in them (names,
# dtypes, shapes, pieces), the parameters against the model, the optimizer header and
# the state keys against what the optimizer keeps, the buffers, and ``extra`` decoded
# whole. Only then does apply (:func:`_apply`) write into the model and the optimizer;
# what it can still meet is an IO error of the disks themselves.
_PARAM_KEYS = {"file", "shape", "states", "values", "pieces"}
_PIECE_KEYS = {"file", "start", "numel"}
_SHARED_FILES = ("buffers.safetensors", "optimizer.safetensors", "extra.safetensors")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class LoadedCheckpoint:
    """The tensor files of one checkpoint, checked against its index when this is made:
    every tensor file's header parsed (the files stay open), each parameter's pieces
    tiling its elements, its master (floating point, its shape) and each listed state
    present, no tensor the index does not list, and scalar states (step counters) read.
    A failure is a :class:`CheckpointError` naming the file and the tensor."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self._open: dict[str, SafetensorsFile] = {}
        self.scalars: dict[tuple[str, str], torch.Tensor] = {}  # 0-d states, read now
        self.values: dict[str, dict] = {}  # non-tensor states, decoded by check_values
        self.index = str(reader.dir / "index.json")
        try:
            self.params: dict[str, dict] = self._check_params()
            # name -> [(file, start, numel)]: the parameter's pieces (one unless sharded)
            self.pieces = {name: self._check_pieces(name, m) for name, m in self.params.items()}
            self._check_tensors()
        except BaseException:
            self.close()
            raise

    def _bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint index {self.index!r}: {what}")

    def _check_params(self) -> dict[str, dict]:
        params = self.reader.meta.get("params")
        if not isinstance(params, dict):
            raise self._bad("meta.params is not an object")
        for name, meta in params.items():
            if not name or not isinstance(meta, dict) or not set(meta) <= _PARAM_KEYS:
                raise self._bad(f"the entry of parameter {name!r} is not valid: {meta!r}")
            shape, states = meta.get("shape"), meta.get("states")
            if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
                raise self._bad(f"parameter {name!r} has an invalid shape {shape!r}")
            if (
                not isinstance(states, list)
                or not all(isinstance(k, str) and k for k in states)
                or len(set(states)) != len(states)
            ):
                raise self._bad(f"parameter {name!r} has an invalid state list {states!r}")
            if ("file" in meta) == ("pieces" in meta):
                raise self._bad(f"parameter {name!r} needs a 'file' or 'pieces', not both")
        return params

    def _check_pieces(self, name: str, meta: dict) -> list[tuple[str, int, int]]:
        total = _prod(meta["shape"])
        if "file" in meta:
            raw = [{"file": meta["file"], "start": 0, "numel": total}]
        else:
            raw = meta["pieces"]
            if not isinstance(raw, list) or not raw:
                raise self._bad(f"parameter {name!r} has invalid pieces {raw!r}")
        pieces, cursor = [], 0
        for piece in raw:
            if not isinstance(piece, dict) or set(piece) != _PIECE_KEYS:
                raise self._bad(f"parameter {name!r} has an invalid piece {piece!r}")
            file, start, numel = piece["file"], piece["start"], piece["numel"]
            if (
                not isinstance(file, str)
                or file not in self.reader.files
                or not file.endswith(".safetensors")
                or file in _SHARED_FILES
            ):
                raise self._bad(f"parameter {name!r} is in {file!r}, not a unit file it lists")
            if not _is_count(start) or not _is_count(numel) or start != cursor:
                raise self._bad(f"the pieces of parameter {name!r} do not tile its elements")
            pieces.append((file, start, numel))
            cursor += numel
        if cursor != total:
            raise self._bad(
                f"the pieces of parameter {name!r} hold {cursor} elements, its shape {total}"
            )
        return pieces

    def _check_tensors(self) -> None:
        listed: dict[str, set[str]] = {}
        for name, meta in self.params.items():
            whole = len(self.pieces[name]) == 1
            for index, (file_name, _, numel) in enumerate(self.pieces[name]):
                f = self.file(file_name)
                shape = tuple(meta["shape"]) if whole else (numel,)
                keys = listed.setdefault(file_name, set())
                for key in [None, *meta["states"]]:
                    tensor_key = name if key is None else f"{name}/{key}"
                    keys.add(tensor_key)
                    where = f"checkpoint file {f.path!r}: tensor {tensor_key!r}"
                    entry = f.entries.get(tensor_key)
                    if entry is None:
                        raise CheckpointError(f"{where} is missing (the index lists it)")
                    ok = entry.shape == shape and entry.dtype.is_floating_point
                    if key is not None:  # a state: elementwise, 0-d, or (unsharded) any shape
                        numeric = entry.dtype != torch.bool and not entry.dtype.is_complex
                        ok = ok or numeric and (entry.shape == () or whole)
                        if ok and entry.shape == () and index == 0:
                            self.scalars[(name, key)] = self._read_whole(f, tensor_key)
                    if not ok:
                        raise CheckpointError(
                            f"{where} is {entry.dtype} {list(entry.shape)}; the index gives "
                            f"{name!r} {list(shape)} there, and a master is floating point"
                        )
        for file_name in self.reader.files:  # every unit file's header, listed or not
            if file_name.endswith(".safetensors") and file_name not in _SHARED_FILES:
                f = self.file(file_name)
                unknown = sorted(set(f.entries) - listed.get(file_name, set()))
                if unknown:
                    raise CheckpointError(
                        f"checkpoint file {f.path!r} holds tensors the index does not list: "
                        f"{unknown[:_SHOWN]}"
                    )

    def _read_whole(self, f: SafetensorsFile, tensor_key: str) -> torch.Tensor:
        try:
            return f.read(tensor_key)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {f.path!r}: {exc}") from exc

    def check_values(self, groups_tensors: dict) -> None:
        """Decode every parameter's non-tensor states (``values``)."""
        for name, meta in self.params.items():
            if "values" not in meta:
                continue
            try:
                values = tagged.decode(meta["values"], groups_tensors, f"state of {name!r}")
            except (ValueError, RecursionError) as exc:
                raise self._bad(str(exc)) from None
            if not isinstance(values, dict) or set(values) & set(meta["states"]):
                raise self._bad(f"the non-tensor states of {name!r} are not valid: {values!r}")
            self.values[name] = values

    def state_spec(self, name: str, key: str) -> list[tuple[int, ...]]:
        """The stored shape of state ``key`` of ``name`` in each of its pieces."""
        tensor_key = f"{name}/{key}"
        return [self.file(f).entries[tensor_key].shape for f, _, _ in self.pieces[name]]

    def file(self, name: str) -> SafetensorsFile:
        if name not in self._open:
            self._open[name] = self.reader.open_tensors(name)
        return self._open[name]

    def close(self) -> None:
        for f in self._open.values():
            f.close()

    def has(self, name: str, key: str | None = None) -> bool:
        meta = self.params.get(name)
        return meta is not None and (key is None or key in meta["states"])

    def _tensor_key(self, name: str, key: str | None) -> tuple[SafetensorsFile, str]:
        return self.file(self.pieces[name][0][0]), name if key is None else f"{name}/{key}"

    def read_into(self, name: str, key: str | None, out: torch.Tensor, start: int = 0) -> None:
        """Elements ``[start, start + out.numel())`` of a parameter's master (``key``
        None) or state, cast to ``out``'s dtype, from whichever pieces hold them."""
        tensor_key = name if key is None else f"{name}/{key}"
        stored = self._tensor_key(name, key)[0].spec(tensor_key).dtype
        direct = stored == out.dtype and out.is_contiguous() and out.device.type == "cpu"
        flat = out.reshape(-1) if direct else torch.empty(out.numel(), dtype=stored)
        end = start + flat.numel()
        for file_name, first, numel in self.pieces[name]:
            a, b = max(start, first), min(end, first + numel)
            if a < b:
                f = self.file(file_name)
                try:
                    f.read_into(tensor_key, flat[a - start : b - start], a - first)
                except (OSError, ValueError) as exc:  # after verification: the disk failed
                    raise CheckpointError(
                        f"checkpoint file {f.path!r}: reading {tensor_key!r} failed after "
                        f"the checkpoint was verified (the file changed or its disk failed): "
                        f"{exc}"
                    ) from exc
        if not direct:
            out.copy_(flat.view(out.shape))

    def read(self, name: str, key: str | None) -> torch.Tensor:
        """A parameter's master or state whole (pieces joined), shaped like the parameter;
        a scalar state (``step``) from its first piece, as read when verified."""
        if key is not None and (name, key) in self.scalars:
            return self.scalars[(name, key)].clone()
        f, tensor_key = self._tensor_key(name, key)
        spec = f.spec(tensor_key)
        shape = self.params[name]["shape"]
        if len(self.pieces[name]) == 1 or not spec.shape:
            return self._read_whole(f, tensor_key)
        out = torch.empty(_prod(shape), dtype=spec.dtype)
        self.read_into(name, key, out)
        return out.view(shape)

    def state(self, name: str, groups_tensors: dict | None = None) -> dict:
        """A parameter's optimizer state as torch keeps it (tensors read whole)."""
        meta = self.params[name]
        values = {key: self.read(name, key) for key in meta["states"]}
        if name in self.values:
            values.update(self.values[name])
        elif "values" in meta:
            values.update(tagged.decode(meta["values"], groups_tensors or {}))
        return values


@dataclass
class _Plan:
    """What the verify phase found, for the apply phase."""

    ckpt: LoadedCheckpoint
    groups_tensors: dict
    header: dict | None
    buffers: dict[str, torch.Tensor]
    extra: object


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    strict: bool = True,
    convert_state_format: bool = False,
):
    """Restore what :func:`save` wrote into ``model`` (and ``optimizer``); return ``extra``.

    The loading run's placement, units and tiers need not be the saving run's: each
    parameter is found by name and written into whatever tier holds it now. Before
    anything is changed, everything is read and checked: the index against its CRC-32
    in ``LATEST``, every file against its size and CRC-32, every header, tensor name,
    dtype and shape against the index, the checkpoint against the model (names, shapes,
    buffers) and the optimizer (class, param groups, the state keys it keeps), and
    ``extra`` decoded. A damaged or crafted checkpoint raises :class:`CheckpointError`
    naming the file (and the tensor or key), a checkpoint of another model or optimizer
    :class:`ConfigError`; either way the model and optimizer are unchanged. With
    ``strict=False`` parameters missing from the checkpoint keep their values.

    A checkpoint records its ``optimizer_state_format``; loading it into an optimizer
    that keeps its states in another format is refused unless ``convert_state_format``
    is True (the states are then rounded to this run's format).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load() takes an nn.Module, got {type(model).__name__}")
    refuse_if_evicted(model, "hetstore.load")
    _check_optimizer(optimizer, model)
    shards = state.shards if (state := state_of(model)) is not None else None
    plan, failure = None, None
    try:
        with CheckpointReader(path) as reader:
            plan = _verify(reader, model, optimizer, strict, convert_state_format)
    except Exception as exc:
        if shards is None:
            raise
        failure = exc
    if shards is not None:  # sharded: apply only if every rank's verification passed
        try:
            sharded.agree_to_load(shards, path, failure)
        except BaseException:
            if plan is not None:
                plan.ckpt.close()
            raise
    try:
        _apply(plan, model, optimizer)
    finally:
        plan.ckpt.close()
    return plan.extra


def _verify(
    reader: CheckpointReader, model: nn.Module, optimizer, strict: bool, convert: bool = False
) -> _Plan:
    """Everything a load needs, read and checked; the model and optimizer untouched."""
    meta = reader.meta
    if meta.get("kind") != KIND or not _is_count(meta.get("world_size")):
        raise CheckpointError(
            f"{str(reader.dir)!r} is not a training-state checkpoint of hetstore.save"
        )
    for name in ("buffers.safetensors",) + (
        ("extra.safetensors",) if "extra.json" in reader.files else ()
    ):
        if name not in reader.files:
            raise CheckpointError(f"checkpoint {str(reader.dir)!r} has no file {name!r}")
    reader.verify()
    ckpt = LoadedCheckpoint(reader)
    try:
        names = _param_names(model)
        _check_params(model, ckpt, strict)
        groups_tensors = (
            reader.read_tensors("optimizer.safetensors")
            if "optimizer.safetensors" in reader.files
            else {}
        )
        ckpt.check_values(groups_tensors)
        header = None
        if optimizer is not None:
            header = _check_optimizer_header(reader, optimizer, names, groups_tensors)
            _check_state_format(header["state_format"], optimizer, convert)
            _check_state_keys(ckpt, model, optimizer, names, header)
        buffers = _check_buffers(reader, model, strict)
        extra = None
        if "extra.json" in reader.files:
            data = reader.read_json("extra.json")
            tensors = reader.read_tensors("extra.safetensors")
            try:
                extra = tagged.decode(data, tensors)
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(
                    f"checkpoint file {str(reader.dir / 'extra.json')!r}: {exc}"
                ) from None
    except BaseException:
        ckpt.close()
        raise
    return _Plan(ckpt, groups_tensors, header, buffers, extra)


def _apply(plan: _Plan, model: nn.Module, optimizer) -> None:
    """Write a verified checkpoint into the model and optimizer."""
    ckpt, groups_tensors = plan.ckpt, plan.groups_tensors
    names = _param_names(model)
    model_buffers = _buffers(model)
    buffers = Buffers(host_of(model))
    try:
        with torch.no_grad():
            runtime = runtime_of(model)
            if runtime is not None:
                for unit in runtime.units:  # (before any is written: a load may be refused)
                    unit.before_state_change()
                for unit in runtime.units:
                    _load_unit(unit, ckpt, names, optimizer, groups_tensors, buffers)
            else:
                _load_plain(model, ckpt, optimizer, groups_tensors)
            for name, value in plan.buffers.items():
                if name in model_buffers:
                    model_buffers[name].copy_(value)
    finally:
        buffers.close()
    if plan.header is not None:
        _apply_optimizer_header(optimizer, plan.header)
    if isinstance(optimizer, OffloadedOptimizer):
        optimizer.zero_grad()


def _check_params(model: nn.Module, ckpt: LoadedCheckpoint, strict: bool) -> None:
    mine = {name: p for name, p in model.named_parameters()}
    missing = [n for n in mine if n not in ckpt.params]
    unexpected = [n for n in ckpt.params if n not in mine]
    wrong = [
        f"{n!r}: {ckpt.params[n]['shape']} in the checkpoint, {list(p.shape)} in the model"
        for n, p in mine.items()
        if n in ckpt.params and ckpt.params[n]["shape"] != list(p.shape)
    ]
    if wrong:
        raise ConfigError(
            f"load: {len(wrong)} parameter(s) have another shape, nothing was loaded: "
            + "; ".join(wrong[:_SHOWN])
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing {missing[:_SHOWN]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:_SHOWN]}")
        raise ConfigError(
            f"load: the checkpoint's parameters do not match the model's ({'; '.join(parts)}), "
            "nothing was loaded; strict=False loads the ones that match"
        )


def _check_optimizer_header(reader: CheckpointReader, optimizer, names, groups_tensors) -> dict:
    """The optimizer header checked against ``optimizer`` and decoded: ``{"hypers": [each
    group's saved hyper-parameters], "loss_scaler": its state or None, "state_format":
    the states' format}``."""
    if "optimizer.json" not in reader.files:
        raise ConfigError("load: the checkpoint has no optimizer state; call load() without one")
    shown = str(reader.dir / "optimizer.json")
    header = reader.read_json("optimizer.json")
    groups = header.get("param_groups") if isinstance(header, dict) else None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("class"), str)
        or not isinstance(groups, list)
        or not all(
            isinstance(g, dict)
            and set(g) == {"params", "hyper"}
            and isinstance(g["params"], list)
            and all(isinstance(n, str) for n in g["params"])
            for g in groups
        )
    ):
        raise CheckpointError(f"checkpoint file {shown!r} is not an optimizer header of save()")
    mine = _optimizer_class(optimizer).__qualname__
    if header["class"] != mine:
        raise ConfigError(
            f"load: the checkpoint's optimizer is {header['class']}, this one is {mine}"
        )
    saved = [g["params"] for g in groups]
    current = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    if saved != current:
        raise ConfigError(
            "load: the optimizer's param groups hold other parameters than the checkpoint's: "
            f"{[len(g) for g in saved]} vs {[len(g) for g in current]} parameters per group"
            + ("" if len(saved) != len(current) else " (or the same counts, other names)")
        )
    hypers = []
    for i, group in enumerate(groups):
        try:
            hyper = tagged.decode(group["hyper"], groups_tensors, f"param_groups[{i}]")
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"checkpoint file {shown!r}: {exc}") from None
        if not isinstance(hyper, dict) or "params" in hyper:
            raise CheckpointError(f"checkpoint file {shown!r}: param_groups[{i}] is not valid")
        hypers.append(hyper)
    scaler = header.get("loss_scaler")
    known = DynamicLossScaler().state_dict()
    if scaler is not None and (
        not isinstance(scaler, dict)
        or not set(scaler) <= set(known)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scaler.values())
    ):
        raise CheckpointError(f"checkpoint file {shown!r}: loss_scaler is not valid: {scaler!r}")
    state_format = header.get("state_format", "fp32")  # checkpoints before the key: fp32
    if state_format not in STATE_FORMATS:
        raise CheckpointError(
            f"checkpoint file {shown!r}: state_format {state_format!r} is not one of "
            f"{STATE_FORMATS}"
        )
    return {"hypers": hypers, "loss_scaler": scaler, "state_format": state_format}


def _check_state_format(saved: str, optimizer, convert: bool) -> None:
    mine = _state_format_of(optimizer)
    if saved != mine and not convert:
        raise ConfigError(
            f"load: the checkpoint's optimizer states were kept as {saved!r} and this "
            f"optimizer keeps them as {mine!r} (optimizer_state_format); pass "
            "convert_state_format=True to load them rounded to this run's format, or "
            f"offload with optimizer_state_format={saved!r}"
        )


def _apply_optimizer_header(optimizer, header: dict) -> None:
    for group, hyper in zip(optimizer.param_groups, header["hypers"], strict=True):
        group.update(hyper)
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and header["loss_scaler"]:
        scaler.load_state_dict(dict(header["loss_scaler"]))


# What torch's optimizers keep per parameter depends on the class, the group's settings
# (amsgrad, momentum) and for some (Adafactor) the parameter's rank. Rather than a table
# that would drift from torch, a fresh optimizer of the class, with the group's settings
# as they will be after the load, steps once a small parameter of the same rank with a
# zero gradient; its state's keys and kinds are what a checkpoint's must be.
_NOT_HYPER = ("params", "foreach", "fused", "capturable", "differentiable")


def _expected_state(optimizer_class: type, hyper: dict, ndim: int) -> dict[str, str] | None:
    """``key -> "element"`` (shaped like the parameter), ``"scalar"`` (0-d tensor),
    ``"other"`` (another tensor) or ``"value"`` (not a tensor); None when it cannot be
    told (not one of torch's own optimizers, or the trial step failed)."""
    if not (
        isinstance(optimizer_class, type)
        and issubclass(optimizer_class, Optimizer)
        and optimizer_class.__module__.startswith("torch.optim")
    ):
        return None
    settings = {k: v for k, v in hyper.items() if k not in _NOT_HYPER}
    param = torch.zeros((2,) * ndim, requires_grad=True)
    param.grad = torch.zeros_like(param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = optimizer_class([{**settings, "params": [param]}])
            trial.step()
    except Exception:  # a setting the trial cannot take: the keys go unchecked
        return None
    kinds = {}
    for key, value in trial.state.get(param, {}).items():
        if not isinstance(value, torch.Tensor):
            kinds[key] = "value"
        elif value.shape == param.shape:
            kinds[key] = "element"
        else:
            kinds[key] = "scalar" if value.dim() == 0 else "other"
    return kinds


def _check_state_keys(ckpt: LoadedCheckpoint, model, optimizer, names, header: dict) -> None:
    """Each stepped parameter's saved states are the ones the optimizer keeps: the same
    keys, per-element ones shaped like the parameter, scalars 0-d; and for states on
    disk, the arrays the optimizer streams (a key it lacks would be dropped, one it has
    but the checkpoint lacks would load as zeros)."""
    optimizer_class = _optimizer_class(optimizer)
    cache: dict[tuple[int, int], dict | None] = {}
    for i, group in enumerate(optimizer.param_groups):
        hyper = {**{k: v for k, v in group.items() if k != "params"}, **header["hypers"][i]}
        for param in group["params"]:
            name = names.get(id(param))
            meta = ckpt.params.get(name)
            if meta is None:
                continue
            keys = set(meta["states"]) | set(ckpt.values.get(name, {}))
            if not keys:
                continue  # never stepped: fresh states, as torch starts them
            ndim = len(meta["shape"])
            if (i, ndim) not in cache:
                cache[(i, ndim)] = _expected_state(optimizer_class, hyper, ndim)
            expected = cache[(i, ndim)]
            if expected is None:
                continue
            where = (
                f"checkpoint file {ckpt.file(ckpt.pieces[name][0][0]).path!r}: parameter {name!r}"
            )
            if keys != set(expected):
                raise CheckpointError(
                    f"{where} has the optimizer states {sorted(keys)}; a {optimizer_class.__name__} "
                    f"with its param group's settings keeps {sorted(expected)}"
                )
            pieces = ckpt.pieces[name]
            element = [tuple(meta["shape"])] if len(pieces) == 1 else [(n,) for _, _, n in pieces]
            for key, kind in expected.items():
                if kind not in ("element", "scalar"):
                    continue
                if key not in meta["states"]:
                    raise CheckpointError(f"{where}: state {key!r} is not a tensor")
                want = element if kind == "element" else [()] * len(pieces)
                got = ckpt.state_spec(name, key)
                if got != want:
                    raise CheckpointError(
                        f"{where}: state {key!r} is shaped {[list(s) for s in got]}, the "
                        f"optimizer keeps {[list(s) for s in want]}"
                    )
    runtime = runtime_of(model)
    if runtime is None or not isinstance(optimizer, OffloadedOptimizer):
        return
    for unit in runtime.units:
        streamed = optimizer.streamed_step_of(unit)
        if streamed is None:
            continue
        wanted = set(streamed.states) | ({"step"} if streamed.has_step else set())
        for entry in unit.entries:
            name = names[id(entry.param)]
            meta = ckpt.params.get(name)
            if entry.group is None or meta is None or not meta["states"]:
                continue
            if set(meta["states"]) != wanted:
                raise ConfigError(
                    f"load: parameter {name!r} has the optimizer states {sorted(meta['states'])} "
                    f"in the checkpoint; this optimizer keeps {sorted(wanted)} on disk for it "
                    "(other param group settings: momentum, amsgrad?); nothing was loaded"
                )


def _check_buffers(reader: CheckpointReader, model: nn.Module, strict: bool) -> dict:
    """The saved buffers, each of the model's shape and a dtype it can take."""
    saved = reader.read_tensors("buffers.safetensors")
    mine = _buffers(model)
    unknown = sorted(set(saved) - set(mine))
    if strict and unknown:
        raise ConfigError(f"load: buffers {unknown[:_SHOWN]} of the checkpoint are not the model's")
    for name, value in saved.items():
        if name not in mine:
            continue
        target = mine[name]
        same_kind = value.dtype == target.dtype or (
            value.dtype.is_floating_point and target.dtype.is_floating_point
        )
        if value.shape != target.shape or not same_kind:
            raise ConfigError(
                f"load: buffer {name!r} is {value.dtype} {list(value.shape)} in the checkpoint, "
                f"{target.dtype} {list(target.shape)} in the model; nothing was loaded"
            )
    return saved


def _load_plain(model: nn.Module, ckpt: LoadedCheckpoint, optimizer, groups_tensors) -> None:
    for name, param in model.named_parameters():
        if ckpt.has(name):
            param.data.copy_(ckpt.read(name, None).view(param.shape))
    if optimizer is None:
        return
    names = _param_names(model)
    state, index = {}, 0
    groups = []
    for group in optimizer.param_groups:
        ids = []
        for param in group["params"]:
            name = names[id(param)]
            if ckpt.has(name) and (ckpt.params[name]["states"] or "values" in ckpt.params[name]):
                state[index] = ckpt.state(name, groups_tensors)
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _load_unit(unit: Unit, ckpt, names, optimizer, groups_tensors, buffers: Buffers) -> None:
    unit.barrier()  # (step_in_forward) not stepped over what is loaded
    entries = [(names[id(e.param)], e) for e in unit.entries]
    if unit.shards is not None:
        _load_shard(unit, entries, ckpt, optimizer)
        return
    streamed = (
        optimizer.streamed_step_of(unit) if isinstance(optimizer, OffloadedOptimizer) else None
    )
    if transfers_only(unit.master):
        _rewrite_disk_unit(unit, entries, ckpt, streamed, buffers)
    else:
        flat = unit.master_copy()  # the master itself unless frozen parameters lack one
        for name, e in entries:
            if ckpt.has(name):
                ckpt.read_into(name, None, flat[e.offset : e.offset + e.numel])
        unit.store_master(flat)
        if streamed is not None:  # compact states in memory
            _load_compact_states(unit, entries, ckpt, streamed)
    if optimizer is None or streamed is not None:
        return
    optimizer.reset_unit_state(unit)
    for name, e in entries:
        if e.group is not None and ckpt.has(name) and ckpt.params[name]["states"]:
            optimizer.import_param_state(e.param, ckpt.state(name, groups_tensors))


def _load_compact_states(unit: Unit, entries, ckpt: LoadedCheckpoint, streamed) -> None:
    """A unit whose states are compact in memory: each parameter's states from the
    checkpoint (zeros where it has none), encoded into the unit's format."""
    values: dict[str, list] = {}
    for name, e in entries:
        if e.group is None or not ckpt.has(name):
            continue
        for key in streamed.states:
            if ckpt.has(name, key):
                values.setdefault(key, []).append((e.offset, ckpt.read(name, key)))
    streamed.write_states(values, None, from_zeros=True)
    streamed.mark_loaded(_segment_steps(unit, entries, ckpt))


def _rewrite_disk_unit(unit: Unit, entries, ckpt: LoadedCheckpoint, streamed, buffers) -> None:
    """Rebuild a unit whose master (and states, when ``streamed``) are on disk, chunk by
    chunk into shadow regions; commit them together at the end (all or nothing: the
    pipeline the streamed step uses, :class:`hetstore.runtime.rewrite.ChunkedRewrite`)."""
    rewrite = streamed.new_rewrite() if streamed is not None else ChunkedRewrite(unit, {})
    compact = streamed is not None and not streamed.format.exact
    chunk = max(unit.align, CHUNK_ELEMENTS // unit.align * unit.align)
    end = unit.master_numel
    spans = [
        Span(a, min(a + chunk, end), min(a + chunk, unit.trainable_numel))
        for a in range(0, end, chunk)
    ]
    taken: list = []

    def fill(i: int, span: Span, slot) -> None:
        _fill(
            slot["master"][: span.end - span.start],
            span.start,
            entries,
            ckpt,
            None,
            keep=unit.master,
        )
        n_state = span.state_end - span.start
        for key in rewrite.states if n_state > 0 else ():
            out = slot[f"{key} fp32" if compact else key][:n_state]
            _fill(out, span.start, entries, ckpt, key)
        if compact and n_state > 0:
            streamed.encode_chunk(rewrite, slot, span.start, n_state)

    try:
        slots = []
        names = streamed.state_slot_names(rewrite) if streamed else rewrite.slot_arrays()
        for _ in range(min(2, len(spans))):  # none: every parameter is frozen, home-only
            slot = {}
            for name, dtype in names:
                pair = buffers.take(min(chunk, unit.numel), dtype, f"load {name}")
                taken.append(pair)
                slot[name] = pair[1]
            slots.append(slot)
        if spans:
            rewrite.run(spans, slots, fill)
        else:
            rewrite.discard()
    except BaseException:
        rewrite.discard()  # (again: frees what the rewrite was given)
        raise
    finally:
        buffers.give(taken)
    unit.home_stale = False
    if unit.has_home_only:
        _load_home_only(unit, entries, ckpt)
    if streamed is not None:
        streamed.mark_loaded(_segment_steps(unit, entries, ckpt))


def _load_home_only(unit: Unit, entries, ckpt: LoadedCheckpoint) -> None:
    """The frozen parameters without a master (``[master_numel, numel)``), cast to the
    compute dtype, straight into ``home``; those the checkpoint lacks keep their values."""
    with unit.edit_home_only() as tail:
        start = unit.master_numel
        for name, e in entries:
            if e.offset >= start and ckpt.has(name):
                ckpt.read_into(name, None, tail[e.offset - start : e.offset - start + e.numel])


def _fill(
    out: torch.Tensor, start: int, entries, ckpt: LoadedCheckpoint, key: str | None, keep=None
) -> None:
    """Elements ``[start, start + out.numel())`` of a unit's flat array from the checkpoint.
    Parameters the checkpoint lacks (``strict=False``) keep their values when ``keep``
    (the array being replaced) is given; padding and fresh states become zeros."""
    end = start + out.numel()
    out.zero_()
    for name, e in entries:
        a, b = max(e.offset, start), min(e.offset + e.numel, end)
        if a >= b:
            continue
        if ckpt.has(name, key):
            ckpt.read_into(name, key, out[a - start : b - start], a - e.offset)
        elif keep is not None and keep.written:
            keep.read(out[a - start : b - start], a).wait()


def _segment_steps(unit: Unit, entries, ckpt: LoadedCheckpoint) -> list[float] | None:
    """Each optimizer segment's step counter (the largest of the parameters in it, or
    partly in it on a shard); None when the checkpoint has no state for any parameter of
    the unit."""
    steps, any_state = [], False
    start = unit.shard_start  # segments are in shard offsets, entries in full-layout ones
    for segment in unit.segments:
        best = 0.0
        for name, e in entries:
            inside = e.offset < segment.end + start and segment.start + start < e.offset + e.numel
            if not inside or not ckpt.has(name):
                continue
            any_state = any_state or bool(ckpt.params[name]["states"])
            if ckpt.has(name, "step"):
                best = max(best, float(ckpt.read(name, "step")))
        steps.append(best)
    return steps if any_state else None


def _load_shard(unit: Unit, entries, ckpt: LoadedCheckpoint, optimizer) -> None:
    """A sharded unit: the master through ``edit_master`` (the whole unit, gathered from
    every rank, so parameters the checkpoint lacks keep their values; this rank keeps its
    shard), then this rank's range of each state, read straight from the pieces."""
    with unit.edit_master() as full:
        for name, e in entries:
            if ckpt.has(name):
                ckpt.read_into(name, None, full[e.offset : e.offset + e.numel])
    if not isinstance(optimizer, OffloadedOptimizer) or not unit.trainable_numel:
        return
    streamed = optimizer.streamed_step_of(unit)
    trainable = [(name, e) for name, e in entries if e.group is not None and ckpt.has(name)]
    keys = list(dict.fromkeys(k for name, _ in trainable for k in ckpt.params[name]["states"]))
    if not keys:  # saved before the first step: fresh states
        optimizer.reset_unit_state(unit)
        if streamed is not None:
            streamed.mark_loaded(None)
        return
    start, numel = unit.shard_start, unit.trainable_numel
    element_keys = [k for k in keys if k != "step"]
    compact = streamed is not None and not streamed.format.exact
    segments = [] if compact else optimizer.segment_states(unit, create=tuple(element_keys))
    decoded: dict[str, list] = {}  # compact: fp32 values, encoded together below
    for key in element_keys:
        local = torch.zeros(numel, dtype=torch.float32)
        for name, e in trainable:
            a, b = max(e.offset, start), min(e.offset + e.numel, start + numel)
            if a < b and ckpt.has(name, key):
                ckpt.read_into(name, key, local[a - start : b - start], a - e.offset)
        if compact:
            if key in streamed.states:
                decoded[key] = [(0, local)]
            continue
        if streamed is not None:
            if key in streamed.states:
                streamed.states[key].write_all(local)
            continue
        for segment in segments:
            seg = segment["segment"]
            segment["states"][key].copy_(local[seg.start : seg.end])
    if compact:
        streamed.write_states(decoded, None)
    steps = _segment_steps(unit, trainable, ckpt)
    if streamed is not None:
        streamed.mark_loaded(steps)
        return
    for segment, best in zip(segments, steps, strict=True):
        if segment["step"] is not None:
            segment["step"].fill_(best)
