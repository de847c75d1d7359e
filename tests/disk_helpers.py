"""Helpers shared by the disk-tier tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess

import pytest
import torch

import hetstore


def disk_config(offload_path) -> hetstore.OffloadConfig:
    """Everything on disk under ``offload_path``, on the CPU device."""
    return hetstore.OffloadConfig(
        offload_param="disk",
        offload_optimizer="disk",
        offload_path=str(offload_path),
        enable_pinned_mem=False,
        device="cpu",
    )


def train_steps(model, optimizer, batches) -> list[float]:
    """One step per batch of token ids (inputs and next-token targets); the losses."""
    losses = []
    for idx in batches:
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def mount_tmpfs(mnt, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``mnt`` (needs root); return why not, or None."""
    if shutil.which("mount") is None:
        return "no mount command"
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    )
    return None if res.returncode == 0 else res.stderr.decode().strip() or "mount failed"


@contextlib.contextmanager
def small_tmpfs(parent, size: str):
    """A tmpfs of ``size`` mounted under ``parent``, unmounted after; skips the test where
    mounting is refused (it needs root)."""
    mnt = parent / "small"
    mnt.mkdir()
    why_not = mount_tmpfs(mnt, size)
    if why_not:
        pytest.skip(f"cannot mount a tmpfs here: {why_not}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# EXT4_IOC_SHUTDOWN = _IOR('X', 125, __u32); NOLOGFLUSH: the file system stops at once,
# as a disk that died would (every later IO on it fails with EIO)
_EXT4_IOC_SHUTDOWN = 0x8004587D
_EXT4_GOING_FLAGS_NOLOGFLUSH = 2


class Ext4Loop:
    """A real ext4 file system in an image file, loop-mounted at ``mnt`` (needs root):
    ``shutdown()`` makes every IO on it fail with EIO; ``remount()`` brings it back as
    after a reboot (the journal replayed: what was fsynced before is there)."""

    def __init__(self, image, mnt, size: str):
        self.image, self.mnt = image, mnt
        subprocess.run(["truncate", "-s", size, str(image)], check=True)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
        if made.returncode:
            pytest.skip(f"cannot make an ext4 image: {made.stderr.decode().strip()}")
        mnt.mkdir()
        self._mount()

    def _mount(self) -> None:
        res = subprocess.run(
            ["mount", "-o", "loop", str(self.image), str(self.mnt)], capture_output=True
        )
        if res.returncode:
            pytest.skip(f"cannot loop-mount ext4 here (needs root): {res.stderr.decode().strip()}")

    def shutdown(self) -> None:
        import fcntl
        import os
        import struct

        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def remount(self) -> None:
        subprocess.run(["umount", str(self.mnt)], check=True)
        self._mount()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mnt)], check=False)


@contextlib.contextmanager
def ext4_loop(parent, size: str = "128M"):
    """An :class:`Ext4Loop` under ``parent``, unmounted after; skips without root,
    ``mkfs.ext4`` or loop devices."""
    for tool in ("mkfs.ext4", "mount", "umount", "truncate"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} command")
    fs = Ext4Loop(parent / "ext4.img", parent / "ext4", size)
    try:
        yield fs
    finally:
        fs.close()
