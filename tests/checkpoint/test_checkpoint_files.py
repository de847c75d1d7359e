"""The checkpoint file layer: atomic versions, verified reads, and SIGKILL at every
durable step of a save leaving a loadable checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hetstore.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter


def save(path, value: float, files=("a", "b")):
    with CheckpointWriter(path) as writer:
        for name in files:
            writer.write_tensors(f"{name}.safetensors", {"w": torch.full((1000,), value)})
        writer.write_json("extra.json", {"value": value})
        writer.commit({"step": int(value)})


def value_of(path) -> float:
    reader = CheckpointReader(path)
    values = {
        float(reader.read_tensors(n)["w"][0]) for n in reader.names() if n.endswith(".safetensors")
    }
    values.add(reader.read_json("extra.json")["value"])
    assert len(values) == 1, "a checkpoint mixing two saves"
    return values.pop()


def test_round_trip_and_versions(tmp_path):
    save(tmp_path / "ck", 1.0)
    save(tmp_path / "ck", 2.0)
    reader = CheckpointReader(tmp_path / "ck")
    assert reader.meta == {"step": 2}
    assert torch.equal(reader.read_tensors("a.safetensors")["w"], torch.full((1000,), 2.0))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["LATEST", "v000002"]


def test_a_save_that_raises_leaves_the_previous_checkpoint(tmp_path):
    save(tmp_path / "ck", 1.0)
    with pytest.raises(RuntimeError), CheckpointWriter(tmp_path / "ck") as writer:
        writer.write_tensors("a.safetensors", {"w": torch.zeros(3)})
        raise RuntimeError("disk full, say")
    assert value_of(tmp_path / "ck") == 1.0
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["LATEST", "v000001"]


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    save(tmp_path / "ck", 1.0)
    file = next((tmp_path / "ck").glob("v*/b.safetensors"))
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x01
    file.write_bytes(bytes(data))
    reader = CheckpointReader(tmp_path / "ck")
    reader.read_tensors("a.safetensors")  # the intact file still reads
    with pytest.raises(CheckpointError, match=r"b\.safetensors.* is corrupted"):
        reader.read_tensors("b.safetensors")


def test_a_truncated_file_is_refused_naming_the_file(tmp_path):
    save(tmp_path / "ck", 1.0)
    file = next((tmp_path / "ck").glob("v*/a.safetensors"))
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"a\.safetensors.* truncated or damaged"):
        CheckpointReader(tmp_path / "ck")


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        CheckpointReader(tmp_path / "nothing")


# A save of two tensor files makes 7 durable steps (fsyncs): the two files, the index,
# the version directory, the checkpoint directory, the LATEST pointer's temporary file,
# and the directory after the pointer is replaced. SIGKILL before each of them.
KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from hetstore.checkpoint import CheckpointWriter
    path, kill_at = sys.argv[1], int(sys.argv[2])
    real_fsync, calls = os.fsync, [0]
    def fsync(fd):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)
    os.fsync = fsync
    with CheckpointWriter(path) as writer:
        for name in ("a", "b"):
            writer.write_tensors(name + ".safetensors", {"w": torch.full((1000,), 2.0)})
        writer.commit()
    """
)


@pytest.mark.parametrize("kill_at", range(1, 8))
def test_sigkill_at_any_step_of_a_save_leaves_a_loadable_checkpoint(tmp_path, kill_at):
    path = tmp_path / "ck"
    save(path, 1.0, files=("a", "b"))
    done = subprocess.run([sys.executable, "-c", KILLER, str(path), str(kill_at)], timeout=120)
    assert done.returncode == -signal.SIGKILL
    reader = CheckpointReader(path)
    got = float(reader.read_tensors("b.safetensors")["w"][0])
    # before the pointer is replaced the old save is the checkpoint, after it the new one
    assert got == (2.0 if kill_at == 7 else 1.0)
    assert float(reader.read_tensors("a.safetensors")["w"][0]) == got
    # the next save clears the partial version and succeeds
    save(path, 3.0)
    assert value_of(path) == 3.0
    left = sorted(p.name for p in path.iterdir())
    assert len(left) == 2 and left[0] == "LATEST" and left[1].startswith("v")
