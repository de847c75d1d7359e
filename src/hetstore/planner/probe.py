"""Measuring what a FLOP count cannot know: one real unit's forward and backward.

A plan made before any step used to turn counted FLOPs into time with one probed matmul
rate, and fell 27-43% short: a transformer block also spends its time in layer norms,
activations, softmax and small matmuls that run far below a large matmul's rate. Here,
while the tracer runs the batch on fake or meta tensors, each unit's call is recorded
(its arguments' shapes, dtypes and whether they require grad); then one unit of each
kind (same module type, same parameter shapes, same call) runs its forward and backward
for real on the compute device, on random tensors of those shapes, in the compute
dtype: a warm-up, then the fastest of a few timed runs (other load on a shared machine
only ever adds time to a run: see ``planner.machine.fastest_rate``), and how much longer the
median run took is kept as the trace's ``compute_spread``. Units of the same kind take that
time; the root unit (embeddings, head, loss: not a module of its own) takes its FLOPs
at the rate the probed units achieved.

The cost is one unit's forward and backward a few times over, a fraction of one step
for a model of many blocks. Nothing of the model is touched: the module runs through
``torch.func.functional_call`` with the random tensors in place of its parameters and
buffers (a meta-device model works too), and the runtime's hooks idle while the
planner traces. A call the probe cannot reproduce (an argument object it cannot
rebuild, a device out of memory) leaves that kind's time to the FLOP estimate, and the
trace says which figures were measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hetstore.errors import OutOfTierMemory
from hetstore.planner.trace import Trace

__all__ = ["Probe", "TensorSpec", "UnitCall", "describe_call", "probe_compute", "timed_runs"]

# timed runs after the warm-up; fewer when one run is long (see timed_runs). Each run's
# saved tensors are held until the backwards (see _time_unit): more runs, more memory
_REPEATS = 3
_PRIMITIVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class Probe:
    """Time units for real on ``device``. ``budget_s``: skip a unit whose forward and
    backward would take longer than this by the FLOP estimate (a dry run of a big model
    on a slow device); None: always probe (``offload()``: training follows anyway)."""

    device: torch.device
    budget_s: float | None = None
    # the budgets its tensors are counted in while it runs (tiers.accounting's
    # MemoryAccount), first that has room: the device's, and on a CPU device the
    # host's too (the same memory); none with room: FLOPs. Empty: not counted
    accounts: tuple = ()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the probe rebuilds it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class _Opaque:
    """An argument the probe cannot rebuild (a cache object, a module): passed as None,
    which is what a training forward without a cache passes."""

    def __repr__(self) -> str:
        return "<opaque>"


_OPAQUE = _Opaque()


@dataclass(frozen=True)
class UnitCall:
    """One unit's forward call: its arguments with tensors as :class:`TensorSpec`."""

    args: tuple
    kwargs: dict

    def key(self) -> str:
        return repr((self.args, sorted(self.kwargs.items())))


def describe_call(args: tuple, kwargs: dict) -> UnitCall:
    def describe(x):
        if isinstance(x, torch.Tensor):
            return TensorSpec(tuple(x.shape), x.dtype, x.requires_grad)
        return x if isinstance(x, _PRIMITIVES) else _OPAQUE

    return UnitCall(tree_map(describe, tuple(args)), tree_map(describe, dict(kwargs)))


