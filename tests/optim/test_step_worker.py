"""``StepWorker``'s queue (hetstore.optim.step_worker): one thread, the call whose result
is needed soonest first; and the life of the jobs it runs (hetstore.optim.step_job)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from hetstore.optim.step_job import MOVES, JobState
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


def test_the_drawing_of_a_jobs_life_names_exactly_the_states_of_the_enum():
    """docs/how-it-works.md draws one unit step's life; the drawing and ``JobState`` are
    the same states (a state added or renamed in one is caught here)."""
    text = (Path(__file__).parents[2] / "docs" / "how-it-works.md").read_text()
    section = text.split("### One unit's step away from `optimizer.step()`", 1)[1]
    drawing = section.split("```", 2)[1]
    drawn = set(re.findall(r"\b[A-Z][A-Z_]{3,}\b", drawing))
    assert drawn == {state.name for state in JobState}
    assert set(MOVES) == set(JobState)
    # every state but the final ones has a way out, and every final one none
    final = {JobState.COMMITTED, JobState.LANDED, JobState.CANCELLED}
    assert {s for s, to in MOVES.items() if not to} == final
