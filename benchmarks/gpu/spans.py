"""Wall-clock spans of hetstore's step machinery, per thread, for one benchmark step.

``record_spans()`` wraps a fixed list of methods (the speculative step on the worker,
its commit, the ordinary unit step, gradient-copy waits, the home refresh) so that each
call appends ``(name, thread, start, end)``; the benchmark marks its own phases with
``mark``. Used by ``offload_step.py --spans FILE`` to tell where an overlapped step's
time goes on a GPU machine, where a profiler of CPU threads is not at hand.

``device_busy_fraction(step)``: the share of one step's wall time during which the GPU
ran a kernel or a copy, from ``torch.profiler`` (offload_step.py's and step_table.py's
GPU busy column).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hetstore.optim import borrowed, in_forward, step_ahead
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.offloaded import OffloadedOptimizer
from hetstore.runtime import grad_sink, staging
from hetstore.runtime.unit import Unit

T = TypeVar("T")

WRAPPED = [
    (InMemoryUnitStep, "step"),
    (step_ahead.StepAhead, "settle"),
    (step_ahead.StepAhead, "grads_final"),
    (OffloadedOptimizer, "step"),
    (Unit, "refresh_after_step"),
    (grad_sink.GradSink, "wait_copies"),
    (in_forward.ForwardSteps, "_run"),
    (in_forward.ForwardSteps, "land"),
    (step_ahead.StepAhead, "_start_read_ahead"),
    (borrowed, "_read_into"),
    (staging.ParamStager, "take"),
    (staging.ParamStager, "lend"),
    (Unit, "fetch"),
    (Unit, "wait_ready"),
]


class Spans:
    def __init__(self):
        self.records: list[tuple[str, str, float, float]] = []
        self.origin = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter() - self.origin
        self.records.append((name, "mark", now, now))


@contextlib.contextmanager
def record_spans():
    spans = Spans()
    saved = []
    for owner, name in WRAPPED:
        original = getattr(owner, name)
        saved.append((owner, name, original))

        label = f"{getattr(owner, '__name__', '?').rsplit('.', 1)[-1]}.{name}"
        setattr(owner, name, _timed(original, label, spans))
    try:
        yield spans
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _timed(original, label: str, spans: Spans):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter() - spans.origin
        try:
            return original(*args, **kwargs)
        finally:
            end = time.perf_counter() - spans.origin
            spans.records.append((label, threading.current_thread().name, start, end))

    return wrapper


def summary(spans: Spans) -> list[str]:
    """Per method and thread: calls, total seconds, and the last end."""
    rows: dict[tuple[str, str], list[float]] = {}
    for name, thread, start, end in spans.records:
        row = rows.setdefault((name, thread), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += end - start
        row[2] = max(row[2], end)
    lines = [f"  {'span':44s} {'thread':24s} calls  total s  last end s"]
    for (name, thread), (calls, total, last) in sorted(rows.items(), key=lambda r: r[1][2]):
        lines.append(f"  {name:44s} {thread[:24]:24s} {calls:5d} {total:8.4f} {last:10.4f}")
    return lines


def device_busy_fraction(step: Callable[[], T]) -> tuple[float, T]:
    """Run ``step()`` once under ``torch.profiler``: the share of its wall time during
    which the GPU ran a kernel or a copy (the union of every device event's interval:
    streams overlap), and what ``step`` returned. The device is synchronized before and
    at the end of the step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result: Any = step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        # (a labelled region's GPU-side span, gpu_user_annotation, covers idle gaps too)
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
    )
    busy, open_start, open_end = 0.0, None, None
    for s, e in intervals:
        if open_end is None or s > open_end:
            if open_end is not None:
                busy += open_end - open_start
            open_start, open_end = s, e
        else:
            open_end = max(open_end, e)
    if open_end is not None:
        busy += open_end - open_start
    return busy / 1e6 / wall, result
