"""``hetstore.evict`` / ``hetstore.restore``: give an offloaded model's device memory back
between training steps and take it again (colocated RL: the inference engine rolls out
in between on the same device).

What moves is every byte hetstore holds on the device: the units' buffers the device
tier made (parameters placed there, fp32 masters, gradients, optimizer states), the
optimizer's step counts there, the model's buffers, and the fetched copies of
parameters whose home is elsewhere (those are dropped, not copied: their home holds
the values). Each distinct storage is copied whole into one host buffer (the host tier's
pinned blocks; a disk array where the host budget is short), and then its bytes are
freed with ``UntypedStorage.resize_(0)``, FSDP2's trick: every tensor, view and
``nn.Parameter`` that shares the storage stays the same object, so the optimizer's
states, the units' views and the user's references need no rewiring, and ``restore``
gives the same storages their bytes back and copies the values in. The values are the
bytes themselves, so training after any number of cycles is bitwise what it is without
them.

While evicted, every use that would touch those storages refuses, naming
``hetstore.restore``, before anything moves: a forward of the model or of one of its
blocks (``OffloadRuntime.refusal``; a streaming eval forward is not offered: the
inference engine is the one that rolls out), its state dicts and copies, the
optimizer's step, zero_grad, clip and state dicts (``OffloadedOptimizer.refusal``),
reads of its parameters and of ``p.grad`` (``Unit.refusal``; parameters homed on the
device are concealed meanwhile), checkpoints and ``named_weights`` (sync the weights
before ``evict``). The model's buffers are meta tensors until ``restore``.

The host buffers are kept after ``restore`` for the next ``evict`` (pinned once, no
allocation per cycle), and stay counted in the host tier as ``'eviction buffers'``; the
host tier gives them back first when it runs out of room (``HostTier.reclaimers``), and
``restore(model, keep_buffers=False)`` or ``hetstore.release`` at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from hetstore._sizes import format_size
from hetstore.errors import ConfigError
from hetstore.model_state import ModelState, is_released, state_of
from hetstore.tier import Tier
from hetstore.tiers import HostBuffer
from hetstore.tiers.host import HostTier
from hetstore.tiers.store import read_into, write_from

__all__ = ["evict", "restore", "is_evicted", "refuse_if_evicted", "EvictionReport"]

_EVICTED = "evicted"  # the host tier's label for the copies while evicted
_KEPT = "eviction buffers"  # ... and for the buffers kept between cycles
_CHUNK = 64 << 20  # a CUDA storage spilled to disk crosses host memory in pieces this big


@dataclass
class EvictionReport:
    """What an ``evict`` or a ``restore`` moved: bytes per tier the copies went to (or
    came from), how many storages, and the seconds it took."""

    bytes: dict[str, int] = field(default_factory=dict)
    storages: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __str__(self) -> str:
        where = ", ".join(f"{format_size(n)} {tier}" for tier, n in self.bytes.items()) or "0 B"
        rate = self.total / self.seconds / 2**30 if self.seconds > 0 else 0.0
        return (
            f"{where} in {self.storages} storages, {self.seconds * 1e3:.1f} ms ({rate:.2f} GiB/s)"
        )


@dataclass(eq=False)
class _Moved:
    """One storage evicted: its bytes wait in ``copy`` (a host buffer or a disk array)."""

    storage: torch.UntypedStorage
    nbytes: int
    copy: object
    tier: Tier
    buffer: bool  # a module buffer's (the model keeps them after a release)


@dataclass(eq=False)
class Eviction:
    """One model's evictions (``ModelState.eviction``): what the current one took, and
    the host buffers kept between cycles."""

    host: HostTier
    moved: list[_Moved] = field(default_factory=list)
    held: dict[str, int] | None = None  # the device tier's holders while evicted
    # the model's buffers while evicted: (module, name, the buffer), a meta tensor in
    # its place (a read says it has no data, instead of touching freed memory)
    buffers: list = field(default_factory=list)
    spare: list[HostBuffer] = field(default_factory=list)  # kept for the next evict

    @property
    def active(self) -> bool:
        return self.held is not None

    def reclaim(self) -> bool:
        """The host tier is out of room: give the kept buffers back (they are made again
        at the next evict). True when something was freed."""
        if not self.spare:
            return False
        for buffer in self.spare:
            self.host.free(buffer)
        self.spare = []
        return True


def is_evicted(model: nn.Module) -> bool:
    """``model`` is evicted: its device bytes wait in host memory (or on disk)."""
    state = state_of(model)
    return state is not None and state.eviction is not None and state.eviction.active


def evict(model: nn.Module, optimizer=None) -> EvictionReport:
    """Move every byte hetstore holds on the device for ``model`` to host memory (or disk
    where the host budget is short); afterwards its device tier holds zero bytes. Pending
    step work lands first. Evicting an evicted model does nothing. See the module doc."""
    state = _checked(model, optimizer, "evict")
    if state.eviction is None:
        state.eviction = Eviction(state.tiers.host)
    eviction = state.eviction
    if eviction.active:
        return EvictionReport()
    runtime = state.runtime
    if torch._C._current_graph_task_id() != -1:
        raise ConfigError("hetstore.evict() called during a backward: call it between steps")
    if runtime.graph_alive:
        raise ConfigError(
            "hetstore.evict(): a forward's graph awaits its backward (it reads the device "
            "copies); run the backward, or drop the loss, before evicting"
        )
    opt = runtime.optimizer() if runtime.optimizer is not None else None
    if opt is not None:
        opt.finish_steps_in_forward()  # (a step still running on from the last step())
    for unit in runtime.units:
        unit.barrier()
        unit.release()  # fetched copies: their home holds the values (no graph reads them)
    _refuse_transient_holders(state)
    storages = _device_storages(model, state, opt)  # (after the steps landed)
    start = time.perf_counter()
    buffers = {
        b.untyped_storage().data_ptr() for b in model.buffers() if b.device == state.tiers.device
    }
    moved = _copy_out(state, storages, eviction, buffers)
    why = (
        f"this {type(model).__name__} is evicted (hetstore.evict), its device memory given "
        "back; call hetstore.restore(model) first"
    )
    # (from here nothing can fail: every refusal is set before a storage loses its bytes)
    runtime.refusal = why
    if opt is not None:
        opt.refusal = why
    for unit in runtime.units:  # reads of its parameters and gradients refused
        unit.refusal = why
        if unit.materialized:  # (parameters homed on the device: concealed meanwhile)
            unit.conceal_params()
    eviction.buffers = _swap_buffers(model, storages)
    for m in moved:
        m.storage.resize_(0)
    eviction.moved = moved
    eviction.held = state.tiers.device_tier.account.take_all()
    if state.tiers.device.type == "cuda":
        torch.cuda.empty_cache()  # the cached blocks those storages left
    return _report(moved, start)


def restore(model: nn.Module, optimizer=None, *, keep_buffers: bool = True) -> EvictionReport:
    """Bring back what ``evict`` moved, the first units' storages first; afterwards the
    model trains as if it never left. Restoring a model that is not evicted does nothing.
    Refused before any work if the device budget cannot hold it again. ``keep_buffers``:
    keep the host buffers for the next ``evict`` (counted in the host tier, and given
    back first whenever the host tier runs out of room), or give them back now."""
    state = _checked(model, optimizer, "restore")
    eviction = state.eviction
    if eviction is None or not eviction.active:
        return EvictionReport()
    account = state.tiers.device_tier.account
    account.give_back_all(eviction.held)  # (raises, nothing done, past the budget)
    start = time.perf_counter()
    done: list[_Moved] = []
    cuda = state.tiers.device.type == "cuda"
    try:
        for m in eviction.moved:
            m.storage.resize_(m.nbytes)
            done.append(m)
            _copy_in(state, m)
        # On CUDA the copies are queued on the compute stream in the units' order and
        # the host does not wait: the next forward is launched while they run, and its
        # kernels follow them in stream order. Only buffers given back wait for them.
        if cuda and not keep_buffers:
            torch.cuda.current_stream(state.tiers.device).synchronize()
    except BaseException:
        for m in done:  # still evicted, as before the call: the copies hold the values
            m.storage.resize_(0)
        for label, nbytes in eviction.held.items():
            account.release(nbytes, label)
        raise
    for m in eviction.moved:
        if keep_buffers and isinstance(m.copy, HostBuffer):
            state.tiers.host.rename(m.copy, _KEPT)
            eviction.spare.append(m.copy)
        else:
            _free_copy(state, m)
    if eviction.spare and eviction.reclaim not in state.tiers.host.reclaimers:
        state.tiers.host.reclaimers.append(eviction.reclaim)
    report = _report(eviction.moved, start)
    _put_back(model, state, eviction)
    return report


def forget(state: ModelState) -> None:
    """The model is being released: free the copies and the kept buffers, and if it is
    evicted give the device tier its holders back (the release frees the units' buffers
    as it always does) and the model's buffers their bytes (the model keeps them)."""
    eviction = state.eviction
    if eviction is None:
        return
    model = state.runtime.model
    moved = eviction.moved
    if eviction.active:
        for m in moved:
            if m.buffer:
                m.storage.resize_(m.nbytes)
                _copy_in(state, m)
        state.tiers.device_tier.account.give_back_all(eviction.held)
        _put_back(model, state, eviction)
    for m in moved:
        _free_copy(state, m)
    eviction.moved = []
    eviction.reclaim()
    if eviction.reclaim in state.tiers.host.reclaimers:
        state.tiers.host.reclaimers.remove(eviction.reclaim)
    state.eviction = None


