"""Where one model's backward passes stand: what the runtime's hooks remember between calls.

The hooks (:mod:`hetstore.runtime.hooks`) decide what moves when; this object keeps the
state those decisions read across hook calls:

- the backward now running (autograd's graph task), so that its first gradient hook is
  seen once as its start (the runtime then queues its end-of-backward callback), and a
  backward run inside it (reentrant activation checkpointing) is part of it;
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


class BackwardState:
    """The backward passes of one model as its runtime's hooks see them (module doc)."""

    def __init__(self) -> None:
        self._task: int | None = None  # the graph task of the backward running
        # units whose trainable gradients are in but whose frozen weights may still be
        # needed later in this backward (see release_finished_before)
        self._awaiting_release: list[Unit] = []
        # the pre-backward hooks of forwards whose backward has not run: a graph alive
        # (empty once its backward ends or it is dropped; hetstore.evict refuses while not)
        self._awaiting_backward: weakref.WeakSet = weakref.WeakSet()
        self.any_frozen = False  # (set as each backward starts: see has_untracked_params)

    def starts(self) -> bool:
        """Whether a backward is running that was not seen before (it is recorded now):
        its first gradient hook calls this. A backward that starts while the recorded one
        has not ended is run inside it: reentrant activation checkpointing
        (``use_reentrant=True``: torch's when not passed, transformers 4's) re-runs each
        block's forward and backward as a graph task of its own within the outer
        backward's. Its gradients are the outer backward's, which ends once for all of
        them (before, each inner task was taken for a new backward: every unit's pending
        gradients counted again, and everything released and committed at each block's
        end)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._task or self._task is not None:
            return False
        self._task = task
        return True

    def forward_starts(self) -> None:
        """A forward outside any backward: a backward recorded as running did not end
        (it raised before autograd's end-of-backward callback); the next one starts anew."""
        if self._task is not None:
            self.ended()

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
        self._task = None
        self._awaiting_release = []
        self._awaiting_backward = weakref.WeakSet()
