"""Where one model's backward passes stand: what the runtime's hooks remember between calls.

The hooks (:mod:`hetstore.runtime.hooks`) decide what moves when; this object keeps the
state those decisions read across hook calls:

- the backward now running, seen once as its start at its first gradient hook, and its
  end-of-backward callback, queued on the outermost graph task (the model output's
  gradient hook queues it there first): a backward run inside it (reentrant activation
  checkpointing) is part of it, and one that raised is over (its task dropped the
  callback);
- the graphs of forwards whose backward has not run: ``graph_alive`` while one is (its
  parameters and saved tensors may still be read, so ``hetstore.evict`` refuses);
- the units whose trainable gradients are in but whose frozen weights may still be
  needed later in this backward, released once backward has moved past them.

Everything here is reset by :meth:`BackwardState.ended` at the end of a backward.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetstore.runtime.unit import Unit

__all__ = ["BackwardState", "GraphMarker", "in_backward"]


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


class GraphMarker:
    """Lives as long as the graph of a forward's output (``graph_alive``); does nothing."""

    __slots__ = ("__weakref__",)

    def __call__(self, grad) -> None:
        return None


class _EndOfBackward:
    """The end-of-backward callback as queued on autograd's graph task: the task holds it
    until it has run, and drops it when the backward raises, so it is alive exactly while
    its backward runs."""

    __slots__ = ("state", "__weakref__")

    def __init__(self, state: BackwardState):
        self.state = state

    def __call__(self) -> None:
        self.state._callback_ran()


class BackwardState:
    """The backward passes of one model as its runtime's hooks see them (module doc).
    ``on_end``: a weak reference to what the end of a backward that started runs (the
    runtime's: weak, so that this state does not keep its runtime alive)."""

    def __init__(self, on_end) -> None:
        self._on_end = on_end
        self._end: weakref.ref | None = None  # the queued _EndOfBackward
        self._started = False  # a gradient hook of the backward running has come
        # units whose trainable gradients are in but whose frozen weights may still be
        # needed later in this backward (see release_finished_before)
        self._awaiting_release: list[Unit] = []
        # the pre-backward hooks of forwards whose backward has not run: a graph alive
        # (empty once its backward ends or it is dropped; hetstore.evict refuses while not)
        self._awaiting_backward: weakref.WeakSet = weakref.WeakSet()
        self.any_frozen = False  # (set as each backward starts: see has_untracked_params)

    @property
    def _running(self) -> bool:
        """A queued end-of-backward callback is alive: its backward has not ended."""
        return self._end is not None and self._end() is not None

    def queue_end(self) -> None:
        """Queue the end-of-backward callback on the graph task running on this thread,
        unless one is alive. The model output's gradient hook calls this first, in the
        outermost task: reentrant activation checkpointing (``use_reentrant=True``:
        torch's when not passed, transformers 4's) runs each block's backward as a graph
        task of its own inside it, and a callback queued there would end the backward at
        each block's end (measured: the root released while backward still read it, and
        ``step_in_backward`` refusing "a second backward")."""
        if self._running:
            return
        if self._started:  # the last one raised: its task dropped the callback
            self.ended()
        callback = _EndOfBackward(self)
        self._end = weakref.ref(callback)
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    def starts(self) -> bool:
        """Whether a backward starts now: its first gradient hook calls this (and queues
        the end-of-backward callback where the output's hook did not). A gradient hook of
        a backward already started, or of one run inside it (reentrant checkpointing),
        does not start one; after one that raised, the next does."""
        if not in_backward() or (self._started and self._running):
            return False
        self.queue_end()
        self._started = True
        return True

    def _callback_ran(self) -> None:
        on_end = self._on_end()
        if self._started and on_end is not None:
            on_end()  # (which ends this state: ended())
        else:  # through the output alone (torch.autograd.grad of the inputs): no start
            self._end = None

    def await_backward(self, tensor: torch.Tensor, hook) -> None:
        """Hang ``hook`` (a tensor gradient hook holding nothing strongly but itself) on
        ``tensor``: its graph counts as alive while the hook does."""
        tensor.register_hook(hook)
        self._awaiting_backward.add(hook)

    @property
    def graph_alive(self) -> bool:
        """A forward's graph awaits its backward (its parameters and saved tensors may
        still be read)."""
        return len(self._awaiting_backward) > 0

    def release_later(self, unit: Unit) -> None:
        """``unit``'s gradients are in, but its frozen weights may still be needed for
        the gradient of its input: released when backward moves to an earlier unit."""
        self._awaiting_release.append(unit)

    def release_finished_before(self, unit: Unit, order: list[Unit]) -> None:
        """Backward reached ``unit``'s output: units after it in the forward ``order``
        have computed their input's gradient, so their frozen weights are no longer
        needed. Release those whose trainable gradients are all in (and wholly frozen
        ones)."""
        if not self.any_frozen or unit not in order:
            return
        for other in order[order.index(unit) + 1 :]:
            if not other.materialized or not other.has_untracked_params:
                continue
            if other in self._awaiting_release or not other.expected_grads:
                other.release()
        self._awaiting_release = [u for u in self._awaiting_release if u.materialized]

    def ended(self) -> None:
        """The backward is over (autograd's end-of-backward callback): no graph of an
        earlier forward is alive, nothing waits for release."""
        self._end, self._started = None, False
        self._awaiting_release = []
        self._awaiting_backward = weakref.WeakSet()
