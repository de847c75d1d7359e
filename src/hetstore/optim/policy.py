"""When each unit's step runs, decided in one place, and only ever between exact paths.

It owns the rules of where a unit's step may run (:class:`StepSite`, :class:`StepModes`
and the functions below them: a disk unit in backward, in the next forward, read ahead;
a host-memory unit in place in backward or in the next forward), asked alike by the
runtime's :mod:`hetstore.optim.arrangement` and the planner's :mod:`hetstore.planner.cost`;
and, at run time, what the running steps measured: :class:`StepPolicy` (which backward
is the last before a step, hold-back after a clip that bit, back-off after rollbacks)
and :class:`OverlapTrial` (whether overlap pays at all, ``overlap_step='auto'``). The
runtime finds at run time whether a step does run where the rules allow (room, a clip
that bit, a rollback); the planner predicts it. docs/how-it-works.md tells the whole
story ("Stepping ahead, during backward" and the sections after it).
"""

from __future__ import annotations

import time
from typing import NamedTuple

from hetstore.footprints import READ_AHEAD_UNITS

__all__ = [
    "OverlapTrial",
    "StepModes",
    "StepPolicy",
    "StepSite",
    "streamed_ahead",
    "streamed_in_backward",
    "streamed_in_forward",
    "memory_in_backward",
    "memory_in_forward",
    "read_ahead",
    "reads_ahead",
]


# ---------------------------------------------------------------------- where a step may run
class StepSite(NamedTuple):
    """The facts of one unit that decide where its step may run, as the runtime knows
    them (a unit and its step) and as the planner does (a traced unit and a placement).
    (A tuple: the planner's search makes one per unit for every placement it prices.)"""

    # master and states streamed from a tier the step cannot address (disk), every copy
    # of the parameters written through shadows
    streamed: bool
    in_memory: bool  # master and torch's fp32 states in host memory, stepped flat
    params_in_memory: bool  # its parameters' home is in host memory
    exact: bool  # fp32 states (a compact format's carry block scales)
    trainable: bool  # the optimizer steps some of its elements


class StepModes(NamedTuple):
    """The configuration's step keys, resolved for the compute device."""

    overlap_disk: bool  # overlap_step, for disk units
    in_backward: bool  # step_in_backward
    in_forward: bool  # step_in_forward, for disk units
    in_forward_memory: bool  # step_in_forward, for host-memory units (a GPU)


def streamed_in_backward(site: StepSite, modes: StepModes) -> bool:
    """A disk unit stepped during backward: into shadows (``overlap_step``), or taking
    its gradients (``step_in_backward``)."""
    return site.streamed and site.trainable and (modes.overlap_disk or modes.in_backward)


def streamed_in_forward(site: StepSite, modes: StepModes) -> bool:
    """A disk unit whose step backward leaves to the next forward (``step_in_forward``):
    all of them without ``overlap_step`` (with it, a clip that bit: the planner's
    ``clip_bites_s``). With ``overlap_step`` the root's is taken in backward too, when
    its gradients are final at backward's end, and ``optimizer.step()`` waits for it:
    leaving it to the next forward, whose first use it is, measured no faster
    (benchmarks/results/disk_offload_root_step_in_forward_ab_2026-11-28_epyc.txt)."""
    return (
        site.streamed
        and site.trainable
        and modes.in_forward
        and not modes.in_backward
        and not modes.overlap_disk
    )


def memory_in_backward(site: StepSite, modes: StepModes) -> bool:
    """A host-memory unit whose ordinary step runs in place on the worker during backward,
    as soon as its gradients are on the host (``step_in_backward``), its parameters
    fetched from host memory: no device copy to keep in step, and the next fetch lands
    the step first."""
    return site.in_memory and site.trainable and site.params_in_memory and modes.in_backward


def memory_in_forward(site: StepSite, modes: StepModes) -> bool:
    """A host-memory unit whose ordinary step runs in place in the next forward
    (``step_in_forward`` on a GPU): its parameters fetched from host memory. Sharded
    too: a rank steps its own shard, and the unit's fetch lands that step before it
    gathers every rank's shard, on every rank in the same order."""
    return site.in_memory and site.trainable and site.params_in_memory and modes.in_forward_memory


def streamed_ahead(site: StepSite, modes: StepModes) -> bool:
    """A disk unit whose step the step ahead manages: in backward, or in the next forward
    (the runtime's, whichever it turns out to be; the planner's: the two rules above)."""
    return (
        site.streamed
        and site.trainable
        and (modes.overlap_disk or modes.in_backward or modes.in_forward)
    )


def reads_ahead(site: StepSite) -> bool:
    """A unit whose master and states can be read ahead during backward for its step: a
    disk unit with fp32 states (a compact format's carry block scales besides)."""
    return site.streamed and site.trainable and site.exact


def read_ahead(sites: list[StepSite]) -> list[int]:
    """Of ``sites`` in the order their steps run, those whose masters and states are read
    ahead during backward: the first ``READ_AHEAD_UNITS`` that :func:`reads_ahead`."""
    return [k for k, s in enumerate(sites) if reads_ahead(s)][:READ_AHEAD_UNITS]


# ---------------------------------------------------------------------- at run time


# the trial of overlap against none (OverlapTrial): steps before the first, steps counted
# a way, steps between trials
TRIAL_AFTER = 20
TRIAL_STEPS = 3
TRIAL_EVERY = 500


