"""``StepWorker``'s queue (hetstore.optim.step_worker): one thread, the call whose result
is needed soonest first."""

from __future__ import annotations

import threading

from hetstore.optim.step_worker import AT_STEP, StepWorker, in_forward, outcome


def test_the_worker_runs_the_queued_call_needed_soonest_first():
    """Queued behind a busy worker: the steps settled at optimizer.step() first, then
    the next forward's in its order (a unit's read-ahead before its step, as queued);
    not the order they were queued in."""
    worker = StepWorker(None, [], [], keep_thread=False)
    release, ran = threading.Event(), []
    busy = worker.submit(release.wait)  # (the first, at AT_STEP: the thread takes it)
    queued = [
        worker.submit(ran.append, "forward unit 5", next_use=in_forward(5)),
        worker.submit(ran.append, "read ahead unit 1", next_use=in_forward(1)),
        worker.submit(ran.append, "forward unit 1", next_use=in_forward(1)),
        worker.submit(ran.append, "settled at step", next_use=AT_STEP),
    ]
    release.set()
    assert all(outcome(f) for f in [busy, *queued])
    assert ran == ["settled at step", "read ahead unit 1", "forward unit 1", "forward unit 5"]
    worker.stop(closing=True)


def test_a_call_that_raises_is_the_callers_to_see_and_the_queue_goes_on():
    worker = StepWorker(None, [], [], keep_thread=False)
    failed = worker.submit(lambda: 1 / 0)
    after = worker.submit(lambda: "ran")
    assert not outcome(failed)
    assert isinstance(failed.exception(), ZeroDivisionError)
    assert after.result(timeout=10) == "ran"
    worker.stop(closing=True)
