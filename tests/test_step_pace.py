"""overlap_step='auto' on a GPU steps a host-memory unit during backward only when the
worker can finish it before optimizer.step() (optim.pace); the rest take the ordinary
step. Exact either way: the reference is the same model without overlap, bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch

import hetstore
from hetstore.config import OffloadConfig
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.pace import StepPace
from tests.models.gpt import batches
from tests.test_step_ahead import assert_bitwise, assert_same_optimizer_state, fresh, train


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_unit_is_admitted_until_the_worker_and_the_step_were_measured():
    clock = Clock()
    pace = StepPace(clock)
    pace.backward_started()
    assert all(pace.admit(10**9) for _ in range(5))
    pace.ran(1000, 1.0)  # measured: the worker's speed, not yet when the step comes
    assert pace.admit(10**9)


def test_units_are_admitted_while_the_worker_is_predicted_to_finish_before_the_step():
    clock = Clock()
    pace = StepPace(clock)
    # (binary fractions of a second: the sums below are exact)
    pace.backward_started()
    clock.now += 0.125  # optimizer.step() came 125 ms after backward started
    pace.step_called()
    pace.ran(1000, 0.03125)  # 31.25 us per element
    assert pace.until_step == 0.125
    pace.backward_started()
    clock.now += 0.03125
    # the worker is idle: 31.25 + 3 x 31.25 = 125 ms, the fourth would end at 156.25
    assert [pace.admit(1000) for _ in range(4)] == [True, True, True, False]
    clock.now += 0.0625  # a unit whose gradients come late, with work still queued
    assert not pace.admit(1)  # it would start when the queue ends, at the deadline
    pace.backward_started()
    clock.now += 0.200  # a backward far longer than the estimate: one is still admitted
    assert pace.admit(1000) and not pace.admit(1000)


def test_the_estimates_follow_new_measurements():
    clock = Clock()
    pace = StepPace(clock)
    pace.ran(100, 1.0)
    pace.ran(100, 3.0)
    assert pace.per_element == pytest.approx(0.02)  # halfway: the newest weighs half
    for seconds in (0.1, 0.3):
        pace.backward_started()
        clock.now += seconds
        pace.step_called()
    assert pace.until_step == pytest.approx(0.2)
    pace.step_called()  # no backward since: nothing to measure
    assert pace.until_step == pytest.approx(0.2)


def paced(tmp_path, monkeypatch, overlap):
    """Host placement with overlap_step='auto' made to step ahead on this CPU device, as
    it does on a GPU (and paced), or overlap off."""
    if overlap:
        monkeypatch.setattr(OffloadConfig, "overlaps_memory_steps", lambda self, device=None: True)
    model, opt = fresh()
    cfg = OffloadConfig(
        offload_param="cpu",
        offload_optimizer="cpu",
        overlap_step="auto" if overlap else False,
        offload_path=str(tmp_path),
    )
    return hetstore.offload(model, opt, cfg)


def test_a_worker_too_slow_for_backward_leaves_the_late_units_to_the_ordinary_step(
    tmp_path, monkeypatch
):
    """Each speculative step made to take 60 ms, far longer than this model's backward:
    from the second step on, the units after the first in a backward go to
    optimizer.step(), and the training is bit for bit that without overlap."""
    run = InMemoryUnitStep.run_speculation

    def slow(self, *args, **kwargs):
        time.sleep(0.060)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InMemoryUnitStep, "run_speculation", slow)
    data = batches(4, vocab=64)
    on, on_opt = paced(tmp_path / "on", monkeypatch, True)
    on_losses = train(on, on_opt, data)
    monkeypatch.undo()
    off, off_opt = paced(tmp_path / "off", monkeypatch, False)
    assert train(off, off_opt, data) == on_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    stats = on_opt.speculation_stats
    units = len(on_opt.step_ahead._steps)
    assert units >= 3
    # step 1 steps every unit ahead (and measures); steps 2-4 at least the first each
    assert stats["started"] == stats["committed"] >= units + 3
    assert stats["too_late"] > 0
    assert stats["started"] + stats["too_late"] == units * len(data)


def test_a_worker_fast_enough_for_backward_steps_every_unit_ahead(tmp_path, monkeypatch):
    """optimizer.step() made to come 0.5 s after backward started: every unit fits."""
    data = batches(3, vocab=64)
    on, on_opt = paced(tmp_path / "on", monkeypatch, True)

    def between(model, opt):
        time.sleep(0.5)

    train(on, on_opt, data, between=between)
    stats = on_opt.speculation_stats
    assert stats["too_late"] == 0
    assert stats["committed"] == len(on_opt.step_ahead._steps) * len(data)
    assert torch.isfinite(next(on.parameters())).all()
