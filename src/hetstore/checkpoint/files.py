"""The checkpoint's files: written atomically, verified on read.

A checkpoint at ``path`` is a directory of *versions* and one pointer file:

    path/
      LATEST                 the name of the complete version ("v000002"), replaced atomically
      v000002/
        index.json           every file with its size and SHA-256, written last
        unit-blocks.0.safetensors, optimizer.json, ...

A save writes a new version directory next to the old one: every file is written,
flushed and fsynced, then the index, then the directory is fsynced, and only then is
``LATEST`` replaced (a temporary file fsynced, ``os.replace``, the parent fsynced). The
old version is deleted after that. A crash or SIGKILL at any moment therefore leaves
``LATEST`` naming a complete version: the previous one until the replace, the new one
after. Leftover partial versions are removed by the next save.

Reading checks each file's size when it is opened and its SHA-256 when it is read, so a
truncated or corrupted file is refused with its name instead of being loaded as garbage.
Tensors are stored as safetensors (no pickle: nothing executable is loaded from a file),
other data as JSON. A tensor file can be streamed (:meth:`CheckpointWriter.stream_tensors`:
header first, then the data in pieces, hashed as it goes), so a caller moving a unit's
states from disk never holds more than its own buffers in memory; reading is streamed the
same way (:meth:`CheckpointReader.open_tensors`, after :meth:`CheckpointReader.verify`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from hetstore.checkpoint.safetensors_stream import (
    SafetensorsFile,
    SafetensorsStreamWriter,
    TensorSpec,
)
from hetstore.errors import HetstoreError

__all__ = ["CheckpointError", "CheckpointWriter", "CheckpointReader"]

FORMAT = "hetstore-checkpoint"
FORMAT_VERSION = 1
_VERSION = re.compile(r"^v(\d{6})$")
_READ_BLOCK = 8 * 2**20  # bytes hashed per read when verifying
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class CheckpointError(HetstoreError, ValueError):
    """A checkpoint that is missing, incomplete, truncated or corrupted; names the file."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _HashingFile:
    """A file being written that counts and hashes every byte on the way."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.bytes += len(data)


def _check_name(name: str) -> None:
    if not _NAME.match(name) or name in ("index.json", ".", ".."):
        raise ValueError(f"checkpoint file name {name!r}: use letters, digits, '_', '.', '-'")


def _versions(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _VERSION.match(p.name))


class CheckpointWriter:
    """Writes one new version of the checkpoint at ``path`` (see module doc).

    ``write_tensors`` / ``write_json`` add files; ``commit()`` makes the version the one
    ``LATEST`` names. Used as a context manager, an exception before ``commit`` removes
    the partial version and leaves the previous checkpoint as it was.
    """

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"checkpoint path {str(self.root)!r} exists and is not a directory"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        latest = _read_latest(self.root)
        for stale in _versions(self.root):  # partial versions of saves that died
            if stale != latest:
                shutil.rmtree(self.root / stale, ignore_errors=True)
        for pointer in self.root.glob(".LATEST.*"):  # their unfinished pointer files
            pointer.unlink(missing_ok=True)
        number = max((int(_VERSION.match(v).group(1)) for v in _versions(self.root)), default=0)
        self.version = f"v{number + 1:06d}"
        self.dir = self.root / self.version
        self.dir.mkdir()
        self.files: dict[str, dict] = {}
        self.committed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.committed:
            self.abort()

    @contextlib.contextmanager
    def _durable_file(self, name: str) -> Iterator[_HashingFile]:
        """A new file of this version, hashed as written, flushed and fsynced on exit."""
        _check_name(name)
        if name in self.files:
            raise ValueError(f"checkpoint file {name!r} written twice")
        with open(self.dir / name, "wb") as f:
            out = _HashingFile(f)
            yield out
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"bytes": out.bytes, "sha256": out.sha.hexdigest()}

    def _add(self, name: str, data: bytes) -> None:
        with self._durable_file(name) as out:
            out.write(data)

    @contextlib.contextmanager
    def stream_tensors(
        self, name: str, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ) -> Iterator[SafetensorsStreamWriter]:
        """A safetensors file whose data the caller writes piece by piece, in the order of
        ``specs``; it must write every announced byte before the block ends."""
        with self._durable_file(name) as out:
            writer = SafetensorsStreamWriter(out, specs, metadata)
            yield writer
            writer.finish()

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """One safetensors file of ``tensors`` (small ones: each is written whole)."""
        specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
        with self.stream_tensors(name, specs) as writer:
            for tensor in tensors.values():
                writer.write(tensor)

    def write_json(self, name: str, value) -> None:
        self._add(name, json.dumps(value, sort_keys=True).encode())

    def commit(self, meta: dict | None = None) -> Path:
        """Write the index, then point ``LATEST`` at this version; the old one is removed."""
        index = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "files": self.files,
            "meta": meta or {},
        }
        _write_durable(
            self.dir / "index.json", json.dumps(index, sort_keys=True, indent=1).encode()
        )
        _fsync_dir(self.dir)
        _fsync_dir(self.root)
        previous = _read_latest(self.root)
        pointer = self.root / f".LATEST.{os.getpid()}"
        _write_durable(pointer, self.version.encode())
        os.replace(pointer, self.root / "LATEST")
        _fsync_dir(self.root)
        self.committed = True
        if previous and previous != self.version:
            shutil.rmtree(self.root / previous, ignore_errors=True)
        return self.dir

    def abort(self) -> None:
        """Remove this partial version; the previous checkpoint stays as it was."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _read_latest(root: Path) -> str | None:
    try:
        name = (root / "LATEST").read_text().strip()
    except FileNotFoundError:
        return None
    return name if _VERSION.match(name) else None