def _put_back(model: nn.Module, state: ModelState, eviction: Eviction) -> None:
    """Undo what an evict changed besides the bytes: the model's buffers, the concealed
    parameters, the refusals."""
    for module, name, buffer in eviction.buffers:
        module._buffers[name] = buffer  # (the buffer object it had; its bytes are back)
    eviction.buffers = []
    runtime = state.runtime
    for unit in runtime.units:
        unit.refusal = None
        if unit.materialized:
            unit.expose_params()
    if runtime.activations is not None:
        runtime.activations.note_buffers(model)  # (their storages have new addresses)
    runtime.refusal = None
    opt = runtime.optimizer() if runtime.optimizer is not None else None
    if opt is not None:
        opt.refusal = None
    eviction.moved, eviction.held = [], None


# ---------------------------------------------------------------------- what moves
def _checked(model: nn.Module, optimizer, what: str) -> ModelState:
    if not isinstance(model, nn.Module):
        raise TypeError(f"hetstore.{what}() takes an nn.Module, got {type(model).__name__}")
    if is_released(model):
        raise ConfigError(f"hetstore.{what}(): this model was released by hetstore.release()")
    state = state_of(model)
    if state is None:
        raise ConfigError(
            f"hetstore.{what}() takes a model returned by hetstore.offload(); this "
            f"{type(model).__name__} is not offloaded"
        )
    runtime = state.runtime
    mine = runtime.optimizer() if runtime.optimizer is not None else None
    if optimizer is not None and optimizer is not mine:
        raise ConfigError(
            f"hetstore.{what}(model, optimizer): this optimizer is not the one "
            "hetstore.offload() returned with the model; pass that one, or none"
        )
    return state


