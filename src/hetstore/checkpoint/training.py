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
each state). Every file is verified against its CRC-32 *before* the model is touched,
so a corrupt checkpoint is refused with the file named and changes nothing.
"""

from __future__ import annotations

import contextlib
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
from hetstore.errors import ConfigError
from hetstore.optim.offloaded import OffloadedOptimizer
from hetstore.runtime.flat import ALIGN_ELEMENTS, DiskArray, DiskSlice, wait_all, wait_all_quiet
from hetstore.runtime.unit import Unit

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


def _runtime(model: nn.Module):
    return getattr(model, "_hetstore_runtime", None)


def _check_optimizer(optimizer, model: nn.Module) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
    if _runtime(model) is not None and not isinstance(optimizer, OffloadedOptimizer):
        raise ConfigError(
            "optimizer: pass the optimizer hetstore.offload() returned for this model, not the "
            f"original {type(optimizer).__name__} (its parameters now live in hetstore's tiers)"
        )


def _optimizer_class(optimizer: Optimizer) -> type:
    return getattr(optimizer, "optimizer_class", type(optimizer))


def _host(model: nn.Module):
    tiers = getattr(model, "_hetstore_tiers", None)
    return tiers.host if tiers is not None else None


class _Buffers:
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
@dataclass
class _Item:
    key: str
    data: torch.Tensor | DiskSlice

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
    _check_optimizer(optimizer, model)
    if isinstance(optimizer, OffloadedOptimizer):
        optimizer.check_between_steps()
    runtime = _runtime(model)
    names = _param_names(model)
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_json = None if extra is None else tagged.encode(extra, extra_tensors)
    groups_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = None
    if optimizer is not None:
        optimizer_json = _optimizer_header(optimizer, names, groups_tensors)
    if runtime is not None and any(u.any_grad() for u in runtime.units):
        warnings.warn(
            "save(): gradients accumulated since the last optimizer step are not saved",
            stacklevel=2,
        )

    shards = getattr(model, "_hetstore_shards", None)
    files = _file_plan(model, optimizer, runtime, names, shards)
    buffers = _Buffers(_host(model))
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


def _write_unit_files(writer, files, buffers: _Buffers, groups_tensors: dict) -> dict:
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
            for _, piece in _stream(items, buffers):
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
    }


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
            [(names[id(e.param)], e.param, _master_of(unit, e)) for e in unit.entries]
            for unit in runtime.units
            if unit.entries
        ]
    else:
        groups = [[(names[id(p)], p, p.detach()) for p in dict.fromkeys(model.parameters())]]
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
    plan = []
    for index, entries in enumerate(groups):
        items = [_Item(name, master) for name, _, master in entries]
        by_key: dict[str, list[_Item]] = {}
        values: dict[str, dict] = {}
        for name, param, _ in entries:
            state = _param_state(optimizer, param) if id(param) in optimized else {}
            for key, value in state.items():
                if isinstance(value, (torch.Tensor, DiskSlice)):
                    by_key.setdefault(key, []).append(_Item(f"{name}/{key}", value))
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
    on_disk = isinstance(unit.master, DiskArray)
    segments = []
    if isinstance(optimizer, OffloadedOptimizer) and unit.trainable_numel:
        segments = [s for s in optimizer.segment_states(unit) if s["stepped"]]
    items: list[_Item] = []
    by_key: dict[str, list[_Item]] = {}
    pieces: dict[str, dict] = {}
    for entry, a, b in sharded.shard_pieces(unit):
        name = names[id(entry.param)]
        whole = (a, b) == (entry.offset, entry.offset + entry.numel)
        shape = entry.shape if whole else torch.Size([b - a])
        pieces[name] = {"start": a - entry.offset, "numel": b - a, "shape": list(entry.shape)}
        local = a - start
        if on_disk:
            items.append(_Item(name, DiskSlice(unit.master, local, b - a, shape)))
        else:
            items.append(_Item(name, unit.master[local : local + b - a].view(shape)))
        if entry.group is None:
            continue
        segment = next(
            (s for s in segments if s["segment"].start <= local < s["segment"].end), None
        )
        if segment is None:
            continue  # fresh states (before the first step) are not saved, as in torch
        if segment["step"] is not None:
            by_key.setdefault("step", []).append(_Item(f"{name}/step", segment["step"]))
        for key, data in segment["states"].items():
            at = local - segment["base"]
            if isinstance(data, DiskArray):
                piece = DiskSlice(data, at, b - a, shape)
            else:
                piece = data[at : at + b - a].view(shape)
            by_key.setdefault(key, []).append(_Item(f"{name}/{key}", piece))
    for key_items in by_key.values():
        items += key_items
    return f"unit-{index:05d}-rank{rank:05d}.safetensors", items, {}, pieces


def _master_of(unit: Unit, entry) -> torch.Tensor | DiskSlice:
    if isinstance(unit.master, DiskArray):
        return DiskSlice(unit.master, entry.offset, entry.numel, entry.shape)
    return unit.master[entry.offset : entry.offset + entry.numel].view(entry.shape)


def _param_state(optimizer, param) -> dict:
    if isinstance(optimizer, OffloadedOptimizer):
        return optimizer.export_param_state(param)
    return optimizer.state.get(param, {})


def _stream(items: list[_Item], buffers: _Buffers) -> Iterator[tuple[_Item, torch.Tensor]]:
    """Each item's data in order, in pieces of at most a chunk, with the item it belongs
    to. Memory pieces are views; disk pieces are read one ahead into two alternating
    chunk buffers (a piece is valid until the next one is asked for)."""
    jobs: list[tuple[_Item, torch.Tensor | tuple[DiskArray, int, int]]] = []
    for item in items:
        data = item.data
        if isinstance(data, DiskSlice):
            for a in range(0, data.numel, CHUNK_ELEMENTS):
                n = min(CHUNK_ELEMENTS, data.numel - a)
                jobs.append((item, (data.array, data.start + a, n)))
        else:
            flat = data.detach().reshape(-1)
            for a in range(0, max(flat.numel(), 1), CHUNK_ELEMENTS):
                jobs.append((item, flat[a : a + CHUNK_ELEMENTS]))
    disk = [job for _, job in jobs if isinstance(job, tuple)]
    if not disk:
        yield from jobs
        return
    numel = max(n for _, _, n in disk)
    taken = [buffers.take(numel, torch.float32, f"checkpoint chunk {k}") for k in range(2)]
    pending: dict[int, object] = {}

    def issue(k: int) -> None:
        array, start, n = disk[k]
        pending[k] = array.read(taken[k % 2][1][:n], start)

    try:
        issue(0)
        k = 0
        for item, job in jobs:
            if not isinstance(job, tuple):
                yield item, job
                continue
            pending.pop(k).wait()
            if k + 1 < len(disk):
                issue(k + 1)
            yield item, taken[k % 2][1][: job[2]]
            k += 1
    finally:
        wait_all_quiet(list(pending.values()))
        buffers.give(taken)


# ---------------------------------------------------------------------- load
class _Checkpoint:
    """The files of one verified checkpoint, opened on demand."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.params: dict[str, dict] = reader.meta["params"]
        self._open: dict[str, SafetensorsFile] = {}
        # name -> [(file, start, numel)]: the parameter's pieces (one unless sharded)
        self.pieces = {
            name: [(p["file"], p["start"], p["numel"]) for p in meta["pieces"]]
            if "pieces" in meta
            else [(meta["file"], 0, _prod(meta["shape"]))]
            for name, meta in self.params.items()
        }

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
                self.file(file_name).read_into(tensor_key, flat[a - start : b - start], a - first)
        if not direct:
            out.copy_(flat.view(out.shape))

    def read(self, name: str, key: str | None) -> torch.Tensor:
        """A parameter's master or state whole (pieces joined), shaped like the parameter;
        a scalar state (``step``) from its first piece."""
        f, tensor_key = self._tensor_key(name, key)
        spec = f.spec(tensor_key)
        shape = self.params[name]["shape"]
        if len(self.pieces[name]) == 1 or not spec.shape:
            return f.read(tensor_key)
        out = torch.empty(_prod(shape), dtype=spec.dtype)
        self.read_into(name, key, out)
        return out.view(shape)

    def state(self, name: str, groups_tensors: dict) -> dict:
        """A parameter's optimizer state as torch keeps it (tensors read whole)."""
        meta = self.params[name]
        values = {key: self.read(name, key) for key in meta["states"]}
        values.update(tagged.decode(meta.get("values", {}), groups_tensors))
        return values


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    strict: bool = True,
):
    """Restore what :func:`save` wrote into ``model`` (and ``optimizer``); return ``extra``.

    The loading run's placement, units and tiers need not be the saving run's: each
    parameter is found by name and written into whatever tier holds it now. Before
    anything is changed, every file is checked against its CRC-32 and the checkpoint
    against the model (names, shapes) and the optimizer (class, param groups); a
    mismatch raises :class:`CheckpointError` or :class:`ConfigError` and changes nothing.
    With ``strict=False`` parameters missing from the checkpoint keep their values.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load() takes an nn.Module, got {type(model).__name__}")
    _check_optimizer(optimizer, model)
    reader = CheckpointReader(path)
    if reader.meta.get("kind") != KIND:
        raise CheckpointError(
            f"{str(reader.dir)!r} is not a training-state checkpoint of hetstore.save"
        )
    reader.verify()
    ckpt = _Checkpoint(reader)
    names = _param_names(model)
    _check_params(model, ckpt, strict)
    groups_tensors = (
        reader.read_tensors("optimizer.safetensors")
        if "optimizer.safetensors" in reader.files
        else {}
    )
    header = None
    if optimizer is not None:
        header = _check_optimizer_header(reader, optimizer, names)
    buffers_file = reader.read_tensors("buffers.safetensors")
    model_buffers = _buffers(model)
    unknown = sorted(set(buffers_file) - set(model_buffers))
    if strict and unknown:
        raise ConfigError(f"load: buffers {unknown[:_SHOWN]} of the checkpoint are not the model's")

    buffers = _Buffers(_host(model))
    try:
        with torch.no_grad():
            runtime = _runtime(model)
            if runtime is not None:
                for unit in runtime.units:
                    _load_unit(unit, ckpt, names, optimizer, groups_tensors, buffers)
            else:
                _load_plain(model, ckpt, optimizer, groups_tensors)
            for name, value in buffers_file.items():
                if name in model_buffers:
                    model_buffers[name].copy_(value)
    finally:
        buffers.close()
        ckpt.close()
    if header is not None:
        _apply_optimizer_header(optimizer, header, groups_tensors)
    if isinstance(optimizer, OffloadedOptimizer):
        optimizer.zero_grad()
    if "extra.json" not in reader.files:
        return None
    return tagged.decode(reader.read_json("extra.json"), reader.read_tensors("extra.safetensors"))


def _check_params(model: nn.Module, ckpt: _Checkpoint, strict: bool) -> None:
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


def _check_optimizer_header(reader: CheckpointReader, optimizer, names) -> dict:
    if "optimizer.json" not in reader.files:
        raise ConfigError("load: the checkpoint has no optimizer state; call load() without one")
    header = reader.read_json("optimizer.json")
    mine = _optimizer_class(optimizer).__qualname__
    if header["class"] != mine:
        raise ConfigError(
            f"load: the checkpoint's optimizer is {header['class']}, this one is {mine}"
        )
    saved = [g["params"] for g in header["param_groups"]]
    current = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    if saved != current:
        raise ConfigError(
            "load: the optimizer's param groups hold other parameters than the checkpoint's: "
            f"{[len(g) for g in saved]} vs {[len(g) for g in current]} parameters per group"
            + ("" if len(saved) != len(current) else " (or the same counts, other names)")
        )
    return header


def _apply_optimizer_header(optimizer, header: dict, groups_tensors: dict) -> None:
    for group, saved in zip(optimizer.param_groups, header["param_groups"], strict=True):
        group.update(tagged.decode(saved["hyper"], groups_tensors))
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and header.get("loss_scaler"):
        scaler.load_state_dict(header["loss_scaler"])


def _load_plain(model: nn.Module, ckpt: _Checkpoint, optimizer, groups_tensors) -> None:
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


def _load_unit(unit: Unit, ckpt, names, optimizer, groups_tensors, buffers: _Buffers) -> None:
    entries = [(names[id(e.param)], e) for e in unit.entries]
    if unit.shards is not None:
        _load_shard(unit, entries, ckpt, optimizer)
        return
    streamed = (
        optimizer.streamed_step_of(unit) if isinstance(optimizer, OffloadedOptimizer) else None
    )
    if isinstance(unit.master, DiskArray):
        _rewrite_disk_unit(unit, entries, ckpt, streamed, buffers)
    else:
        for name, e in entries:
            if ckpt.has(name):
                ckpt.read_into(name, None, unit.master[e.offset : e.offset + e.numel])
        unit.store_master(unit.master)
    if optimizer is None or streamed is not None:
        return
    optimizer.reset_unit_state(unit)
    for name, e in entries:
        if e.group is not None and ckpt.has(name) and ckpt.params[name]["states"]:
            optimizer.import_param_state(e.param, ckpt.state(name, groups_tensors))


def _rewrite_disk_unit(unit: Unit, entries, ckpt: _Checkpoint, streamed, buffers) -> None:
    """Rebuild a unit whose master (and states, when ``streamed``) are on disk, chunk by
    chunk into shadow regions; commit them together at the end (all or nothing)."""
    home = unit.home
    targets: dict[str, DiskArray] = {"master": unit.master}
    if isinstance(home, DiskArray) and home is not unit.master:
        targets["home"] = home
    keys = list(streamed.states) if streamed is not None else []
    for key in keys:
        targets[key] = streamed.states[key]
    dtypes = {name: array.dtype for name, array in targets.items()}
    chunk = max(ALIGN_ELEMENTS, CHUNK_ELEMENTS // ALIGN_ELEMENTS * ALIGN_ELEMENTS)
    starts = list(range(0, unit.numel, chunk))
    shadows: dict[str, DiskArray] = {}
    taken: list = []
    writes: dict[int, list] = {}
    try:
        for name, array in targets.items():
            shadows[name] = array.shadow()
        sets = []
        for _ in range(min(2, len(starts))):
            slot = {}
            for name, dtype in dtypes.items():
                pair = buffers.take(min(chunk, unit.numel), dtype, f"load {name}")
                taken.append(pair)
                slot[name] = pair[1]
            sets.append(slot)
        for i, a in enumerate(starts):
            b = min(a + chunk, unit.numel)
            slot = sets[i % len(sets)]
            wait_all(writes.pop(i % len(sets), []))
            master = slot["master"][: b - a]
            _fill(master, a, entries, ckpt, None, keep=unit.master)
            handles = [unit.master.write(master, a, into=shadows["master"])]
            if "home" in targets:
                cast = slot["home"][: b - a]
                cast.copy_(master)
                handles.append(home.write(cast, a, into=shadows["home"]))
            elif home is not unit.master:
                home[a:b].copy_(master)
            if unit.materialized and unit.device_flat is not home:
                unit.device_flat[a:b].copy_(master)
            state_end = min(b, unit.trainable_numel)
            for key in keys if state_end > a else ():
                view = slot[key][: state_end - a]
                _fill(view, a, entries, ckpt, key)
                handles.append(targets[key].write(view, a, into=shadows[key]))
            writes[i % len(sets)] = handles
        for handles in writes.values():
            wait_all(handles)
        for name, array in targets.items():
            array.commit(shadows.pop(name))
    except BaseException:
        for handles in writes.values():
            wait_all_quiet(handles)
        for shadow in shadows.values():
            shadow.discard()
        raise
    finally:
        buffers.give(taken)
    unit.home_stale = False
    if unit.param_stager is not None:
        unit.param_stager.forget(unit)
    if streamed is not None:
        streamed.mark_loaded(_segment_steps(unit, entries, ckpt))


def _fill(
    out: torch.Tensor, start: int, entries, ckpt: _Checkpoint, key: str | None, keep=None
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


def _segment_steps(unit: Unit, entries, ckpt: _Checkpoint) -> list[float] | None:
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


def _load_shard(unit: Unit, entries, ckpt: _Checkpoint, optimizer) -> None:
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
    segments = optimizer.segment_states(unit, create=tuple(element_keys))
    for key in element_keys:
        local = torch.zeros(numel, dtype=torch.float32)
        for name, e in trainable:
            a, b = max(e.offset, start), min(e.offset + e.numel, start + numel)
            if a < b and ckpt.has(name, key):
                ckpt.read_into(name, key, local[a - start : b - start], a - e.offset)
        if streamed is not None:
            if key in streamed.states:
                streamed.states[key].write_all(local)
            continue
        for segment in segments:
            seg = segment["segment"]
            segment["states"][key].copy_(local[seg.start : seg.end])
    steps = _segment_steps(unit, trainable, ckpt)
    if streamed is not None:
        streamed.mark_loaded(steps)
        return
    for segment, best in zip(segments, steps, strict=True):
        if segment["step"] is not None:
            segment["step"].fill_(best)
