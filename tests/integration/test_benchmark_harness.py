"""The benchmarks' harnesses run (at a tiny size) and print their tables; their timings
are not asserted here (benchmarks measure speed, tests do not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_tiny(script: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """``benchmarks/<script> --tiny --dir <tmp_path> [extra]``, its output captured."""
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / script),
            "--tiny",
            "--dir",
            str(tmp_path),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_planner_benchmark_prints_predictions_and_measurements(tmp_path):
    done = run_tiny("planner.py", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "predicted (calibrated)" in done.stdout
    for model in ("gpt", "llama"):
        for budget in ("100%", "50%", "20%", "20%, host 100%"):
            assert f"| {model} | {budget} | device |" in done.stdout
            assert f"| {model} | {budget} | " in done.stdout.split("| model | budget |")[0]
    # the peak RSS table (--tiny: one budget per model, each trained in its own process)
    rss = done.stdout.split("| measured peak RSS |")[1]
    for model in ("gpt", "llama"):
        row = next(line for line in rss.splitlines() if line.startswith(f"| {model} | 20%, host"))
        float(row.strip(" |").split(" | ")[-1])  # a ratio, not a failed child's "-"


def test_evict_restore_benchmark_prints_its_table(tmp_path):
    out = run_tiny("evict_restore.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("| evict | copy out |", "| restore | copy in |", "| restore | alloc + copy in |"):
        assert row in out.stdout, out.stdout


def test_checkpoint_benchmark_prints_its_table(tmp_path):
    out = run_tiny("checkpoint.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("hetstore.save", "hetstore.load", "hetstore.export_weights", "dcp.save"):
        assert f"| {row}" in out.stdout, out.stdout
    assert not list(tmp_path.iterdir())  # its files are removed


def test_distributed_benchmark_prints_its_table(tmp_path):
    out = run_tiny("distributed.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for placement in ("cpu", "disk"):
        for ranks in (1, 2):
            assert f"| {placement} | {ranks} |" in out.stdout


def test_largest_model_benchmark_prints_its_table(tmp_path):
    """The ≥ 6.5B run's harness at a tiny size, everything on disk and with the
    planner's own placement (which prints its predicted peaks)."""
    for extra in ([], ["--auto"]):
        done = run_tiny("largest_model.py", tmp_path, *extra)
        assert done.returncode == 0, done.stderr
        assert "| step | loss | step s |" in done.stdout
        assert "B/param" in done.stdout
        if extra:
            assert "planner predicted peaks" in done.stdout


def test_largest_model_benchmark_trains_a_hugging_face_config(tmp_path):
    """``--hf-config``: the 7B Llama config shrunk to a few MB (width, heads, vocab) and
    2 layers; every layer is stepped inside backward."""
    import json

    values = json.loads((REPO / "benchmarks" / "configs" / "llama7b.json").read_text())
    values.update(
        hidden_size=128,
        intermediate_size=344,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(values))
    done = run_tiny("largest_model.py", tmp_path, "--hf-config", str(config), "--layers", "2")
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM" in done.stdout and "2 layers" in done.stdout
    assert "'not_started': 0" in done.stdout


def test_disk_offload_benchmark_prints_its_table_with_the_traffic_floor(tmp_path):
    variants = "plain (+ disk traffic),disk (defaults)"
    out = run_tiny("disk_offload.py", tmp_path, "--no-fio", "--clip", "1.0", "--variants", variants)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("plain", "plain (+ disk traffic)", "disk (defaults)"):
        assert f"| {row} | " in out.stdout, out.stdout
    assert "written from the forward's start" in out.stdout  # the bytes it moves a phase
    assert not list(tmp_path.iterdir())  # the offload path and the traffic file are removed


def test_overlap_trial_benchmark_prints_its_table(tmp_path):
    done = run_tiny("overlap_trial.py", tmp_path, "--cases", "disk (defaults)")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| disk (defaults) |")]
    assert [row.split(" | ")[1] for row in rows] == ["no overlap", "overlap, no trial", "auto"]
    # every way is exact: the same losses as without overlap, step by step
    assert all(row.rstrip(" |").endswith("| 0.0e+00") for row in rows)
    assert "'overlap_trials': 1" in done.stdout  # (auto's stats: the tiny trial ran)
    assert not list(tmp_path.iterdir())  # each run's offload directory is gone


def test_hook_overhead_benchmark_prints_its_table(tmp_path):
    out = tmp_path / "table.txt"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "hook_overhead.py"),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for runner in ("plain", "host", "states on host"):
        assert f"| {runner} |" in done.stdout, done.stdout
    assert out.read_text() == done.stdout
