"""hetstore.load verifies everything before it changes anything (issue 19, item 3), and
hetstore.save says which disk failed (item 4, first half).

The model under test has trained one step past its checkpoint, so its state differs
from the checkpoint's: a load that wrote anything before failing would show. After every
refused load the model's parameters and the optimizer's ``state_dict()`` (states, step
counters, param groups) are compared bitwise with what they were.

Checkpoints are damaged with real files: bytes changed in place, headers rewritten,
FIFOs, symlinks and devices put where files were, the offload disk's region file
truncated under a save, a file-size limit (RLIMIT_FSIZE) under a save. "Crafted" cases
re-sign the checkpoint after the change (every size and CRC-32 in the index, the index's
in ``LATEST``), so they get past the checksums and test the checks behind them.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import resource
import shutil
import signal
import stat
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hetstore
from hetstore import CheckpointError, ConfigError, DiskIOError, OffloadConfig
from tests.models.gpt import GPT

VOCAB, CTX = 16, 4
BOUNDED_S = 5.0  # a refused load of this 30 KB checkpoint takes ~1 ms; a hang takes forever


def tiny(seed: int = 0, depth: int = 1, width: int = 8) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab=VOCAB, width=width, depth=depth, heads=1, ctx=CTX)


def offload(model: GPT, where: Path, placement: str):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    config = OffloadConfig(
        offload_param=placement,
        offload_optimizer=placement,
        offload_path=str(where / "swap"),
        enable_pinned_mem=False,
        device="cpu",
    )
    return hetstore.offload(model, optimizer, config)


def train_step(model, optimizer) -> None:
    idx = torch.randint(0, VOCAB, (2, CTX + 1))
    model(idx[:, :-1], idx[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model, optimizer) -> tuple:
    params = {k: v.clone() for k, v in model.state_dict().items()}
    return params, copy.deepcopy(optimizer.state_dict())


def same(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


class Saved:
    """An offloaded model, its optimizer and a checkpoint it saved one step ago."""

    def __init__(self, tmp: Path, placement: str):
        self.placement = placement
        self.model, self.optimizer = offload(tiny(), tmp, placement)
        scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1, gamma=0.5)
        train_step(self.model, self.optimizer)
        scheduler.step()
        self.root = tmp / "ck"
        self.extra = {
            "scheduler": scheduler.state_dict(),
            "numpy": np.arange(3, dtype=np.int32),
            "half": torch.arange(4, dtype=torch.bfloat16),
            "tuple": (1, 2.5, float("inf")),
            "int_keys": {1: "a"},
        }
        self.version = hetstore.save(self.root, self.model, self.optimizer, extra=self.extra)
        self.saved_state = snapshot(self.model, self.optimizer)
        self.pristine = tmp / "pristine"
        shutil.copytree(self.root, self.pristine, symlinks=True)
        self.move_on()

    def move_on(self) -> None:
        """Train past the checkpoint: a load that wrote anything would now show."""
        train_step(self.model, self.optimizer)
        self.state = snapshot(self.model, self.optimizer)
        assert not same(self.state, self.saved_state)

    def unchanged(self) -> bool:
        return same(snapshot(self.model, self.optimizer), self.state)

    def restore(self) -> None:
        shutil.rmtree(self.root)
        shutil.copytree(self.pristine, self.root, symlinks=True)

    def load(self):
        return hetstore.load(self.root, self.model, self.optimizer)


@pytest.fixture(scope="module", params=["cpu", "disk"])
def saved(request, tmp_path_factory):
    run = Saved(tmp_path_factory.mktemp(request.param), request.param)
    yield run
    hetstore.release(run.model)


@pytest.fixture
def ckpt(saved):
    """The checkpoint, put back as it was after the test."""
    yield saved
    saved.restore()
    if not saved.unchanged():  # a failed test changed the model: the next starts afresh
        saved.move_on()


# ---------------------------------------------------------------------- 1. every byte
def mutation_plan(root: Path, version: Path) -> list[tuple[Path, list[int]]]:
    """Which bytes of which files to change. Every byte of LATEST, of every JSON file
    (the index included) and of every safetensors file's length field and header; of
    tensor data, every 61st byte and the last 8 (61 is prime, so every position inside
    a 4-byte float and every 8-byte word is hit). Why sample the data: every data byte
    is guarded by the same check (its file's CRC-32, which catches any change of up to
    32 consecutive bits, so every single-byte change, by construction), and changing
    each of the ~20 KB of data, a load apiece, would add about a minute per placement
    for no case the headers do not already exercise."""
    plan = [(root / "LATEST", list(range((root / "LATEST").stat().st_size)))]
    for file in sorted(version.iterdir()):
        size = file.stat().st_size
        if file.suffix != ".safetensors":
            plan.append((file, list(range(size))))
            continue
        header_end = 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]
        data = range(header_end, size)
        sampled = sorted({*data[::61], *data[-8:]})
        plan.append((file, list(range(header_end)) + sampled))
    return plan


def test_every_changed_byte_is_refused_naming_the_file_and_changes_nothing(ckpt):
    plan = mutation_plan(ckpt.root, ckpt.version)
    tried = 0
    for file, offsets in plan:
        original = file.read_bytes()
        named = "LATEST" if file.name == "LATEST" else file.name
        for offset in offsets:
            data = bytearray(original)
            data[offset] ^= 1 << (offset % 8)  # each bit position in turn
            file.write_bytes(bytes(data))
            try:
                ckpt.load()
            except CheckpointError as exc:
                assert named in str(exc), (file.name, offset, str(exc))
            else:
                pytest.fail(f"{file.name}: byte {offset} changed, and the load went through")
            tried += 1
            # A refused load that wrote anything would leave the model changed for good:
            # nothing puts it back, no later load succeeds until the end. So a check
            # every 16th attempt and after each file catches any write (and names the
            # attempt within 16), at a fraction of a check per attempt (2-7 ms each).
            if tried % 16 == 0:
                assert ckpt.unchanged(), (file.name, offset)
        file.write_bytes(original)
        assert ckpt.unchanged(), file.name
    assert tried > 8000
    # put back, the checkpoint loads, with its extra, and is the state it saved
    extra = ckpt.load()
    assert same(snapshot(ckpt.model, ckpt.optimizer), ckpt.saved_state)
    assert same(extra["scheduler"], ckpt.extra["scheduler"]) and extra["tuple"][1] == 2.5
    ckpt.move_on()


# ---------------------------------------------------------------------- 2. crafted files
def resign(version: Path) -> None:
    """Make the index and LATEST agree with the files again (sizes, CRC-32s), as a
    crafted checkpoint would: what remains to refuse it are the checks behind them."""
    index_file = version / "index.json"
    if not stat.S_ISREG(index_file.lstat().st_mode):
        return  # the case is the index itself not being a file: nothing to re-sign
    index = json.loads(index_file.read_bytes())
    for name, entry in index["files"].items():
        file = version / name
        if file.is_file() and not file.is_symlink():
            data = file.read_bytes()
            entry.update(bytes=len(data), crc32=zlib.crc32(data))
    encoded = json.dumps(index, sort_keys=True, indent=1).encode()
    index_file.write_bytes(encoded)
    pointer = f"{version.name} index.json {len(encoded)} {zlib.crc32(encoded):08x}\n"
    (version.parent / "LATEST").write_text(pointer)


def edit_index(version: Path, edit) -> None:
    index = json.loads((version / "index.json").read_bytes())
    edit(index)
    (version / "index.json").write_text(json.dumps(index))


def split(file: Path) -> tuple[bytes, dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[:8], json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(file: Path, header, data: bytes) -> None:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(file: Path, edit) -> None:
    _, header, data = split(file)
    edit(header)
    write_header(file, header, data)


def edit_tensors(file: Path, edit) -> None:
    """Rewrite a tensor file through the safetensors library (a well-formed file)."""
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def first_master(header: dict) -> dict:
    """The header entry of the file's first parameter master (a 2-d fp32 tensor)."""
    return header[next(k for k in header if "/" not in k and k != "__metadata__")]


