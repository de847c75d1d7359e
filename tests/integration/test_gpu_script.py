"""benchmarks/gpu/step_table.py, the GPU machine's one table, in its CPU smoke mode: every
row is there, and every plain and hetstore row was measured (a finite ratio to plain).
Timings are not asserted (benchmarks measure speed, tests do not); the GPU run itself is
benchmarks/gpu/run_all.sh on a lent machine."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RUNNERS = (
    "plain",
    "hetstore host",
    "hetstore host no-overlap",
    "hetstore host step_in_backward",
    "hetstore states on host",
    "hetstore disk",
    "fsdp2 cpu-offload",
    "torchao cpu-offload",
)
ROW = re.compile(r"^\| (gpt|llama) [^|]+ \| (\d+x\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|")


def test_smoke_run_prints_every_row_against_plain(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SMOKE", None)
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu" / "step_table.py"),
            "--smoke",
            "--out",
            str(tmp_path / "parts"),
            "--offload-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("| model | tokens/step | runner |")[-1]  # the merged one
    rows = {}
    for line in table.splitlines():
        match = ROW.match(line)
        if match:
            model, tokens, runner, median, ratio = (g.strip() for g in match.groups())
            rows[model, tokens, runner] = (median, ratio)
    for model in ("gpt", "llama"):
        for tokens in ("2x16", "4x16"):
            for runner in RUNNERS:
                assert (model, tokens, runner) in rows, (model, tokens, runner, table)
                median, ratio = rows[model, tokens, runner]
                if runner == "plain" or runner.startswith("hetstore"):
                    assert math.isfinite(float(median)), (model, tokens, runner, median)
                    assert math.isfinite(float(ratio)) and float(ratio) > 0, (runner, ratio)
    assert rows["gpt", "2x16", "plain"][1] == "1.00"
    # below it, where each runner's profiled step spent its time, per CPU thread: the
    # caller's, and for the disk row the optimizer's worker, stepping units in backward
    profiled = {}  # (model, tokens, runner) -> its line
    for line in done.stdout.split("where each profiled step's time went")[-1].splitlines():
        match = re.match(r"# (gpt|llama) \S+ (\d+x\d+) ([^:]+): ", line)
        if match:
            profiled[match.groups()] = line
    for model in ("gpt", "llama"):
        for runner in ("plain", "hetstore host", "hetstore disk"):
            line = profiled[model, "2x16", runner]
            assert re.search(r"caller ops \d+\.\d", line), line
    # before each shape's timed rounds the disk row ran its overlap trial alone, and
    # where it kept the overlap, its profiled step shows the worker's AdamW
    kept = re.findall(
        r"# (gpt|llama) \S+: (\d+x\d+): hetstore disk: overlap trial kept (.+) \(", done.stdout
    )
    assert len(kept) == 4, done.stdout[-3000:]
    for model, tokens, way in kept:
        if way == "overlap":
            disk = profiled[model, tokens, "hetstore disk"]
            assert re.search(r"thread \d+ ops [\d.]+ \([^)]*(?i:adamw)", disk), disk
    # the CPU has no CUDA for torchao's optimizer: the row says so instead of figures
    torchao = rows["gpt", "2x16", "torchao cpu-offload"][0]
    assert torchao.startswith(("needs CUDA", "unavailable:")), torchao
    # the disk tier's files are gone with the run
    assert not list(tmp_path.glob("hetstore-step-table-*"))


def test_the_profiled_step_sees_a_worker_threads_ops():
    """spans.profile_step records every thread's ops (the optimizer's worker's, as on a
    GPU): a step that hands a matrix product to a worker thread shows it there."""
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import spans
    finally:
        sys.path.pop(0)
    worker = ThreadPoolExecutor(1)
    a = torch.randn(256, 256)
    worker.submit(torch.mm, a, a).result()  # (the thread exists before the profile)

    def step():
        return worker.submit(lambda: [torch.mm(a, a) for _ in range(20)]).result()

    _, breakdown, result = spans.profile_step(step, cuda=False)
    worker.shutdown()
    assert len(result) == 20
    others = [t for t in breakdown["threads"] if t["thread"] != "caller"]
    assert any(name == "aten::mm" for t in others for name, _ in t["top"]), breakdown


def test_smoke_run_leaves_a_slow_runner_out_of_the_later_shapes(tmp_path):
    """``--slow-s``: a runner whose step took longer at the first shape is not run at
    the next, and its row says why; plain, every row's reference, always runs."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu" / "step_table.py"),
            "--smoke",
            "--slow-s",
            "1e-9",
            "--offload-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "SMOKE"},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("| model | tokens/step | runner |")[-1]
    rows = {}
    for line in table.splitlines():
        match = ROW.match(line)
        if match:
            model, tokens, runner, median, _ = (g.strip() for g in match.groups())
            rows[model, tokens, runner] = median
    assert math.isfinite(float(rows["gpt", "4x16", "plain"]))
    assert math.isfinite(float(rows["gpt", "2x16", "hetstore disk"]))
    assert rows["gpt", "4x16", "hetstore disk"].startswith("not run: its 2x16 step took")


def test_the_host_probe_times_each_piece_of_a_host_units_step():
    """benchmarks/gpu/host_probe.py (run_all.sh's first timing) on this machine's CPU: the
    step and the home's cast each on both threads, every figure a positive time (the
    copies to and from the device appear only where CUDA is there)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu/host_probe.py", "--numel", "1000000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+) \|$", done.stdout, re.MULTILINE))
    for piece in ("fused AdamW step", "cast of the master into the bf16 home"):
        for thread in ("main thread", "worker thread"):
            assert float(rows[f"{piece}, {thread}"]) > 0, (piece, thread, done.stdout)
    # what the worker's AdamW costs the feeding thread, by the worker's thread count
    assert float(rows["feeding work alone (500 launches)"]) > 0, done.stdout
    counts = re.findall(r"worker thread with (\d+) intra-op thread", done.stdout)
    assert counts and len(counts) == len(set(counts)), done.stdout
    for count in counts:
        assert float(rows[f"feeding work beside that worker's steps ({count} thread(s))"]) > 0
    assert len(rows) == 4 + 1 + 2 * len(counts), done.stdout
