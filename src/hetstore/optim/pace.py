"""Which host-memory steps to take during backward: only those the worker can finish
before ``optimizer.step()`` comes.

A speculative step of a unit in host memory (:mod:`hetstore.optim.in_memory`) first
copies the live master and states into shadows, so it moves about twice the bytes of
the ordinary step: measured on an H100 host, 8-10 ms for a unit the ordinary step
takes ~3 ms for (docs/BENCHMARKS.md). Taken during backward it costs nothing; still
running when ``optimizer.step()`` waits for it, it costs more than the ordinary step
would have. So, with ``overlap_step='auto'``, a unit is stepped ahead only when the
worker is predicted to finish it before the step: from the last steps, how long after
backward started ``optimizer.step()`` came, and how many seconds per element the
worker's steps took. The units left over (those whose gradients come last) are stepped
the ordinary way, exactly as without overlap: pacing never changes a result, only
which of two exact paths a unit takes.

Until both have been measured once, every unit is stepped ahead (and measured); after,
the first unit of each backward always is, so the estimate keeps following the worker.
"""

from __future__ import annotations

import time

__all__ = ["StepPace"]

# weight of the newest measurement in the running estimates
NEWEST = 0.5


class StepPace:
    """The running estimates, and the worker's predicted finish of what it was given."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._backward_start: float | None = None
        self.until_step: float | None = None  # seconds from backward start to step()
        self.per_element: float | None = None  # the worker's seconds per element
        self._worker_free: float = 0.0  # when the worker is predicted to be idle
        self._admitted = 0  # since backward started

    def backward_started(self) -> None:
        self._backward_start = self._clock()
        self._worker_free = self._backward_start
        self._admitted = 0

    def step_called(self) -> None:
        """``optimizer.step()`` came: how long after backward started."""
        if self._backward_start is not None:
            self.until_step = _blend(self.until_step, self._clock() - self._backward_start)
            self._backward_start = None

    def ran(self, numel: int, seconds: float) -> None:
        """The worker stepped ``numel`` elements ahead in ``seconds`` (its own time, not
        counting a wait for the gradients' copies)."""
        if numel > 0:
            self.per_element = _blend(self.per_element, seconds / numel)

    def admit(self, numel: int) -> bool:
        """Whether a step of ``numel`` elements, queued behind what the worker has, is
        predicted to end before ``optimizer.step()``; if so it counts as queued."""
        now = self._clock()
        start = max(now, self._worker_free)
        if self.per_element is None or self.until_step is None or self._backward_start is None:
            self._worker_free = start  # nothing measured yet: admit, and learn
            return True
        end = start + numel * self.per_element
        if self._admitted and end > self._backward_start + self.until_step:
            return False
        self._worker_free = end
        self._admitted += 1
        return True


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - NEWEST) * old + NEWEST * new
