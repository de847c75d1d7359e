"""``hetstore.offload``: the one call that turns a model and optimizer into offloaded ones."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence

from torch import nn
from torch.optim import Optimizer

from hetstore._malloc import HeapBound, current_rss
from hetstore._sizes import format_size
from hetstore.config import OffloadConfig
from hetstore.errors import ConfigError
from hetstore.footprints import param_staging_slots
from hetstore.model_state import ModelState, attach, is_released, state_of
from hetstore.optim import DynamicLossScaler, OffloadedOptimizer
from hetstore.optim.original import redirect_original
from hetstore.optim.policy import StepModes
from hetstore.optim.registry import FLAT_NAMES, flat_steppable
from hetstore.optim.state_format import state_format
from hetstore.planner import Capacities, Plan, Trace, UnitChoice, make_plan
from hetstore.planner.calibrate import calibrated_trace, steady_profile
from hetstore.planner.floor import check_manual_floor, floor_of_config
from hetstore.planner.machine import free_space_at, machine_capacities, measure_machine
from hetstore.planner.probe import Probe
from hetstore.planner.shapes import BatchGuard
from hetstore.planner.tracer import model_data_trace, trace_model, with_batch
from hetstore.runtime.activations import ActivationHooks
from hetstore.runtime.copying import PlainCopies
from hetstore.runtime.events import Events
from hetstore.runtime.grads import GradContract
from hetstore.runtime.hooks import OffloadRuntime
from hetstore.runtime.materialize import materialize_module, owns_meta
from hetstore.runtime.profiler import StepProfiler
from hetstore.runtime.sharding import rank_device, resolve_process_group
from hetstore.runtime.staging import GradStager, ParamStager
from hetstore.runtime.state_dict import install_state_dict_hooks
from hetstore.runtime.streams import CudaStreams
from hetstore.runtime.unfrozen import RefuseUnfrozen
from hetstore.runtime.unit import Placement, Unit
from hetstore.tier import Tier
from hetstore.tiers import Tiers
from hetstore.tiers.accounting import MemoryAccount
from hetstore.tiers.flat import ALIGN_ELEMENTS, BYTE_ALIGN_ELEMENTS
from hetstore.tiers.store import transfers_only
from hetstore.units import UnitSpec, find_units

__all__ = ["offload"]

# Steps timed per unit and phase after offload(); the first is a warm-up, the others'
# medians calibrate the plan's prediction (runtime.profiler, planner.calibrate).
PROFILED_STEPS = 3


def offload(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    config: OffloadConfig | None = None,
    *,
    units: Sequence[nn.Module] | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    example_inputs=None,
    process_group=None,
) -> tuple[nn.Module, OffloadedOptimizer | None]:
    """Offload ``model``'s parameters, gradients and optimizer states per ``config``.

    The model is changed in place (its parameters become views into hetstore's buffers)
    and returned with an optimizer to use instead of ``optimizer``. A plain PyTorch
    training loop then works unchanged. ``units`` overrides the default grouping of
    parameters (one unit per repeated block plus one for the rest).

    A model built under ``torch.device("meta")`` is materialized unit by unit straight
    into its tiers: each module's ``reset_parameters()`` runs, then ``init_fn(module)``
    if given (see :mod:`hetstore.runtime.materialize`), so a model larger than host
    memory can be created. Load trained weights afterwards with ``hetstore.load_weights``.

    With ``auto_offload=True`` the planner chooses every unit's placement (see
    :func:`hetstore.plan`); ``example_inputs`` (the arguments of one forward, real or
    meta tensors) lets it trace the activations too, on fake tensors, before anything
    moves. The plan used is ``hetstore.state_of(model).plan``.

    Under ``torchrun`` (any initialized default process group with more than one rank),
    or with ``process_group=`` (a ``ProcessGroup`` or one-dimensional ``DeviceMesh``),
    every unit is sharded over the ranks (ZeRO-3, :mod:`hetstore.runtime.sharding`):
    each rank keeps 1/N of the master weights, gradients and optimizer states in its own
    tiers, and N ranks with batch b train like one process with batch N*b (gradients are
    averaged, as DDP does). ``process_group=False`` turns sharding off. Every rank must
    call ``offload`` with the same model and configuration; capacities are per rank.

    Raises ``ConfigError`` for a bad configuration and ``OutOfDeviceMemory`` /
    ``OutOfTierMemory`` when the model states cannot be placed, before any training.
    """
    phases = _Offloading(model, optimizer, config, process_group)
    phases.validate()
    phases.group_into_units(units)
    phases.plan_placement(units, example_inputs)
    phases.materialize(init_fn)
    phases.wire_hooks()
    return model, phases.wire_optimizer()


class _Offloading:
    """``offload()``'s phases, in order, and what each made: validate the arguments,
    group the parameters into units, plan their placement, materialize the units in
    their tiers, wire the runtime's hooks into the model, wire the optimizer. Nothing is
    allocated before ``materialize``; a refusal before it leaves the model untouched.
    What the runtime asks of offload() later (a new plan for the first batch, the
    profile's calibration, advice when a budget overflows) are methods here too."""

    def __init__(self, model: nn.Module, optimizer, config, process_group):
        self.model = model
        self.optimizer = optimizer
        self.config = config if config is not None else OffloadConfig()
        self.process_group = process_group
        self.events = Events()  # the model's bus: units and runtime publish on it
        self.units: list[Unit] = []  # every unit, in order, once materialize built them
        # the process's resident set before anything was made, where it is bounded
        # (_bound_process_memory); the bound against it is the runtime's (heap_bound)
        self._rss_before: int | None = None
        self.tiers: Tiers | None = None  # made by materialize
        self.runtime: OffloadRuntime | None = None  # made by wire_hooks

    # ------------------------------------------------------------------ phases
    def validate(self) -> None:
        """Refuse a bad configuration, model or optimizer before anything is made."""
        model, optimizer, config = self.model, self.optimizer, self.config
        if not isinstance(config, OffloadConfig):
            raise ConfigError(
                f"config must be a hetstore.OffloadConfig, got {type(config).__name__}"
            )
        if state_of(model) is not None:
            raise ConfigError("this model was already passed to hetstore.offload()")
        if is_released(model):
            raise ConfigError(
                "this model was released by hetstore.release() and its weights freed; build "
                "a new model to offload"
            )
        if (
            optimizer is not None
            and config.offload_optimizer is Tier.DISK
            and not config.auto_offload
        ):
            _check_streamable(optimizer)
        device = config.resolved_device()
        shards = resolve_process_group(self.process_group, device)
        if shards is not None:
            device = rank_device(device)
            if optimizer is not None and not flat_steppable(optimizer):
                raise ConfigError(
                    f"sharded over {shards.world_size} ranks, hetstore steps flat shards of "
                    f"{FLAT_NAMES} (non-differentiable); got "
                    f"{type(optimizer).__name__}. Use one of those, or process_group=False"
                )
        if optimizer is not None and config.optimizer_state_format != "fp32":
            _check_compact_states(optimizer, config.optimizer_state_format)
        self.device, self.shards = device, shards
        # (its warning points at the caller of offload(): validate, offload, the caller)
        self.groups_of = _group_index(model, optimizer, stacklevel=4)

    def group_into_units(self, units: Sequence[nn.Module] | None) -> None:
        """Which parameters move, fetch and step together (hetstore.units)."""
        self.specs = find_units(self.model, units)

    def plan_placement(self, units: Sequence[nn.Module] | None, example_inputs) -> None:
        """Every unit's placement (manual or planned); refused here when nothing fits."""
        self.trace, self.plan = _plan_for(
            self.model,
            self.optimizer,
            self.config,
            self.specs,
            self.device,
            units,
            example_inputs,
        )
        if self.plan.source == "manual" and self.shards is None:
            _check_manual_placement(self.trace, self.optimizer, self.config)

    def _bound_process_memory(self, plan: Plan) -> None:
        """On a CPU device the device's memory is the process's: keep freed memory from
        staying resident (hetstore._malloc.HeapBound) where the user bounds the process,
        with a host budget, or with anything on disk (it must stay far below the states'
        size). Its baseline is the process before anything was made; the runtime checks
        it after each unit (``OffloadRuntime.heap_bound``)."""
        on_disk = any(
            Tier.DISK in (u.choice.param, u.choice.optimizer, u.choice.activations)
            for u in plan.units
        )
        bounded = self.config.offload_cpu_size is not None or on_disk
        if self.device.type != "cpu" or not bounded or self._rss_before is not None:
            return
        rss = current_rss()
        if rss is None:
            return  # (no /proc: nothing to measure against)
        # (a replan: what the tiers hold is the process's already)
        self._rss_before = rss - (_tiers_hold(self.tiers) if self.tiers is not None else 0)
        if self.runtime is not None:
            self._attach_heap_bound()

    def _attach_heap_bound(self) -> None:
        if self._rss_before is None:
            return
        held = functools.partial(_tiers_hold, self.tiers)
        self.runtime.heap_bound = HeapBound(self._rss_before, held, slack=HEAP_SLACK)

    def materialize(self, init_fn: Callable[[nn.Module], None] | None) -> None:
        """Make the tiers and every unit's buffers in them (a meta model is initialized
        unit by unit on the way); a failure frees whatever was made."""
        config, shards = self.config, self.shards
        self._bound_process_memory(self.plan)
        built: list[Unit | None] = [None] * len(self.specs)
        self.built = built
        self.tiers = Tiers(
            config,
            device=self.device,
            rank=shards.rank if shards else 0,
            world_size=shards.world_size if shards else 1,
            ranks_on_host=_ranks_on_host() if shards else 1,
            advice=self.advice,
        )
        try:
            _build_units(self.model, self.specs, built, self._build_unit, init_fn)
        except BaseException:
            for unit in built:
                if unit is not None:
                    unit.close()
            self.tiers.close()
            raise
        self.units = list(built)
        _move_buffers(self.model, self.tiers)
        self.root = next(
            (u for u, s in zip(self.units, self.specs, strict=True) if s.is_root), None
        )
        self.grad_stager = _attach_stagers(self.units, self.tiers, self.plan.prefetch_depth)

    def wire_hooks(self) -> None:
        """The runtime's hooks in the model (fetch, release, prefetch, gradients,
        activations, state dict, p.grad, copies), and the model's state attached."""
        model, config, plan, unit_list = self.model, self.config, self.plan, self.units
        streams = CudaStreams.for_device(self.device)  # the model's side streams (CUDA)
        self.activations = _activation_hooks(model, unit_list, self.tiers, plan, config, streams)
        self.profiler = StepProfiler(self.device, PROFILED_STEPS)
        # an automatic plan places activations for the batch it was traced with, or at
        # the first forward when none was given, and moves them for a larger batch later
        guard = None
        if plan.source == "auto":
            guard = BatchGuard(
                self.trace,
                plan,
                config,
                self.replan,
                trace_batch=self.trace_batch,
                move_params=self.shards is None,
            )
        runtime = OffloadRuntime(
            model,
            unit_list,
            {u.index: s.module for u, s in zip(unit_list, self.specs, strict=True)},
            self.root,
            prefetch_depth=plan.prefetch_depth,
            grad_stager=self.grad_stager,
            activations=self.activations,
            profiler=self.profiler,
            batch_guard=guard,
            copy_stream=streams.params if streams is not None else None,
            grad_stream=streams.grads if streams is not None else None,
            events=self.events,
        )
        self.runtime = runtime
        self._attach_heap_bound()
        _refuse_untrained_grads(model, unit_list, self.optimizer, runtime)
        runtime.adopt(install_state_dict_hooks(model, unit_list, lambda: runtime.refusal))
        self.grad_contract = GradContract(unit_list)  # p.grad reads hetstore's buffers
        runtime.adopt([self.grad_contract])
        runtime.adopt([PlainCopies(model, unit_list, runtime)])  # copy.deepcopy: plain
        attach(model, ModelState(runtime, self.tiers, self.shards))
        runtime.plan = plan
        runtime.trace = self.trace
        runtime.profile = None  # the measured steps, once profiled
        runtime.calibrated_plan = None  # the plan's prediction re-made from them
        self.profiler.on_profiled = self.profiled

    def wire_optimizer(self) -> OffloadedOptimizer | None:
        """The optimizer to use instead of the user's, stepping the units' flat buffers;
        the user's one redirected to it."""
        optimizer, config, runtime, profiler = (
            self.optimizer,
            self.config,
            self.runtime,
            self.profiler,
        )
        self.optimizer = None  # (this object lives on in the runtime's batch guard)
        if optimizer is None:
            return None
        scaler = DynamicLossScaler() if config.compute_dtype == "fp16" else None
        wrapped = OffloadedOptimizer(
            optimizer,
            self.units,
            loss_scaler=scaler,
            chunk_numel=config.optimizer_chunk_size // 4,
            param_order=list(self.model.parameters()),
            shards=self.shards,
            modes=StepModes(
                overlap_disk=config.overlaps_disk_steps,
                in_backward=config.step_in_backward,
                in_forward=config.steps_disk_in_forward,
                in_forward_memory=config.steps_memory_in_forward(self.device),
            ),
            # 'auto' with no step placement forced: whether to overlap at all, measured
            trial_overlap=config.overlap_step == "auto"
            and config.step_in_forward is not True
            and not config.step_in_backward,
            state_format=state_format(config.optimizer_state_format),
            on_step_begin=lambda: profiler.switch("optimizer"),
            on_step=profiler.step_ends,
        )
        # the user's optimizer held the original parameters; its state is meaningless now
        optimizer.state.clear()
        # ...and it stays usable: its param groups are the returned one's, its step and
        # state dict go there (a scheduler made before offload() keeps scheduling)
        redirect_original(optimizer, wrapped)
        self.grad_contract.disk_gradients = wrapped.disk_grads  # (p.grad of disk grads)
        runtime.optimizer = weakref.ref(wrapped)  # hetstore.release(model) releases it too
        _wire_steps(runtime, wrapped)
        if runtime.batch_guard is not None:  # the first batch may move its states to disk
            runtime.batch_guard.move_states = wrapped.can_move_states
        return wrapped

    # ------------------------------------------------------------------ used later
    def _build_unit(self, index: int) -> None:
        spec = self.specs[index]
        config, plan = self.config, self.plan
        params = []
        for module, attr, qualified in spec.params:
            param = module._parameters[attr]
            if not param.is_floating_point():
                raise ConfigError(
                    f"parameter {qualified!r} has dtype {param.dtype}; hetstore manages "
                    "floating-point parameters only"
                )
            params.append((qualified, param, self.groups_of.get(id(param))))
        choice = plan.choice_of(spec.name)
        grad = choice.optimizer if plan.source == "auto" else config.grad_tier
        placement = Placement(param=choice.param, optimizer=choice.optimizer, grad=grad)
        # 1-byte states need page-aligned chunks of their own
        align = BYTE_ALIGN_ELEMENTS if config.optimizer_state_format == "8bit" else ALIGN_ELEMENTS
        self.built[index] = Unit(
            index,
            spec.name,
            params,
            placement,
            self.tiers,
            config.torch_compute_dtype,
            shards=self.shards,
            align=align,
            defer_disk_grad=config.step_in_backward and self.optimizer is not None,
            events=self.events,
        )

    def advice(self, tier: str, nbytes: int) -> list[str]:
        """What a tier's overflow report adds: the placement change that would fit."""
        kept = dict(self.tiers.device_tier.account.holders(n=1_000)).get("activations", 0)
        built = [u for u in self.built if u is not None]
        return _placement_advice(self.config, built, tier, kept)

    def replan(self, new_plan: Plan) -> None:
        """The first batch or a larger one placed activations, and parameters that had
        to leave the device (planner.shapes): put the new plan in effect."""
        unit_list, tiers, runtime = self.units, self.tiers, self.runtime
        self._bound_process_memory(new_plan)  # (something may move to disk now)
        by_name = {u.name: u for u in unit_list}
        # states first: a master leaving host memory makes room for a home moved there
        _move_states(
            [
                by_name[p.name]
                for p in new_plan.units
                if p.choice.optimizer != by_name[p.name].placement.optimizer
            ],
            unit_list,
            tiers,
            runtime,
        )
        for unit_plan in new_plan.units:
            unit = by_name[unit_plan.name]
            if unit_plan.choice.param != unit.placement.param:
                _move_home(unit, unit_plan.choice.param, unit_list, tiers, new_plan)
            self.activations.set_unit_tier(unit_plan.name, unit_plan.choice.activations)
        self.activations.min_bytes = _min_bytes(new_plan, self.config)
        runtime.plan = new_plan

    def trace_batch(self, args: tuple, kwargs: dict) -> Trace:
        """The first training batch's activations, traced on fake tensors."""
        runtime = self.runtime
        with runtime.tracing():
            traced = with_batch(
                self.trace,
                self.model,
                args,
                kwargs,
                self.specs,
                self.config,
                on_meta=True,
                probe=Probe(self.device, accounts=_probe_budgets(self.tiers, self.device)),
            )
        runtime.trace = traced
        return traced

    def profiled(self, profiles) -> None:
        """The profiled steps are in: the plan's prediction re-made from them."""
        runtime = self.runtime
        runtime.profile = steady_profile(profiles)
        if runtime.trace.machine is not None:  # the trace and plan in effect
            measured = calibrated_trace(runtime.trace, runtime.profile)
            runtime.calibrated_plan = runtime.plan.reestimated(
                measured, self.config.optimizer_chunk_size
            )


def _activation_hooks(model, unit_list, tiers, plan: Plan, config, streams):
    """The saved-tensor hooks that move activations, when anything may move them (a
    CPU device always: its budget counts them), set to each unit's planned tier."""
    default_tier = Tier.DEVICE if plan.source == "auto" else config.offload_activations
    if not (
        tiers.device.type == "cpu"
        or plan.source == "auto"
        or any(u.choice.activations is not Tier.DEVICE for u in plan.units)
    ):
        return None
    activations = ActivationHooks(
        model,
        unit_list,
        tiers,
        default_tier,
        _min_bytes(plan, config),
        prefetch_depth=plan.prefetch_depth,
        stream=streams.activations if streams is not None else None,
    )
    for unit_plan in plan.units:
        if unit_plan.choice.activations != default_tier:
            activations.set_unit_tier(unit_plan.name, unit_plan.choice.activations)
    return activations


def _refuse_untrained_grads(model, unit_list, optimizer, runtime: OffloadRuntime) -> None:
    """Parameters that require grad outside the optimizer: warned, their gradients
    dropped; frozen at offload() but the optimizer's: refused if ever unfrozen."""
    unoptimized = [
        e.param for u in unit_list for e in u.entries if e.param.requires_grad and e.group is None
    ]
    if unoptimized and optimizer is not None:
        warnings.warn(
            f"{len(unoptimized)} parameters require grad but are not in the optimizer; their "
            "gradients are dropped after backward (set requires_grad=False to silence)",
            stacklevel=4,  # (_refuse_untrained_grads, wire_hooks, offload: the caller)
        )
        runtime.drop_grads_of(unoptimized)
    if optimizer is not None:  # frozen at offload() but the optimizer's: never unfrozen
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        frozen = [
            e
            for u in unit_list
            for e in u.entries
            if e.group is None and id(e.param) in in_optimizer
        ]
        if frozen:
            runtime.adopt([RefuseUnfrozen.install(model, frozen)])


def _wire_steps(runtime: OffloadRuntime, optimizer: OffloadedOptimizer) -> None:
    """Tell the optimizer the order of the next forward (its steps in the next forward
    go in it); again after states moved to disk. (What happens in backward reaches it
    through the runtime's events, runtime.events.)"""
    if optimizer.step_ahead is not None:
        use_order = weakref.WeakMethod(runtime.use_order)
        optimizer.step_ahead.use_order = lambda: use_order()() if use_order() else []


def _move_states(
    moving: list[Unit], units: list[Unit], tiers: Tiers, runtime: OffloadRuntime
) -> None:
    """Move ``moving`` units' masters, gradients and optimizer states from host memory to
    disk (the first batch's plan; nothing has a gradient yet), one unit at a time, each
    whole or not at all (its new buffers are made and written before anything of it is
    freed), then arrange the optimizer's steps for the placement as it is. A failure
    part-way (the disk full) leaves the units before on disk and the rest as they were."""
    if not moving:
        return
    optimizer = runtime.optimizer() if runtime.optimizer is not None else None
    try:
        for unit in moving:
            master = unit.prepare_master_move(Tier.DISK)
            try:
                states = optimizer.prepare_states_move(unit) if optimizer is not None else None
            except BaseException:
                unit.discard_master_move(master)
                raise
            unit.commit_master_move(master)  # (allocates nothing from here on)
            _stage_grads(unit, units, tiers, runtime)
            if optimizer is not None:
                optimizer.commit_states_move(unit, states)
    finally:
        if optimizer is not None:
            optimizer.arrange_steps()
            _wire_steps(runtime, optimizer)


def _stage_grads(unit: Unit, units: list[Unit], tiers: Tiers, runtime: OffloadRuntime) -> None:
    """Give ``unit``, whose gradients now belong on disk, the model's gradient stager,
    or a larger one shared by every such unit when its slots are too small."""
    if not unit.grads.staged:
        return
    stager = runtime.grad_stager
    if stager is not None and stager.slot_bytes >= unit.trainable_numel * 4:
        unit.grad_stager = stager
        return
    larger = _share_grad_stager([u for u in units if u.grads.staged], tiers)
    if stager is not None:
        stager.close()  # (nothing staged yet: no gradient exists before the first batch)
    runtime.grad_stager = larger


def _share_grad_stager(staged: list[Unit], tiers: Tiers) -> GradStager:
    """One gradient stager for ``staged`` units, its slots sized for the largest."""
    stager = GradStager(
        tiers.host, max(u.trainable_numel * 4 for u in staged), events=staged[0].events
    )
    for unit in staged:
        unit.grad_stager = stager
    return stager


# what the process may hold beyond what it held before offload() and what the tiers hold
# now before the heap is trimmed (hetstore._malloc): a unit's temporaries, allocator slack
HEAP_SLACK = 96 * 2**20


def _tiers_hold(tiers: Tiers) -> int:
    """Bytes the tiers hold in the process's memory: the device account (a CPU device)
    and the host pool's mapped blocks."""
    return tiers.device_tier.account.current + tiers.host.reserved


def _ranks_on_host() -> int:
    """Ranks sharing this machine (torchrun's LOCAL_WORLD_SIZE), to split its memory."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _check_compact_states(optimizer: Optimizer, fmt: str) -> None:
    """Compact states are a flat optimizer's (sharded too: each rank keeps its shard's
    states in the format; 8-bit blocks never cross a shard, whose size is a multiple of
    the 4096-element alignment)."""
    if not flat_steppable(optimizer):
        raise ConfigError(
            f"optimizer_state_format={fmt!r} keeps the states of {FLAT_NAMES} compact; got "
            f"{type(optimizer).__name__}. Use one of those, or optimizer_state_format='fp32'"
        )


def _check_streamable(optimizer: Optimizer) -> None:
    if not flat_steppable(optimizer):
        raise ConfigError(
            f"offload_optimizer='disk' streams the states of {FLAT_NAMES} "
            f"chunk by chunk; got {type(optimizer).__name__}. Use one of those, or "
            "offload_optimizer='cpu'"
        )


def _build_units(
    model: nn.Module,
    specs: list[UnitSpec],
    built: list[Unit | None],
    build: Callable[[int], None],
    init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Build every unit; a meta model is materialized module by module in between, and
    each unit is built (moved into its tiers) as soon as all its modules are real."""
    meta_modules = [(name, m) for name, m in model.named_modules() if owns_meta(m)]
    # every module holding a parameter, tied ones included: a unit is built (and its
    # storage released) only after all of them have run their initialization
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(id(module))
    owner_ids = [
        set().union(*(holders[id(module._parameters[attr])] for module, attr, _ in spec.params))
        for spec in specs
    ]
    pending = {id(m) for _, m in meta_modules}

    def build_ready() -> None:
        for index, owners in enumerate(owner_ids):
            if built[index] is None and not owners & pending:
                build(index)

    build_ready()
    for name, module in meta_modules:
        materialize_module(module, name, init_fn)
        pending.discard(id(module))
        build_ready()