def _kind(module: torch.nn.Module, call: UnitCall) -> str:
    tensors = [
        (name, tuple(t.shape), t.dtype)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    return repr((type(module).__qualname__, tensors, call.key()))


def _real(spec: TensorSpec, device: torch.device, float_dtype: torch.dtype) -> torch.Tensor:
    if spec.dtype.is_floating_point:
        tensor = torch.randn(spec.shape, device=device, dtype=float_dtype)
        return tensor.requires_grad_(spec.requires_grad)
    if spec.dtype == torch.bool:  # masks: everything attends
        return torch.ones(spec.shape, device=device, dtype=torch.bool)
    return torch.zeros(spec.shape, device=device, dtype=spec.dtype)  # ids, positions


def _module_tensors(module, device, dtype) -> tuple[dict, list[torch.Tensor]]:
    """Random stand-ins for the module's parameters (floating ones in the compute dtype,
    as the runtime's device copies are) and buffers, and the ones autograd fills."""
    named, leaves = {}, []
    for name, param in module.named_parameters(remove_duplicate=False):
        tensor = _real(TensorSpec(tuple(param.shape), param.dtype, False), device, dtype)
        if tensor.is_floating_point():
            tensor.mul_(0.02)  # small weights keep the activations in range
        named[name] = tensor.requires_grad_(param.requires_grad)
        if param.requires_grad:
            leaves.append(tensor)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        spec = TensorSpec(tuple(buffer.shape), buffer.dtype, False)
        named[name] = _real(spec, device, buffer.dtype)
    return named, leaves


def _time_unit(module, call: UnitCall, device, dtype, most: int = _REPEATS):
    """``(forward_s, backward_s, spread)`` of ``module`` on ``call``'s shapes: the fastest
    forward and backward of the timed runs, and how much longer the median run's forward
    and backward took than the fastest's (None with one timed run).

    After a warm-up, the timed forwards run one after another with every graph kept,
    then the backwards in reverse, as a model's blocks do: each forward's saved tensors
    land in fresh memory (page faults included) instead of the memory the previous run
    just freed, which timed a block 10-20% fast on a CPU."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    named, params = _module_tensors(module, device, dtype)

    def rebuild(x):
        if isinstance(x, TensorSpec):
            return _real(x, device, dtype)
        return None if x is _OPAQUE else x

    def forward() -> tuple[float, list[torch.Tensor]]:
        args, kwargs = tree_map(rebuild, (call.args, call.kwargs))
        sync()
        start = time.perf_counter()
        out = torch.func.functional_call(module, named, args, kwargs, tie_weights=False)
        sync()
        seconds = time.perf_counter() - start
        return seconds, [
            t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]

    def backward(outs: list[torch.Tensor]) -> float:
        sync()
        start = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        sync()
        return time.perf_counter() - start

    with torch.enable_grad():
        first, outs = forward()  # warm-up: the allocator, lazy initialization
        first += backward(outs)
        del outs
        forwards = [forward() for _ in range(min(most, timed_runs(first)))]
        backwards = [backward(outs) for _, outs in reversed(forwards)]
    for param in params:
        param.grad = None
    totals = [f + b for (f, _), b in zip(forwards, reversed(backwards), strict=True)]
    spread = statistics.median(totals) / max(min(totals), 1e-9) - 1 if len(totals) > 1 else None
    return min(f for f, _ in forwards), min(backwards), spread


def _counted_in(accounts: tuple, unit) -> tuple[int, tuple | None]:
    """How many timed runs a probe of ``unit`` makes, and (account, bytes) reserved for
    it: the most runs the first account with room has room for (each run's saved
    tensors are kept, beside the parameters and their gradients in the compute dtype);
    ``_REPEATS`` and nothing reserved without accounts; 0 where none has room."""
    if not accounts:
        return _REPEATS, None
    for repeats in range(_REPEATS, 0, -1):
        need = 2 * unit.param_bytes + repeats * (unit.saved_bytes + unit.kept_bytes)
        for account in accounts:
            try:
                account.reserve(need, "compute probe")
            except OutOfTierMemory:
                continue
            return repeats, (account, need)
    return 0, None


def timed_runs(one_run_s: float) -> int:
    """Fewer timed runs when one is long: the probe stays a fraction of one step; two
    up to 2 s a run, so that a busy second is not all the probe saw."""
    if one_run_s < 0.5:
        return _REPEATS
    return 2 if one_run_s < 2 else 1


def probe_compute(
    trace: Trace,
    specs,
    calls: dict[int, UnitCall],
    device: torch.device,
    dtype: torch.dtype,
    *,
    budget_s: float | None = None,
    accounts: tuple = (),
) -> Trace:
    """``trace`` with each unit's forward and backward seconds measured (see module
    doc). ``calls``: unit index -> its recorded call. ``budget_s``, ``accounts``: see
    :class:`Probe`."""
    machine = trace.machine
    if machine is None or not calls:
        return trace
    timed: dict[str, tuple[float, float, float | None] | None] = {}
    kinds: dict[int, str] = {}
    for index, call in calls.items():
        unit, module = trace.units[index], specs[index].module
        if module is None or unit.is_root:
            continue
        kind = kinds[index] = _kind(module, call)
        if kind in timed:
            continue
        if budget_s is not None and machine.flops and unit.flops / machine.flops > budget_s:
            timed[kind] = None
            continue
        # what it holds at once: the parameters and their gradients in the compute
        # dtype, and the saved tensors of every timed forward (their graphs are kept):
        # as many timed runs as the device budget has room for, none without room
        repeats, counted = _counted_in(accounts, unit)
        if not repeats:  # no room in any budget beside what it holds: FLOPs
            timed[kind] = None
            continue
        try:
            timed[kind] = _time_unit(module, call, device, dtype, repeats)
        except Exception:  # noqa: BLE001 - the module's own code, on arguments rebuilt
            timed[kind] = None  # from shapes: a call it cannot reproduce is left to FLOPs
        finally:
            if counted is not None:
                account, need = counted
                account.release(need, "compute probe")
    measured = {i: timed[k][:2] for i, k in kinds.items() if timed.get(k) is not None}
    if not measured:
        return trace
    spreads = [t[2] for t in timed.values() if t is not None and t[2] is not None]
    # what has no probe (the root: embeddings, head, loss) runs at the rate the probed
    # units achieved: its FLOP-based times, made at the machine's matmul rate, rescaled
    flops = sum(trace.units[i].flops for i in measured)
    seconds = sum(f + b for f, b in measured.values())
    scale = machine.flops * seconds / flops if flops and seconds else 1.0
    units = []
    for index, unit in enumerate(trace.units):
        forward_s, backward_s = measured.get(
            index, (unit.forward_s * scale, unit.backward_s * scale)
        )
        units.append(replace(unit, forward_s=forward_s, backward_s=backward_s))
    blocks = sum(1 for u in trace.units if not u.is_root)
    basis = "probed" if len(measured) == blocks else "partly probed"
    return replace(
        trace,
        units=tuple(units),
        compute_basis=basis,
        compute_spread=max(spreads) if spreads else None,
    )
