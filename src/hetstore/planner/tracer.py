"""Tracing a model for the planner without running it: shapes, saved bytes and FLOPs.

The model's forward runs once on fake tensors (``FakeTensorMode``: shapes and dtypes
propagate, nothing is allocated or computed) -- or, for a model built under
``torch.device("meta")``, on meta tensors -- under ``saved_tensors_hooks`` and
``FlopCounterMode``. Each unit's forward hooks attribute what is saved and counted to
the unit that runs; the rest (embeddings, head, loss) is the root's. Backward is not
run: its FLOPs are taken as twice the forward's (two matmuls per forward matmul).

Model data comes from the units themselves: elements, trainable elements (in the
optimizer, or requiring grad when there is none), the compute dtype, and the optimizer
state bytes per element (Adam 8, or 12 with amsgrad; SGD with momentum 4; without an
optimizer AdamW is assumed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hetstore.optim.registry import flat_steppable, state_count, state_itemsize
from hetstore.planner.probe import Probe, UnitCall, describe_call, probe_compute
from hetstore.planner.trace import MachineRates, Trace, UnitTrace
from hetstore.tier import Tier
from hetstore.units import UnitSpec, find_units

__all__ = ["trace_model", "with_batch", "batch_shapes", "model_data_trace", "state_itemsize"]


def _trainable(param: nn.Parameter, optimizer) -> bool:
    if optimizer is None:
        return param.requires_grad
    return param.requires_grad and any(
        param is p for g in optimizer.param_groups for p in g["params"]
    )


def _segments(params: list[nn.Parameter], group_of: dict[int, int]) -> tuple[int, ...]:
    """The trainable elements of each optimizer param group among ``params`` (one
    unit's; ``group_of``: id(parameter) -> its group): a unit lays each group's out as
    one segment, and its streamed step's chunks never cross one."""
    per_group: dict[int, int] = {}
    for p in params:
        if p.requires_grad and id(p) in group_of:  # (_trainable, by the map)
            g = group_of[id(p)]
            per_group[g] = per_group.get(g, 0) + p.numel()
    return tuple(per_group[g] for g in sorted(per_group))


def model_data_trace(
    model: nn.Module,
    config,
    machine: MachineRates,
    *,
    optimizer=None,
    units: Sequence[nn.Module] | None = None,
    specs: list[UnitSpec] | None = None,
) -> Trace:
    """A trace of model data only (no activations, no compute times)."""
    specs = specs if specs is not None else find_units(model, units)
    itemsize = config.torch_compute_dtype.itemsize
    states = state_itemsize(optimizer, config.optimizer_state_format)
    count = state_count(optimizer)
    groups = optimizer.param_groups if optimizer is not None else []
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    traced = []
    for spec in specs:
        params = [module._parameters[attr] for module, attr, _ in spec.params]
        traced.append(
            UnitTrace(
                name=spec.name,
                numel=sum(p.numel() for p in params),
                trainable_numel=sum(p.numel() for p in params if _trainable(p, optimizer)),
                frozen_compute_numel=sum(
                    p.numel()
                    for p in params
                    if not _trainable(p, optimizer) and p.dtype == config.torch_compute_dtype
                ),
                compute_itemsize=itemsize,
                state_itemsize=states,
                state_count=count,
                max_param_numel=max((p.numel() for p in params), default=0),
                segment_numels=_segments(params, group_of),
                is_root=spec.is_root,
            )
        )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return Trace(
        units=tuple(traced),
        machine=machine,
        buffer_bytes=buffers,
        step_overlap=config.overlaps_disk_steps,
        step_in_forward=config.steps_disk_in_forward,
        # (as the runtime: a flat step of fp32 states from gradients in host memory,
        # InMemoryUnitStep.steps_flat_in_memory)
        step_in_forward_memory=config.steps_memory_in_forward(machine.device if machine else "cpu")
        and (optimizer is None or flat_steppable(optimizer))
        and config.grad_tier is Tier.HOST,
        step_in_backward=config.step_in_backward,
    )


def trace_model(
    model: nn.Module,
    example_inputs,
    config,
    machine: MachineRates,
    *,
    optimizer=None,
    units: Sequence[nn.Module] | None = None,
    probe: Probe | None = None,
) -> Trace:
    """Trace ``model(*example_inputs)`` on fake or meta tensors (see module doc).

    ``example_inputs``: a tuple of arguments (a single tensor is one argument); tensors
    may be real, meta, or given as ``torch.empty(shape, dtype=..., device="meta")``.
    ``probe``: also time one unit of each kind for real (:mod:`hetstore.planner.probe`).
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    specs = find_units(model, units)
    base = model_data_trace(model, config, machine, optimizer=optimizer, specs=specs)
    on_meta = any(p.is_meta for p in model.parameters())
    return with_batch(base, model, example_inputs, {}, specs, config, on_meta=on_meta, probe=probe)


def with_batch(
    base: Trace,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    specs: list[UnitSpec],
    config,
    *,
    on_meta: bool = False,
    probe: Probe | None = None,
) -> Trace:
    """``base`` (a model-data trace) with the activations, FLOPs and times of one forward
    of ``model(*args, **kwargs)``, and the batch's shapes (which the batch guard compares
    later batches with).

    ``on_meta``: run on meta tensors of the parameters' shapes, and the arguments moved
    to meta; else on fake copies. A meta-device model is traced so, and so is an
    offloaded model at its first forward (its released parameters have no bytes for a
    fake copy to read, and nothing real may move).

    ``probe``: then time one unit of each kind for real at the traced shapes, on the
    compute device (:mod:`hetstore.planner.probe`); else compute is FLOPs at the
    machine's matmul rate."""
    machine = base.machine
    sizes, flops, calls = _run(model, args, kwargs, specs, config, on_meta)
    traced = []
    for index, unit in enumerate(base.units):
        forward_flops = flops.get(index, 0.0)
        forward_s = forward_flops / machine.flops if machine is not None and machine.flops else 0.0
        saved_sizes = tuple(sizes.get(index, ()))
        traced.append(
            replace(
                unit,
                saved_sizes=saved_sizes,
                largest_saved_bytes=max((n for n, *_ in saved_sizes), default=0),
                flops=3 * forward_flops,
                forward_s=forward_s,
                backward_s=2 * forward_s,
            )
        )
    traced = replace(base, units=tuple(traced), batch_shapes=batch_shapes(args, kwargs))
    traced = traced.at_min_bytes(config.activation_min_bytes)
    if probe is None:
        return traced
    return probe_compute(
        traced,
        specs,
        calls,
        probe.device,
        config.torch_compute_dtype,
        budget_s=probe.budget_s,
        accounts=probe.accounts,
    )