class CheckpointReader:
    """The complete version ``LATEST`` names, every file checked before use."""

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        latest = _read_latest(self.root)
        if latest is None:
            raise CheckpointError(
                f"no complete checkpoint at {str(self.root)!r} (no valid LATEST file)"
            )
        self.dir = self.root / latest
        index_path = self.dir / "index.json"
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint index {str(index_path)!r} is unreadable: {exc}"
            ) from exc
        if index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"{str(index_path)!r} is not a {FORMAT} v{FORMAT_VERSION} index")
        self.files: dict[str, dict] = index["files"]
        self.meta: dict = index.get("meta", {})
        for name, entry in self.files.items():
            file = self.dir / name
            size = file.stat().st_size if file.exists() else None
            if size != entry["bytes"]:
                found = "missing" if size is None else f"{size} bytes"
                raise CheckpointError(
                    f"checkpoint file {str(file)!r} is truncated or damaged: "
                    f"{found}, the index says {entry['bytes']}"
                )

    def names(self) -> list[str]:
        return list(self.files)

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"checkpoint {str(self.dir)!r} has no file {name!r}")
        return self.dir / name

    def _corrupted(self, name: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint file {str(self.dir / name)!r} is corrupted: its SHA-256 does not "
            "match the index"
        )

    def verify(self, names: list[str] | None = None) -> None:
        """Hash every file (or ``names``) in blocks and compare with the index; a
        mismatch raises :class:`CheckpointError` naming the file. Nothing is kept in
        memory but one block."""
        block = bytearray(_READ_BLOCK)
        view = memoryview(block)
        for name in self.names() if names is None else names:
            sha = hashlib.sha256()
            with open(self._file(name), "rb", buffering=0) as f:
                while n := f.readinto(block):
                    sha.update(view[:n])
            if sha.hexdigest() != self.files[name]["sha256"]:
                raise self._corrupted(name)

    def _read(self, name: str) -> bytes:
        data = self._file(name).read_bytes()
        entry = self.files[name]
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise self._corrupted(name)
        return data

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A small safetensors file whole (checked against its hash first)."""
        self.verify([name])
        with self.open_tensors(name) as f:
            return {key: f.read(key) for key in f.keys()}

    def open_tensors(self, name: str) -> SafetensorsFile:
        """A safetensors file to read in pieces. Its size was checked when the reader
        opened; call :meth:`verify` first for the content."""
        file = self._file(name)
        try:
            return SafetensorsFile(file)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {str(file)!r} is unreadable: {exc}") from exc

    def read_json(self, name: str):
        return json.loads(self._read(name))
