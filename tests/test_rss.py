"""The promise of disk offload, measured from outside: a model whose training states do
not fit in host memory trains with a small, bounded resident set."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent


def test_3gib_of_states_train_from_disk_under_1_2gib_rss(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tests.rss_probe", str(tmp_path), "17", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    states, rss = result["states_bytes"], result["peak_rss"]
    print(f"\nfp32 training states {states / GiB:.2f} GiB, peak RSS {rss / GiB:.2f} GiB")
    assert states >= 3 * GiB
    assert rss < 1.2 * GiB
    assert result["device_peak"] <= 256 * 2**20
    assert result["disk_peak"] >= states * 0.9  # the states really are on disk
    losses = result["losses"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