def _refuse_transient_holders(state: ModelState) -> None:
    """Evict only what lives between steps (the units released first): the units' own
    device buffers and the model's buffers. Anything more on the device belongs to a
    step under way (a forward's saved tensors, gradients in flight) and would be lost:
    refused before anything moves."""
    account = state.tiers.device_tier.account
    between_steps = dict(account.holders(n=1 << 30)).get("module buffers", 0)
    for unit in state.runtime.units:
        between_steps += sum(
            b.numel() * b.element_size()
            for b in unit.buffers_on(Tier.DEVICE)
            if isinstance(b, torch.Tensor)
        )
    if account.current != between_steps:
        units = tuple(" " + u.name for u in state.runtime.units)
        listed = ", ".join(
            f"{label!r} ({n} bytes)"
            for label, n in account.holders(n=8)
            if label.startswith(("grad in flight", "grad bucket")) or not label.endswith(units)
        )
        raise ConfigError(
            f"hetstore.evict(): the device holds {account.current - between_steps} bytes "
            f"of a step under way ({listed or 'scratch'}). Evict between steps, after "
            "optimizer.step() (a forward's saved tensors go with its backward)"
        )


def _device_storages(model: nn.Module, state: ModelState, opt) -> list[torch.UntypedStorage]:
    """Every distinct storage with bytes on the device that the model's units, its
    optimizer and its buffers keep, the units' in the runtime's order (so restore brings
    the first units back first)."""
    device = state.tiers.device
    tensors: list[torch.Tensor] = []
    for unit in state.runtime.units:
        tensors.extend(b for b in unit.buffers_on(Tier.DEVICE) if isinstance(b, torch.Tensor))
    if opt is not None:
        for unit_step in opt.unit_steps:  # (its step counts sit beside its master)
            if unit_step.unit.placement.optimizer is Tier.DEVICE:
                tensors.extend(t for t in unit_step.held_tensors() if isinstance(t, torch.Tensor))
    tensors.extend(model.buffers())
    seen: set[int] = set()
    out = []
    for tensor in tensors:
        if tensor.device != device:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(storage)
    return out


