"""``OffloadedOptimizer``: the user's optimizer, stepping flat fp32 master buffers.

Built from the user's optimizer instance (its class and every ``param_groups`` entry).
Per unit, each param group's parameters are one contiguous segment of the unit's fp32
master; Adam/AdamW/SGD step a segment with torch's fused kernel in one call (measured
at the memory-bandwidth ceiling on CPU, at parity with DeepSpeed's CPUAdam). Any other
``torch.optim`` class steps per-parameter views of the same buffers.

``param_groups`` are the user's groups, live: an LR scheduler edits them, and every
step copies their hyper-parameters into the per-unit inner optimizers.
``state_dict()`` / ``load_state_dict()`` speak torch's format over the original
parameters, so states move to and from a plain torch optimizer. If a step fails
part-way (disk full, IO error), the units before the failing one are stepped and the
rest are untouched; calling ``step()`` again finishes the step.

The class is the torch-facing optimizer (param groups, ``step``, ``zero_grad``); the
rest is in the classes it is made of, :class:`~hetstore.optim.arrangement.StepArrangement`,
:class:`~hetstore.optim.grad_handling.GradHandling` and
:class:`~hetstore.optim.state_io.StateIO` (each module says what it owns).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.optim import Optimizer

from hetstore._sizes import format_size
from hetstore.errors import ConfigError, OutOfTierMemory
from hetstore.optim.arrangement import StepArrangement
from hetstore.optim.disk_grads import DiskGradients
from hetstore.optim.grad_handling import GradHandling
from hetstore.optim.grad_norms import RecordedNorms
from hetstore.optim.in_memory import InMemoryUnitStep
from hetstore.optim.loss_scaler import DynamicLossScaler
from hetstore.optim.policy import OverlapTrial, StepModes
from hetstore.optim.registry import flat_spec, flat_steppable
from hetstore.optim.state_format import StateFormat
from hetstore.optim.state_io import StateIO
from hetstore.optim.step_ahead import StepAhead
from hetstore.optim.streamed import UnitStates
from hetstore.runtime.sharding import ShardGroup
from hetstore.runtime.unit import ParamEntry, Unit
from hetstore.tier import Tier
from hetstore.tiers.store import transfers_only

__all__ = ["OffloadedOptimizer"]


class OffloadedOptimizer(StepArrangement, GradHandling, StateIO, Optimizer):
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
        modes: StepModes,
        trial_overlap: bool = False,
        state_format: StateFormat,
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
        self.state_format = state_format
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
        # why it cannot be used now (hetstore.release freed the units' buffers; evict
        # moved those on the device away until restore), None when it can
        self.refusal: str | None = None
        # where unit steps may run besides optimizer.step() (optim.policy); sharded, only
        # host units are stepped taking their gradients in backward (offload() refuses
        # step_in_backward with states on disk)
        self.modes = modes
        self._trial_overlap = trial_overlap  # (OverlapTrial: whether overlap pays)
        self.overlap_trial: OverlapTrial | None = None  # (made by arrange_steps)
        self.step_ahead: StepAhead | None = None
        self.grad_norms: RecordedNorms | None = None
        self._stepped_ahead: set[int] = set()  # ids of the units this step committed
        self.disk_grads = DiskGradients(self)  # p.grad of gradients on disk
        self.arrange_steps()

    @property
    def unit_steps(self) -> tuple[InMemoryUnitStep | UnitStates, ...]:
        """Each trainable unit's step, in the order ``step()`` takes them."""
        return tuple(self._unit_steps)

    @property
    def speculation_stats(self) -> dict[str, int] | None:
        """Speculative steps started, committed, rolled back, cancelled (None when no
        unit is stepped ahead; see ``overlap_step``), and the overlap trial's counts:
        trials ended and steps taken without overlap (0 without a trial)."""
        if self.step_ahead is None:
            return None
        trial = self.overlap_trial
        return {
            **self.step_ahead.stats.as_dict(),
            "overlap_trials": trial.trials if trial is not None else 0,
            "without_overlap": trial.without if trial is not None else 0,
        }

    # ------------------------------------------------------------------ lifetime
    def release(self) -> None:
        """The model was released (hetstore.release): drop every reference to the units'
        buffers and refuse to be used from now on."""
        self.refusal = (
            "its model was released by hetstore.release(), which freed the master weights "
            "and optimizer states; offload a new model"
        )
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
        if self.refusal is not None:
            raise ConfigError(f"optimizer.{what}(): {self.refusal}")

    # ------------------------------------------------------------------ construction
    def _hyper(self, group_index: int) -> dict:
        group = self.param_groups[group_index]
        hyper = {k: v for k, v in group.items() if k != "params"}
        if self._flat:
            hyper.update(foreach=False, fused=True)
        return hyper

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
            self.step_ahead.policy.step_called()
        self.finish_steps_in_forward()  # the last step's, if no forward came between
        self._check_chunked_state_keys()
        if self._resume_at == 0:
            found_inf = self._unscale()
            if self.loss_scaler is not None:
                self.loss_scaler.update(found_inf)
                if found_inf:
                    self.zero_grad()  # (drops the steps taken ahead too)
                    if self.step_ahead is not None:
                        self.step_ahead.policy.step_ended()
                    self._trial_step_ended()
                    return None
            # the loss scaler has decided (once: a step resumed after a failure skips this)
            if self.step_ahead is not None:
                # recorded as each commits and kept until the step is done: a step resumed
                # after a failure (even one in settle, or at the first unit) skips them
                self.step_ahead.settle(
                    self._disk_grad_factors, self._stepped_ahead, clipped=self._clipped
                )
            self._refuse_consumed_again()
        elif self.step_ahead is not None:
            # resuming: speculations of a backward run since are not this step's
            self.step_ahead.discard_all()
        if self.step_ahead is not None and self.step_ahead.modes.in_forward:
            # the rest of the disk units' steps, and on a GPU the host units', run on
            # during the next forward
            later = [
                s
                for s in self._unit_steps[self._resume_at :]
                if id(s.unit) not in self._stepped_ahead
            ]
            for unit_step in later:
                if unit_step.unit.grads.any():
                    self._warn_missing(unit_step.unit)
            # (recorded as each starts: a step resumed after a failure here skips them)
            self.step_ahead.forward.hand_over(later, self._factors_for, self._stepped_ahead)
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
            ahead = None if self.step_ahead is None else self.step_ahead.read_aheads.take(unit)
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
        if self.step_ahead is not None:  # what no step used goes, and the idle worker
            self.step_ahead.read_aheads.drop()
            self.step_ahead.stop_worker_if_idle()
        self._forget_this_step()
        self._trial_step_ended()
        if self._on_step is not None:
            self._on_step()
        return None

    def _trial_step_ended(self) -> None:
        """The overlap trial's clock, at the end of every step (taken or skipped), on
        every rank (sharded, its decision is a collective)."""
        if self.overlap_trial is not None:
            self.overlap_trial.step_ended()

    def _note_held_shadows(self, exc: OutOfTierMemory) -> None:
        """The disk was full for a step: say what the steps running on into the next
        forward hold of it, if any, and how to keep that room for this step."""
        steps, held = (0, 0) if self.step_ahead is None else self.step_ahead.forward.shadow_bytes()
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
            self.step_ahead.read_aheads.give_back(ahead)

    def _factors_for(self, unit: Unit) -> list:
        """What the step multiplies ``unit``'s gradients by as it reads them: the clip's
        and fp16's factors for gradients on disk (in memory they were applied in place)."""
        return list(self._disk_grad_factors) if transfers_only(unit.grad) else []

    def finish_steps_in_forward(self) -> None:
        """Commit the unit steps still running on from the last ``optimizer.step()``
        (``step_in_forward``); a no-op otherwise. Everything that reads the optimizer's
        states, the master or the gradients as a whole calls it first."""
        if self.step_ahead is not None:
            self.step_ahead.forward.land_all()

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
        if self.step_ahead is not None:  # (step_in_backward: those steps are taken)
            self.step_ahead.refuse_dropping("optimizer.zero_grad()")
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
