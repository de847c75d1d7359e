"""Safetensors files written and read piece by piece, never whole in memory.

The ``safetensors`` package serializes a dict of tensors that are all in memory at once
(``save`` returns one ``bytes``). A unit's optimizer states on disk are bigger than the
host memory we allow ourselves, so this module writes the same format as a stream: the
header first (every tensor's name, dtype, shape and byte range are known before any data
is read from its tier), then the tensors' bytes in header order, in pieces of any size.
Reading goes the other way: the header is parsed, then any element range of any tensor
is read straight into a caller's buffer with ``os.preadv`` (no intermediate copy).

The files are ordinary safetensors: ``safetensors.torch.load_file`` and Hugging Face
``from_pretrained`` read them.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length
N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`` padded with spaces so the data starts 8-byte aligned, then
the data, tensors packed back to back in offset order.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

__all__ = ["TensorSpec", "SafetensorsStreamWriter", "SafetensorsFile", "DTYPE_NAMES"]

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.to("cpu").contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class SafetensorsStreamWriter:
    """Writes a safetensors file to ``out``: the header now, the data by :meth:`write`.

    Data must come in the order of ``specs``; pieces may split or span tensors of the
    same dtype. :meth:`finish` checks that exactly the announced bytes were written, so a
    stream that stops short never passes for a complete file.
    """

    def __init__(
        self, out: BinaryIO, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ):
        self.out = out
        self.specs = specs
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for spec in specs:
            if spec.dtype not in DTYPE_NAMES:
                raise TypeError(f"safetensors cannot store {spec.name!r} of dtype {spec.dtype}")
            if spec.name in header:
                raise ValueError(f"tensor {spec.name!r} appears twice in one file")
            end = offset + spec.nbytes
            header[spec.name] = {
                "dtype": DTYPE_NAMES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        self.total = offset
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        self.written = 0

    def write(self, piece: torch.Tensor) -> None:
        data = as_bytes(piece)
        if self.written + len(data) > self.total:
            raise ValueError("more data than the header announced")
        self.out.write(data)
        self.written += len(data)

    def finish(self) -> None:
        if self.written != self.total:
            raise ValueError(f"wrote {self.written} of {self.total} announced bytes")


def _is_count(value) -> bool:
    """A non-negative JSON integer (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """A JSON ``object_pairs_hook`` that refuses an object naming a key twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} appears twice")
    return out


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    """``n`` bytes at ``offset`` (the caller checked they lie inside the file)."""
    parts, done = [], 0
    while done < n:
        part = os.pread(fd, n - done, offset + done)
        if not part:
            raise ValueError(f"{path}: the file ends at byte {offset + done}, {n} expected")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


class SafetensorsFile:
    """An open safetensors file: its header parsed and checked, tensors read in element
    ranges.

    The header is checked whole before anything is read from the data: its declared
    length against the file's size (never allocated beyond it), the JSON (an object of
    objects, no duplicate keys), every dtype (known), shape (non-negative integers) and
    ``data_offsets`` (the tensors' byte ranges tile the data exactly, in order, to the
    end of the file, each as long as its shape and dtype say), as the safetensors library
    itself requires. Anything else raises ``ValueError`` naming the file and the tensor.

    ``fd``: an already opened descriptor of ``path`` (the checkpoint reader's, checked to
    be a regular file); it is owned and closed by this object. Without it, ``path`` is
    opened here and refused unless it is a regular file (a FIFO would block, a device
    like ``/dev/zero`` never ends).
    """

    def __init__(self, path: str | os.PathLike, fd: int | None = None):
        self.path = os.fspath(path)
        if fd is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        self.fd = fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{self.path}: not a regular file")
            self.size = st.st_size
            self.entries, self.metadata = self._parse()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    def _parse(self) -> tuple[dict[str, _Entry], dict[str, str]]:
        size = self.size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{self.path}: too short for a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(
                f"{self.path}: header length {length} does not fit the file ({size} bytes)"
            )
        raw = _pread_exact(self.fd, length, 8, self.path)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{self.path}: the header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: the header is a {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError(f"{self.path}: __metadata__ is not an object of strings")
        base = 8 + length
        entries = {}
        for name, info in header.items():
            entries[name] = self._entry_of(name, info, base)
        cursor = base  # the ranges must tile the data: in order, no gap, no overlap
        for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
            if entry.begin != cursor:
                raise ValueError(
                    f"{self.path}: {name!r} starts at data byte {entry.begin - base}, the "
                    f"previous tensor ends at {cursor - base} (overlap or gap)"
                )
            cursor = entry.end
        if cursor != size:
            raise ValueError(
                f"{self.path}: the tensors' data ends at byte {cursor}, the file at {size}"
            )
        return entries, metadata

    def _entry_of(self, name: str, info, base: int) -> _Entry:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where} is not {{dtype, shape, data_offsets}}")
        dtype = _DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{where} has an unsupported dtype {info['dtype']!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ValueError(f"{where} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
        ):
            raise ValueError(f"{where} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end < begin or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{where}: data_offsets {offsets} do not hold {tuple(shape)} of {dtype}"
            )
        if base + end > self.size:
            raise ValueError(
                f"{where}: data_offsets {offsets} reach past the end of the file "
                f"({self.size - base} data bytes)"
            )
        return _Entry(dtype, tuple(shape), base + begin, base + end)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def keys(self) -> list[str]:
        return list(self.entries)

    def spec(self, name: str) -> TensorSpec:
        entry = self._entry(name)
        return TensorSpec(name, entry.dtype, entry.shape)

    def _entry(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Elements ``[start, start + out.numel())`` of tensor ``name`` (flattened) into
        ``out``, a contiguous CPU tensor of the stored dtype."""
        entry = self._entry(name)
        if out.dtype != entry.dtype:
            raise TypeError(f"{name!r} is {entry.dtype}, the buffer {out.dtype}")
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("read_into needs a contiguous CPU buffer")
        itemsize = entry.dtype.itemsize
        offset = entry.begin + start * itemsize
        if start < 0 or offset + out.numel() * itemsize > entry.end:
            raise ValueError(f"elements [{start}, {start + out.numel()}) outside {name!r}")
        view = as_bytes(out)
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise ValueError(f"{self.path}: the file ends inside {name!r}")
            done += n

    def read(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, out.reshape(-1))
        return out
