"""What the runtime tells the rest of hetstore: events published down, never callbacks up.

The runtime (hooks, units) publishes what happened on one :class:`Events` bus per model;
whoever cares subscribes: the optimizer's step machinery, the clip's recorded norms. The
runtime never holds a reference to them and never calls a method of theirs; a lower
layer works the same with no subscriber at all (a model offloaded without an optimizer).

| event | published by | with | when |
|---|---|---|---|
| ``BACKWARD_STARTED`` | runtime.hooks | | the first gradient hook of a backward |
| ``GRADS_GATHERED`` | runtime.hooks | unit | the unit's last gradient is in its buffer (and reduced); a subscriber that takes the gradients (the step in backward) returns True |
| ``GRADS_FINAL`` | runtime.hooks | unit | not taken: the disk write has started, the buffer is final for this backward |
| ``BACKWARD_ENDED`` | runtime.hooks | | autograd's end-of-backward callback |
| ``UNIT_READ`` | ``Unit.barrier`` | unit | something is about to read or change the unit while work on it is pending (``Unit.work_pending``): that work lands first |
| ``STATE_CHANGE`` | ``Unit.before_state_change`` | unit | the master or the optimizer states are about to be rewritten outside a step |
| ``PARAM_BUFFER_FREE`` | ``ParamStager.give_back`` | | a fetch gave its parameter staging buffer back (a subscriber may lend it on) |
| ``PARAM_BUFFERS_LENT`` | ``ParamStager`` | | a fetch found every parameter staging buffer lent: a subscriber that gives one back returns True |
| ``GRAD_BUFFERS_LENT`` | ``GradStager.buffer_for`` | | a unit needs a gradient staging buffer and every free one is lent: a subscriber that gives one back returns True |

Subscribers run on the publishing thread, in the order they subscribed.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

__all__ = ["Event", "Events"]


class Event(Enum):
    BACKWARD_STARTED = auto()
    GRADS_GATHERED = auto()
    GRADS_FINAL = auto()
    BACKWARD_ENDED = auto()
    UNIT_READ = auto()
    STATE_CHANGE = auto()
    PARAM_BUFFER_FREE = auto()
    PARAM_BUFFERS_LENT = auto()
    GRAD_BUFFERS_LENT = auto()


class Events:
    """One model's event bus (see the module doc)."""

    def __init__(self):
        self._subscribers: dict[Event, list[Callable]] = {event: [] for event in Event}
        # the subscribers that read a unit's gradient buffer on the publishing thread
        # when its gradients are final: the runtime lets the copies to it land first
        self._grad_readers: list[Callable] = []

    def subscribe(self, event: Event, handler: Callable, *, reads_grads: bool = False) -> None:
        """``reads_grads``: ``handler`` reads the unit's gradient buffer when it runs
        (``GRADS_GATHERED``, ``GRADS_FINAL``)."""
        self._subscribers[event].append(handler)
        if reads_grads:
            self._grad_readers.append(handler)

    def unsubscribe(self, event: Event, handler: Callable) -> None:
        """Stop ``handler`` (bound methods compare equal); nothing if not subscribed."""
        for handlers in (self._subscribers[event], self._grad_readers):
            if handler in handlers:
                handlers.remove(handler)

    def publish(self, event: Event, *args) -> bool:
        """Run every subscriber of ``event``; True when any returned a true value."""
        taken = False
        for handler in list(self._subscribers[event]):
            taken = bool(handler(*args)) or taken
        return taken

    @property
    def grads_read_when_final(self) -> bool:
        """Whether a subscriber reads gradient buffers as soon as they are final."""
        return bool(self._grad_readers)
