"""overlap_step='auto' on a GPU steps a host-memory unit during backward only when the
worker can finish it before optimizer.step() (optim.policy); the rest take the ordinary
step. Exact either way: the reference is the same model without overlap, bit for bit.
"""

from __future__ import annotations

import time

import torch

import hetstore
from hetstore.config import OffloadConfig
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.policy import StepPace
from tests.models.gpt import batches
from tests.optim.helpers import assert_bitwise, assert_same_optimizer_state, fresh, train


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps(pace: StepPace, clock: Clock, admitted_ms: list[float], step_at_ms: float) -> list:
    """One backward: a unit's gradients final at each time of ``admitted_ms`` (ms from
    backward start), each speculation taking 10 ms of a worker that runs them in turn;
    optimizer.step() at ``step_at_ms``. Returns what was admitted."""
    start = clock.now
    pace.backward_started()
    admitted = []
    for at in admitted_ms:
        clock.now = start + at / 1000
        admitted.append(pace.admit())
    clock.now = start + step_at_ms / 1000
    pace.step_called()
    worker = start
    for at, ok in zip(admitted_ms, admitted, strict=True):
        if ok:
            worker = max(worker, start + at / 1000) + 0.010
            clock.now = worker
            pace.ran(0.010)
    pace.settled()
    clock.now = max(clock.now, start + step_at_ms / 1000) + 1.0
    return admitted


def test_every_unit_is_stepped_ahead_while_the_worker_finishes_before_the_step():
    clock = Clock()
    pace = StepPace(clock)
    for _ in range(3):  # 8 units of 10 ms from 5 ms on: done at 85 ms, step at 100
        assert all(steps(pace, clock, [5 + i for i in range(8)], 100))
    assert pace.limit is None


def test_a_late_worker_leaves_as_many_units_to_the_step_as_it_was_late_by():
    clock = Clock()
    pace = StepPace(clock)
    grads = [5 + i for i in range(12)]  # 12 units: the worker would end at 125 ms
    assert all(steps(pace, clock, grads, 78))  # 47 ms late: 5 units fewer
    assert pace.limit == 7
    assert steps(pace, clock, grads, 78) == [True] * 7 + [False] * 5
    assert pace.limit == 7  # done at 75 ms: 3 ms idle holds no more unit
    steps(pace, clock, grads, 71)  # 4 ms late, less than half a unit: it still pays
    assert pace.limit == 7
    # a longer backward: 30 ms idle before the step, three more fit (the refused ones)
    assert sum(steps(pace, clock, grads, 105)) == 7
    assert pace.limit == 10
    # however late, one unit a backward stays stepped ahead (and keeps measuring)
    steps(pace, clock, grads, 1)
    assert pace.limit == 1
    assert steps(pace, clock, grads, 1) == [True] + [False] * 11


def test_a_step_without_a_speculation_changes_nothing():
    clock = Clock()
    pace = StepPace(clock)
    steps(pace, clock, [5] * 4, 10)  # late: 35 ms
    limit = pace.limit
    pace.backward_started()
    pace.step_called()
    pace.settled()
    assert pace.limit == limit


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
    units = len(on_opt.step_ahead.unit_steps)
    assert units >= 3
    # step 1 steps every unit ahead (and measures); steps 2-4 at least the first each
    assert stats["started"] == stats["committed"] >= units + 3
    assert on_opt.step_ahead.pace.limit < units
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
    assert stats["committed"] == len(on_opt.step_ahead.unit_steps) * len(data)
    assert torch.isfinite(next(on.parameters())).all()


def test_the_paced_worker_thread_lasts_across_steps_and_goes_with_the_model(tmp_path, monkeypatch):
    """One worker thread for every step (not a new one, with a new OpenMP team, each
    backward); hetstore.release(model) stops it."""
    import threading

    def workers() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("hetstore-step")}

    earlier = workers()  # (other tests' models, not yet collected)
    model, opt = paced(tmp_path, monkeypatch, True)
    seen = set()
    for x, y in batches(3, vocab=64):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        seen |= workers() - earlier
    assert len(seen) == 1
    hetstore.release(model)
    (thread,) = seen
    thread.join(timeout=5)
    assert not thread.is_alive()
