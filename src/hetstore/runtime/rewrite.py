"""One all-or-nothing, chunked rewrite of a disk unit's flat arrays.

Used by the optimizer's streamed step (:mod:`hetstore.optim.streamed`) and by loading a
checkpoint into a disk unit (:mod:`hetstore.checkpoint.training`): both produce a unit's
new fp32 master (and optimizer states) chunk by chunk through a few host buffer sets
and must replace the old arrays only when every chunk is written.

The pipeline, per chunk ``i``: start the reads of chunk ``i+1`` (if the caller reads
anything), wait for chunk ``i``'s, let the caller fill the chunk's master and states,
then write them, and the compute-dtype ``home`` cast from the master, into shadow
regions (:meth:`Store.shadow`); an in-memory home and a materialized device copy are
refreshed in place. Buffer set ``i mod depth`` is reused only after its writes are done.
All shadows are committed together at the end. If anything fails (a read, the caller,
a write, disk full), every shadow is discarded, an in-memory home and device copy are
rebuilt from the (untouched) master on disk, and the error is raised: the unit is
exactly as before.

A unit whose frozen compute-dtype parameters have no master (``Unit.master_numel``)
is rewritten over ``[0, master_numel)`` only. A shadow of its disk home would have to
copy those frozen bytes through (a LoRA model's whole base, every step), so the home's
head is written in place instead, with ``home_stale`` set until it is done: after a
failure the next fetch rebuilds the head from the untouched master, and the frozen part,
which no write touched, is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hetstore.tiers.store import Store, transfers_only, wait_all, wait_all_quiet

if TYPE_CHECKING:
    from hetstore.tiers import HostBuffer, HostTier

__all__ = ["Span", "ChunkedRewrite", "WholeArray", "chunk_buffers"]


class _SpanLike(Protocol):
    start: int
    end: int  # master/home elements [start, end)
    state_end: int  # state (and gradient) elements [start, state_end)


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    state_end: int


@dataclass(frozen=True)
class WholeArray:
    """An array a rewrite writes whole after its last chunk (the 8-bit optimizer states'
    block scales): its values ``before`` the rewrite, which the caller reads while
    filling chunks, and the new ones it fills into ``after``; shadowed like the rest."""

    array: Store
    before: torch.Tensor
    after: torch.Tensor


Slot = dict[str, torch.Tensor]  # one buffer set: array name -> host buffer of a chunk
Fill = Callable[[int, _SpanLike, Slot], None]  # leaves a chunk's new master and states
Read = Callable[[_SpanLike, Slot], list] | None  # starts a chunk's reads: their handles
# a chunk's own host tensors for some of the arrays, used in place of the slot's buffers
# (the whole unit's values read into memory before: stepped there, and written from there)
Views = Callable[[_SpanLike], Slot] | None


def chunk_buffers(
    host: HostTier, count: int, names: list[tuple[str, torch.dtype]], numel: int, label: str
) -> tuple[list[Slot], list[HostBuffer]]:
    """``count`` buffer sets (slots) of ``numel`` elements per named array, from ``host``,
    labelled ``"{label} {name}"``; and the buffers, to free with ``host.free``. A failed
    allocation frees what was taken and raises. Transient: a step or a scan frees them
    again (tiers.host carves them from the top)."""
    sets: list[Slot] = []
    buffers: list[HostBuffer] = []
    try:
        for _ in range(count):
            slot = {}
            for name, dtype in names:
                nbytes = max(numel, 1) * dtype.itemsize
                buffer = host.allocate(nbytes, f"{label} {name}", dtype, transient=True)
                buffers.append(buffer)
                slot[name] = buffer.tensor
            sets.append(slot)
    except BaseException:
        for buffer in buffers:
            host.free(buffer)
        raise
    return sets, buffers


class ChunkedRewrite:
    """Rewrites ``unit``'s master, the given ``states`` (disk arrays over its trainable
    elements) and its compute-dtype copies (see module doc).

    :meth:`run` is the whole rewrite. A *speculative* rewrite (the optimizer's step
    ahead, :mod:`hetstore.optim.step_ahead`) is cut in three so that its parts can run
    on different threads: :meth:`begin` makes the shadows, :meth:`write` fills them and
    leaves every copy the model reads untouched, and :meth:`commit` or :meth:`discard`
    decides later. It needs a unit whose copies all live in shadowed disk arrays (see
    :meth:`can_speculate`)."""

    def __init__(
        self,
        unit,
        states: dict[str, Store],
        *,
        speculative: bool = False,
        whole: dict[str, WholeArray] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self.unit = unit
        self.states = states  # per-element arrays, written chunk by chunk
        self.whole = whole or {}  # written whole after the last chunk
        self._on_close = on_close  # frees the caller's buffers once committed or discarded
        self.speculative = speculative
        home = unit.home
        self.home_on_disk = transfers_only(home) and home is not unit.master
        self.home_in_place = self.home_on_disk and unit.has_home_only
        if speculative and not self.can_speculate(unit):
            raise ValueError(f"unit {unit.name!r} has copies a speculative rewrite would touch")
        self.targets: dict[str, Store] = {"master": unit.master, **states}
        if self.home_on_disk and not self.home_in_place:
            self.targets["home"] = home
        self.targets.update({name: whole.array for name, whole in self.whole.items()})
        self._shadows: dict[str, Store] = {}
        self._touched_memory = False

    @staticmethod
    def can_speculate(unit) -> bool:
        """True when every copy of the unit's parameters is a disk array written through a
        shadow (or the master itself): until the commit, nothing the model reads changes."""
        if not transfers_only(unit.master):
            return False
        home = unit.home
        if home is unit.master:
            return True
        return transfers_only(home) and not unit.has_home_only

    @property
    def shadow_bytes(self) -> int:
        """Disk capacity :meth:`begin` allocates (each shadow rounded as the tier does)."""
        return sum(array.reserved_bytes for array in self.targets.values())

    def slot_arrays(self) -> list[tuple[str, torch.dtype]]:
        """The host buffers one chunk needs here: the master, each state, the cast home."""
        names = [("master", torch.float32)]
        names += [(key, array.dtype) for key, array in self.states.items()]
        if self.home_on_disk:
            names.append(("home", self.unit.compute_dtype))
        return names

    def run(
        self,
        spans: Sequence[_SpanLike],
        slots: list[Slot],
        fill: Fill,
        read: Read = None,
        views: Views = None,
    ) -> None:
        """Rewrite ``spans`` in order. ``read(span, slot)`` starts the reads a chunk needs
        and returns their handles (read one chunk ahead); ``fill(i, span, slot)`` leaves
        the chunk's new master in ``slot["master"]`` and states in ``slot[key]``.
        ``views(span)``: tensors of the chunk's own that stand in the slot for the named
        arrays (read, filled and written from there instead of a slot buffer)."""
        try:
            self.begin()
            self.write(spans, slots, fill, read, views=views)
            self.commit()
        except BaseException:
            self.discard()
            raise

    def begin(self) -> None:
        """Make the shadow of every target (disk full: raises, nothing is left behind)."""
        if not self.speculative:
            self.unit.before_state_change()
        try:
            for name, array in self.targets.items():
                self._shadows[name] = array.shadow()
        except BaseException:
            self.discard()
            raise
        if self.home_in_place:
            self.unit.home_stale = True  # until every in-place write is done

    def write(
        self,
        spans: Sequence[_SpanLike],
        slots: list[Slot],
        fill: Fill,
        read: Read = None,
        params_out: torch.Tensor | None = None,
        views: Views = None,
    ) -> None:
        """Fill the shadows (see :meth:`run`); every write is finished on return. On an
        error the transfers still running are waited for and the error raised; the
        caller discards. ``params_out``: a host tensor of the unit's compute-dtype
        parameters that also receives the new values, the same bytes the home's shadow
        gets (a step in the next forward leaves them where the unit's fetch takes them,
        instead of that fetch reading back what was just written)."""
        unit, shadows = self.unit, self._shadows
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        chunk_slots: dict[int, Slot] = {}
        # the new parameters are the master's own values (the home is the fp32 master):
        # a chunk's master is then read, stepped and written in ``params_out`` itself,
        # not in the slot's buffer and copied there after
        in_params = params_out is not None and unit.home is unit.master
        try:

            def start_reads(i: int) -> None:
                wait_all(writes.pop(i % len(slots), []))  # the buffer set is free again
                own = slots[i % len(slots)]
                slot = own if views is None else {**own, **views(spans[i])}
                if in_params and slot["master"] is own["master"]:  # (not a view's)
                    slot = {**slot, "master": params_out[spans[i].start : spans[i].end]}
                chunk_slots[i] = slot
                reads[i] = read(spans[i], slot) if read is not None else []

            start_reads(0)
            for i, span in enumerate(spans):
                if i + 1 < len(spans):
                    start_reads(i + 1)
                wait_all(reads.pop(i))
                slot = chunk_slots.pop(i)
                fill(i, span, slot)
                n, n_state = span.end - span.start, span.state_end - span.start
                master = slot["master"][:n]
                handles = [unit.master.write(master, span.start, into=shadows["master"])]
                for key, array in self.states.items() if n_state > 0 else ():
                    handles.append(array.write(slot[key][:n_state], span.start, into=shadows[key]))
                compute = master  # the chunk's new parameters as the home holds them
                if self.home_on_disk:
                    compute = slot["home"][:n]
                    compute.copy_(master)
                    handles.append(unit.home.write(compute, span.start, into=shadows.get("home")))
                elif unit.home is not unit.master:
                    self._touched_memory = True
                    unit.copy_cast(unit.home[span.start : span.end], master)
                out = None if params_out is None else params_out[span.start : span.end]
                if out is not None and out.data_ptr() != compute.data_ptr():
                    out.copy_(compute)
                if unit.has_device_copy and not self.speculative:
                    self._touched_memory = True
                    unit.write_device_copy(master, span.start)
                writes[i % len(slots)] = handles
            for handles in writes.values():
                wait_all(handles)
            for name, whole in self.whole.items():
                whole.array.write(whole.after, 0, into=shadows[name])
                shadows[name].wait_writes()
        except BaseException:
            for handles in list(reads.values()) + list(writes.values()):
                wait_all_quiet(handles)
            raise

    def commit(self) -> None:
        """Make the shadows the unit's arrays (all of them: each commit only swaps regions)."""
        unit = self.unit
        unit.param_version += 1
        for name, array in self.targets.items():
            array.commit(self._shadows.pop(name))
        if self.home_in_place:
            unit.home.wait_writes()
            unit.home_stale = False
        if unit.param_stager is not None:
            unit.param_stager.forget(unit)
        if self.speculative and unit.materialized:
            unit.release()  # its device copy is the old one: the next fetch reads the new
        self._close()

    def _close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def discard(self) -> None:
        """Throw the shadows away; the unit is as before :meth:`begin`."""
        unit = self.unit
        for shadow in self._shadows.values():
            shadow.discard()
        self._shadows.clear()
        if self.home_in_place:  # settle its writes (home_stale stays set)
            try:
                unit.home.wait_writes()
            except BaseException:  # noqa: BLE001 - the first error is being raised
                pass
        if self._touched_memory:
            self._touched_memory = False
            self._restore_memory_copies()
        self._close()

    def _restore_memory_copies(self) -> None:
        """After a failed rewrite: the in-memory home and device copy back from the
        master on disk, which no write touched."""
        unit = self.unit
        n = unit.master_numel  # frozen parameters after it have no master; none changed
        scratch = unit.scratch(n, torch.float32, "restore scratch")
        try:
            master = scratch.tensor[:n]
            unit.master.read(master).wait()
            if not self.home_on_disk and unit.home is not unit.master:
                unit.copy_cast(unit.home[:n], master)
            unit.write_device_copy(master)
        finally:
            unit.tiers.host.free(scratch)