class OverlapTrial:
    """Whether the steps overlap backward and the next forward at all, measured (on a GPU
    the worker shares the host with the thread that feeds the device, at a cost no model
    here predicts: docs/dev/BENCHMARKS.md): the faster of the two ways by the time between
    steps (docs/how-it-works.md, "Whether to overlap at all"). Not made under
    ``step_in_forward=True`` or ``step_in_backward``, which a user sets for its memory,
    not its speed."""

    def __init__(self, agree=None):
        # the schedule (TRIAL_*), and the clock it reads at the end of each step
        self.after, self.steps, self.every = TRIAL_AFTER, TRIAL_STEPS, TRIAL_EVERY
        self.clock = time.perf_counter
        # sharded over ranks: values -> their sums over the ranks (a collective, at the
        # same step on every rank): the votes for the tried way, so every rank keeps the
        # same way
        self._agree = agree
        self.overlapping = True  # the way the next step takes
        self.trials = 0  # trials ended
        self.without = 0  # steps taken without overlap (a trial's, or its choice)
        self._last: float | None = None  # when the last step ended
        self._since = 0  # steps ended since the start, or the last trial's end
        self._kept: list[float] = []  # the way kept: its last intervals
        self._tried: list[float] | None = None  # the other way's, during a trial
        self._skip = 0  # the step after a switch: not counted
        self._restarted = False  # (restart: due once the kept way has its intervals)

    def restart(self) -> None:
        """Measure again now, not after the schedule's wait: the way kept so far for
        ``steps`` counted steps, then the other way's. For a change that may move the
        balance between the ways (another batch shape or sequence length, another load
        on the host); a trial under way is dropped and its kept way taken back. Sharded
        over ranks, every rank must call it before the same step."""
        if self._tried is not None:
            self.overlapping = not self.overlapping
        self._tried, self._kept, self._since, self._skip = None, [], 0, 0
        self._last, self._restarted = None, True

    def step_ended(self) -> None:
        """A step ended (taken, or skipped by fp16): count its interval, and switch the
        way the next step takes when a trial starts or ends."""
        now = self.clock()
        interval = None if self._last is None else now - self._last
        self._last = now
        if not self.overlapping:
            self.without += 1
        if self._tried is None:  # not trying: the kept way's last intervals
            self._since += 1
            if interval is not None:
                self._kept = [*self._kept, interval][-self.steps :]
            due = 0 if self._restarted else self.every if self.trials else self.after
            if self._since >= due and len(self._kept) == self.steps:
                self._tried, self._skip, self._restarted = [], 1, False
                self.overlapping = not self.overlapping
            return
        if self._skip:  # (the way before's steps landed in this one's forward)
            self._skip -= 1
            return
        self._tried.append(interval)
        if len(self._tried) < self.steps:
            return
        # with no difference between the ways, each of 3 steps faster than each of 3
        # happens by chance 1 time in 20: steps whose times vary keep the way they had
        faster = max(self._tried) < min(self._kept)
        if self._agree is not None:  # every rank must find it faster
            votes, ranks = self._agree(float(faster), 1.0)
            faster = votes == ranks
        if not faster:
            self.overlapping = not self.overlapping  # back to the way kept
        self.trials += 1
        self._tried, self._kept, self._since = None, [], 0


class StepPolicy:
    """The decisions of one optimizer's step machinery (see the module doc)."""

    def __init__(self, trial: OverlapTrial | None = None):
        # whether to overlap at all, measured (overlap_step='auto'; the optimizer's, told
        # of each step's end there, on every rank); else always
        self.trial = trial
        # whether this step's units may step away from optimizer.step() at all (in
        # backward, read ahead, in the next forward): the trial's way, taken when the
        # step's backward starts, so that one step goes one way from backward to its end
        self.overlapping = True
        self.backwards = 0  # backward passes since the last step
        self.expected = 1  # backward passes the last step had
        # the last step scaled the gradients (a clip that bit): a speculation assumes
        # they are not scaled, so it would roll back; hold back until a step that does not
        self.hold_back = False
        # unit id -> (steps to wait next time, steps left): the back-off
        self._backoff: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------------ backward
    def backward_started(self) -> None:
        self.backwards += 1
        if self.trial is not None:
            self.overlapping = self.trial.overlapping

    @property
    def last_backward(self) -> bool:
        """Whether the backward running is the last before a step (by the count)."""
        return self.backwards >= self.expected

    def held_back(self, key: int) -> bool:
        """Whether unit ``key``'s step waits for ``optimizer.step()`` this time (a clip
        that bit at the last step, or its back-off)."""
        return self.hold_back or self._backoff.get(key, (0, 0))[1] > 0

    def step_called(self) -> None:
        """``optimizer.step()`` (or a clip before it) came: a step with no backward since
        the last takes the trial's way now."""
        if self.trial is not None and not self.backwards:
            self.overlapping = self.trial.overlapping

    # ------------------------------------------------------------------ after a step
    def step_settled(self, outcomes: dict[int, bool], clipped: bool) -> None:
        """``optimizer.step()`` settled the speculations (``outcomes``: unit id -> it
        committed): a clip that bit holds the next ones back; units that rolled back
        for another reason wait twice as long as last time before they go ahead again;
        a commit forgets it; the others count a step down."""
        self.hold_back = clipped
        for key, (wait, left) in list(self._backoff.items()):
            if key not in outcomes and left > 0:
                self._backoff[key] = (wait, left - 1)
        for key, ok in outcomes.items():
            if ok:
                self._backoff.pop(key, None)
            elif not clipped:
                wait = min(2 * self._backoff.get(key, (0, 0))[0] or 1, 64)
                self._backoff[key] = (wait, wait)

    def step_ended(self) -> None:
        """A step was taken or skipped (fp16 overflow): count micro-batches anew."""
        self.expected = max(self.backwards, 1)
        self.backwards = 0
