"""Calibrating a trace with measured steps: the plan's prediction, re-made from the real
model's compute times.

A plan made before any step predicts compute from counted FLOPs and a probed matmul
rate, which can miss by 30% either way on a CPU (the probe's matrix is not the model's,
and a shared machine's rate moves between runs). Once a few steps have run, the
runtime's profiler (:mod:`hetstore.runtime.profiler`) knows each unit's forward and
backward time, and the time the step spends outside the model (the user's loop, data,
``zero_grad``). This module puts those into the trace; transfers and the optimizer step
stay predicted by the cost model, so comparing the calibrated prediction with the
measured step still tests the model of what offloading costs.
"""

from __future__ import annotations

from dataclasses import replace

from hetstore.planner.trace import StepProfile, Trace

__all__ = ["calibrated_trace", "steady_profile"]


def steady_profile(profiles: list[StepProfile]) -> StepProfile:
    """The fastest time of each label over the profiled steps, leaving out the first (a
    warm-up: the allocator, page faults, lazy initialization) when there are more; the
    total is their sum. The fastest, as the machine probes take it (planner.machine
    ``fastest_rate``): other load on a shared machine only adds time to a step, and with two
    steady steps a median is their mean, half of a disturbed step's delay."""
    steady = profiles[1:] if len(profiles) > 1 else profiles
    if not steady:
        raise ValueError("no profiled step")
    labels = {label for p in steady for label in p.seconds}
    seconds = {label: min(p.seconds.get(label, 0.0) for p in steady) for label in labels}
    return StepProfile(seconds=seconds, total_s=sum(seconds.values()))


def calibrated_trace(trace: Trace, profile: StepProfile) -> Trace:
    """``trace`` with each unit's compute time and the step's overhead as measured."""
    units = tuple(
        replace(
            u,
            forward_s=profile.unit_s(u.name, "forward"),
            backward_s=profile.unit_s(u.name, "backward"),
        )
        for u in trace.units
    )
    return replace(trace, units=units, overhead_s=profile.of("other"), measured=True)