def _plan_for(model, optimizer, config, specs, device, units, example_inputs):
    """The placement of every unit: the offload_* keys for all (a manual plan), or the
    planner's choice from a trace (``auto_offload``); refused here, before any work,
    when nothing fits."""
    if not config.auto_offload:
        trace = model_data_trace(model, config, None, optimizer=optimizer, specs=specs)
        choice = UnitChoice(
            config.offload_param, config.offload_optimizer, config.offload_activations
        )
        plan = Plan.uniform(trace, choice, config.prefetch_depth, Capacities(None, None, None))
        return trace, plan
    machine = measure_machine(device, config.offload_path, config.optimizer_state_format)
    if example_inputs is not None:
        trace = trace_model(
            model,
            example_inputs,
            config,
            machine,
            optimizer=optimizer,
            units=units,
            # one unit of each kind timed for real (a step's fraction), where a budget
            # has room for it: nothing else is held yet
            probe=Probe(device, accounts=_probe_budgets(None, device, config)),
        )
    else:
        trace = model_data_trace(model, config, machine, optimizer=optimizer, specs=specs)
    streamable = optimizer is None or flat_steppable(optimizer)
    capacities = machine_capacities(config, device)
    return trace, make_plan(trace, capacities, config, disk_optimizer=streamable)


