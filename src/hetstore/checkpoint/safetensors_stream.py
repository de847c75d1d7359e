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


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


class SafetensorsFile:
    """An open safetensors file: its header parsed, tensors read in element ranges."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.entries, self.metadata = self._parse()
        except BaseException:
            os.close(self.fd)
            raise

    def _parse(self) -> tuple[dict[str, _Entry], dict[str, str]]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{self.path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{self.path}: header length {length} does not fit the file")
        header = json.loads(os.pread(self.fd, length, 8))
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + length
        entries = {}
        for name, info in header.items():
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{self.path}: {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
                raise ValueError(f"{self.path}: {name!r} has an inconsistent byte range")
            entries[name] = _Entry(dtype, shape, base + begin, base + end)
        return entries, metadata

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
