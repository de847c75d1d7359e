"""``StepWorker``'s queue (hetstore.optim.step_worker): one thread, the call whose result
is needed soonest first."""

from __future__ import annotations

import threading

from hetstore.optim.step_worker import AT_STEP, StepWorker, in_forward, outcome


def test_the_worker_runs_the_queued_call_needed_soonest_first():
    """Queued behind a busy worker: what optimizer.step() waits for first (a step in
    backward, a read-ahead it takes), in the order queued, then the next forward's steps
    in that forward's order; not the order they were queued in."""
    worker = StepWorker(None, [], [], keep_thread=False)
    release, ran = threading.Event(), []
    busy = worker.submit(release.wait)  # (the first, at AT_STEP: the thread takes it)
    queued = [
        worker.submit(ran.append, "forward unit 5", next_use=in_forward(5)),
        worker.submit(ran.append, "read ahead", next_use=AT_STEP),
        worker.submit(ran.append, "forward unit 1", next_use=in_forward(1)),
        worker.submit(ran.append, "step in backward", next_use=AT_STEP),
    ]
    release.set()
    assert all(outcome(f) for f in [busy, *queued])
    assert ran == ["read ahead", "step in backward", "forward unit 1", "forward unit 5"]
    worker.stop(closing=True)


def test_a_call_that_raises_is_the_callers_to_see_and_the_queue_goes_on():
    worker = StepWorker(None, [], [], keep_thread=False)
    failed = worker.submit(lambda: 1 / 0)
    after = worker.submit(lambda: "ran")
    assert not outcome(failed)
    assert isinstance(failed.exception(), ZeroDivisionError)
    assert after.result(timeout=10) == "ran"
    worker.stop(closing=True)