def _probe_budgets(tiers: Tiers | None, device, config: OffloadConfig | None = None) -> tuple:
    """The budgets the compute probe's tensors count in (planner.probe): the device's,
    and on a CPU device the host's too (its memory is the same). Before the tiers exist,
    empty accounts of the configured capacities."""
    if tiers is not None:
        accounts = (tiers.device_tier.account, tiers.host.account)
    else:
        accounts = (
            MemoryAccount(Tier.DEVICE, config.max_device_memory),
            MemoryAccount(Tier.HOST, config.offload_cpu_size),
        )
    return accounts if device.type == "cpu" else accounts[:1]


def _check_manual_placement(trace: Trace, optimizer, config: OffloadConfig) -> None:
    """Refuse, before anything is built, a manual placement whose buffers cannot all be
    held within the configured capacities (planner.floor): without this the lazily made
    ones (the disk paths' staging, the step's chunks and shadow) ran out mid-run."""
    from hetstore.tiers import physical_memory

    floor = floor_of_config(trace, config, optimizer)
    host = config.offload_cpu_size
    disk = config.offload_disk_size
    capacities = {tier: getattr(config, tier.capacity_key) for tier in Tier}
    machine = set()  # tiers without a key set: limited by the machine itself
    if host is None:
        capacities[Tier.HOST] = physical_memory()
        machine.add(Tier.HOST)
    if disk is None and floor.total(Tier.DISK):
        capacities[Tier.DISK] = free_space_at(config.offload_path)
        machine.add(Tier.DISK)
    check_manual_floor(floor, capacities, config, machine=frozenset(machine))


