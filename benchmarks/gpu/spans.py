"""Wall-clock spans of hetstore's step machinery, per thread, for one benchmark step.

``record_spans()`` wraps a fixed list of methods (the speculative step on the worker,
its commit, the ordinary unit step, gradient-copy waits, the home refresh) so that each
call appends ``(name, thread, start, end)``; the benchmark marks its own phases with
``mark``. Used by ``offload_step.py --spans FILE`` (written before ``profile_step`` saw
every thread).

``profile_step(step, cuda)``: one step under ``torch.profiler``: the share of its wall
time during which the GPU ran a kernel or a copy (step_table.py's GPU busy column;
``device_busy_fraction`` for offload_step.py), and where the time went, per GPU activity
and per CPU thread (step_table.py's breakdown lines).
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


# a region around the profiled step, telling the caller's thread among the profile's
MAIN_THREAD = "spans: the caller's thread"


def device_busy_fraction(step: Callable[[], T]) -> tuple[float | None, T]:
    """:func:`profile_step` on the GPU: the busy share (None when the profiler failed)
    and what ``step`` returned."""
    busy, _, result = profile_step(step, cuda=True)
    return busy, result


def profile_step(step: Callable[[], T], cuda: bool) -> tuple[float | None, dict, T]:
    """Run ``step()`` once under ``torch.profiler`` (every thread's ops, where this torch
    can: the optimizer's worker and autograd's threads too): the share of its wall time
    during which the GPU ran a kernel or a copy (the union of every device event's
    interval: streams overlap; None without ``cuda``), where the time went
    (:func:`breakdown`), and what ``step`` returned. With ``cuda`` the device is
    synchronized before and at the end of the step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # (torch's option, experimental: absent in older releases)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        options = {"experimental_config": config}
    except (AttributeError, TypeError):
        options = {}
    if cuda:
        torch.cuda.synchronize()
    prof, failed = None, ""
    for kwargs in (options, {}):  # (the experimental option refused: without it)
        try:
            prof = profile(activities=activities, **kwargs)
            prof.start()
            break
        except Exception as exc:  # noqa: BLE001 - the step runs unprofiled, and says why
            prof, failed = None, f"{type(exc).__name__}: {exc}"[:200]
    if prof is None:
        start = time.perf_counter()
        result = step()
        if cuda:
            torch.cuda.synchronize()
        return None, {"wall ms": (time.perf_counter() - start) * 1e3, "error": failed}, result
    try:
        with record_function(MAIN_THREAD):  # (tells the caller's thread in the events)
            start = time.perf_counter()
            result: Any = step()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        try:
            prof.stop()
            events = list(prof.events())
        except Exception as exc:  # noqa: BLE001 - the step ran: keep it, say why no profile
            events, failed = None, f"{type(exc).__name__}: {exc}"[:200]
    if events is None:
        return None, {"wall ms": wall * 1e3, "error": failed}, result
    busy = None
    if cuda:
        intervals = sorted(
            (e.time_range.start, e.time_range.end)
            for e in events
            # (a labelled region's GPU-side span, gpu_user_annotation, covers idle gaps too)
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
        )
        total, open_start, open_end = 0.0, None, None
        for s, e in intervals:
            if open_end is None or s > open_end:
                if open_end is not None:
                    total += open_end - open_start
                open_start, open_end = s, e
            else:
                open_end = max(open_end, e)
        if open_end is not None:
            total += open_end - open_start
        busy = total / 1e6 / wall
    return busy, breakdown(events, wall), result


def breakdown(events, wall: float, top: int = 4) -> dict:
    """Where one profiled step's time went, in ms: the GPU's kernels and its copies each
    way (summed over streams), and per CPU thread (the caller's first) the time its ops
    ran (their self time) and its ``top`` ops by that."""
    device = {"kernels": 0.0, "copies to device": 0.0, "copies to host": 0.0}
    threads: dict[int, dict[str, float]] = {}
    main = None
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False):
                continue
            kind = (
                "copies to device"
                if "HtoD" in e.name
                else "copies to host"
                if "DtoH" in e.name
                else "kernels"
            )
            device[kind] += (e.time_range.end - e.time_range.start) / 1e3
            continue
        if e.name == MAIN_THREAD:
            main = e.thread
            continue
        ops = threads.setdefault(e.thread, {})
        ops[e.name] = ops.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    # (threads whose ops took under 0.05 ms: the profiler's own, idle pools)
    busy = [t for t in threads if t == main or sum(threads[t].values()) >= 0.05]
    order = sorted(busy, key=lambda t: (t != main, -sum(threads[t].values())))
    return {
        "wall ms": wall * 1e3,
        **{f"GPU {kind} ms": ms for kind, ms in device.items()},
        "threads": [
            {
                "thread": "caller" if t == main else f"thread {k}",
                "ops ms": sum(threads[t].values()),
                "top": sorted(threads[t].items(), key=lambda kv: -kv[1])[:top],
            }
            for k, t in enumerate(order)
        ],
    }


def breakdown_line(b: dict) -> str:
    """One line of :func:`breakdown`'s figures."""
    if "error" in b:
        return f"wall {b['wall ms']:.1f}; no profile ({b['error']})"
    threads = "; ".join(
        f"{t['thread']} ops {t['ops ms']:.1f} ("
        + ", ".join(f"{name} {ms:.1f}" for name, ms in t["top"])
        + ")"
        for t in b["threads"]
    )
    gpu = [b["GPU kernels ms"], b["GPU copies to device ms"], b["GPU copies to host ms"]]
    if not any(gpu):  # (a CPU run)
        return f"wall {b['wall ms']:.1f}; {threads}"
    return (
        f"wall {b['wall ms']:.1f}; GPU kernels {gpu[0]:.1f}, to device {gpu[1]:.1f}, "
        f"to host {gpu[2]:.1f}; {threads}"
    )
