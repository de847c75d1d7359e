"""overlap_step='auto' measures whether stepping ahead pays at all (optim.policy's
OverlapTrial): after some steps it runs a few without overlap, keeps the faster way by
the time between steps, and tries again later. Both ways are exact, so a run that
switches between them trains bit for bit like one that never overlaps.
"""

from __future__ import annotations

import pytest

import hetstore
from hetstore.optim.policy import OverlapTrial
from tests.models.gpt import batches
from tests.optim.helpers import (
    assert_bitwise,
    assert_same_optimizer_state,
    config,
    fresh,
    train,
)


class Steps:
    """A clock for the trial: each step ended took ``cost(overlapping)`` seconds."""

    def __init__(self, cost):
        self.cost = cost
        self.now = 0.0
        self.trial: OverlapTrial | None = None

    def __call__(self) -> float:
        if self.trial is not None:  # (None while the trial is being made)
            self.now += self.cost(self.trial.overlapping)
        return self.now


def scheduled(clock: Steps, after: int, steps: int, every: int, trial=None) -> OverlapTrial:
    """``trial`` (a new one by default) on ``clock`` and the schedule given."""
    trial = trial if trial is not None else OverlapTrial()
    trial.clock, trial.after, trial.steps, trial.every = clock, after, steps, every
    clock.trial = trial
    return trial


def run(trial: OverlapTrial, clock: Steps, count: int) -> list[bool]:
    """The way each of ``count`` steps took."""
    clock.trial = trial
    ways = []
    for _ in range(count):
        ways.append(trial.overlapping)
        trial.step_ended()
    return ways


def test_overlap_that_pays_is_kept_after_trying_without():
    clock = Steps(lambda overlapping: 1.0 if overlapping else 1.3)
    trial = scheduled(clock, after=5, steps=3, every=10)
    ways = run(trial, clock, 30)
    # 5 steps, then 1 + 3 without (the first not counted), back; again 10 steps later
    assert ways[:5] == [True] * 5
    assert ways[5:9] == [False] * 4
    assert ways[9:19] == [True] * 10
    assert ways[19:23] == [False] * 4
    assert all(ways[23:])
    assert trial.trials == 2
    assert trial.without == 8


def test_overlap_slower_than_none_is_dropped_until_a_trial_finds_it_pays_again():
    """The GPU case of issue 47: stepping ahead made the step slower than none."""
    costs = {True: 1.5, False: 1.4}
    clock = Steps(lambda overlapping: costs[overlapping])
    trial = scheduled(clock, after=5, steps=3, every=10)
    ways = run(trial, clock, 19)
    assert ways[5:] == [False] * 14  # chosen at step 9; kept for the 10 after
    assert trial.trials == 1
    costs[True] = 1.0  # (a longer sequence: overlap pays now)
    ways = run(trial, clock, 10)
    # the next trial: step 19 ends the 10; one step with overlap not counted, 3 counted
    assert ways[0:4] == [True] * 4
    assert all(ways[4:])
    assert trial.trials == 2


def test_a_tie_keeps_the_way_it_had():
    clock = Steps(lambda overlapping: 1.0)
    trial = scheduled(clock, after=3, steps=2, every=100)
    ways = run(trial, clock, 20)
    assert ways[3:6] == [False] * 3
    assert all(ways[6:])


def test_steps_whose_times_vary_keep_the_way_they_had():
    """Without overlap faster on its median but not on each step (one long sequence in
    the trial): overlap is kept. Faster on each step, by less than the spread of
    either way's times elsewhere: dropped."""
    # each step's seconds: 4 with overlap, 1 + 3 without (the first not counted), back
    # to overlap for 3, 1 + 3 without again, then without
    times = iter([1.0] * 4 + [9.9, 0.8, 0.8, 1.2] + [1.0] * 3 + [9.9, 0.95, 0.97, 0.99])
    clock = Steps(lambda overlapping: next(times, 0.95))
    trial = scheduled(clock, after=3, steps=3, every=3)
    ways = run(trial, clock, 18)
    assert ways == [True] * 4 + [False] * 4 + [True] * 3 + [False] * 7
    assert trial.trials == 2


def test_the_step_after_a_switch_is_not_counted():
    """It still carries the other way's work (steps landing in its forward): made to
    take 10 s here, it does not decide the trial."""
    calls = []

    def cost(overlapping):
        calls.append(overlapping)
        if len(calls) == 4:  # the first step without overlap
            return 10.0
        return 1.0 if overlapping else 0.9

    clock = Steps(cost)
    trial = scheduled(clock, after=3, steps=2, every=100)
    ways = run(trial, clock, 12)
    assert ways[3:] == [False] * 9


