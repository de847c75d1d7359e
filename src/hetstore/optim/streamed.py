"""The optimizer step of a unit whose fp32 master and states live on disk, streamed.

ZeRO-Infinity's pipelined swap, chunk by chunk through a fixed set of host buffers: while
chunk ``i`` is stepped, chunk ``i+1``'s master, gradient and moments are being read and
chunk ``i-1``'s are being written. Three buffer sets of ``chunk_numel`` elements per
array bound the host memory whatever the unit's size.

All writes of one unit go into shadow regions (see :mod:`hetstore.tiers.flat`) that
replace the old ones only when every write of the unit has finished. If anything fails
(disk full when allocating the shadow, an IO error) the unit's master, moments, step
counter and compute-dtype copies are exactly as before the step, and the step can be
run again.

A chunk never straddles two optimizer segments (param groups), so one call of the fused
kernel steps it with its group's hyper-parameters; chunks start at multiples of
``chunk_numel`` from the segment start, which keeps every element's arithmetic identical
to stepping the whole segment at once. The padding after a segment and frozen
parameters that keep a master are copied through unchanged; frozen parameters stored
only in the compute dtype are not touched (see :class:`ChunkedRewrite`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from hetstore.footprints import STREAMED_STEP_SLOT_SETS
from hetstore.optim.registry import flat_spec
from hetstore.optim.state_format import (
    BLOCK,
    StateFormat,
    blocks,
    covering,
    decode,
    encode,
    scales_of,
    stored_arrays,
)
from hetstore.runtime.rewrite import ChunkedRewrite, WholeArray, chunk_buffers
from hetstore.runtime.unit import Unit
from hetstore.tier import Tier
from hetstore.tiers.host import own_version_counter
from hetstore.tiers.store import Store, transfers_only

__all__ = ["StreamedUnitStep", "UnitStates", "step_flat", "chunks_of"]


def step_flat(
    inner: Optimizer,
    hyper: dict,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: dict[str, torch.Tensor],
    step: torch.Tensor | None,
    fresh: bool,
) -> dict:
    """One fused step of flat ``param`` with ``grad`` and the fp32 ``states`` (views the
    step updates in place), as ``inner`` (a one-group optimizer of the user's class) would
    step it with the group values ``hyper``; ``step``: the counter before this step (not
    changed here). ``fresh``: torch makes the states itself (SGD's first momentum). The
    one kernel call of every flat step (in memory, compact, streamed; ordinary, ahead or
    in the next forward). Returns the state torch left: the counter after this step, and
    the states (those it made itself, when ``fresh``)."""
    group = inner.param_groups[0]
    group.update(hyper)
    group["params"] = [param]
    param.grad = grad
    state = {} if step is None else {"step": step.clone()}
    if not fresh:
        state.update(states)
    inner.state.clear()
    inner.state[param] = state
    inner.step()
    for key, view in states.items():
        value = inner.state[param].get(key)
        if value is not None and value.data_ptr() != view.data_ptr():
            view.copy_(value)  # a state torch created itself (SGD's first momentum)
    param.grad = None
    stepped = inner.state.pop(param)
    inner.state.clear()
    return stepped


def placeholder_optimizers(
    optimizer_class: type, groups: list[dict], device: torch.device | str = "cpu"
) -> list[Optimizer]:
    """One one-group optimizer of ``optimizer_class`` per group values in ``groups``,
    over a placeholder: what :func:`step_flat` steps flat tensors through."""
    placeholder = torch.zeros(1, device=device)
    return [optimizer_class([{**group, "params": [placeholder]}]) for group in groups]


def _scales_name(key: str) -> str:
    return f"{key} scales"


@dataclass(frozen=True)
class _Chunk:
    segment: int | None  # index into unit.segments; None: frozen tail, copied through
    start: int
    end: int  # master/home range [start, end)
    state_end: int  # grad/state range [start, state_end)
    step_end: int  # stepped range [start, step_end)


def chunks_of(unit: Unit, chunk_numel: int) -> list[_Chunk]:
    """The master's elements ``[0, master_numel)`` in chunks: frozen parameters without
    a master are not part of a step at all."""
    end = unit.master_numel
    spans = [(i, s.start, s.end) for i, s in enumerate(unit.segments)]
    tail = unit.segments[-1].end if unit.segments else 0
    tail += -tail % unit.align
    if tail < end:
        spans.append((None, tail, end))
    chunks = []
    for k, (segment, start, seg_end) in enumerate(spans):
        span_end = spans[k + 1][1] if k + 1 < len(spans) else end
        for a in range(start, span_end, chunk_numel):
            b = min(a + chunk_numel, span_end)
            stepped = min(b, seg_end) if segment is not None else a
            chunks.append(_Chunk(segment, a, b, min(b, unit.trainable_numel), stepped))
    return chunks


class UnitStates:
    """What a chunked unit step owns, in memory or on disk: the unit's optimizer states
    in the format's arrays (and 8-bit block scales) on ``tier``, one step counter per
    segment, and one placeholder optimizer per segment through which torch's fused
    kernel gets the group's values (:func:`step_flat`)."""

    def __init__(
        self,
        unit: Unit,
        optimizer_class: type,
        hyper: Callable[[int], dict],
        state_keys: tuple[str, ...],
        chunk_numel: int,
        fmt: StateFormat,
        tier: Tier,
        device: torch.device | str = "cpu",
    ):
        self.unit = unit
        self.optimizer_class = optimizer_class
        self.hyper = hyper
        self.format = fmt
        self.has_step = flat_spec(optimizer_class).has_step
        # chunks start at multiples of the layout's alignment (and of the 8-bit block)
        self.chunk_numel = max(unit.align, chunk_numel // unit.align * unit.align)
        self.states: dict = {}  # per element, in the format's dtype
        self.scales: dict = {}  # 8-bit: each block's scale
        for key in state_keys:
            for suffix, (dtype, size) in stored_arrays(fmt, unit.trainable_numel).items():
                array = unit.allocate(tier, size, dtype, f"{key} {suffix}".strip())
                (self.scales if suffix else self.states)[key] = array
        self.steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in unit.segments]
        self.stepped = False  # states hold values (else: fresh, as torch starts them)
        self._inner = placeholder_optimizers(
            optimizer_class, [hyper(s.group) for s in unit.segments], device
        )

    @property
    def states_absent(self) -> bool:
        """True when torch creates the states itself on the first step (SGD momentum);
        Adam's fresh states are zeros."""
        return not self.stepped and not self.has_step

    def held_tensors(self) -> list:
        """Every array it keeps (states and scales: tensors, or stores on disk) and the
        step counts."""
        return [*self.states.values(), *self.scales.values(), *self.steps]

    def _count_step(self) -> None:
        for counter in self.steps:
            counter += 1
        self.stepped = True

    def mark_loaded(self, segment_steps: list[float] | None) -> None:
        """After a checkpoint rewrote the states: each segment's step counter, or
        ``None`` for states that are fresh (never stepped)."""
        if segment_steps is None:
            for counter in self.steps:
                counter.zero_()
            self.stepped = False
            return
        for counter, value in zip(self.steps, segment_steps, strict=True):
            counter.fill_(float(value))
        self.stepped = True

    # ------------------------------------------------------------------ state arrays
    def _read_decoded(self, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start+numel)`` of state ``key`` as fp32 (whole blocks are
        read and decoded in the 8-bit format)."""
        array = self.states[key]
        if self.format.exact:
            out = torch.empty(numel, dtype=torch.float32)
            array.read(out, start).wait()
            return out
        a, b = covering(start, numel, array.numel)
        codes = torch.empty(b - a, dtype=array.dtype)
        array.read(codes, a).wait()
        scales = None
        if key in self.scales:
            scales = torch.empty(blocks(b) - a // BLOCK, dtype=torch.float32)
            self.scales[key].read(scales, a // BLOCK).wait()
        out = torch.empty(b - a, dtype=torch.float32)
        decode(self.format, key, codes, scales, out)
        return out[start - a : start - a + numel]

    def _write_encoded(self, key: str, flat: torch.Tensor) -> None:
        """State ``key`` from fp32 ``flat`` (all of it; overwritten in the 8-bit format)."""
        array = self.states[key]
        if self.format.exact:
            array.write_all(flat)
            return
        codes = torch.empty(array.numel, dtype=array.dtype)
        scales = torch.empty(self.scales[key].numel) if key in self.scales else None
        encode(self.format, key, flat, codes, scales)
        array.write_all(codes)
        if scales is not None:
            self.scales[key].write_all(scales)


class StreamedUnitStep(UnitStates):
    """Owns a disk unit's optimizer states and steps them (see module doc)."""

    def __init__(
        self,
        unit: Unit,
        optimizer_class: type,
        hyper: Callable[[int], dict],
        state_keys: tuple[str, ...],
        chunk_numel: int,
        fmt: StateFormat,
    ):
        super().__init__(unit, optimizer_class, hyper, state_keys, chunk_numel, fmt, Tier.DISK)
        self._chunks = chunks_of(unit, self.chunk_numel)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(
        self,
        grad_multipliers: list,
        *,
        hyper: dict | None = None,
        has_grad: tuple[bool, ...] | None = None,
        read_ahead: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Step every segment of the unit; all-or-nothing (see module doc). ``hyper`` and
        ``has_grad``: the group values and gradient flags taken when the step was called
        (a step finished in the next forward that failed on the worker runs again here,
        after ``zero_grad`` or a scheduler may have changed the live ones).
        ``read_ahead``: see :meth:`run_into_shadows`."""
        unit = self.unit
        if unit.grad_stager is not None:
            unit.grad_stager.finish()  # backward's gradient writes, and their errors
        rewrite = self.new_rewrite()
        names = self.slot_names() if transfers_only(unit.grad) else self.state_slot_names(rewrite)
        if read_ahead is not None:  # stepped where it was read (_views_of): no buffers
            names = [(name, dtype) for name, dtype in names if name not in read_ahead]
        if hyper is None:
            hyper = {s.group: self.hyper(s.group) for s in unit.segments}
        try:
            # (longest_chunk: less than a chunk for a unit smaller than one, so a small
            # model does not pay for big chunks)
            sets, buffers = chunk_buffers(
                unit.tiers.host, self.slot_sets, names, self.longest_chunk, f"swap {unit.name}"
            )
        except BaseException:
            rewrite.discard()
            raise
        lent = None
        try:
            if unit.grad_stager is not None:
                # the last gradients written, still in the stager's buffer: not read back
                # (taken inside: the chunk buffers above are freed whatever it raises)
                lent = unit.grad_stager.lend_written(unit, has_grad)
            read, fill = self._pipeline(
                grad_multipliers,
                hyper,
                rewrite,
                grads=lent,
                live_grads=lent is not None,
                has_grad=has_grad,
                read_ahead=read_ahead,
            )
            rewrite.run(self._chunks, sets, fill, read, views=self._views_of(read_ahead))
        finally:
            for buffer in buffers:
                unit.tiers.host.free(buffer)
            if lent is not None:
                unit.grad_stager.give_back(unit)
        self._count_step()

    # ------------------------------------------------------------------ the format
    def new_rewrite(self, speculative: bool = False) -> ChunkedRewrite:
        """The rewrite of this unit's master and states. In the 8-bit format it carries
        the block scales (:class:`WholeArray`): the current ones read whole into host
        memory, and the new ones, filled chunk by chunk and written whole at its end."""
        if not self.scales:
            return ChunkedRewrite(self.unit, self.states, speculative=speculative)
        host = self.unit.tiers.host
        taken = []

        def free() -> None:
            for buffer in taken:
                host.free(buffer)
            taken.clear()

        def host_copy(array: Store, key: str) -> torch.Tensor:
            buffer = self.unit.scratch(array.numel, torch.float32, f"{key} scales")
            taken.append(buffer)
            return buffer.tensor[: array.numel]

        try:
            whole = {}
            for key, array in self.scales.items():
                before = host_copy(array, key)
                array.read(before).wait()
                whole[_scales_name(key)] = WholeArray(array, before, host_copy(array, key))
            return ChunkedRewrite(
                self.unit, self.states, speculative=speculative, whole=whole, on_close=free
            )
        except BaseException:
            free()
            raise

    def state_slot_names(self, rewrite: ChunkedRewrite) -> list[tuple[str, torch.dtype]]:
        """The rewrite's buffers, and fp32 ones to step compact states in."""
        names = rewrite.slot_arrays()
        if not self.format.exact:
            names += [(f"{key} fp32", torch.float32) for key in self.states]
        return names

    def decode_chunk(self, rewrite: ChunkedRewrite, slot, start: int, n_state: int) -> None:
        """Compact formats: the chunk's states, from ``slot[key]``, as fp32 in
        ``slot[key + " fp32"]``."""
        for key in self.states:
            out = slot[f"{key} fp32"][:n_state]
            if self.states_absent:  # not read: fresh (the padding must stay zero)
                out.zero_()
                continue
            scales = self._scales(rewrite, key, "before")
            decode(self.format, key, slot[key][:n_state], scales_of(scales, start, n_state), out)

    def encode_chunk(self, rewrite: ChunkedRewrite, slot, start: int, n_state: int) -> None:
        """Compact formats: ``slot[key + " fp32"]`` stored back into ``slot[key]`` (and
        the new block scales)."""
        for key in self.states:
            scales = scales_of(self._scales(rewrite, key, "after"), start, n_state)
            encode(self.format, key, slot[f"{key} fp32"][:n_state], slot[key][:n_state], scales)

    @staticmethod
    def _scales(rewrite: ChunkedRewrite, key: str, side: str) -> torch.Tensor | None:
        whole = rewrite.whole.get(_scales_name(key))
        return None if whole is None else getattr(whole, side)

    # ------------------------------------------------------------------ step ahead
    # A speculative step (hetstore.optim.step_ahead): the same arithmetic, from
    # gradients in memory, into shadows that :meth:`commit` makes the unit's arrays.
    def slot_names(self) -> list[tuple[str, torch.dtype]]:
        """The worker's buffers: the rewrite's, and one for gradients (read from disk,
        or multiplied by fp16's unscale factor without touching the live ones)."""
        rewrite = ChunkedRewrite(self.unit, self.states)
        return self.state_slot_names(rewrite) + [("grad", torch.float32)]

    @property
    def shadow_bytes(self) -> int:
        """Disk bytes a step of this unit holds beside its arrays until it commits."""
        scales = sum(array.reserved_bytes for array in self.scales.values())
        return ChunkedRewrite(self.unit, self.states).shadow_bytes + scales

    @property
    def longest_chunk(self) -> int:
        return max(c.end - c.start for c in self._chunks)

    @property
    def slot_sets(self) -> int:
        """Buffer sets a step of this unit pipelines through (no more than its chunks)."""
        return min(STREAMED_STEP_SLOT_SETS, len(self._chunks))

    def begin_speculation(self) -> ChunkedRewrite:
        """Main thread: the shadows of a speculative step (raises when the disk is full)."""
        rewrite = self.new_rewrite(speculative=True)
        try:
            rewrite.begin()
        except BaseException:
            rewrite.discard()
            raise
        return rewrite

    @torch.no_grad()
    def run_into_shadows(
        self,
        rewrite: ChunkedRewrite,
        slots: list,
        hyper: dict,
        multipliers: list,
        *,
        live_grads: bool,
        grads: torch.Tensor | None = None,
        has_grad: tuple[bool, ...] | None = None,
        params_out: torch.Tensor | None = None,
        read_ahead: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Any thread: the step into ``rewrite``'s shadows with the group values
        ``hyper`` (taken when it was made), from the gradients where they are or in
        ``grads`` (a host copy of gradients on disk), multiplied by ``multipliers``:

        - in backward, speculative: fp16's unscale factor, applied into the slot's own
          buffer (``live_grads``: the worker never writes gradients others own);
        - in the next forward (:meth:`ForwardSteps.hand_over`): the step :meth:`step`
          would take now, with that call's gradient flags ``has_grad`` and multipliers
          (clip, unscale), missing gradients zeroed before (read from disk, in the
          slot: zeroed there too).

        ``params_out``: see :meth:`ChunkedRewrite.write`. ``read_ahead``: the whole master
        (``"master"``) and states (by key), read from disk earlier, copied from instead
        of read."""
        read, fill = self._pipeline(
            multipliers, hyper, rewrite, grads, live_grads, has_grad, read_ahead
        )
        views = self._views_of(read_ahead)
        rewrite.write(self._chunks, slots, fill, read, params_out=params_out, views=views)

    def _views_of(self, read_ahead: dict[str, torch.Tensor] | None):
        """The chunks of what was read ahead (the whole master and states, in host
        buffers of the step's own until it ends), stepped in place and written from
        there: no copy into the slot's buffers and back (24 bytes a parameter)."""
        if read_ahead is None:
            return None
        # fp32 states only (optim.policy.read_ahead): a compact format's chunk must
        # be decoded from its own dtype, and its block scales are read whole
        assert self.format.exact and not self.scales, "read ahead of compact states"
        keys = [k for k in self.states if k in read_ahead and not self.states_absent]
        master = read_ahead["master"]

        def views(c: _Chunk) -> dict[str, torch.Tensor]:
            out = {"master": master[c.start : c.end]}
            if c.state_end > c.start:
                out.update({k: read_ahead[k][c.start : c.state_end] for k in keys})
            return out

        return views

    def commit_speculation(self, rewrite: ChunkedRewrite) -> None:
        rewrite.commit()
        self._count_step()

    def _pipeline(
        self,
        grad_multipliers: list,
        hyper: dict,
        rewrite: ChunkedRewrite,
        grads: torch.Tensor | None = None,
        live_grads: bool = False,
        has_grad: tuple[bool, ...] | None = None,
        read_ahead: dict[str, torch.Tensor] | None = None,
    ):
        unit = self.unit
        if grads is None and isinstance(unit.grad, torch.Tensor):
            grads = unit.grad
        grad_on_disk = grads is None

        def read(c: _Chunk, slot) -> list:
            handles = []
            if read_ahead is None:  # (else it is the slot's own already: _views_of)
                handles.append(unit.master.read(slot["master"][: c.end - c.start], c.start))
            n_state = c.state_end - c.start
            if n_state > 0:
                if grad_on_disk:
                    handles.append(unit.grad.read(slot["grad"][:n_state], c.start))
                if read_ahead is None and not self.states_absent:
                    for key, array in self.states.items():
                        handles.append(array.read(slot[key][:n_state], c.start))
            return handles

        def fill(i: int, c: _Chunk, slot) -> None:
            n_state = c.state_end - c.start
            compact = not self.format.exact and n_state > 0
            if compact:
                self.decode_chunk(rewrite, slot, c.start, n_state)
            if c.segment is not None and c.step_end > c.start:
                stepped = slot["master"][: c.end - c.start]
                grad = slot["grad"] if grad_on_disk else grads[c.start : c.step_end]
                self._step_chunk(
                    c, slot, stepped, grad, grad_multipliers, hyper, live_grads, has_grad
                )
            if compact:
                self.encode_chunk(rewrite, slot, c.start, n_state)

        return read, fill

    def _step_chunk(
        self,
        c: _Chunk,
        slot,
        master,
        grad,
        multipliers,
        hyper: dict,
        live_grads: bool,
        has_grad: tuple[bool, ...] | None = None,
    ) -> None:
        """Step elements ``[c.start, c.step_end)``: ``master`` and ``grad`` start at
        ``c.start`` (the slot's buffers, or a view of gradients in memory). ``live_grads``:
        a worker's step (ahead, or in the next forward), which reads gradients others
        own and writes nothing but its slot; else missing gradients are zeroed, by the
        flags ``has_grad`` (None: the live ones)."""
        unit = self.unit
        n = c.step_end - c.start
        grad = grad[:n]
        if live_grads:
            # nothing to fill (every parameter had its gradient when a speculation began;
            # a step in the next forward had the missing ones zeroed first), and the
            # worker must never write the gradients: a factor goes into the slot's own;
            # its fused step must not move the buffer's version counter either
            if multipliers and grad.data_ptr() != slot["grad"].data_ptr():
                grad = torch.mul(grad, multipliers[0], out=slot["grad"][:n])
                multipliers = multipliers[1:]
            grad = own_version_counter(grad)
        else:
            unit.grads.fill_missing(grad, c.start, has_grad)  # like the in-memory step: zeros
        for m in multipliers:
            grad.mul_(m)
        fp32 = "" if self.format.exact else " fp32"  # the slot buffers stepped in fp32
        states = {key: slot[key + fp32][:n] for key in self.states}
        hyper_of = hyper[unit.segments[c.segment].group]
        step = self.steps[c.segment] if self.has_step else None
        step_flat(
            self._inner[c.segment], hyper_of, master[:n], grad, states, step, self.states_absent
        )

    # ------------------------------------------------------------------ state dict
    def read_state(self, key: str, start: int, numel: int) -> torch.Tensor | None:
        """Elements ``[start, start+numel)`` of state ``key`` (None before the first step)."""
        if not self.stepped:
            return None
        return self._read_decoded(key, start, numel)

    def write_states(self, values: dict[str, list[tuple[int, torch.Tensor]]], step) -> None:
        """Overwrite slices of the states: ``values[key] = [(start, flat tensor), ...]``;
        every segment's step counter becomes ``step`` (torch keeps one per parameter; a
        loaded state has one value for all of a unit's parameters in practice)."""
        unit = self.unit
        unit.before_state_change()
        n = unit.trainable_numel
        scratch = unit.scratch(n, torch.float32, "state scratch")
        try:
            for key, array in self.states.items():
                flat = scratch.tensor[:n]
                if self.format.exact:
                    array.read(flat).wait()
                else:
                    flat.copy_(self._read_decoded(key, 0, n))
                for start, value in values.get(key, []):
                    flat[start : start + value.numel()].copy_(value.reshape(-1))
                self._write_encoded(key, flat)
        finally:
            unit.tiers.host.free(scratch)
        if step is not None:
            for counter in self.steps:
                counter.fill_(float(step))
        self.stepped = True
