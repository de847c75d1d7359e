"""Shared helpers for the CPU benchmarks (``optimizer_step.py``, ``train_step.py``).

The machines these run on are shared and noisy (2x between runs), so every benchmark
measures hetstore and its references in the same run, interleaved round by round, and
reports medians and ratios rather than absolute figures.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch

import hetstore
from hetstore._sizes import format_size

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
BENCH_VENV = REPO / ".bench-venv"
BENCH_PYTHON = BENCH_VENV / "bin" / "python"
# DeepSpeed JIT-builds its ops on first use; keeping them here makes the second run fast.
TORCH_EXTENSIONS_DIR = BENCH_VENV / "torch_extensions"

_SUFFIXES = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}


def parse_count(text: str) -> int:
    """'100M' -> 100_000_000; '1.5G' -> 1_500_000_000; plain integers pass through."""
    text = text.strip().upper()
    if text and text[-1] in _SUFFIXES:
        return int(float(text[:-1]) * _SUFFIXES[text[-1]])
    return int(text)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line() -> str:
    """One line saying what the numbers were measured on (the GPU first, where there is one)."""
    gpu = f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    return (
        f"{gpu}{os.cpu_count()} vCPU {cpu_name()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, Python {platform.python_version()}"
    )


def peak_rss_bytes() -> int:
    # VmHWM: this process's own peak (ru_maxrss would start at its parent's)
    return hetstore.peak_rss()


def interleaved(
    variants: dict[str, Callable[[], T]], repeats: int, settle: float = 0.05
) -> dict[str, list[T]]:
    """Run every variant once per round, ``repeats`` rounds; return each one's samples
    (what it returned: its seconds, or a tuple of several).

    Each round runs the variants in a fresh random order (seeded, so runs are
    comparable): a fixed or merely rotated order would always put the same variant right
    after the same neighbour and charge it that neighbour's after-effects. Before every
    sample we sleep ``settle`` seconds: OpenMP worker threads keep spinning for a while
    after a parallel region, and a worker *process* (DeepSpeed's) that just finished
    would otherwise steal one of the two cores from whoever runs next.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            time.sleep(settle)
            samples[name].append(variants[name]())
    return samples


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    """'[min..max]' of the samples, to show how noisy a median is."""
    return f"[{min(values):.3g}..{max(values):.3g}]"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-markdown table, so output can be pasted into docs/dev/BENCHMARKS.md as is."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def size(nbytes: int | float | None) -> str:
    """Bytes in binary units ('1.52 GiB'), '-' when there is nothing to report."""
    return "-" if nbytes is None else format_size(int(nbytes))


# ------------------------------------------------------------ one process per variant
def reply(message: dict[str, Any]) -> None:
    """Worker side: answer the driver with one JSON line."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Worker:
    """Driver side: one variant's process (``python *argv``); requests are answered in
    order, one JSON line each. ``ready`` is the worker's first message."""

    def __init__(self, variant: str, argv: list[str]):
        self.variant = variant
        self.proc = subprocess.Popen(
            [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.ready = self.request(None)

    def request(self, command: dict[str, Any] | None) -> dict[str, Any]:
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.variant!r} worker exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=300)


# ---------------------------------------------------------------- lockstep training runs
SETTLE_S = 0.05  # pause before each timed step: the other workers' OpenMP threads spin down


def start_worker(script: str, variant: str, argv: list[str]) -> Worker:
    """Start ``script --worker variant`` with ``argv``; its ready message carries
    ``params`` (and ``build_s``, the model set-up time)."""
    worker = Worker(variant, [script, *argv, "--worker", variant])
    worker.params = worker.ready["params"]
    worker.build_s = worker.ready.get("build_s")
    return worker


def lockstep(
    workers: list[Worker],
    total: int,
    *,
    warmup: int = 0,
    timed_extra: Callable[[], None] | None = None,
    progress: bool = True,
    chain: int = 1,
) -> dict[str, list[dict[str, Any]]]:
    """Step i of every worker (and, in timed rounds, one call of ``timed_extra``), in a
    fresh random order per round with ``SETTLE_S`` before each, then step i + 1. Returns
    each worker's step replies. ``chain`` > 1: a round runs ``chain`` consecutive steps of
    each worker back to back, and the first of them is marked ``after_gap`` (work a worker
    left running after its last step, step_in_forward's, had the other workers' turns
    to finish in; the next steps' forwards overlap it as in a training loop)."""
    results: dict[str, list[dict[str, Any]]] = {w.variant: [] for w in workers}
    order = random.Random(0)
    starts = range(0, total, chain)
    for number, first in enumerate(starts):
        t_round = time.perf_counter()
        steps = range(first, min(first + chain, total))
        jobs: list[Worker | None] = list(workers)
        if timed_extra is not None and steps[-1] >= warmup:
            jobs.append(None)
        for job in order.sample(jobs, len(jobs)):
            time.sleep(SETTLE_S)
            if job is None:
                timed_extra()
                continue
            for step in steps:
                reply = job.request({"op": "step", "step": step})
                reply["after_gap"] = chain > 1 and step == first
                results[job.variant].append(reply)
        if progress:
            kind = "warm-up" if steps[-1] < warmup else "timed"
            print(
                f"# round {number + 1}/{len(starts)} ({kind}) took "
                f"{time.perf_counter() - t_round:.1f} s",
                flush=True,
            )
    return results


def loss_report(
    results: dict[str, list[dict[str, Any]]], *, relative: bool = False, reference: str = "plain"
) -> tuple[str, float]:
    """Each variant's losses against ``reference``'s, step by step: the lines to print
    and the largest (absolute, or relative) difference."""
    ref = [s["loss"] for s in results[reference]]
    lines = [f"losses, step 0 -> {len(ref) - 1}: {reference} {ref[0]:.6f} -> {ref[-1]:.6f}"]
    worst = 0.0
    kind = "relative" if relative else "absolute"
    for variant, steps in results.items():
        if variant == reference:
            continue
        losses = [s["loss"] for s in steps]
        diff = max(
            abs(a - b) / abs(b) if relative else abs(a - b)
            for a, b in zip(losses, ref, strict=True)
        )
        worst = max(worst, diff)
        lines.append(
            f"  {variant}: {losses[0]:.6f} -> {losses[-1]:.6f}; "
            f"max {kind} difference from {reference} = {diff:.2e}"
        )
    return "\n".join(lines), worst


# ------------------------------------------------------------- results for the docs
RESULTS = REPO / "benchmarks" / "results"
RESULT_SCHEMA = "hetstore-result/1"  # what tools/perf_page.py reads


def git_commit() -> str:
    """The checkout's short commit, with '+' when tracked files differ from it; or
    ``$GIT_COMMIT`` where set (a copy on a lent machine, whose .git, if any, may be
    another commit's)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def bench_command(script: str, argv: Sequence[str]) -> str:
    """The command line that reproduces a run: ``script`` with ``argv`` less ``--json``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            kept.append(arg)
    return shlex.join([".venv/bin/python", script, *kept])


def record_json(
    path: str | Path,
    *,
    scenario: str,
    rows: Sequence[dict[str, Any]],
    command: str,
    machine: str,
    commit: str | None = None,
    date: str | None = None,
    notes: Iterable[str] = (),
    source: str | None = None,
    provenance: str | None = None,
) -> Path:
    """Write a result record, the file docs/performance.md is generated from.

    ``rows``: one dict per measured configuration, each with a ``config`` string naming
    it (a later record with the same scenario and config replaces the row on the page)
    and the scenario's figures, under the keys ``tools/perf_page.py``'s columns read.
    ``commit`` defaults to the checkout's (``git_commit``), ``date`` to now in UTC
    (``YYYY-MM-DDTHH:MM``). Then run ``.venv/bin/python tools/perf_page.py``.
    """
    rows = [dict(row) for row in rows]
    if not rows or any(not row.get("config") for row in rows):
        raise ValueError("every row needs a 'config' naming the configuration it measured")
    record = {
        "schema": RESULT_SCHEMA,
        "scenario": scenario,
        "date": date or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M"),
        "machine": machine,
        "commit": commit or git_commit(),
        "command": command,
        "source": source,
        "provenance": provenance
        or "written by the benchmark itself (benchmarks/_common.record_json)",
        "notes": list(notes),
        "rows": rows,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path