def last_tensor(header: dict) -> dict:
    return max(
        (e for k, e in header.items() if k != "__metadata__"), key=lambda e: e["data_offsets"]
    )


def in_unit(edit):
    """A crafting step that edits the unit file's header (a dict) in place."""
    return lambda v: edit_header(unit_of(v), edit)


def negate_shape(header: dict) -> None:
    entry = first_master(header)
    entry["shape"] = [-d for d in entry["shape"]]


def four_bytes_longer(header: dict) -> None:
    first_master(header)["data_offsets"][1] += 4


def past_the_end(header: dict) -> None:
    """The last tensor grown by 1 Mi elements, shape and offsets consistent, past the file."""
    entry = last_tensor(header)
    begin, end = entry["data_offsets"]
    entry.update(shape=[(end - begin) // 4 + 2**20], data_offsets=[begin, end + 2**22])


def duplicate_name(v: Path) -> None:
    _, header, data = split(unit_of(v))
    encoded = json.dumps(header)[:-1].encode() + b', "wte.weight": {}}'
    write_header(unit_of(v), encoded, data)


def set_states(version: Path, name: str, states: list[str]) -> None:
    edit_index(version, lambda index: index["meta"]["params"][name].update(states=states))


def drop_state(version: Path, key: str) -> None:
    """A consistent checkpoint without state ``key``: the tensors gone from the file and
    the index. On disk placement, loading it used to zero the state."""
    unit = version / "unit-00000.safetensors"
    edit_tensors(unit, lambda t: [t.pop(k) for k in [k for k in t if k.endswith("/" + key)]])
    index = json.loads((version / "index.json").read_bytes())
    for meta in index["meta"]["params"].values():
        meta["states"] = [s for s in meta["states"] if s != key]
    (version / "index.json").write_text(json.dumps(index))


def rename_state(version: Path, key: str, new: str) -> None:
    unit = version / "unit-00000.safetensors"

    def rename(t):
        for k in [k for k in t if k.endswith("/" + key)]:
            t[k[: -len(key)] + new] = t.pop(k)

    edit_tensors(unit, rename)
    index = json.loads((version / "index.json").read_bytes())
    for meta in index["meta"]["params"].values():
        meta["states"] = [new if s == key else s for s in meta["states"]]
    (version / "index.json").write_text(json.dumps(index))


def reshape_tensor(version: Path, key: str, shape) -> None:
    def reshape(t):
        t[key] = t[key].reshape(shape).contiguous()

    edit_tensors(unit_of(version), reshape)


def half_a_piece(version: Path) -> None:
    """The index gives ``wte.weight`` one piece of half its elements."""

    def edit(index):
        meta = index["meta"]["params"]["wte.weight"]
        meta["pieces"] = [{"file": meta.pop("file"), "start": 0, "numel": 64}]

    edit_index(version, edit)


def symlink_to_a_copy(version: Path) -> None:
    """A symlink to an intact copy of the file: refused too, for what it is."""
    shutil.copy(unit_of(version), version.parent / "copy")
    replace_with_symlink(unit_of(version), str(version.parent / "copy"))


def unit_of(v: Path) -> Path:
    return v / "unit-00000.safetensors"


def extra_json(v: Path, text: str) -> None:
    (v / "extra.json").write_text(text)


def replace_with_fifo(file: Path) -> None:
    file.unlink()
    os.mkfifo(file)


def replace_with_symlink(file: Path, target: str) -> None:
    file.unlink()
    file.symlink_to(target)


def replace_with_device(file: Path) -> None:
    file.unlink()
    try:
        os.mknod(file, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")


def version_dir_as_symlink(v: Path) -> None:
    elsewhere = v.parent.parent / f"elsewhere-{v.parent.name}"
    shutil.rmtree(elsewhere, ignore_errors=True)
    shutil.move(v, elsewhere)
    v.symlink_to(elsewhere)


def tag_as_ndarray(v: Path) -> None:
    """``half`` (a bf16 tensor) tagged as a numpy array, which numpy cannot hold."""
    data = json.loads((v / "extra.json").read_bytes())
    data["half"] = {"__ndarray__": data["half"]["__tensor__"]}
    (v / "extra.json").write_text(json.dumps(data))


def hyper(v: Path, edit) -> None:
    data = json.loads((v / "optimizer.json").read_bytes())
    edit(data)
    (v / "optimizer.json").write_text(json.dumps(data))


HUGE = struct.pack("<Q", 2**62)

# (id, what it does to the version directory, the file the error must name, the words)
CRAFTED = [
    # safetensors headers
    (
        "huge-header-length",
        lambda v: unit_of(v).write_bytes(HUGE + unit_of(v).read_bytes()[8:]),
        "unit-00000.safetensors",
        "header length 4611686018427387904 does not fit",
    ),
    (
        "header-is-a-list",
        lambda v: write_header(unit_of(v), b"[1, 2, 3]", split(unit_of(v))[2]),
        "unit-00000.safetensors",
        "the header is a list, not an object",
    ),
    (
        "header-is-not-json",
        lambda v: write_header(unit_of(v), b'{"a": ', split(unit_of(v))[2]),
        "unit-00000.safetensors",
        "not valid JSON",
    ),
    (
        "header-nested-100000-deep",
        lambda v: write_header(unit_of(v), b"[" * 100_000, b""),
        "unit-00000.safetensors",
        "not valid JSON",
    ),
    (
        "tensor-entry-not-an-object",
        in_unit(lambda h: h.update({"wte.weight": [1]})),
        "unit-00000.safetensors",
        "is not {dtype, shape, data_offsets}",
    ),
    ("negative-shape", in_unit(negate_shape), "unit-00000.safetensors", "has an invalid shape"),
    (
        "unknown-dtype",
        in_unit(lambda h: first_master(h).update(dtype="F33")),
        "unit-00000.safetensors",
        "unsupported dtype 'F33'",
    ),
    (
        "offsets-inconsistent-with-shape",
        in_unit(four_bytes_longer),
        "unit-00000.safetensors",
        "do not hold",
    ),
    (
        "offsets-beyond-the-file",
        in_unit(past_the_end),
        "unit-00000.safetensors",
        "reach past the end of the file",
    ),
    (
        "overlapping-offsets",
        in_unit(
            lambda h: h["wte.weight/exp_avg_sq"].update(
                data_offsets=h["wte.weight/exp_avg"]["data_offsets"]
            )
        ),
        "unit-00000.safetensors",
        "overlap or gap",
    ),
    (
        "metadata-not-strings",
        in_unit(lambda h: h.update(__metadata__={"a": 1})),
        "unit-00000.safetensors",
        "__metadata__",
    ),
    ("duplicate-tensor-name", duplicate_name, "unit-00000.safetensors", "appears twice"),
    # tensors against the index and the optimizer
    (
        "tensor-renamed",
        in_unit(lambda h: h.update(x=h.pop("wte.weight"))),
        "unit-00000.safetensors",
        "tensor 'wte.weight' is missing",
    ),
    (
        "index-drops-a-listed-state",
        lambda v: set_states(v, "wte.weight", ["exp_avg", "step"]),
        "unit-00000.safetensors",
        "tensors the index does not list",
    ),
    (
        "state-dropped-consistently",
        lambda v: drop_state(v, "exp_avg_sq"),
        "unit-00000.safetensors",
        "AdamW with its param group's settings keeps",
    ),
    (
        "state-renamed-consistently",
        lambda v: rename_state(v, "exp_avg", "exp_avf"),
        "unit-00000.safetensors",
        "has the optimizer states",
    ),
    (
        "step-not-a-scalar",
        lambda v: reshape_tensor(v, "wte.weight/step", (1,)),
        "unit-00000.safetensors",
        "state 'step' is shaped [[1]]",
    ),
    (
        "state-transposed",
        lambda v: reshape_tensor(v, "wte.weight/exp_avg", (8, VOCAB)),
        "unit-00000.safetensors",
        "state 'exp_avg' is shaped [[8, 16]]",
    ),
    (
        "master-transposed",
        lambda v: reshape_tensor(v, "wte.weight", (8, VOCAB)),
        "unit-00000.safetensors",
        "tensor 'wte.weight' is torch.float32 [8, 16]",
    ),
    (
        "master-as-integers",
        lambda v: edit_tensors(
            unit_of(v), lambda t: t.update({"wte.weight": t["wte.weight"].int()})
        ),
        "unit-00000.safetensors",
        "tensor 'wte.weight' is torch.int32",
    ),
    # the index's names and the files' kinds
    (
        "index-names-dotdot",
        lambda v: edit_index(v, lambda i: i["files"].update({"../x": i["files"]["extra.json"]})),
        "index.json",
        "'../x' that is not a plain file name",
    ),
    (
        "index-names-absolute",
        lambda v: edit_index(
            v, lambda i: i["files"].update({"/etc/passwd": {"bytes": 1, "crc32": 0}})
        ),
        "index.json",
        "'/etc/passwd' that is not a plain file name",
    ),
    (
        "index-names-subdirectory",
        lambda v: edit_index(v, lambda i: i["files"].update({"sub/x": {"bytes": 1, "crc32": 0}})),
        "index.json",
        "'sub/x' that is not a plain file name",
    ),
    (
        "param-in-a-file-not-listed",
        lambda v: edit_index(v, lambda i: i["meta"]["params"]["wte.weight"].update(file="../x")),
        "index.json",
        "parameter 'wte.weight' is in '../x'",
    ),
    (
        "pieces-do-not-tile",
        half_a_piece,
        "index.json",
        "hold 64 elements, its shape 128",
    ),
    ("fifo", lambda v: replace_with_fifo(unit_of(v)), "unit-00000.safetensors", "is a FIFO"),
    (
        "symlink-to-dev-zero",
        lambda v: replace_with_symlink(unit_of(v), "/dev/zero"),
        "unit-00000.safetensors",
        "is a symbolic link",
    ),
    (
        "symlink-to-a-good-copy",
        symlink_to_a_copy,
        "unit-00000.safetensors",
        "is a symbolic link",
    ),
    (
        "character-device",
        lambda v: replace_with_device(unit_of(v)),
        "unit-00000.safetensors",
        "is a character device",
    ),
    (
        "directory",
        lambda v: unit_of(v).unlink() or unit_of(v).mkdir(),
        "unit-00000.safetensors",
        "is a directory",
    ),
    ("index-is-a-fifo", lambda v: replace_with_fifo(v / "index.json"), "index.json", "is a FIFO"),
    (
        "version-directory-is-a-symlink",
        version_dir_as_symlink,
        "LATEST",
        "not a directory of the checkpoint: it is a symbolic link",
    ),
    # extra
    (
        "extra-names-a-missing-tensor",
        lambda v: extra_json(v, '{"a": {"__tensor__": "t99"}}'),
        "extra.json",
        "extra['a']: tensor 't99' is not in the tensor file",
    ),
    (
        "extra-tag-with-a-sibling",
        lambda v: extra_json(v, '{"a": {"__tuple__": [], "b": 1}}'),
        "extra.json",
        "must be alone",
    ),
    (
        "extra-bad-float",
        lambda v: extra_json(v, '[{"__float__": "1e999"}]'),
        "extra.json",
        "extra[0]: __float__ holds '1e999'",
    ),
    (
        "extra-bad-dict-pair",
        lambda v: extra_json(v, '{"__dict__": [[1, 2, 3]]}'),
        "extra.json",
        "__dict__ item 0 is not a [key, value] pair",
    ),
    (
        "extra-unhashable-key",
        lambda v: extra_json(v, '{"__dict__": [[{"a": 1}, 2]]}'),
        "extra.json",
        "__dict__ key 0",
    ),
    (
        "extra-nested-100000-deep",
        lambda v: extra_json(v, "[" * 100_000 + "]" * 100_000),
        "extra.json",
        "not valid JSON",
    ),
    (
        "extra-not-utf8",
        lambda v: (v / "extra.json").write_bytes(b'{"a": "\xff"}'),
        "extra.json",
        "not valid JSON",
    ),
    ("extra-ndarray-of-bf16", tag_as_ndarray, "extra.json", "cannot be a numpy array"),
    (
        "extra-tensor-file-bad-dtype",
        lambda v: edit_header(
            v / "extra.safetensors",
            lambda h: [e.update(dtype="Q4") for k, e in h.items() if k != "__metadata__"],
        ),
        "extra.safetensors",
        "unsupported dtype 'Q4'",
    ),
    (
        "extra-tensor-file-missing",
        lambda v: (
            (v / "extra.safetensors").unlink()
            or edit_index(v, lambda i: i["files"].pop("extra.safetensors"))
        ),
        "extra.safetensors",
        "has no file",
    ),
    # the optimizer header
    (
        "hyper-names-a-missing-tensor",
        lambda v: hyper(v, lambda d: d["param_groups"][0]["hyper"].update(lr={"__tensor__": "t9"})),
        "optimizer.json",
        "param_groups[0]['lr']: tensor 't9' is not in the tensor file",
    ),
    (
        "hyper-not-an-object",
        lambda v: hyper(v, lambda d: d["param_groups"][0].update(hyper=[1])),
        "optimizer.json",
        "param_groups[0] is not valid",
    ),
    (
        "header-not-an-object",
        lambda v: (v / "optimizer.json").write_text("[]"),
        "optimizer.json",
        "is not an optimizer header",
    ),
    (
        "loss-scaler-not-numbers",
        lambda v: hyper(v, lambda d: d.update(loss_scaler={"scale": "big"})),
        "optimizer.json",
        "loss_scaler is not valid",
    ),
]


@pytest.mark.parametrize(
    "craft, named, words", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED]
)
def test_a_crafted_checkpoint_is_refused_before_anything_changes(ckpt, craft, named, words):
    craft(ckpt.version)
    resign(ckpt.version)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        ckpt.load()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert named in message and words in message, message
    assert elapsed < BOUNDED_S
    assert ckpt.unchanged()


def test_a_sound_checkpoint_of_another_model_is_a_config_error(ckpt):
    """The checks against the model come after the checkpoint's own: a checkpoint that is
    sound but of another model (``wte.weight`` transposed, its states too) is the
    caller's mismatch, a ConfigError as before, and changes nothing either."""
    version = ckpt.version

    def transpose(tensors):
        for key in [k for k in tensors if k.split("/")[0] == "wte.weight"]:
            if tensors[key].dim() == 2:
                tensors[key] = tensors[key].reshape(8, VOCAB).contiguous()

    edit_tensors(unit_of(version), transpose)
    edit_index(version, lambda i: i["meta"]["params"]["wte.weight"].update(shape=[8, VOCAB]))
    resign(version)
    with pytest.raises(ConfigError, match=r"'wte\.weight': \[8, 16\] in the checkpoint, \[16, 8\]"):
        ckpt.load()
    assert ckpt.unchanged()


# ---------------------------------------------------------------------- 3. LATEST
@pytest.mark.parametrize(
    "content, words",
    [
        (b"v000001 index.json 12\xff4 0123abcd\n", "byte 0xff at offset 21 is not ASCII"),
        (b"\xc3\xa9", "byte 0xc3 at offset 0 is not ASCII"),
        (b"v000001\n", "without its index's checksum (written by a hetstore from before"),
        (b"v000001 index.json 0100 0123abcd\n", "is damaged"),
        (b"v000001 index.json 100 0123ABCD\n", "is damaged"),
        (b"v" * 2**20, "is damaged"),
        (b"v000001 index.json 999999999999 0123abcd\n", "more than the"),
    ],
    ids=["non-utf8", "non-ascii", "legacy", "leading-zero", "upper-hex", "1MB", "huge-index"],
)
def test_a_bad_latest_is_refused_naming_it(ckpt, content, words):
    (ckpt.root / "LATEST").write_bytes(content)
    with pytest.raises(CheckpointError, match="LATEST|index.json") as info:
        ckpt.load()
    assert words in str(info.value) and "LATEST" in str(info.value), str(info.value)
    assert ckpt.unchanged()


def test_special_latest_and_sparse_index_are_refused_in_bounded_time(ckpt):
    latest = ckpt.root / "LATEST"
    pointer = latest.read_bytes()
    for make in (lambda: os.mkfifo(latest), lambda: latest.symlink_to("/dev/zero")):
        latest.unlink()
        make()
        start = time.monotonic()
        with pytest.raises(CheckpointError, match="LATEST"):
            ckpt.load()
        assert time.monotonic() - start < BOUNDED_S
    latest.unlink()
    latest.write_bytes(pointer)
    os.truncate(ckpt.version / "index.json", 2**40)  # 1 TiB, sparse: never read
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="index.json.* truncated or damaged"):
        ckpt.load()
    assert time.monotonic() - start < BOUNDED_S
    assert ckpt.unchanged()


def test_a_save_over_a_damaged_latest_keeps_the_version_it_named(saved, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved.pristine, root)
    (root / "LATEST").write_bytes(b"\xff garbage")
    hetstore.save(root, saved.model, saved.optimizer)
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "v000001", "v000002"]
    hetstore.load(root, saved.model, saved.optimizer)  # the new one, complete
    saved.move_on()


