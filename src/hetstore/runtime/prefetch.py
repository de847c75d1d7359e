"""Which units to bring closer before they are used: the prefetch decisions.

The runtime's hooks (:mod:`hetstore.runtime.hooks`) fetch the unit a forward or a
backward needs now; :class:`Prefetch` decides which others to start bringing closer
then, from the execution order the first forward recorded and ``prefetch_depth``: before
a forward the first units of that order, before a backward the last ones, and at each
unit the next ``prefetch_depth`` in the direction the pass runs. A prefetch never waits:
a disk home starts its read into host staging (any device), a host home on CUDA its
host-to-device copy on the side stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetstore.runtime.unit import Unit

__all__ = ["Prefetch"]


class Prefetch:
    """The prefetch decisions of one model's runtime (see the module doc)."""

    def __init__(self, depth: int, order: list[Unit], copy_stream: torch.cuda.Stream | None):
        self.depth = depth
        # the runtime's execution order, recorded on the first forward (read, never written)
        self.order = order
        self.copy_stream = copy_stream  # (None on CPU)

    def edge(self, first: bool) -> None:
        """Prefetch the units the next phase starts with: the first ones in the recorded
        order before a forward, the last ones before a backward."""
        if not self.depth or not self.order:
            return
        edge = self.order[: self.depth] if first else self.order[::-1][: self.depth]
        for unit in edge:
            self.start(unit)

    def after(self, unit: Unit, step: int) -> None:
        """Bring the next units closer: start their disk reads (any device) and, on CUDA,
        their host-to-device copies on the side stream. On CPU a host-to-"device" copy
        is a synchronous memcpy, so prefetching it would only hold memory earlier."""
        if not self.depth or unit not in self.order:
            return
        position = self.order.index(unit)
        for k in range(1, min(self.depth, len(self.order)) + 1):
            other = position + step * k
            if 0 <= other < len(self.order):
                self.start(self.order[other])

    def start(self, unit: Unit) -> None:
        """Start bringing ``unit`` closer without waiting (see :meth:`after`)."""
        if unit.param_stager is not None:
            unit.prefetch()
        elif self.copy_stream is not None:
            unit.fetch(self.copy_stream)
