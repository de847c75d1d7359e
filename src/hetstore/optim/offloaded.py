"""``OffloadedOptimizer``: the user's optimizer, stepping flat fp32 master buffers.

Built from the user's optimizer instance (its class and every ``param_groups`` entry).
Per unit, each param group's parameters are one contiguous segment of the unit's fp32
master; Adam/AdamW/SGD step a segment with torch's fused kernel in one call (measured
at the memory-bandwidth ceiling on CPU, at parity with DeepSpeed's CPUAdam). Any other
``torch.optim`` class steps per-parameter views of the same buffers.

``param_groups`` are the user's groups, live: an LR scheduler edits them, and every
step copies their hyper-parameters into the per-unit inner optimizers.
``state_dict()`` / ``load_state_dict()`` speak torch's format over the original
parameters, so states move to and from a plain torch optimizer.

Units whose master and states are on disk are stepped by :class:`StreamedUnitStep`
(chunks streamed through host buffers, all-or-nothing per unit). Gradients on disk are
never rewritten for clipping or unscaling: the factors are remembered and applied to
each chunk as it is read, in the order torch would have applied them in place. If a
step fails part-way (disk full, IO error), the units before the failing one are
stepped and the rest are untouched; calling ``step()`` again finishes the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.optim import Optimizer

from hetstore._sizes import format_size
from hetstore.errors import ConfigError, OutOfTierMemory
from hetstore.optim.compact import CompactUnitStep
from hetstore.optim.disk_grads import DiskGradients
from hetstore.optim.grad_norms import RecordedNorms
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.loss_scaler import DynamicLossScaler
from hetstore.optim.registry import FLAT_NAMES, flat_spec, flat_steppable
from hetstore.optim.state_format import StateFormat
from hetstore.optim.state_format import state_format as state_format_named
from hetstore.optim.step_ahead import StepAhead, eligible
from hetstore.optim.streamed import ChunkNorms, StreamedUnitStep, UnitStates
from hetstore.runtime.sharding import ShardGroup
from hetstore.runtime.unit import ParamEntry, Unit
from hetstore.tier import Tier
from hetstore.tiers.flat import DiskSlice
from hetstore.tiers.store import transfers_only

__all__ = ["OffloadedOptimizer"]


class OffloadedOptimizer(Optimizer):
    """Steps the model's fp32 master weights on the tier that holds them."""

    def __init__(
        self,
        original: Optimizer,
        units: list[Unit],
        *,
        loss_scaler: DynamicLossScaler | None = None,
        on_step: Callable[[], None] | None = None,
        on_step_begin: Callable[[], None] | None = None,
        chunk_numel: int = 2**24,
        param_order: list | None = None,
        shards: ShardGroup | None = None,
        overlap_step: bool = False,
        overlap_memory_step: bool = False,
        pace_memory_steps: bool = False,
        step_in_forward_memory: bool = False,
        root: Unit | None = None,
        step_in_backward: bool = False,
        step_in_forward: bool = False,
        state_format: StateFormat | None = None,
    ):
        self._laid_out = False  # add_param_group: only Optimizer.__init__'s own calls
        super().__init__([dict(g) for g in original.param_groups], dict(original.defaults))
        # The original's param_groups themselves, live (optim.original): an LR scheduler
        # or callback made on the user's optimizer before offload() edits what the step
        # reads, and one made on this one edits the original's.
        self.param_groups = original.param_groups
        self.defaults = original.defaults
        self._original = original
        self._laid_out = True
        self.optimizer_class = type(original)
        self.units = units
        self.shards = shards  # sharded over ranks: every unit holds this rank's shard only
        self.loss_scaler = loss_scaler
        self._on_step = on_step
        self._on_step_begin = on_step_begin
        self._flat = flat_steppable(original)
        self._spec = flat_spec(original)  # what states a flat step keeps
        self.state_format = state_format or state_format_named("fp32")
        self._entry_of: dict[int, tuple[Unit, ParamEntry]] = {}
        for unit in units:
            for entry in unit.entries:
                self._entry_of[id(entry.param)] = (unit, entry)
        self._chunk_numel = chunk_numel
        # the order norms are summed in by clip_grad_norm_: the model's parameter order
        # (what torch.nn.utils.clip_grad_norm_(model.parameters()) uses), else the groups'
        in_groups = [p for g in self.param_groups for p in g["params"]]
        known = {id(p) for p in in_groups}
        self._norm_order = [p for p in (param_order or in_groups) if id(p) in known]
        self._unit_steps = [self._build_unit_step(u) for u in units if u.trainable_numel]
        self._unscaled = False
        self._found_inf = False  # what the unscale of this step found
        self._warned_missing: set[str] = set()
        # factors (unscale, clip) still to apply to on-disk gradients, in order
        self._disk_grad_factors: list = []
        self._clipped = False  # clip_grad_norm_ scaled this step's gradients
        self._resume_at = 0  # index into _unit_steps where an interrupted step goes on
        self._released = False  # hetstore.release(model) freed the units' buffers
        self.step_in_backward = step_in_backward and shards is None
        self._overlap = (overlap_step, overlap_memory_step, step_in_forward)
        self._pace_memory_steps = pace_memory_steps  # see optim.policy
        self._step_in_forward_memory = step_in_forward_memory
        self._root = root
        self.step_ahead: StepAhead | None = None
        self.grad_norms: RecordedNorms | None = None
        self._stepped_ahead: set[int] = set()  # ids of the units this step committed
        self.disk_grads = DiskGradients(self)  # p.grad of gradients on disk
        self.arrange_steps()

    def arrange_steps(self) -> None:
        """Which unit steps run ahead of ``step()`` and which record the clip's norms in
        backward, from the unit steps as they are now (at construction, and again when
        units' states moved before training: :meth:`commit_states_move`). The runtime is told
        of the new ``step_ahead`` and ``grad_norms`` by its owner (``offload()``)."""
        overlap_step, overlap_memory_step, step_in_forward = self._overlap
        if self.step_ahead is not None:
            self.step_ahead.close()
        # the clip's norms of disk gradients, taken in backward (the runtime's
        # GRADS_FINAL event); with or without the step ahead, and told before it
        if self.grad_norms is not None:
            self.grad_norms.close()
        streamed = [s for s in self._unit_steps if isinstance(s, StreamedUnitStep)]
        self.grad_norms = RecordedNorms(streamed) if self.shards is None and streamed else None
        # units stepped speculatively during backward (optim.step_ahead): disk units,
        # unsharded; memory units sharded too (a rank steps its own shard, with nothing
        # collective in it)
        ahead = []
        if overlap_step or self.step_in_backward or step_in_forward:
            ahead += [s for s in self._unit_steps if eligible(s, s.unit)]
        if overlap_memory_step and not self.step_in_backward:
            # the root's gradients are final when backward ends: nothing would hide it
            ahead += [
                s
                for s in self._unit_steps
                if isinstance(s, InMemoryUnitStep)
                and s.unit is not self._root
                and s.can_speculate(self._flat)
            ]
        # host units whose ordinary step runs on, in place, during the next forward
        # (step_in_forward on a GPU): not sharded (a fetch gathers every rank's shard)
        in_place = []
        if step_in_forward and self._step_in_forward_memory and self.shards is None:
            in_place = [
                s
                for s in self._unit_steps
                if isinstance(s, InMemoryUnitStep) and s.can_speculate(self._flat)
            ]
        self.step_ahead = None
        if ahead or in_place:
            self.step_ahead = StepAhead(
                ahead,
                self._hyper,
                self.loss_scaler,
                consume=self.step_in_backward,
                speculate=overlap_step or overlap_memory_step,
                in_forward=step_in_forward,
                pace=self._pace_memory_steps,
                in_place=in_place,
            )

    @property
    def can_move_states(self) -> bool:
        """Units' states in host memory can move to disk before training
        (:meth:`prepare_states_move`): a flat optimizer in the exact format, unsharded."""
        return self._flat and self.state_format.exact and self.shards is None

    @torch.no_grad()
    def prepare_states_move(self, unit: Unit) -> StreamedUnitStep | None:
        """The first half of moving ``unit``'s optimizer states to disk along with its
        master (``Unit.prepare_master_move``, before its first gradient): the streamed
        step that will own them, its disk arrays made and, for states that hold values
        (a checkpoint loaded before training), written with each segment's step counter;
        fresh ones are the arrays' zeros. The unit's current step is untouched, so a
        failure changes nothing (the new arrays are given back). None: nothing trainable.
        :meth:`commit_states_move` makes it the unit's, then :meth:`arrange_steps`."""
        self._check_alive("move_states")
        old = next((s for s in self._unit_steps if s.unit is unit), None)
        if old is None:
            return None
        if not isinstance(old, InMemoryUnitStep) or not self.can_move_states:
            raise ValueError(f"unit {unit.name!r}: only flat fp32 states in memory move to disk")
        inner = [old.optimizer.state.get(t) or {} for t in old.tensors]
        started = [bool(state) and self._has_started(state) for state in inner]
        keys = self._spec.state_keys(self.param_groups)
        with unit.freed_on_failure():  # (the arrays made before a failure)
            new = StreamedUnitStep(
                unit, self.optimizer_class, self._hyper, keys, self._chunk_numel, self.state_format
            )
            if any(started):
                values: dict[str, list] = {}
                for segment, state, begun in zip(unit.segments, inner, started, strict=True):
                    for key in new.states:
                        if begun and key in state:
                            values.setdefault(key, []).append((segment.start, state[key]))
                new.write_states(values, None)
                new.mark_loaded([float(state.get("step", 0)) for state in inner])
        return new

    def commit_states_move(self, unit: Unit, new: StreamedUnitStep | None) -> None:
        """The second half (see :meth:`prepare_states_move`), once the unit's master is on
        disk: the streamed step replaces the in-memory one and the host states go."""
        if new is None:
            return
        index = next(i for i, s in enumerate(self._unit_steps) if s.unit is unit)
        old = self._unit_steps[index]
        for tensor in old.tensors:
            state = old.optimizer.state.get(tensor) or {}
            for value in state.values():
                unit.free_buffer(value)  # (the unit's only: not torch's step counter)
            state.clear()
        self._unit_steps[index] = new

    @property
    def unit_steps(self) -> tuple[InMemoryUnitStep | UnitStates, ...]:
        """Each trainable unit's step, in the order ``step()`` takes them."""
        return tuple(self._unit_steps)

    def group_hyper(self, group_index: int) -> dict:
        """The values a unit step of param group ``group_index`` runs with (the group's,
        with torch's fused kernel for a flat optimizer)."""
        return self._hyper(group_index)

    @property
    def speculation_stats(self) -> dict[str, int] | None:
        """Speculative steps started, committed, rolled back, cancelled (None when no
        unit is stepped ahead; see ``overlap_step``)."""
        return self.step_ahead.stats.as_dict() if self.step_ahead is not None else None

    # ------------------------------------------------------------------ lifetime
    def release(self) -> None:
        """The model was released (hetstore.release): drop every reference to the units'
        buffers and refuse to be used from now on."""
        self._released = True
        if self.step_ahead is not None:
            self.step_ahead.close()
            self.step_ahead = None
        if self.grad_norms is not None:
            self.grad_norms.close()
        self.grad_norms = None  # it holds the unit steps (and their buffers)
        self._unit_steps = []
        self._entry_of = {}
        self.units = []
        self.state.clear()

    def _check_alive(self, what: str) -> None:
        if self._released:
            raise ConfigError(
                f"optimizer.{what}(): its model was released by hetstore.release(), which "
                "freed the master weights and optimizer states; offload a new model"
            )

    # ------------------------------------------------------------------ construction
    def _hyper(self, group_index: int) -> dict:
        group = self.param_groups[group_index]
        hyper = {k: v for k, v in group.items() if k != "params"}
        if self._flat:
            hyper.update(foreach=False, fused=True)
        return hyper

    def _build_unit_step(self, unit: Unit) -> InMemoryUnitStep | UnitStates:
        on_disk = transfers_only(unit.master)
        if on_disk and not self._flat:
            raise TypeError(
                f"offload_optimizer='disk' streams the states of {FLAT_NAMES}; "
                f"{self.optimizer_class.__name__} is not supported there"
            )
        # compact states in memory: checked at offload() to be a flat optimizer's
        if on_disk or not self.state_format.exact:
            chunked = StreamedUnitStep if on_disk else CompactUnitStep
            keys = self._spec.state_keys(self.param_groups)
            return chunked(
                unit, self.optimizer_class, self._hyper, keys, self._chunk_numel, self.state_format
            )
        inner_groups, tensors, owners = [], [], []
        if self._flat:
            for seg in unit.segments:
                master = unit.master[seg.start : seg.end]
                master.grad = unit.grad[seg.start : seg.end]
                inner_groups.append({**self._hyper(seg.group), "params": [master]})
                tensors.append(master)
                owners.append(seg.group)
        else:
            by_group: dict[int, list[torch.Tensor]] = {}
            for e in unit.trainable_entries:
                view = unit.master[e.offset : e.offset + e.numel].view(e.shape)
                view.grad = unit.grad[e.offset : e.offset + e.numel].view(e.shape)
                by_group.setdefault(e.group, []).append(view)
                tensors.append(view)
            for group_index, views in by_group.items():
                inner_groups.append({**self._hyper(group_index), "params": views})
                owners.append(group_index)
        inner = self.optimizer_class(inner_groups)
        step = InMemoryUnitStep(unit, inner, tensors, owners)
        if self._flat and self._spec.preallocate_states:
            self._preallocate_states(step)
        return step

    def _preallocate_states(self, step: InMemoryUnitStep) -> None:
        """Allocate the states (Adam's moments) in the unit's optimizer tier now, so a
        placement that cannot hold them is refused before training starts, not at the
        first step."""
        unit = step.unit
        for group, master in zip(step.optimizer.param_groups, step.tensors, strict=True):
            keys = self._spec.state_keys([group])
            state = {"step": torch.zeros((), dtype=torch.float32, device=master.device)}
            for key in keys:
                tensor = unit.allocate(unit.placement.optimizer, master.numel(), torch.float32, key)
                tensor.zero_()
                state[key] = tensor
            step.optimizer.state[master] = state

    # ------------------------------------------------------------------ gradients
    def _memory_grad_views(self) -> dict[int, torch.Tensor]:
        """id(param) -> its gradient view, for parameters with a gradient in memory."""
        views = {}
        for unit in self.units:
            if unit.grad is None or transfers_only(unit.grad):
                continue
            for entry in unit.trainable_entries:
                if entry.has_grad:
                    views[id(entry.param)] = unit.grad[entry.offset : entry.offset + entry.numel]
        return views

    def _grad_shards(self) -> list[torch.Tensor]:
        """Sharded: the in-memory gradient shards of units that have gradients (whole
        flat buffers; their padding is zero)."""
        return [
            u.grad
            for u in self.units
            if isinstance(u.grad, torch.Tensor) and u.trainable_numel and u.grads.any()
        ]

    def _disk_units(self) -> list[StreamedUnitStep]:
        return [
            us
            for us in self._unit_steps
            if isinstance(us, StreamedUnitStep)
            and transfers_only(us.unit.grad)
            and us.unit.grads.any()
        ]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` under fp16 dynamic loss scaling, else ``loss`` unchanged.

        Usage with ``compute_dtype="fp16"``: ``optimizer.scale_loss(loss).backward()``
        (or ``optimizer.backward(loss)``), then ``optimizer.step()`` as usual.
        """
        if self.loss_scaler is None:
            return loss
        return loss * self.loss_scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.scale_loss(loss).backward(**kwargs)

    def _unscale(self) -> bool:
        """Divide gradients by the loss scale once per step; return True if any is inf/NaN
        (again on a second call: ``clip_grad_norm_`` unscales before ``step()`` does, and
        the step must still skip; it used to see False there and step with inf/NaN)."""
        if self.loss_scaler is None:
            return False
        if self._unscaled:
            return self._found_inf
        self._unscaled = True
        self._found_inf = self._unscale_now()
        return self._found_inf

    def _unscale_now(self) -> bool:
        if self.step_ahead is not None:
            self.step_ahead.caller_waits()
        inv = 1.0 / self.loss_scaler.scale
        if self.shards is not None:
            views = self._grad_shards()
        else:
            views = list(self._memory_grad_views().values())
        found = False
        if views:
            unscaled = None
            if self.step_ahead is not None:  # steps taken ahead applied inv themselves
                unscaled = self.step_ahead.unscaling(
                    [u for u in self.units if isinstance(u.grad, torch.Tensor)]
                )
            torch._foreach_mul_(views, inv)
            if unscaled is not None:
                unscaled(inv)
            found = not all(bool(torch.isfinite(v).all()) for v in views)
        self._disk_grad_factors.append(inv)
        finite = [True]

        def check(chunk: torch.Tensor, start: int) -> None:
            if finite[0] and not bool(torch.isfinite(chunk).all()):
                finite[0] = False

        for unit_step in self._disk_units():
            if found or not finite[0]:
                break
            unit_step.scan_grads(self._disk_grad_factors, check)
        found = found or not finite[0]
        if self.shards is not None:  # every rank skips the step, or none does
            flag = torch.tensor(float(found), device=self.units[0].device)
            self.shards.all_reduce(flag, "max", "the fp16 overflow check")
            found = bool(flag)
        return found

    def prepare_grad_reads(self, norm_type: float) -> None:
        """Before a clip reads the gradients (``clip_grad_norm_``, or torch's through
        ``p.grad`` of gradients on disk): the steps still running on them land, and from
        the next backward on each disk unit's L2 norms are taken as its gradients are
        written (with fp16 the clip reads unscaled gradients, which backward has not)."""
        if self.step_ahead is not None:
            self.step_ahead.caller_waits()
        self.finish_steps_in_forward()
        if self.grad_norms is not None and norm_type == 2.0 and self.loss_scaler is None:
            self.grad_norms.enabled = True

    def disk_grad_norms(self, norm_type: float) -> dict[int, torch.Tensor]:
        """id(param) -> norm of its (factored) gradient, for gradients on disk. A
        parameter split across two chunks combines the chunks' norms."""
        norms: dict[int, torch.Tensor] = {}
        for unit_step in self._disk_units():
            recorded = self._norms_from_backward(unit_step.unit, norm_type)
            if recorded is not None:  # taken at the end of backward: no read from disk
                norms.update(recorded)
                continue
            chunked = ChunkNorms(unit_step.unit, norm_type)
            unit_step.scan_grads(self._disk_grad_factors, chunked.visit)
            norms.update(chunked.result())
        return norms

    def disk_grads_version(self) -> tuple:
        """Changes whenever the gradients on disk, or the factors on them, change."""
        states = tuple(s.unit.grads.state() for s in self._disk_units())
        return (len(self._disk_grad_factors), states)

    def disk_grad_entries(self) -> list[ParamEntry]:
        """The parameters whose gradients are on disk and present."""
        return [e for s in self._disk_units() for e in s.unit.trainable_entries if e.has_grad]

    def scale_disk_grads(self, factor: torch.Tensor) -> None:
        """Multiply every gradient on disk by ``factor`` (as the step reads them)."""
        self._disk_grad_factors.append(factor)

    def forget_disk_factors(self) -> None:
        """Every gradient on disk was cleared through torch's API: the factors meant for
        them go (as optimizer.zero_grad() drops them)."""
        self._disk_grad_factors = []
        self.disk_grads.forget()

    def _norms_from_backward(self, unit: Unit, norm_type: float) -> dict[int, torch.Tensor] | None:
        """The per-parameter norms recorded from ``unit``'s gradients in backward, when
        they are still what the clip would read (no factor to apply yet: an earlier clip
        scales them); else None."""
        if self.grad_norms is None or norm_type != 2.0 or self._disk_grad_factors:
            return None
        return self.grad_norms.norms_of(unit)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the global gradient norm over every gradient, wherever it lives.

        Same semantics and return value as ``torch.nn.utils.clip_grad_norm_`` over the
        original parameters (norms per parameter, then the norm of those norms, summed in
        ``model.parameters()`` order). Gradients on disk are read once for their norms and
        scaled as the step reads them.
        """
        self._check_alive("clip_grad_norm_")
        if self.step_in_backward:
            raise ConfigError(
                "optimizer.clip_grad_norm_(): with step_in_backward=True each unit is stepped "
                "inside backward, before the global norm is known, and its gradients are "
                "gone; set step_in_backward=False to clip (overlap_step still steps beside "
                "backward, exactly)"
            )
        norm_type = float(norm_type)
        self.prepare_grad_reads(norm_type)
        self._unscale()
        if self.shards is not None:
            return self._clip_sharded(max_norm, norm_type, error_if_nonfinite)
        memory = self._memory_grad_views()
        per_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for key, view in memory.items():
            per_device.setdefault(view.device, []).append((key, view))
        norms: dict[int, torch.Tensor] = {}
        for items in per_device.values():
            computed = torch._foreach_norm([v for _, v in items], norm_type)
            norms.update(zip((k for k, _ in items), computed, strict=True))
        norms.update(self.disk_grad_norms(norm_type))
        ordered = [norms[id(p)] for p in self._norm_order if id(p) in norms]
        if not ordered:
            return torch.tensor(0.0)
        target = ordered[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(target) for n in ordered]), norm_type)
        self._check_finite(total, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coef) != 1.0:  # x * 1.0 is x: not clipping leaves the buffers untouched,
            self._clipped = True  # so a step already taken ahead still holds
            for items in per_device.values():
                device = items[0][1].device
                torch._foreach_mul_([v for _, v in items], coef.to(device))
        self._disk_grad_factors.append(coef.cpu())
        return total

    @staticmethod
    def _check_finite(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} for gradients is non-finite, so it "
                "cannot be clipped; set error_if_nonfinite=False to clip anyway"
            )

    def _clip_sharded(
        self, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """``clip_grad_norm_`` over shards: each rank sums its shards' ``|g|^p`` (or takes
        their max for the inf-norm), the ranks all-reduce, and every rank clips by the
        same factor. Equal to torch's per-parameter norm-of-norms up to fp32 rounding of
        the summation order (it sums in float64, then rounds)."""
        infinite = norm_type == float("inf")
        partials: list[torch.Tensor] = []

        def add(chunks: list[torch.Tensor]) -> None:
            for norm in torch._foreach_norm(chunks, norm_type):
                norm = norm.double().cpu()
                partials.append(norm if infinite else norm**norm_type)

        flats = self._grad_shards()
        if flats:
            add(flats)
        for unit_step in self._disk_units():
            unit_step.scan_grads(self._disk_grad_factors, lambda chunk, start: add([chunk]))
        local = torch.zeros((), dtype=torch.float64)
        if partials:
            stacked = torch.stack(partials)
            local = stacked.max() if infinite else stacked.sum()
        local = local.to(self.units[0].device)
        self.shards.all_reduce(local, "max" if infinite else "sum", "the gradient norm")
        total = (local if infinite else local ** (1.0 / norm_type)).float().cpu()
        self._check_finite(total, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if flats and float(coef) != 1.0:  # (x * 1.0 is x: a step taken ahead holds)
            self._clipped = True
            torch._foreach_mul_(flats, coef.to(flats[0].device))
        self._disk_grad_factors.append(coef)
        return total

    # ------------------------------------------------------------------ step
    def add_param_group(self, param_group: dict) -> None:
        if self._laid_out:
            raise ConfigError(
                "optimizer.add_param_group() after hetstore.offload(): each unit's flat "
                "buffers are laid out by param group at offload(); add the group to the "
                "optimizer before calling hetstore.offload()"
            )
        super().add_param_group(param_group)

    def step(self, closure=None):
        """torch's ``step(closure=None)``: the closure (forward and backward) runs under
        ``torch.enable_grad()`` first, as torch's optimizers run it, and its loss is
        returned; its backward is this step's backward like any other."""
        self._check_alive("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        self._original._opt_called = True  # (a scheduler on the user's optimizer checks)
        return loss

    @torch.no_grad()
    def _step(self) -> None:
        self.disk_grads.check_complete()  # (a torch clip's scale reached every one)
        if self._on_step_begin is not None:
            self._on_step_begin()
        if self.step_ahead is not None:
            self.step_ahead.caller_waits()
        self.finish_steps_in_forward()  # the last step's, if no forward came between
        self._check_chunked_state_keys()
        if self._resume_at == 0:
            found_inf = self._unscale()
            if self.loss_scaler is not None:
                self.loss_scaler.update(found_inf)
                if found_inf:
                    self.zero_grad()  # (drops the steps taken ahead too)
                    if self.step_ahead is not None:
                        self.step_ahead.step_ended()
                    return None
        # the loss scaler has decided; an interrupted step resumes below, not above
        if self.step_ahead is not None:
            if self._resume_at == 0:
                # recorded as each commits and kept until the step is done: a step resumed
                # after a failure (even one in settle, or at the first unit) skips them
                self.step_ahead.settle(
                    self._disk_grad_factors, self._stepped_ahead, clipped=self._clipped
                )
            else:  # resuming: speculations of a backward run since are not this step's
                self.step_ahead.discard_all()
        if self._resume_at == 0:
            self._refuse_consumed_again()
        if self.step_ahead is not None and self.step_ahead.in_forward:
            # the rest of the disk units' steps run on during the next forward
            later = [
                s
                for s in self._unit_steps[self._resume_at :]
                if id(s.unit) not in self._stepped_ahead
                and isinstance(s, (UnitStates, InMemoryUnitStep))
            ]
            for unit_step in later:
                if unit_step.unit.grads.any():
                    self._warn_missing(unit_step.unit)
            # (recorded as each starts: a step resumed after a failure here skips them)
            self.step_ahead.defer(later, self._factors_for, self._stepped_ahead)
        for index in range(self._resume_at, len(self._unit_steps)):
            self._resume_at = index
            unit_step = self._unit_steps[index]
            unit = unit_step.unit
            if id(unit) in self._stepped_ahead:
                continue
            if unit.home_stale:  # stepped before an interruption; only the copy is left
                unit.refresh_from_master()
                continue
            if not unit.grads.any():
                continue  # like torch: parameters without a gradient are not stepped
            self._warn_missing(unit)
            # (taken while the unit's versions are still those it was read at)
            ahead = None if self.step_ahead is None else self.step_ahead.take_read_ahead(unit)
            # an in-memory master that is also the home changes in place: the values
            # forward sees move from here, even if the step then fails
            unit.param_version += 1
            if isinstance(unit_step, UnitStates):
                try:
                    self._step_streamed(unit_step, ahead)
                except OutOfTierMemory as exc:
                    self._note_held_shadows(exc)
                    raise
                continue
            unit.grads.fill_missing()
            unit_step.step(self._hyper)
        self._resume_at = 0
        if self.step_ahead is not None:
            self.step_ahead.drop_read_ahead()
        self._forget_this_step()
        if self._on_step is not None:
            self._on_step()
        return None

    def _note_held_shadows(self, exc: OutOfTierMemory) -> None:
        """The disk was full for a step: say what the steps running on into the next
        forward hold of it, if any, and how to keep that room for this step."""
        steps, held = (
            (0, 0) if self.step_ahead is None else self.step_ahead.in_forward_shadow_bytes()
        )
        if exc.tier == Tier.DISK.label and steps:
            exc.add_note(
                f"hetstore: {steps} unit steps running on into the next forward "
                f"(step_in_forward) hold {format_size(held)} of disk shadows until their "
                "units are used; step_in_forward=False leaves that room to optimizer.step()"
            )

    def _step_streamed(self, unit_step: UnitStates, ahead) -> None:
        """The unit's chunked step; from its master and states read into host memory
        during backward, ``ahead``, where they were (a clip that bit: ``StepAhead``)."""
        unit = unit_step.unit
        if ahead is None:
            unit_step.step(self._factors_for(unit))
            return
        try:
            unit_step.step(self._factors_for(unit), read_ahead=ahead.arrays)
        finally:
            self.step_ahead.give_back_read_ahead(ahead)

    def _factors_for(self, unit: Unit) -> list:
        """What the step multiplies ``unit``'s gradients by as it reads them: the clip's
        and fp16's factors for gradients on disk (in memory they were applied in place)."""
        return list(self._disk_grad_factors) if transfers_only(unit.grad) else []

    def finish_steps_in_forward(self) -> None:
        """Commit the unit steps still running on from the last ``optimizer.step()``
        (``step_in_forward``); a no-op otherwise. Everything that reads the optimizer's
        states, the master or the gradients as a whole calls it first."""
        if self.step_ahead is not None:
            self.step_ahead.finish_in_forward()

    def _check_chunked_state_keys(self) -> None:
        """States streamed chunk by chunk (on disk, or compact) are arrays laid out at
        ``offload()`` for the states the param groups asked for then; refuse a step that
        would need others (SGD's momentum or Adam's amsgrad turned on since) rather than
        step without them."""
        if not self._flat:
            return
        keys = set(self._spec.state_keys(self.param_groups))
        for unit_step in self._unit_steps:
            if isinstance(unit_step, UnitStates) and set(unit_step.states) != keys:
                raise ConfigError(
                    f"optimizer.step(): the param groups now ask for the states "
                    f"{sorted(keys)}, but unit {unit_step.unit.name!r} keeps "
                    f"{sorted(unit_step.states)} chunk by chunk (laid out at offload(); "
                    "SGD's momentum or Adam's amsgrad was changed since). Set them before "
                    "hetstore.offload(), or keep these states in memory "
                    "(offload_optimizer='cpu', optimizer_state_format='fp32')"
                )

    def _forget_this_step(self) -> None:
        """What one step's gradients carried (after the step, or dropped by zero_grad)."""
        self._stepped_ahead = set()
        self._unscaled = False
        self._disk_grad_factors = []
        self._clipped = False
        self.disk_grads.forget()
        if self.grad_norms is not None:
            self.grad_norms.clear()

    def _refuse_consumed_again(self) -> None:
        """A second optimizer.step() on gradients a step in backward consumed: plain
        PyTorch would step again with them, which are gone."""
        again = [
            u.name for u in self.units if u.grads.consumed and id(u) not in self._stepped_ahead
        ]
        if again:
            raise RuntimeError(
                f"optimizer.step() again on the gradients of units {again[:3]}, which the "
                "step inside the last backward consumed (step_in_backward=True); call "
                "zero_grad() and run a backward before the next step"
            )

    def _warn_missing(self, unit: Unit) -> None:
        names = [e.name for e in unit.trainable_entries if not e.has_grad]
        new = [n for n in names if n not in self._warned_missing]
        if new:
            self._warned_missing.update(new)
            warnings.warn(
                f"parameters {new} got no gradient but share a flat buffer with parameters "
                "that did: they are stepped with a zero gradient (plain PyTorch would skip "
                "them; with weight decay or momentum they move). Put them in their own unit "
                "with units=[...], freeze them before hetstore.offload(), or freeze whole "
                "units (blocks) after it.",
                stacklevel=3,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (the buffers stay allocated for the next step)."""
        self._check_alive("zero_grad")
        if self._resume_at:
            warnings.warn(
                "zero_grad() after a step() that failed part-way: the units it had not "
                "reached yet are not stepped (call step() again before zero_grad() to finish)",
                stacklevel=2,
            )
            self._resume_at = 0
        self._forget_this_step()
        if self.step_ahead is not None:
            self.step_ahead.discard_all()
        for unit in self.units:
            unit.grads.clear()

    # ------------------------------------------------------------------ state dict
    def _locate(self, param) -> tuple[InMemoryUnitStep, int, torch.Tensor, ParamEntry]:
        unit, entry = self._entry_of[id(param)]
        for unit_step in self._unit_steps:
            if unit_step.unit is unit and isinstance(unit_step, UnitStates):
                return unit_step, entry.offset, None, entry
            if unit_step.unit is unit:
                if self._flat:
                    for seg, tensor in zip(unit.segments, unit_step.tensors, strict=True):
                        if seg.start <= entry.offset < seg.end:
                            return unit_step, entry.offset - seg.start, tensor, entry
                else:
                    # by identity: dataclass == would compare the parameters (storage-less)
                    view_index = next(i for i, e in enumerate(unit.trainable_entries) if e is entry)
                    return unit_step, 0, unit_step.tensors[view_index], entry
        raise KeyError(f"parameter {entry.name!r} is not stepped by this optimizer")

    def _refuse_sharded(self, what: str) -> None:
        if self.shards is not None:
            raise RuntimeError(
                f"optimizer.{what}() in torch's format needs every parameter's whole state, "
                f"but each of the {self.shards.world_size} ranks holds a shard of it; save "
                "and load sharded training state with hetstore.save / hetstore.load"
            )

    def state_dict(self) -> dict:
        """Torch's format over the original parameters (indices in param_groups order)."""
        self._check_alive("state_dict")
        self.finish_steps_in_forward()
        self._refuse_sharded("state_dict")
        state: dict[int, dict] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            ids = []
            for param in group["params"]:
                unit_step, start, tensor, entry = self._locate(param)
                if isinstance(unit_step, UnitStates):
                    streamed = self._export_streamed(unit_step, entry)
                    if streamed:
                        state[index] = streamed
                    ids.append(index)
                    index += 1
                    continue
                inner_state = unit_step.optimizer.state.get(tensor)
                if inner_state and self._has_started(inner_state):
                    state[index] = {
                        key: self._export_value(value, tensor, start, entry)
                        for key, value in inner_state.items()
                    }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        out = {"state": state, "param_groups": groups}
        if not self.state_format.exact:  # states decoded to fp32; loads check the format
            out["state_format"] = self.state_format.name
        return out

    @staticmethod
    def _export_streamed(unit_step: UnitStates, entry: ParamEntry) -> dict:
        if not unit_step.stepped:
            return {}
        out = {}
        segment = next(
            i for i, s in enumerate(unit_step.unit.segments) if s.start <= entry.offset < s.end
        )
        if unit_step.has_step:
            out["step"] = unit_step.steps[segment].clone()
        for key in unit_step.states:
            value = unit_step.read_state(key, entry.offset, entry.numel)
            out[key] = value.view(entry.shape)
        return out

    @staticmethod
    def _has_started(inner_state: dict) -> bool:
        step = inner_state.get("step")
        return step is None or float(step) > 0

    def _export_value(self, value, tensor: torch.Tensor, start: int, entry: ParamEntry):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() == tensor.numel() and tensor.dim() == 1 and self._flat:
                return value[start : start + entry.numel].view(entry.shape).clone()
            return value.clone()
        return value.clone() if isinstance(value, torch.Tensor) else value

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_alive("load_state_dict")
        self.finish_steps_in_forward()
        self._refuse_sharded("load_state_dict")
        saved_format = state_dict.get("state_format", "fp32")
        if saved_format != self.state_format.name:
            raise ValueError(
                f"optimizer.load_state_dict(): the states were saved with "
                f"optimizer_state_format={saved_format!r} and this run keeps them as "
                f"{self.state_format.name!r}; to convert them (rounding them to this run's "
                f"format), set state_dict['state_format'] = {self.state_format.name!r} first"
            )
        if self.step_ahead is not None:
            self.step_ahead.discard_all()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(s["params"])
            for g, s in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "loaded optimizer state has a different param group layout than this optimizer: "
                f"{[len(g['params']) for g in groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]} parameters per group"
            )
        for saved, group in zip(groups, self.param_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        saved_state = state_dict["state"]
        streamed: dict[UnitStates, tuple[dict, list]] = {}
        for saved, group in zip(groups, self.param_groups, strict=True):
            for index, param in zip(saved["params"], group["params"], strict=True):
                if index not in saved_state and str(index) not in saved_state:
                    continue
                values = saved_state.get(index, saved_state.get(str(index)))
                unit_step, start, _, entry = self._locate(param)
                if isinstance(unit_step, UnitStates):
                    slices, steps = streamed.setdefault(unit_step, ({}, []))
                    for key, value in values.items():
                        if key == "step":
                            steps.append(float(value))
                        elif key in unit_step.states:
                            slices.setdefault(key, []).append((start, value))
                    continue
                self._import_param_state(param, values)
        for unit_step, (slices, steps) in streamed.items():
            unit_step.write_states(slices, max(steps) if steps else None)

    # ------------------------------------------------------------------ checkpoint access
    # hetstore.save / hetstore.load stream states unit by unit through these, without the
    # copies state_dict() makes (see hetstore.checkpoint.training).
    def check_between_steps(self) -> None:
        """Refuse to checkpoint in the middle of a step that failed part-way."""
        self.finish_steps_in_forward()
        if self._resume_at:
            raise RuntimeError(
                "a step() failed part-way (some units are stepped, others not): call step() "
                "again to finish it before saving a checkpoint"
            )

    def streamed_step_of(self, unit: Unit) -> UnitStates | None:
        """The step that owns ``unit``'s states chunk by chunk (on disk, or in a compact
        format in memory), else None."""
        self.finish_steps_in_forward()
        for unit_step in self._unit_steps:
            if unit_step.unit is unit:
                return unit_step if isinstance(unit_step, UnitStates) else None
        return None

    def export_param_state(self, param) -> dict:
        """``param``'s state without copies: per-element states as views of the flat
        buffers (memory) or :class:`DiskSlice` (disk), the rest as torch keeps it. Empty
        before the parameter's first step, as in torch."""
        self.finish_steps_in_forward()
        unit_step, start, tensor, entry = self._locate(param)
        if isinstance(unit_step, UnitStates):
            if not unit_step.stepped:
                return {}
            segment = next(
                i for i, s in enumerate(unit_step.unit.segments) if s.start <= entry.offset < s.end
            )
            out: dict = {"step": unit_step.steps[segment]} if unit_step.has_step else {}
            for key, array in unit_step.states.items():
                if self.state_format.exact:
                    out[key] = DiskSlice(array, entry.offset, entry.numel, entry.param.shape)
                else:  # decoded: the copy a compact format needs
                    value = unit_step.read_state(key, entry.offset, entry.numel)
                    out[key] = value.view(entry.param.shape)
            return out
        inner_state = unit_step.optimizer.state.get(tensor)
        if not inner_state or not self._has_started(inner_state):
            return {}
        out = {}
        for key, value in inner_state.items():
            if self._flat and isinstance(value, torch.Tensor) and value.dim() > 0:
                value = value[start : start + entry.numel].view(entry.shape)
            out[key] = value
        return out

    def segment_states(self, unit: Unit, *, create: tuple[str, ...] = ()) -> list[dict]:
        """The states of each of ``unit``'s optimizer segments (of this rank's shard), in
        order, without copies, for checkpoints of sharded runs: ``{"segment", "base",
        "step", "states", "stepped"}``, where element ``i`` of the shard's flat layout is
        ``states[key][i - base]`` (a tensor in memory, a ``Store`` on disk) and
        ``step`` the segment's counter (None for SGD). ``create``: per-element keys made
        as zeros where torch has not made them yet (SGD's momentum before its first step).
        Flat optimizers only (the ones sharding allows)."""
        self.finish_steps_in_forward()
        for unit_step in self._unit_steps:
            if unit_step.unit is not unit:
                continue
            if isinstance(unit_step, StreamedUnitStep):
                return [
                    {
                        "segment": segment,
                        "base": 0,
                        "step": unit_step.steps[i] if unit_step.has_step else None,
                        "states": dict(unit_step.states),
                        "stepped": unit_step.stepped,
                    }
                    for i, segment in enumerate(unit.segments)
                ]
            out = []
            for segment, tensor in zip(unit.segments, unit_step.tensors, strict=True):
                inner = unit_step.optimizer.state.setdefault(tensor, {})
                for key in create:
                    if key not in inner:
                        inner[key] = torch.zeros_like(tensor)
                states = {
                    k: v for k, v in inner.items() if isinstance(v, torch.Tensor) and v.dim() > 0
                }
                out.append(
                    {
                        "segment": segment,
                        "base": segment.start,
                        "step": inner.get("step"),
                        "states": states,
                        "stepped": bool(inner) and self._has_started(inner),
                    }
                )
            return out
        return []

    @torch.no_grad()
    def reset_unit_state(self, unit: Unit) -> None:
        """Make the in-memory states of ``unit`` fresh (as before any step) before a
        checkpoint's are imported; states on disk are rewritten whole by the loader."""
        for unit_step in self._unit_steps:
            if unit_step.unit is not unit or isinstance(unit_step, UnitStates):
                continue
            unit.before_state_change()  # a step taken ahead from these states goes first
            for tensor in unit_step.tensors:
                state = unit_step.optimizer.state.get(tensor)
                if not state:
                    continue
                if self._flat and self._spec.preallocate_states:
                    for value in state.values():  # preallocated: keep the buffers
                        value.zero_()
                else:
                    for value in state.values():  # (a step taken ahead made it the unit's)
                        unit.free_buffer(value)
                    state.clear()

    def import_param_state(self, param, values: dict) -> None:
        """Set ``param``'s state from ``values`` (torch's keys; tensors copied in)."""
        self._import_param_state(param, values)

    @torch.no_grad()
    def _import_param_state(self, param, values: dict) -> None:
        unit_step, start, tensor, entry = self._locate(param)
        unit_step.unit.before_state_change()  # a step taken ahead from these goes first
        inner = unit_step.optimizer.state.setdefault(tensor, {})
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if self._flat and tensor.dim() == 1:
                    if key not in inner:
                        inner[key] = torch.zeros_like(tensor, dtype=value.dtype)
                    inner[key][start : start + entry.numel].copy_(value.reshape(-1))
                else:
                    inner[key] = value.to(tensor.device, copy=True)
            elif isinstance(value, torch.Tensor):
                inner[key] = value.to(dtype=torch.float32, device=tensor.device, copy=True)
            else:
                inner[key] = value
