"""The offload root shared with other users: hetstore's directory and files cannot be
swapped for links, a root others can write without the sticky bit is refused, and
leftover directories that are garbled, hostile or another user's are skipped.

The attack tests run a real second user (``setuid`` in a subprocess): they need root to
switch users and skip with that reason otherwise."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import hetstore
from hetstore import _safefs
from hetstore.demo.gpt import GPT
from hetstore.tiers.disk import DiskTier, reclaim_leftovers
from tests.disk_helpers import disk_config, train_steps

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to a second user (setuid) needs root"
)


def _train(config, steps=2) -> list[float]:
    torch.manual_seed(0)
    model = GPT(vocab=128, width=32, depth=2, heads=2, ctx=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with hetstore.offloaded(model, optimizer, config) as (model, optimizer):
        return train_steps(model, optimizer, (torch.randint(0, 128, (2, 9)) for _ in range(steps)))


def test_a_root_others_can_write_without_the_sticky_bit_is_refused_before_anything(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(hetstore.ConfigError, match="offload_path") as info:
        _train(disk_config(root))
    message = str(info.value)
    assert str(root) in message and "sticky" in message and "chmod +t" in message
    assert list(root.iterdir()) == []  # nothing was created there
    os.chmod(root, 0o1777)  # the fix the message names: as /tmp is
    assert _train(disk_config(root))
    assert list(root.iterdir()) == []


def test_private_files_are_never_created_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    here = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.symlink(victim, tmp_path / "trap")
        with pytest.raises(FileExistsError):
            _safefs.create_private_file(here, "trap", os.O_WRONLY)
        with pytest.raises(FileExistsError):
            _safefs.make_private_dir(here, "trap", str(tmp_path / "trap"))
        os.mkfifo(tmp_path / "fifo")
        start = time.monotonic()
        with pytest.raises(ValueError, match="not a regular file"):
            _safefs.read_small_file(here, "fifo", 1024)  # no hang on a FIFO
        with pytest.raises(OSError):
            _safefs.read_small_file(here, "trap", 1024)  # no reading through a link
        assert time.monotonic() - start < 5
    finally:
        os.close(here)
    assert victim.read_bytes() == b"precious"


def test_garbled_and_hostile_leftovers_are_skipped_with_a_warning(tmp_path, caplog):
    root = tmp_path / "root"
    root.mkdir()
    host = os.uname().nodename
    garbled = {
        f"hetstore-{host}-pid{'9' * 20}-rank0-aaaa": None,  # a pid past every integer type
        f"hetstore-{host}-pid1234567-rank0-bbbb": b'{"pid": 1e400, "hostname": "%s"}'
        % host.encode(),
        f"hetstore-{host}-pid1234568-rank0-cccc": b"\xff\xfe not json",
        f"hetstore-{host}-pid1234569-rank0-dddd": b"[1, 2]",
    }
    for name, owner in garbled.items():
        (root / name).mkdir()
        if owner is not None:
            (root / name / "owner.json").write_bytes(owner)
    fifo_dir = root / f"hetstore-{host}-pid1234570-rank0-eeee"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "owner.json")  # would block a plain open() for ever
    victim = tmp_path / "victim-dir"
    victim.mkdir()
    (victim / "keep").write_bytes(b"x")
    os.symlink(victim, root / f"hetstore-{host}-pid1234571-rank0-ffff")  # a dead "owner"
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hetstore.tiers.disk"):
        tier = DiskTier(root=root, capacity="16MB")
    assert time.monotonic() - start < 10
    try:
        region = tier.allocate(4096, "probe")
        tier.write(region, torch.arange(1024, dtype=torch.int32)).wait()
    finally:
        tier.close()
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    for name in [*garbled, fifo_dir.name]:
        assert any(name in m for m in skipped), (name, skipped)
    assert (victim / "keep").read_bytes() == b"x"  # a link is never followed or removed
    assert os.path.islink(root / f"hetstore-{host}-pid1234571-rank0-ffff")


@needs_root
def test_another_users_leftover_is_never_removed(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o1777)
    os.chmod(root, 0o1777)
    host = os.uname().nodename
    theirs = root / f"hetstore-{host}-pid999999-rank0-abcd"  # a dead pid: ours would go
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    mine = root / f"hetstore-{host}-pid999998-rank0-abce"
    mine.mkdir()
    assert reclaim_leftovers(root) == (1, 0)
    assert theirs.exists() and not mine.exists()


ATTACKER = textwrap.dedent(
    """
    import os, signal, sys
    os.setgid({uid}); os.setuid({uid})
    root, victim = sys.argv[1], sys.argv[2]
    counts = [0, 0]  # tries, wins

    def attack():
        while True:
            for name in os.listdir(root):
                if not name.startswith("hetstore-") or name.endswith(".moved"):
                    continue
                path = os.path.join(root, name)
                counts[0] += 1
                try:  # swap hetstore's directory for a link to the victim's
                    os.rename(path, path + ".moved")
                    os.symlink(victim, path)
                    counts[1] += 1
                except OSError:
                    pass
                try:  # or plant a link among its files
                    os.symlink(os.path.join(victim, "target"), os.path.join(path, "r000001.bin"))
                    counts[1] += 1
                except OSError:
                    pass

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    try:
        attack()
    finally:
        print(*counts, flush=True)
    """
)


@needs_root
def test_a_second_user_cannot_redirect_training_writes(tmp_path):
    """A shared root with the sticky bit (how /tmp and /scratch are): another user races
    to swap hetstore's directory and files for links to the training user's files."""
    shared = tempfile.mkdtemp(prefix="hetstore-shared-")  # in /tmp: the second user reaches it
    os.chmod(shared, 0o1777)
    root = pathlib.Path(shared)
    victim = tmp_path / "home"
    victim.mkdir()
    target = victim / "target"
    target.write_bytes(b"the training user's file")
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER.format(uid=NOBODY), str(root), str(victim)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)  # the attacker is looping before the first directory appears
        reference = _train(disk_config(tmp_path / "alone"))
        assert _train(disk_config(root)) == reference  # trained exactly, undisturbed
        assert [n for n in os.listdir(root) if not n.endswith(".moved")] == []  # cleaned up
    finally:
        attacker.terminate()
        out, _ = attacker.communicate(timeout=30)
        shutil.rmtree(shared, ignore_errors=True)
    assert target.read_bytes() == b"the training user's file"
    assert sorted(os.listdir(victim)) == ["target"]
    tries, wins = map(int, out.split())
    assert tries > 0 and wins == 0, (tries, wins)  # it saw hetstore's directory, and lost


def test_checkpoint_and_export_directories_get_the_same_care(tmp_path):
    torch.manual_seed(0)
    model = GPT(vocab=128, width=32, depth=2, heads=2, ctx=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = hetstore.offload(model, optimizer, disk_config(tmp_path / "offload"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for call in (
        lambda: hetstore.save(shared, model, optimizer),
        lambda: hetstore.export_weights(shared, model),
    ):
        with pytest.raises(hetstore.ConfigError, match="sticky") as info:
            call()
        assert str(shared) in str(info.value)
        assert list(shared.iterdir()) == []
    # with the sticky bit it is accepted; links planted at the names a save and an export
    # write through first are never followed
    os.chmod(shared, 0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for name in (f".LATEST.{os.getpid()}", f".model.safetensors.tmp-{os.getpid()}"):
        os.symlink(victim, shared / name)
    hetstore.save(shared, model, optimizer)
    hetstore.export_weights(shared, model)
    assert victim.read_bytes() == b"precious"
    assert (shared / "model.safetensors").is_file() and not (shared / "LATEST").is_symlink()
    hetstore.release(model)
