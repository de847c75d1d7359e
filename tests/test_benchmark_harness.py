"""The benchmarks' harnesses run (at a tiny size) and print their tables; their timings
are not asserted here (benchmarks measure speed, tests do not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_planner_benchmark_prints_predictions_and_measurements(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "planner.py"), "--tiny", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "predicted (calibrated)" in done.stdout
    for model in ("gpt", "llama"):
        for budget in ("100%", "50%", "20%", "20%, host 100%"):
            assert f"| {model} | {budget} | device |" in done.stdout
            assert f"| {model} | {budget} | " in done.stdout.split("| model | budget |")[0]


def test_checkpoint_benchmark_prints_its_table(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "checkpoint.py"),
            "--tiny",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("hetstore.save", "hetstore.load", "hetstore.export_weights", "dcp.save"):
        assert f"| {row}" in out.stdout, out.stdout
    assert not list(tmp_path.iterdir())  # its files are removed


def test_distributed_benchmark_prints_its_table(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "distributed.py"),
            "--tiny",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for placement in ("cpu", "disk"):
        for ranks in (1, 2):
            assert f"| {placement} | {ranks} |" in out.stdout


def test_largest_model_benchmark_prints_its_table(tmp_path):
    """The ≥ 6.5B run's harness at a tiny size, everything on disk and with the
    planner's own placement (which prints its predicted peaks)."""
    for extra in ([], ["--auto"]):
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "benchmarks" / "largest_model.py"),
                "--tiny",
                "--dir",
                str(tmp_path),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert "| step | loss | step s |" in done.stdout
        assert "B/param" in done.stdout
        if extra:
            assert "planner predicted peaks" in done.stdout