def training(tmp_path, name, overlap, clip, trial_clock=None):
    model, opt = fresh()
    cfg = config(tmp_path / name, overlap, "disk")
    model, opt = hetstore.offload(model, opt, cfg)
    if trial_clock is not None:
        # a trial every few steps, made to choose each way in turn: overlap dropped at
        # the first (the way without it made faster), taken back at the next
        scheduled(trial_clock, after=2, steps=1, every=2, trial=opt.overlap_trial)
    return model, opt


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip-bites"])
def test_switching_ways_between_steps_trains_bitwise_like_no_overlap(tmp_path, clip):
    """Each switch between steps: steps taken in backward and committed, steps left to
    the next forward landing in the first step without overlap, read-ahead after a clip
    that bit; the result is that of the same model without overlap, bit for bit."""
    ended = []

    def cost(overlapping):
        ended.append(overlapping)
        if len(ended) <= 4:
            return 1.0 if overlapping else 0.5
        return 1.0 if overlapping else 2.0

    data = batches(12, vocab=64)
    on, on_opt = training(tmp_path, "on", "auto", clip, Steps(cost))
    off, off_opt = training(tmp_path, "off", False, clip)
    losses, taken = [], []  # each step's loss; its steps taken ahead or in forward
    for batch in data:
        before = dict(on_opt.speculation_stats)
        losses += train(on, on_opt, [batch], clip=clip)
        after = on_opt.speculation_stats
        taken.append(sum(after[k] - before[k] for k in ("started", "in_forward", "read_ahead")))
    assert losses == train(off, off_opt, data, clip=clip)
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    # ways: 2 with; 2 without (a trial: kept), 2 without; 2 with (a trial: back to
    # overlap, made faster now), 2 with; 2 without (a trial: overlap kept)
    assert ended == [True] * 2 + [False] * 4 + [True] * 4 + [False] * 2
    stats = on_opt.speculation_stats
    assert stats["overlap_trials"] == 3 and stats["without_overlap"] == 6
    # nothing stepped away from optimizer.step() in a step without overlap; every unit
    # in one with it (in backward, or handed to the next forward)
    units = len(on_opt.step_ahead.unit_steps)
    assert [n for n, way in zip(taken, ended, strict=True) if not way] == [0] * 6
    assert all(n >= units for n, way in zip(taken, ended, strict=True) if way)
    assert not on_opt.step_ahead.in_forward_jobs()


def test_the_trial_switches_host_steps_in_the_next_forward_as_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU both keys 'auto' step host units in the next forward, in place, and the
    trial turns that on and off: nothing handed over in a step without overlap, every
    unit in one with it, and the run is bitwise the run without overlap."""
    monkeypatch.setattr(  # (the GPU's rule, on this CPU device)
        hetstore.OffloadConfig, "steps_memory_in_forward", lambda self, device=None: True
    )
    ended = []

    def cost(overlapping):
        ended.append(overlapping)
        return 1.0 if overlapping else (0.5 if len(ended) <= 4 else 2.0)

    def host(name, overlap):
        model, opt = fresh()
        cfg = config(tmp_path / name, overlap, "host", step_in_forward=overlap)
        return hetstore.offload(model, opt, cfg)

    data = batches(12, vocab=64)
    on, on_opt = host("on", "auto")
    off, off_opt = host("off", False)
    assert not on_opt.step_ahead.unit_steps  # none in backward: only in the next forward
    scheduled(Steps(cost), after=2, steps=1, every=2, trial=on_opt.overlap_trial)
    losses, handed = [], []
    for batch in data:
        before = on_opt.speculation_stats["in_forward"]
        losses += train(on, on_opt, [batch])
        handed.append(on_opt.speculation_stats["in_forward"] - before)
    assert losses == train(off, off_opt, data)
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    assert ended == [True] * 2 + [False] * 4 + [True] * 4 + [False] * 2
    units = len(hetstore.state_of(on).runtime.units)
    assert [n for n, way in zip(handed, ended, strict=True) if not way] == [0] * 6
    assert [n for n, way in zip(handed, ended, strict=True) if way] == [units] * 6


def test_auto_measures_overlap_and_a_forced_overlap_or_placement_does_not(tmp_path):
    def trial_of(name, overlap, **kwargs):
        _, opt = hetstore.offload(*fresh(), config(tmp_path / name, overlap, "disk", **kwargs))
        assert opt.step_ahead.policy.trial is opt.overlap_trial  # (what the gates read)
        return opt.overlap_trial

    assert trial_of("auto", "auto") is not None
    assert trial_of("no-fwd", "auto", step_in_forward=False) is not None
    assert trial_of("on", True) is None
    assert trial_of("fwd", "auto", step_in_forward=True) is None
    assert trial_of("bwd", "auto", step_in_backward=True) is None


def test_a_step_without_a_backward_takes_the_way_the_trial_set(tmp_path):
    """A second ``optimizer.step()`` on the same gradients (no backward between) after
    the trial turned overlap off hands nothing to the next forward."""
    model, opt = hetstore.offload(*fresh(), config(tmp_path, "auto", "cpu"))
    scheduled(Steps(lambda overlapping: 1.0), after=1, steps=1, every=100, trial=opt.overlap_trial)
    x, y = batches(1, vocab=64)[0]
    for _ in range(2):  # the trial starts at the end of the second step
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    assert not opt.overlap_trial.overlapping
    opt.finish_steps_in_forward()
    handed = opt.speculation_stats["in_forward"]
    opt.step()  # (the same gradients again, no backward)
    assert opt.speculation_stats["in_forward"] == handed
    assert not opt.step_ahead.in_forward_jobs()


def test_a_restarted_trial_measures_both_ways_again_at_once():
    """restart(): after a change of batch shape the ways are compared again without the
    schedule's wait: the kept way's next steps, then the other's."""
    costs = {True: 1.0, False: 1.3}
    clock = Steps(lambda overlapping: costs[overlapping])
    trial = scheduled(clock, after=5, steps=3, every=100)
    run(trial, clock, 10)
    assert trial.trials == 1 and trial.overlapping  # overlap paid and was kept
    costs[True] = 2.0  # (the new shape: overlap slower than none)
    trial.restart()
    ways = run(trial, clock, 12)
    # the first step ended has no interval; 3 counted with overlap, then 1 + 3 without
    assert ways[:4] == [True] * 4
    assert ways[4:] == [False] * 8
    assert trial.trials == 2

    trial.restart()  # restarted in the middle of its trial: the kept way comes back
    run(trial, clock, 5)  # (the kept way's 4, and the switch to overlap)
    assert trial.overlapping
    trial.restart()
    assert not trial.overlapping
    assert trial.trials == 2
