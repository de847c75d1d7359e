"""Helpers shared by the disk-tier tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess

import pytest
import torch


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