def _move_home(unit: Unit, tier: Tier, units: list[Unit], tiers: Tiers, plan: Plan) -> None:
    """Move ``unit``'s parameters off the device (the first batch's plan); a disk home
    gets a parameter stager: the model's own when its slots are large enough, else a
    new one, which the disk homes moved now share."""
    if tier is Tier.DISK:
        stager = next(
            (
                u.param_stager
                for u in units
                if u.param_stager is not None and u.param_stager.slot_bytes >= unit.home_bytes
            ),
            None,
        )
        if stager is None:
            largest = max(
                u.home_bytes
                for u, p in zip(units, plan.units, strict=True)
                if p.choice.param == tier
            )
            stager = ParamStager(
                tiers.host, largest, param_staging_slots(plan.prefetch_depth), unit.events
            )
        unit.param_stager = stager
    unit.move_home(tier)


def _attach_stagers(units: list[Unit], tiers: Tiers, prefetch_depth: int) -> GradStager | None:
    """Give disk-resident units their bounded host staging (see runtime.staging)."""
    disk_home = [u for u in units if transfers_only(u.home)]
    if disk_home:
        stager = ParamStager(
            tiers.host,
            max(u.home_bytes for u in disk_home),
            param_staging_slots(prefetch_depth),
            disk_home[0].events,
        )
        for unit in disk_home:
            unit.param_stager = stager
    disk_grad = [u for u in units if u.grads.staged]
    return _share_grad_stager(disk_grad, tiers) if disk_grad else None


