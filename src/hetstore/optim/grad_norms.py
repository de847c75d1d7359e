"""Gradient norms taken in backward, so that a clip reads no gradient back from disk.

``optimizer.clip_grad_norm_`` needs every parameter's gradient norm. A unit whose
gradients live on disk would have them read back whole for it (and once more by the
step). Yet each of those gradients passes through the gradient stager's host buffer on
its way out (:class:`~hetstore.runtime.staging.GradStager`): once the clip has been
called, :class:`RecordedNorms` takes each such unit's per-parameter L2 norms from that
buffer while its write to disk runs, at the runtime's grads-final event, in the chunks
the disk scan reads (:class:`~hetstore.optim.streamed.ChunkNorms`) -- so the clip's
total is the same bits recorded or scanned, with or without ``overlap_step``.

A record holds while the unit's gradients are unchanged since (``GradSink.state()``:
gradients added, in-place changes, the has-grad flags): a later micro-batch, or a write
through ``p.grad``, makes the clip scan the disk as before. The buffer holds the whole
accumulated gradient (the stager reads earlier micro-batches' sums in before adding), so
a record taken at any micro-batch is exact for it.
"""

from __future__ import annotations

import torch

from hetstore.optim.streamed import ChunkNorms, StreamedUnitStep
from hetstore.runtime.events import Event
from hetstore.runtime.grad_sink import GradState
from hetstore.runtime.unit import Unit

__all__ = ["RecordedNorms"]


class RecordedNorms:
    """Per-parameter L2 gradient norms of the disk-gradient units, recorded in backward."""

    def __init__(self, unit_steps: list[StreamedUnitStep]):
        self._steps = {id(s.unit): s for s in unit_steps if s.unit.grad_stager is not None}
        # off until clip_grad_norm_ (L2) is first called: no cost for runs that never clip
        self.enabled = False
        self._norms: dict[int, tuple[GradState, dict[int, torch.Tensor]]] = {}
        # told by the runtime when a unit's gradients are final; it reads their buffer
        self._events = unit_steps[0].unit.events if unit_steps else None
        if self._events is not None:
            self._events.subscribe(Event.GRADS_FINAL, self.grads_final, reads_grads=True)

    def close(self) -> None:
        """Stop listening (the optimizer arranged its steps anew, or was released)."""
        if self._events is not None:
            self._events.unsubscribe(Event.GRADS_FINAL, self.grads_final)
            self._events = None

    def grads_final(self, unit: Unit) -> None:
        """``unit``'s gradients are final and its stager's write to disk has started."""
        if not self.enabled or id(unit) not in self._steps:
            return
        self._norms.pop(id(unit), None)
        view = unit.grad_stager.peek(unit)
        if view is None:
            return
        chunked = ChunkNorms(unit, 2.0)
        self._steps[id(unit)].visit_in(view, chunked.visit)
        self._norms[id(unit)] = (unit.grads.state(), chunked.result())

    def norms_of(self, unit: Unit) -> dict[int, torch.Tensor] | None:
        """id(param) -> the L2 norm of its gradient as recorded in backward; None unless
        recorded and nothing added to or changed the gradients since."""
        recorded = self._norms.get(id(unit))
        if recorded is None:
            return None
        state, norms = recorded
        return norms if state == unit.grads.state() else None

    def clear(self) -> None:
        self._norms.clear()
