"""``StepJob``: one unit's optimizer step, run on the worker thread away from
``optimizer.step()``'s own loop (during backward, or during the next forward): what it
steps with, where its result goes (``Target``), when it runs (``When``), and one
``JobState`` for its life, which moves only along the arrows drawn in
docs/how-it-works.md ("One unit's step away from optimizer.step()"; a test holds the
drawing to ``MOVES``).

Only the caller's thread moves a job between states (``move``, ``submitted``,
``finished``, ``cancel``); the worker runs the step and, for a step in the next forward,
marks the staging buffer it took (``claimed``, ``filled``), under the step ahead's lock.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetstore.optim.borrowed import ReadAhead
    from hetstore.runtime.grad_sink import GradState

__all__ = ["JobState", "StepJob", "Target", "When"]


class JobState(Enum):
    PENDING = "pending"  # made, its inputs recorded, not yet on the worker
    RUNNING = "running"  # on the worker
    DONE_AHEAD = "done ahead"  # finished into shadows; its inputs are checked at the commit
    COMMITTED = "committed"  # its shadows are the unit's state (its inputs still held)
    LANDED = "landed"  # an in-place step a reader waited for (Unit.barrier): the unit's state
    FAILED = "failed"  # the worker raised; what it wrote is thrown away or raised
    CANCELLED = "cancelled"  # dropped: inputs changed, superseded, zero_grad, a load


class When(Enum):
    IN_BACKWARD = "in backward"  # as soon as the unit's gradients are final
    IN_FORWARD = "in the next forward"  # handed over by optimizer.step(), landed at use


class Target(Enum):
    SHADOWS = "shadows"  # new regions or buffers, made current by a commit
    IN_PLACE = "in place"  # the live master and states (the step is known)


# where a job may go from each state (StepJob.move refuses any other move)
MOVES = {
    JobState.PENDING: {JobState.RUNNING, JobState.CANCELLED},
    # (cancelled while running: only after the caller waited for the worker)
    JobState.RUNNING: {JobState.DONE_AHEAD, JobState.FAILED, JobState.LANDED, JobState.CANCELLED},
    JobState.DONE_AHEAD: {JobState.COMMITTED, JobState.CANCELLED},
    JobState.FAILED: {JobState.CANCELLED, JobState.LANDED},  # (landed: stepped again)
    JobState.COMMITTED: set(),
    JobState.LANDED: set(),
    JobState.CANCELLED: set(),
}


@dataclass(eq=False)
class StepJob:
    """One unit's step away from ``optimizer.step()``'s loop (see the module doc)."""

    unit_step: object  # the unit's StreamedUnitStep or InMemoryUnitStep
    when: When
    target: Target
    hyper: dict[int, dict]  # the param-group values it steps with, by group index
    shadows: object | None = None  # a ChunkedRewrite (Target.SHADOWS)
    # what a step in backward assumed, checked before its commit
    grad_state: GradState | None = None
    state_version: int | None = None
    factor: float | None = None  # fp16: the unscale factor it applied (1 / loss scale)
    # a step handed over by optimizer.step(): what that call would have multiplied
    # gradients on disk by (clip, unscale), and which parameters had a gradient
    multipliers: list = field(default_factory=list)
    has_grad: tuple[bool, ...] | None = None
    future: Future | None = None
    state: JobState = JobState.PENDING
    ok: bool | None = None  # the worker's outcome, once waited for
    # borrowed for the run, given back when it is over:
    lent_grads: bool = False  # the gradient stager's host buffer (gradients on disk)
    # a parameter staging buffer lent for the unit's new parameters, given to the job
    # until the worker starts it (``claimed``); ``filled`` once the run wrote them
    params: torch.Tensor | None = None
    claimed: bool = False
    filled: bool = False
    wants_params: bool = False  # its unit can take its parameters from a staging buffer
    read_ahead: ReadAhead | None = None  # the master and states it reads, in memory

    @property
    def unit(self):
        return self.unit_step.unit

    def move(self, to: JobState) -> None:
        """The one way a job changes state: refused when the drawing has no such arrow."""
        if to not in MOVES[self.state]:
            raise RuntimeError(
                f"hetstore internal error: the step job of unit {self.unit.name!r} cannot go "
                f"from {self.state.value!r} to {to.value!r}"
            )
        self.state = to

    def submitted(self, future: Future) -> None:
        self.future = future
        self.move(JobState.RUNNING)

    def finished(self, ok: bool) -> None:
        """The caller waited for the worker: record the outcome (once)."""
        if self.state is not JobState.RUNNING:
            return
        self.ok = ok
        if not ok:
            self.move(JobState.FAILED)
        elif self.target is Target.IN_PLACE:
            self.move(JobState.LANDED)
        else:
            self.move(JobState.DONE_AHEAD)

    def cancel(self) -> None:
        """Dropped (a job already final stays so)."""
        if self.state not in (JobState.COMMITTED, JobState.LANDED, JobState.CANCELLED):
            self.move(JobState.CANCELLED)