def _min_bytes(plan: Plan, config: OffloadConfig) -> int:
    """The activation_min_bytes in effect: the plan's (the planner may lower the
    configured one to fit a budget), else the configured one."""
    return (
        plan.activation_min_bytes
        if plan.activation_min_bytes is not None
        else config.activation_min_bytes
    )


def _group_index(
    model: nn.Module, optimizer: Optimizer | None, stacklevel: int = 3
) -> dict[int, int]:
    """Parameter id -> index of its optimizer param group; checks the optimizer's params."""
    if optimizer is None:
        return {}
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    model_params = {id(p) for p in model.parameters()}
    index: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in model_params:
                raise ConfigError(
                    f"optimizer param group {g} holds a parameter of shape {tuple(param.shape)} "
                    "that is not in the model; build the optimizer over model.parameters()"
                )
            if param.requires_grad:
                index[id(param)] = g
    if any(float(st.get("step", 0)) > 0 for st in optimizer.state.values()):
        warnings.warn(
            "the optimizer already has state (it has stepped); hetstore starts from fresh "
            "state. Load saved state with optimizer.load_state_dict() after offload().",
            stacklevel=stacklevel,
        )
    return index


def _move_buffers(model: nn.Module, tiers: Tiers) -> None:
    total = 0
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if buffer.device != tiers.device:
                module._buffers[name] = buffer.to(tiers.device)
            total += buffer.numel() * buffer.element_size()
    if total:
        tiers.device_tier.reserve(total, "module buffers")


