"""Gradient norms taken in backward, so that a clip reads no gradient back from disk.

``optimizer.clip_grad_norm_`` needs every parameter's gradient norm. A unit whose
gradients live on disk would have them read back whole for it (and once more by the
step). Yet each of those gradients passes through the gradient stager's host buffer on
its way out (:class:`~hetstore.runtime.staging.GradStager`): once the clip has been
called, :class:`RecordedNorms` takes each such unit's per-parameter L2 norms from that
buffer while its write to disk runs, at the runtime's grads-final event, in the chunks
the disk scan reads (:class:`~hetstore.optim.streamed.ChunkNorms`) -- so the clip's
total is the same bits recorded or scanned, with or without ``overlap_step``.

A record holds while the unit's gradients are unchanged since (``Unit.grads.version``, the
has-grad flags): a later micro-batch, or a write through ``p.grad``, makes the clip scan
the disk as before. The buffer holds the whole accumulated gradient (the stager reads
earlier micro-batches' sums in before adding), so a record taken at any micro-batch is
exact for it.
"""

from __future__ import annotations

import torch

from hetstore.optim.streamed import ChunkNorms, StreamedUnitStep
from hetstore.runtime.unit import Unit

__all__ = ["RecordedNorms", "grad_state"]


def grad_state(unit: Unit) -> tuple[int, int | None]:
    """What tells a later change of the unit's gradients: the count of gradients added
    in, and for a buffer in memory its version counter (in-place changes through
    ``p.grad``: clipping, a user's hook)."""
    grad = unit.grad
    return unit.grads.version, grad._version if isinstance(grad, torch.Tensor) else None


class RecordedNorms:
    """Per-parameter L2 gradient norms of the disk-gradient units, recorded in backward."""

    def __init__(self, unit_steps: list[StreamedUnitStep]):
        self._steps = {id(s.unit): s for s in unit_steps if s.unit.grad_stager is not None}
        # off until clip_grad_norm_ (L2) is first called: no cost for runs that never clip
        self.enabled = False
        self._norms: dict[int, tuple[tuple, tuple, dict[int, torch.Tensor]]] = {}

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
        has_grad = tuple(e.has_grad for e in unit.trainable_entries)
        self._norms[id(unit)] = (grad_state(unit), has_grad, chunked.result())

    def norms_of(self, unit: Unit) -> dict[int, torch.Tensor] | None:
        """id(param) -> the L2 norm of its gradient as recorded in backward; None unless
        recorded and nothing added to or changed the gradients since."""
        recorded = self._norms.get(id(unit))
        if recorded is None:
            return None
        state, has_grad, norms = recorded
        if state != grad_state(unit) or has_grad != tuple(
            e.has_grad for e in unit.trainable_entries
        ):
            return None
        return norms

    def clear(self) -> None:
        self._norms.clear()