def batch_shapes(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a forward's tensor arguments, positional then keyword (by name)."""
    leaves = tree_flatten((args, dict(sorted(kwargs.items()))))[0]
    return tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))


def _run(model, inputs, kwargs, specs, config, on_meta):
    """One forward; per unit index: the storages saved for backward as (bytes, the first
    and the last op that saved them), forward FLOPs, and the unit's first call (for the
    compute probe)."""
    # imported here: they pull in sympy and dynamo (hundreds of MB of RSS), which a
    # manually placed model never needs
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    root_index = next((i for i, s in enumerate(specs) if s.is_root), len(specs))
    current = [root_index]
    sizes: dict[int, list[tuple[int, int, int]]] = {}
    calls: dict[int, UnitCall] = {}
    # (storage, version) -> (storage, unit, its entry in sizes): held, so addresses are
    # not reused
    seen: dict = {}
    handles = []
    for index, spec in enumerate(specs):
        if spec.module is None:
            continue

        def enter(module, args, kwargs, i=index):
            current[0] = i
            if i not in calls:  # the first call of each unit: what a probe runs again
                calls[i] = describe_call(args, kwargs)

        handles.append(spec.module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(
            spec.module.register_forward_hook(lambda m, a, o: current.__setitem__(0, root_index))
        )
    # Meta tensors carry no device, so kernels that pick an algorithm by device pick
    # another: scaled_dot_product_attention on meta takes the math path and saves the
    # B x H x T x T attention weights, which the CPU and CUDA kernels never keep (2 MiB
    # a block at 8 x 128 tokens, 12% of its saved bytes, growing with T squared). So a
    # model without bytes is traced on *fake* tensors of its shapes on the compute
    # device, made from nothing, where that device can be faked here.
    device = _fake_device(config)
    mode = (
        contextlib.nullcontext()
        if on_meta and device is None
        # without bytes, no op may fall back to running its real kernel on zeros of the
        # batch's size (it would allocate outside the budget): it fails, as on meta
        else FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=not on_meta)
    )
    try:
        with mode:
            named = dict(model.named_parameters(remove_duplicate=False))
            named.update(dict(model.named_buffers(remove_duplicate=False)))
            if on_meta:
                # one tensor per parameter object, so tied weights stay tied
                copies: dict[int, torch.Tensor] = {}
                swapped = {
                    name: copies.setdefault(id(t), _empty_like(t, device))
                    for name, t in named.items()
                }
                args, kwargs = tree_map(
                    lambda t: _empty_like(t, device) if isinstance(t, torch.Tensor) else t,
                    (inputs, kwargs),
                )
            else:
                # run on fake copies of the parameters (held here, so their storages are
                # recognized when saved, and no address is reused)
                fakes: dict[int, torch.Tensor] = {}
                swapped = {
                    name: fakes.setdefault(id(t), mode.from_tensor(t)) for name, t in named.items()
                }
                args, kwargs = tree_map(
                    lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                    (inputs, kwargs),
                )
            model_storages = {StorageWeakRef(t.untyped_storage()).cdata for t in swapped.values()}

            def pack(tensor):
                if isinstance(tensor, nn.Parameter):
                    return None
                storage = tensor.untyped_storage()
                cdata = StorageWeakRef(storage).cdata
                key = (cdata, tensor._version)
                if cdata in model_storages:
                    return None
                node = ops.node_of(cdata)
                if key in seen:  # saved again, by a later node: restored from there on
                    _, unit, at = seen[key]
                    if unit == current[0]:
                        nbytes, first, _ = sizes[unit][at]
                        sizes[unit][at] = (nbytes, first, node)
                    return None
                unit_sizes = sizes.setdefault(current[0], [])
                seen[key] = (storage, current[0], len(unit_sizes))
                unit_sizes.append((storage.nbytes(), node, node))
                return None

            with (
                torch.enable_grad(),
                FlopCounterMode(display=False) as counter,
                _OpCount() as ops,
                torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None),
            ):
                torch.func.functional_call(model, swapped, args, kwargs, tie_weights=False)
    finally:
        for handle in handles:
            handle.remove()
    counts = counter.get_flop_counts()
    prefix = type(model).__name__
    flops: dict[int, float] = {}
    total = float(sum(counts.get("Global", {}).values()))
    for index, spec in enumerate(specs):
        if spec.module is not None:
            flops[index] = float(sum(counts.get(f"{prefix}.{spec.name}", {}).values()))
    flops[root_index] = max(0.0, total - sum(flops.values()))
    return sizes, flops, calls