def _swap_buffers(model: nn.Module, storages: list[torch.UntypedStorage]) -> list:
    """Put a meta tensor in place of each module buffer whose storage is evicted (a read
    of it then says it has no data); returns what to put back."""
    evicted = {s.data_ptr() for s in storages}
    swapped = []
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.untyped_storage().data_ptr() in evicted:
                swapped.append((module, name, buffer))
    for module, name, buffer in swapped:
        module._buffers[name] = torch.empty_like(buffer, device="meta")
    return swapped


# ---------------------------------------------------------------------- the copies
def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy_out(
    state: ModelState, storages: list[torch.UntypedStorage], eviction: Eviction, buffers: set[int]
) -> list[_Moved]:
    """Each storage's bytes into a host buffer (a kept one of its size first), or a disk
    array where the host budget is short; all or nothing (a failure gives back what was
    made and leaves the device as it was)."""
    host = state.tiers.host
    moved: list[_Moved] = []
    cuda = state.tiers.device.type == "cuda"
    if cuda:  # (the last restore's copies may still read the kept buffers)
        torch.cuda.current_stream(state.tiers.device).synchronize()
    spare = {}
    for buffer in eviction.spare:
        spare.setdefault(buffer.nbytes, []).append(buffer)
    eviction.spare = []
    try:
        for storage in storages:
            nbytes, key = storage.nbytes(), storage.data_ptr()
            flat = _as_bytes(storage)
            kept = spare.get(nbytes)
            if kept:
                buffer = kept.pop()
                host.rename(buffer, _EVICTED)
                moved.append(_Moved(storage, nbytes, buffer, Tier.HOST, key in buffers))
                buffer.tensor[:nbytes].copy_(flat, non_blocking=cuda)
            elif host.account.would_fit(nbytes):
                buffer = host.allocate(nbytes, _EVICTED, torch.uint8)
                moved.append(_Moved(storage, nbytes, buffer, Tier.HOST, key in buffers))
                buffer.tensor[:nbytes].copy_(flat, non_blocking=cuda)
            else:
                array = state.tiers.disk.allocate_flat(nbytes, torch.uint8, "evicted")
                moved.append(_Moved(storage, nbytes, array, Tier.DISK, key in buffers))
                if cuda:
                    torch.cuda.current_stream(state.tiers.device).synchronize()
                for at in range(0, nbytes, _CHUNK):
                    write_from(array.data, flat[at : at + _CHUNK].cpu(), at)
        if cuda:
            torch.cuda.current_stream(state.tiers.device).synchronize()
    except BaseException:
        for m in moved:
            _free_copy(state, m)
        for buffers in spare.values():
            eviction.spare.extend(buffers)
        raise
    for buffers in spare.values():  # (the model's storages changed size: not needed)
        for buffer in buffers:
            host.free(buffer)
    return moved


def _copy_in(state: ModelState, m: _Moved) -> None:
    flat = _as_bytes(m.storage)
    if m.tier is Tier.HOST:
        flat.copy_(m.copy.tensor[: m.nbytes], non_blocking=flat.device.type == "cuda")
        return
    if flat.device.type == "cpu":
        read_into(m.copy.data, flat)
        return
    for at in range(0, m.nbytes, _CHUNK):
        piece = torch.empty(min(_CHUNK, m.nbytes - at), dtype=torch.uint8)
        read_into(m.copy.data, piece, at)
        flat[at : at + piece.numel()].copy_(piece)


def _free_copy(state: ModelState, m: _Moved) -> None:
    if isinstance(m.copy, HostBuffer):
        state.tiers.host.free(m.copy)
    else:
        m.copy.free()


def _report(moved: list[_Moved], start: float) -> EvictionReport:
    report = EvictionReport(storages=len(moved), seconds=time.perf_counter() - start)
    for m in moved:
        report.bytes[m.tier.label] = report.bytes.get(m.tier.label, 0) + m.nbytes
    return report


def refuse_if_evicted(model: nn.Module, what: str) -> None:
    """Raise a ConfigError naming ``what`` (a call that reads the model's weights or
    states) when ``model`` is evicted."""
    if is_evicted(model):
        raise ConfigError(
            f"{what}: this {type(model).__name__} is evicted (hetstore.evict), its device "
            "memory given back; call hetstore.restore(model) first (or read the weights "
            "before evicting)"
        )
