"""Gradient norms taken in backward, so that a clip reads no gradient back from disk.

``optimizer.clip_grad_norm_`` needs every parameter's gradient norm. A unit whose
gradients live on disk would have them read back whole for it (and once more by the
step). Yet each of those gradients passes through the gradient stager's host buffer on
its way out (:class:`~hetstore.runtime.staging.GradStager`): once the clip has been
called, :class:`RecordedNorms` takes each such unit's per-parameter L2 norms from that
buffer while its write to disk runs, at the runtime's grads-final event, in the chunks
the disk scan reads (:class:`ChunkNorms`, :func:`scan_grads`) -- so the clip's
total is the same bits recorded or scanned, with or without ``overlap_step``.

A record holds while the unit's gradients are unchanged since (``GradSink.state()``:
gradients added, in-place changes, the has-grad flags): a later micro-batch, or a write
through ``p.grad``, makes the clip scan the disk as before. The buffer holds the whole
accumulated gradient (the stager reads earlier micro-batches' sums in before adding), so
a record taken at any micro-batch is exact for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetstore.optim.streamed import StreamedUnitStep
from hetstore.runtime.events import Event
from hetstore.runtime.grad_sink import GradState
from hetstore.runtime.rewrite import chunk_buffers
from hetstore.runtime.unit import Unit
from hetstore.tiers.store import wait_all_quiet

__all__ = ["ChunkNorms", "RecordedNorms", "scan_grads", "visit_in"]


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
        visit_in(self._steps[id(unit)], view, chunked.visit)
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


class ChunkNorms:
    """Per-parameter gradient norms of one unit, from its gradients visited in chunks
    (:func:`scan_grads` from disk, or :func:`visit_in` over a buffer in memory: the same
    chunks either way, so the same bits). A parameter cut by a chunk border gets the norm
    of its pieces' norms (within fp32 round-off of torch's norm)."""

    def __init__(self, unit: Unit, norm_type: float):
        self.unit = unit
        self.norm_type = norm_type
        self._norms: dict[int, torch.Tensor] = {}
        self._parts: dict[int, list[torch.Tensor]] = {}

    def visit(self, chunk: torch.Tensor, start: int) -> None:
        end = start + chunk.numel()
        whole, whole_ids = [], []
        for entry in self.unit.trainable_entries:
            a, b = entry.offset, entry.offset + entry.numel
            if not entry.has_grad or b <= start or a >= end:
                continue
            view = chunk[max(a, start) - start : min(b, end) - start]
            if start <= a and b <= end:
                whole.append(view)
                whole_ids.append(id(entry.param))
            else:
                part = torch.linalg.vector_norm(view, self.norm_type)
                self._parts.setdefault(id(entry.param), []).append(part)
        if whole:
            computed = torch._foreach_norm(whole, self.norm_type)
            self._norms.update(zip(whole_ids, computed, strict=True))

    def result(self) -> dict[int, torch.Tensor]:
        """id(param) -> its gradient's norm."""
        norms = dict(self._norms)
        for key, pieces in self._parts.items():
            norms[key] = torch.linalg.vector_norm(torch.stack(pieces), self.norm_type)
        return norms


# ---------------------------------------------------------------------- the chunks
# A disk unit's gradients are read for a clip, fp16's overflow check or a norm in chunks
# of its streamed step's size; norms recorded in backward visit the same chunks of the
# stager's buffer (one definition: recorded norms equal scanned ones only over the same
# chunks).
def grad_spans(unit_step: StreamedUnitStep) -> list[tuple[int, int]]:
    """The gradient chunks ``[start, end)`` a scan visits."""
    total, size = unit_step.unit.trainable_numel, unit_step.chunk_numel
    return [(a, min(a + size, total)) for a in range(0, total, size)]


def visit_in(
    unit_step: StreamedUnitStep, grads: torch.Tensor, visit: Callable[[torch.Tensor, int], None]
) -> None:
    """Call ``visit(chunk, start)`` over ``grads`` (the unit's whole gradient buffer, in
    memory) in the chunks :func:`scan_grads` reads."""
    for a, b in grad_spans(unit_step):
        visit(grads[a:b], a)


def scan_grads(
    unit_step: StreamedUnitStep, multipliers: list, visit: Callable[[torch.Tensor, int], None]
) -> None:
    """Read the unit's gradients chunk by chunk (two buffers, reading ahead), apply
    ``multipliers`` in order, and call ``visit(chunk, start)``."""
    unit = unit_step.unit
    host = unit.tiers.host
    spans = grad_spans(unit_step)
    starts = [a for a, _ in spans]
    numel = min(unit_step.chunk_numel, unit.trainable_numel)
    sets, buffers = chunk_buffers(
        host, min(2, len(spans)), [("grad", torch.float32)], numel, f"swap {unit.name}"
    )
    pending: list = []
    try:
        views = [sets[i % len(sets)]["grad"][: b - a] for i, (a, b) in enumerate(spans)]
        pending.append(unit.grad.read(views[0], starts[0]))
        for i, a in enumerate(starts):
            current = pending.pop(0)
            if i + 1 < len(starts):
                pending.append(unit.grad.read(views[i + 1], starts[i + 1]))
            current.wait()
            chunk = views[i]
            unit.grads.fill_missing(chunk, a)
            for m in multipliers:
                chunk.mul_(m)
            visit(chunk, a)
    finally:
        wait_all_quiet(pending)
        for buffer in buffers:
            host.free(buffer)