# ---------------------------------------------------------------------- 4. save: which side
def test_a_failed_read_of_the_offload_disk_names_the_offload_file_not_the_checkpoint(tmp_path):
    model, optimizer = offload(tiny(depth=2, width=32), tmp_path, "disk")
    train_step(model, optimizer)
    root = tmp_path / "ck"
    hetstore.save(root, model, optimizer)
    saved = snapshot(model, optimizer)
    train_step(model, optimizer)
    # the last array the save reads (the last unit's last state) loses its bytes: the
    # save has written the earlier units' files by the time it reads there
    units = [u for u in hetstore.state_of(model).runtime.units if u.entries]
    assert len(units) > 1
    victim = list(optimizer.streamed_step_of(units[-1]).states.values())[-1]
    region_file = victim.region.file.path
    assert Path(region_file).is_relative_to(tmp_path / "swap")
    os.truncate(region_file, 0)
    with pytest.raises(DiskIOError) as info:
        hetstore.save(root, model, optimizer)
    message = str(info.value)
    assert info.value.path == region_file  # the failing side: the offload disk
    assert "reading" in message and "from the offload disk failed" in message
    assert f"offload file {region_file!r}" in message and "offload_path" in message
    assert "saving checkpoint file" not in message
    assert "previous one at" in message and "unchanged" in message
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "v000001"]
    # an export reads the masters from the same disk: same side named, nothing left
    master_file = units[-1].master.region.file.path
    os.truncate(master_file, 0)
    with pytest.raises(DiskIOError, match="from the offload disk failed") as info:
        hetstore.export_weights(tmp_path / "export", model)
    assert info.value.path == master_file
    assert "no file in" in str(info.value) and not list((tmp_path / "export").iterdir())
    other, other_optimizer = offload(tiny(seed=1, depth=2, width=32), tmp_path / "b", "disk")
    hetstore.load(root, other, other_optimizer)
    assert same(snapshot(other, other_optimizer), saved)
    hetstore.release(other)
    hetstore.release(model)