def _placement_advice(
    config: OffloadConfig, units: list[Unit], tier: str, kept_activations: int = 0
) -> list[str]:
    """What setting would make the states fit, from the units built so far;
    ``kept_activations``: device bytes of tensors saved for backward kept on the device."""
    if tier != Tier.DEVICE.label or not units:
        return []
    lines = []
    if config.offload_activations is not Tier.DEVICE and kept_activations:
        lines.append(
            f"  {format_size(kept_activations)} of tensors saved for backward stay on the "
            f"device (the 'activations' holder): each is smaller than activation_min_bytes "
            f"({format_size(config.activation_min_bytes)}), below which offload_activations="
            f"'{config.offload_activations}' does not move them; a smaller "
            "activation_min_bytes (0 moves every one) offloads them too"
        )
    numel = sum(u.numel for u in units)
    if config.offload_param is Tier.DEVICE:
        saved = numel * units[0].compute_dtype.itemsize
        lines.append(
            f"  offload_param='cpu' would keep only the running unit's parameters on the "
            f"device (frees about {format_size(saved)} of parameters so far)"
        )
    if config.offload_activations is Tier.DEVICE:
        lines.append(
            "  offload_activations='cpu' would move the tensors saved for backward "
            "(the 'activations' holder) to host memory until their backward"
        )
    if config.offload_optimizer is Tier.DEVICE:
        lines.append(
            f"  offload_optimizer='cpu' would move fp32 master weights, gradients and "
            f"optimizer states to host memory (about {format_size(numel * 16)} so far for Adam)"
        )
    return lines
