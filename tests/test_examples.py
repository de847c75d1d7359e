"""Every example runs, at a tiny size, and shows what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_activation_offload_resnet_ooms_without_and_trains_with():
    text = run_example("activation_offload_resnet.py", "--tiny")
    without, with_offload = text.split("== offload_activations='cpu'")
    assert "stopped as expected" in without and "out of device memory" in without
    assert "offload_activations='cpu' would move" in without  # the advice names the fix
    assert "step 0: loss" in with_offload and "step 1: loss" in with_offload