def test_a_failed_write_of_the_checkpoint_names_the_checkpoint_file(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it fail with
    EFBIG) stands for a checkpoint disk that fails, while the offload disk reads fine."""
    model, optimizer = offload(tiny(depth=2, width=32), tmp_path, "disk")
    train_step(model, optimizer)
    root = tmp_path / "ck"
    first = hetstore.save(root, model, optimizer)
    saved = snapshot(model, optimizer)
    largest = max(f.stat().st_size for f in first.iterdir())
    limit = largest // 2 // 4096 * 4096  # page-aligned: O_DIRECT writes stop at it cleanly
    assert limit >= 4096
    train_step(model, optimizer)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(DiskIOError) as info:
            hetstore.save(root, model, optimizer)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(info.value)
    assert Path(info.value.path).parent == root / "v000002"  # the failing side: the checkpoint
    assert info.value.errno == errno.EFBIG
    assert message.startswith(f"saving checkpoint file {info.value.path!r} failed: File too large")
    assert "offload" not in message and "previous checkpoint" in message
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "v000001"]
    other, other_optimizer = offload(tiny(seed=1, depth=2, width=32), tmp_path / "b", "disk")
    hetstore.load(root, other, other_optimizer)
    assert same(snapshot(other, other_optimizer), saved)
    hetstore.release(other)
    hetstore.release(model)