class _OpCount(TorchDispatchMode):
    """Counts the ops dispatched (not ``prim`` queries such as a fake tensor's device),
    and which op made each storage, to tell which autograd node a saved tensor is for
    (:meth:`node_of`)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._made: dict[int, int] = {}  # storage -> the op whose output it is

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        self.count += 1
        inputs = {_storage_of(t) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            cdata = _storage_of(t)
            if cdata is not None and cdata not in inputs:  # new (a view's is its base's)
                self._made[cdata] = self.count
        return out

    def node_of(self, cdata: int) -> int:
        """The op whose autograd node saves a storage saved now: a node saves its inputs
        before its op runs and its outputs after it, so a storage the last op made is
        that op's output, any other the next op's input. (An input made by the op just
        before is taken for that op's output: its node is then counted larger, never
        smaller.)"""
        return self.count if self._made.get(cdata) == self.count else self.count + 1


def _storage_of(t) -> int | None:
    """A tensor's storage, as an id; None for a non-tensor or a tensor without one (a
    subclass such as a quantized weight: its saves are not told apart, never wrong)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):
        return None


def _fake_device(config) -> torch.device | None:
    """The compute device, where fake tensors can stand for it here (a CUDA device only
    where CUDA is present: its kernels' choices query the device); else None (meta)."""
    device = config.resolved_device()
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()):
        return device
    return None


def _empty_like(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A tensor with ``tensor``'s shape, dtype and requires_grad and no bytes: on
    ``device`` under the fake mode, else on meta (a parameter stays one, so the trace
    saves for backward what training would). Integer inputs keep their dtype; their
    values are never read by a traceable forward."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device or "meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)
