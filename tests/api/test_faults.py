"""Real disk faults: an ext4 file system (a loop-mounted image) shut down with
``EXT4_IOC_SHUTDOWN`` under a running job, as a disk that dies does. Each test asserts
the error type, that the message names the failing file system, that the error comes
in bounded time (no hang), and that what was saved before still loads and resumes bit
for bit. Needs root (loop mounts): skipped with the reason otherwise.

Other real injections live beside the code they test: a full tmpfs (test_disk_offload,
test_disk_tier), SIGKILL mid-save (test_checkpoint, test_checkpoint_files), a killed rank
(test_distributed), a second user racing on a shared root (test_offload_root_security).
"""

from __future__ import annotations

import errno
import time

import pytest
import torch

import hetstore
from hetstore.demo.gpt import GPT
from tests.disk_helpers import disk_config, ext4_loop, train_steps

SHAPE = dict(vocab=128, width=32, depth=2, heads=2, ctx=8)
BOUND_S = 30  # an error, not a hang: far above the few milliseconds a step takes here


def _fresh(offload_path):
    torch.manual_seed(0)
    model = GPT(**SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return hetstore.offload(model, optimizer, disk_config(offload_path))


BATCHES = [
    torch.randint(
        0, SHAPE["vocab"], (2, SHAPE["ctx"] + 1), generator=torch.Generator().manual_seed(i)
    )
    for i in range(4)
]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Losses of steps 3-4 and the final weights of a run no fault touched."""
    model, optimizer = _fresh(tmp_path_factory.mktemp("reference"))
    train_steps(model, optimizer, BATCHES[:2])
    losses = train_steps(model, optimizer, BATCHES[2:])
    weights = _weights(model)
    hetstore.release(model)
    return losses, weights


def _resume_matches(checkpoint, offload_path, uninterrupted) -> None:
    model, optimizer = _fresh(offload_path)
    hetstore.load(checkpoint, model, optimizer)
    losses, weights = uninterrupted
    assert train_steps(model, optimizer, BATCHES[2:]) == losses  # bit for bit
    for name, value in _weights(model).items():
        assert torch.equal(value, weights[name]), name
    hetstore.release(model)


def _one_step_past_a_save(offload_path, checkpoint):
    """A model trained two steps, saved to ``checkpoint``, then stepped once more."""
    model, optimizer = _fresh(offload_path)
    train_steps(model, optimizer, BATCHES[:2])
    hetstore.save(checkpoint, model, optimizer)
    train_steps(model, optimizer, BATCHES[2:3])
    return model, optimizer


def _raises_in_time(kinds, call):
    start = time.monotonic()
    with pytest.raises(kinds) as info:
        call()
    assert time.monotonic() - start < BOUND_S
    return info.value


def test_the_offload_disk_dying_mid_training_is_a_disk_io_error(tmp_path, uninterrupted):
    checkpoint = tmp_path / "ckpt"  # on a healthy disk
    with ext4_loop(tmp_path) as fs:
        model, optimizer = _fresh(fs.mnt / "offload")
        train_steps(model, optimizer, BATCHES[:2])
        hetstore.save(checkpoint, model, optimizer)
        fs.shutdown()
        error = _raises_in_time(
            hetstore.DiskIOError, lambda: train_steps(model, optimizer, BATCHES[2:3])
        )
        assert error.errno == errno.EIO
        assert str(fs.mnt) in str(error) and str(fs.mnt) in error.path
        assert "I/O error" in str(error)
        hetstore.release(model)  # on a dead disk: frees what it can, raises nothing
    _resume_matches(checkpoint, tmp_path / "offload-2", uninterrupted)


def test_the_checkpoint_disk_dying_during_a_save_keeps_the_previous_checkpoint(
    tmp_path, uninterrupted
):
    with ext4_loop(tmp_path) as fs:
        checkpoint = fs.mnt / "ckpt"
        model, optimizer = _one_step_past_a_save(tmp_path / "offload", checkpoint)
        fs.shutdown()
        error = _raises_in_time(
            (hetstore.DiskIOError, hetstore.CheckpointError),
            lambda: hetstore.save(checkpoint, model, optimizer),
        )
        assert str(checkpoint) in str(error)
        hetstore.release(model)
        fs.remount()  # as after a reboot: the journal replayed
        _resume_matches(checkpoint, tmp_path / "offload-2", uninterrupted)


def test_the_offload_disk_dying_during_a_save_is_named_as_the_failing_side(tmp_path, uninterrupted):
    checkpoint = tmp_path / "ckpt"  # on a healthy disk
    with ext4_loop(tmp_path) as fs:
        model, optimizer = _one_step_past_a_save(fs.mnt / "offload", checkpoint)
        fs.shutdown()
        error = _raises_in_time(
            (hetstore.DiskIOError, hetstore.CheckpointError),
            lambda: hetstore.save(checkpoint, model, optimizer),
        )
        message = str(error)
        # the offload disk is what failed, read from; the checkpoint disk is healthy
        assert str(fs.mnt) in message and "read" in message.lower(), message
        hetstore.release(model)
    _resume_matches(checkpoint, tmp_path / "offload-2", uninterrupted)
