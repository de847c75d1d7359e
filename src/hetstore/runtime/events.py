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


class Events:
    """One model's event bus (see the module doc)."""

    def __init__(self):
        self._subscribers: dict[Event, list[Callable]] = {event: [] for event in Event}
        # subscribers of GRADS_GATHERED / GRADS_FINAL that read the unit's gradient
        # buffer on the publishing thread: the runtime lets the copies to it land first
        self._reads_grads: list[Callable[[], bool]] = []

    def subscribe(self, event: Event, handler: Callable) -> None:
        self._subscribers[event].append(handler)

    def unsubscribe(self, event: Event, handler: Callable) -> None:
        """Stop ``handler`` (bound methods compare equal); nothing if not subscribed."""
        handlers = self._subscribers[event]
        if handler in handlers:
            handlers.remove(handler)

    def publish(self, event: Event, *args) -> bool:
        """Run every subscriber of ``event``; True when any returned a true value."""
        taken = False
        for handler in list(self._subscribers[event]):
            taken = bool(handler(*args)) or taken
        return taken

    def subscribed(self, event: Event) -> bool:
        return bool(self._subscribers[event])

    def reads_grads_when_final(self, probe: Callable[[], bool]) -> None:
        """Declare (with ``probe``, asked at each backward) that a subscriber reads
        gradient buffers when a unit's gradients are final; withdraw with
        :meth:`forget_reader`."""
        self._reads_grads.append(probe)

    def forget_reader(self, probe: Callable[[], bool]) -> None:
        if probe in self._reads_grads:
            self._reads_grads.remove(probe)

    @property
    def grads_read_when_final(self) -> bool:
        return any(probe() for probe in self._reads_grads)
