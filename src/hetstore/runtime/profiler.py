"""Where a training step's time goes, measured on the real model: per unit and phase.

The runtime's hooks already mark every boundary of a step (a unit's forward starts once
its parameters are ready, its backward ends when its last gradient is in), so the
profiler is one clock and a current *label*: each mark charges the time since the
previous mark to the label that was current, then switches. Labels are
``(unit name, "forward" | "backward")`` while a unit computes; ``"transfer"`` while
the hooks fetch and wait for parameters; ``"optimizer"`` inside ``optimizer.step()``;
and ``"other"`` for everything else (the root unit's own work is charged to it: the
hooks switch back to the root when a block ends). A step runs from a forward's start
to the end of ``optimizer.step()`` (or, without one, to the next forward's start).

On CUDA the marks are events on the compute stream (kernels are asynchronous: a wall
clock would time their launches), read once the step is over; on a CPU device they are
``time.perf_counter()``. The profiler runs for ``steps`` steps and then turns itself off,
so steady-state training pays nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hetstore.planner.trace import StepProfile

__all__ = ["StepProfile", "StepProfiler"]  # StepProfile: defined with the Trace it calibrates


class StepProfiler:
    """Charges the time between the runtime's marks to labels (see module doc).

    ``on_profiled(profiles)`` is called once, after the last profiled step, with every
    step's :class:`StepProfile`; the first is a warm-up (allocator, page faults) and
    usually slower.
    """

    def __init__(
        self,
        device: torch.device,
        steps: int,
        on_profiled: Callable[[list[StepProfile]], None] | None = None,
    ):
        self.device = device
        self.steps = steps
        self.on_profiled = on_profiled
        self.profiles: list[StepProfile] = []
        self.active = steps > 0
        self._marks: list[tuple[object, tuple[str, str] | str]] = []
        self._label: tuple[str, str] | str = "other"

    def _stamp(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def switch(self, label: tuple[str, str] | str) -> None:
        """Charge the time since the last mark to the current label; ``label`` is next."""
        if not self.active or not self._marks:
            self._label = label
            return
        self._marks.append((self._stamp(), self._label))
        self._label = label

    def step_begins(self) -> None:
        """A forward starts: close the running step (if no optimizer step closed it) and
        open the next."""
        if not self.active:
            return
        self.step_ends()
        if self.active:
            self._marks = [(self._stamp(), "start")]
            self._label = "other"

    def step_ends(self) -> None:
        """The optimizer step is done: the time until the next forward (data loading,
        logging, evaluation) is not the training step's."""
        if not self.active or not self._marks:
            return
        self._marks.append((self._stamp(), self._label))
        self.profiles.append(self._resolve())
        self._marks = []
        if len(self.profiles) >= self.steps:
            self.active = False
            if self.on_profiled is not None:
                self.on_profiled(self.profiles)

    def _resolve(self) -> StepProfile:
        if self.device.type == "cuda":
            self._marks[-1][0].synchronize()

            def between(a, b) -> float:
                return a.elapsed_time(b) / 1e3

        else:

            def between(a, b) -> float:
                return b - a

        profile = StepProfile()
        for (start, _), (end, label) in zip(self._marks, self._marks[1:], strict=False):
            profile.seconds[label] = profile.seconds.get(label, 0.0) + between(start, end)
        profile.total_s = between(self._marks[0][0], self._marks[-1][0])
        return profile
