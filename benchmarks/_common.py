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
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hetstore._sizes import format_size

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
    """One line saying what the numbers were measured on."""
    return (
        f"{os.cpu_count()} vCPU {cpu_name()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, Python {platform.python_version()}"
    )


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def interleaved(
    variants: dict[str, Callable[[], float]], repeats: int, settle: float = 0.05
) -> dict[str, list[float]]:
    """Run every variant once per round, ``repeats`` rounds; return each one's samples.

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
    """A GitHub-markdown table, so output can be pasted into docs/BENCHMARKS.md as is."""
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
