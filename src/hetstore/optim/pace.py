"""Which host-memory steps to take during backward: only as many as the worker finishes
before ``optimizer.step()`` comes.

A speculative step of a unit in host memory (:mod:`hetstore.optim.in_memory`) first
copies the live master and states into shadows, so it moves about twice the bytes of
the ordinary step: on an H100 machine's host, 8-10 ms for a unit the ordinary step
takes ~3 ms for (docs/BENCHMARKS.md). Finished during backward it costs nothing; still
running when ``optimizer.step()`` waits for it, it costs more than the ordinary step
would have. So, with ``overlap_step='auto'``, at most ``limit`` units of a backward are
stepped ahead (the first whose gradients are final); the rest take the ordinary step,
exactly as without overlap: pacing never changes a result, only which of two exact
paths a unit takes.

The limit follows what each step measured, not a model of the machine (on a GPU the
worker waits for gradients the device produces later than the host's autograd sees
them, by an amount no model here knows): when the worker finished the last admitted
unit ``late`` seconds after the caller first waited for it (``optimizer.step()``, or
before it a hetstore clip or fp16's unscale), the next backward admits
``round(late / t)`` fewer units, ``t`` being the worker's mean time per unit (late by
less than half a unit costs less than the unit saves: no change); when it was idle for a
while before that and the limit had turned units away, as many more as that idle time
held. No limit until a step was late: every unit is stepped ahead.
"""

from __future__ import annotations

import math
import time

__all__ = ["StepPace"]


class StepPace:
    """The limit, and what the current backward's speculations measured."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self.limit: int | None = None  # units stepped ahead per backward; None: all
        self._admitted = 0  # this backward's
        self._refused = 0
        self._step_at: float | None = None  # when the caller first waited for the worker
        self._last_end: float | None = None  # when the worker finished its last one
        self._worker_seconds = 0.0
        self._ran = 0

    def backward_started(self) -> None:
        """A backward (the last micro-batch's counts) starts: count anew."""
        self._admitted = self._refused = self._ran = 0
        self._worker_seconds = 0.0
        self._step_at = self._last_end = None

    def admit(self) -> bool:
        """Whether the unit whose gradients are now final is stepped ahead."""
        if self.limit is not None and self._admitted >= self.limit:
            self._refused += 1
            return False
        self._admitted += 1
        return True

    def ran(self, seconds: float) -> None:
        """Worker: a speculative step took ``seconds`` of its time and ended now."""
        self._worker_seconds += seconds
        self._ran += 1
        self._last_end = self._clock()

    def step_called(self) -> None:
        """The caller waits for the worker from now (``optimizer.step()``, or a clip or
        fp16's unscale before it): the first such moment since backward started counts."""
        if self._step_at is None:
            self._step_at = self._clock()

    def settled(self) -> None:
        """``optimizer.step()`` has waited for every speculation: set the next limit."""
        if not self._ran or self._step_at is None or self._last_end is None:
            return
        per_unit = self._worker_seconds / self._ran
        if per_unit <= 0:
            return
        late = self._last_end - self._step_at
        fewer = round(late / per_unit)
        if fewer > 0:
            self.limit = max(1, self._admitted - fewer)
        elif late < 0 and self._refused:
            self.limit = self._admitted + min(self._refused, math.floor(-late / per_unit))
