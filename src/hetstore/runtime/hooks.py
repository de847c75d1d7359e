"""The hooks that move a unit's parameters around forward and backward.

Forward: a pre-forward hook fetches the unit (and prefetches the next ones in the
recorded order); a post-forward hook releases it and hangs a hook on its outputs that
fetches it again just before its backward. Backward: each parameter's
post-accumulate-grad hook moves the gradient into the unit's fp32 buffer (sharded: into
its full device bucket, reduce-scattered across ranks once the unit has all its
gradients) and, once the unit has all its gradients, releases the unit. A callback queued on the autograd engine
releases whatever is left when backward ends (units whose parameters got no gradient).

Activation checkpointing re-runs forward inside backward: pre-forward hooks run again
(and fetch), post-forward hooks may not, so nothing is released by a forward hook while
a backward is running. Reentrant checkpointing's inner backwards are the outer one's
(``BackwardState.starts``).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from hetstore.errors import BACKWARD_AFTER_RELEASE, ConfigError
from hetstore.runtime import released
from hetstore.runtime.backward_state import BackwardState, GraphMarker, in_backward
from hetstore.runtime.events import Event, Events
from hetstore.runtime.grads import set_torch_grad, torch_grad
from hetstore.runtime.prefetch import Prefetch
from hetstore.runtime.profiler import StepProfiler
from hetstore.runtime.staging import stagers_of
from hetstore.runtime.unit import Unit

__all__ = ["OffloadRuntime"]


def _eager(hook):
    """``hook``, never traced into a ``torch.compile`` graph (see OffloadRuntime)."""
    return torch.compiler.disable(hook, recursive=True, reason=_COMPILE_REASON)


# what a parameter of a model freed by hetstore.release() answers a read with
_FREED = (
    "its model was released by hetstore.release() and its weights freed; read weights "
    "(model.state_dict(), hetstore.save) before releasing the model"
)

_COMPILE_REASON = (
    "hetstore: this hook moves an offloaded unit's parameters between tiers and must run "
    "eagerly, so a torch.compile graph ends at every unit boundary. fullgraph=True cannot "
    "hold an offloaded model or block: compile without it, or compile each block's forward "
    "(block.forward = torch.compile(block.forward, fullgraph=True)), which leaves the "
    "module's hooks outside the graph"
)


def _refuse_compiled_autograd() -> None:
    """Compiled autograd traces backward hooks into a graph; hetstore's gradient moves
    and fetches must run eagerly. Refused at the forward, before anything is traced."""
    from torch._dynamo import compiled_autograd

    configured = getattr(torch._dynamo.config, "compiled_autograd", False)
    if configured or getattr(compiled_autograd, "compiled_autograd_enabled", False):
        raise ConfigError(
            "torch.compile's compiled autograd (torch._dynamo.config.compiled_autograd=True "
            "or compiled_autograd.enable) is not supported on an offloaded model: it would "
            "trace hetstore's gradient hooks into the backward graph. Turn it off; "
            "torch.compile of the model or of its blocks works without it"
        )


class OffloadRuntime:
    """Owns every hook hetstore installs on one model; ``remove()`` takes them all off."""

    def __init__(
        self,
        model: nn.Module,
        units: list[Unit],
        unit_modules: dict[int, nn.Module],
        root: Unit | None,
        *,
        prefetch_depth: int,
        grad_stager=None,
        activations=None,
        profiler: StepProfiler | None = None,
        batch_guard=None,
        copy_stream: torch.cuda.Stream | None = None,
        grad_stream: torch.cuda.Stream | None = None,
        events: Events,
    ):
        self.model = model
        # what this runtime tells others (runtime.events): its units' bus, one per model
        # (a unit on another would publish where nobody listens)
        if any(u.events is not events for u in units):
            raise ValueError("hetstore internal error: a runtime's units publish on its bus")
        self.events = events
        # a CPU device whose process memory is bounded: checked after each unit, it
        # gives the C heap's freed pages back when the process outgrows the tiers
        self.heap_bound = None  # (hetstore._malloc.HeapBound, set by offload())
        self.units = units
        self.root = root
        self.block_units = [u for u in units if u is not root]
        # hooks on tensors find their unit by its index, which is its place in ``units``
        assert all(u.index == i for i, u in enumerate(units))
        self.optimizer: weakref.ref | None = None  # the OffloadedOptimizer, set by offload()
        self.released = False  # set by hetstore.release: a graph still alive must not run
        # why the model cannot run or be read now (hetstore.evict gave the device's bytes
        # away): refused by forward, state_dict() / load_state_dict(), copies; None: it can
        self.refusal: str | None = None
        self.grad_stager = grad_stager
        self.profiler = profiler
        # checks each forward's inputs against the batch the plan was made for
        self.batch_guard = batch_guard
        self._root_name = root.name if root is not None else "root"
        # host-to-device copies of the next unit overlap this unit's compute (CUDA only;
        # owned by runtime.streams.CudaStreams)
        self.copy_stream = copy_stream
        # gradients bound for host memory cross on this one while backward goes on
        self.grad_stream = grad_stream
        self.order: list[Unit] = []  # execution order recorded on the first forward
        # which units to bring closer, and when (runtime.prefetch), over that order
        self.prefetcher = Prefetch(prefetch_depth, self.order, copy_stream)
        self._order_done = False
        self._handles: list = []
        # what the hooks remember between calls: the backward running, the graphs that
        # await theirs, the units whose release waits for backward to move past them
        self.backward_state = BackwardState(weakref.WeakMethod(self._end_of_backward))

        # Every module hook runs eagerly, outside any torch.compile graph: it moves bytes
        # and resizes storages, which a graph must never capture (Inductor cannot lower
        # a storage resize, and a graph replayed later would skip the fetch). Dynamo
        # breaks the graph at each hook, so a compiled block is one graph between them.
        # True while the planner traces a batch through the model on meta tensors (the
        # first forward without example_inputs): the module hooks then do nothing
        self._tracing = False
        pre_hook, post_hook = model.register_forward_pre_hook, model.register_forward_hook
        # first of all: a model that cannot run now (evicted) refuses before anything moves
        self._handles.append(pre_hook(self._module_hook(self._refuse_if_unusable)))
        if batch_guard is not None:  # next: it may change where activations go
            self._handles.append(pre_hook(self._module_hook(self._check_batch), with_kwargs=True))
        self.activations = activations
        if activations is not None:
            # first in, last out: the saved-tensor hooks cover the root's work too, and
            # always_call leaves them even when forward raises
            self._handles.append(pre_hook(self._module_hook(self._enter_activations)))
            self._handles.append(
                post_hook(self._module_hook(self._exit_activations), always_call=True)
            )
        self._handles.append(pre_hook(self._module_hook(self._model_pre_forward)))
        self._handles.append(post_hook(self._module_hook(self._model_post_forward)))
        for unit in self.block_units:
            module = unit_modules[unit.index]
            self._handles.append(
                module.register_forward_pre_hook(
                    self._module_hook(lambda m, a, u=unit: self._pre_forward(u))
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    self._module_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
                )
            )
        # Hooks on tensors live in autograd's C++ side, which the garbage collector cannot
        # see through: they hold the runtime only weakly, by position, so that a model
        # nobody references any more is collected (and its tiers freed) like any other.
        self._weak = weakref.ref(self)
        for unit in units:
            for e, entry in enumerate(unit.trainable_entries):
                self._handles.append(
                    entry.param.register_post_accumulate_grad_hook(
                        _GradReadyHook(self._weak, unit.index, e)
                    )
                )

    def _module_hook(self, hook):
        """``hook`` as a module hook: eager, and idle while a batch is traced."""

        def run(*args):
            if not self._tracing:
                return hook(*args)
            return None

        return _eager(run)

    @contextlib.contextmanager
    def tracing(self):
        """The model's forward runs on meta tensors for the planner: nothing moves."""
        self._tracing = True
        try:
            yield
        finally:
            self._tracing = False

    def adopt(self, handles: list) -> None:
        """Take ownership of hooks installed elsewhere, so ``remove()`` takes them off too."""
        self._handles.extend(handles)

    def hooks_installed(self) -> list[tuple[int, object, list[dict]]]:
        """hetstore's hooks as ``(handle id, hook, the dicts holding that id)``: the hook
        dict and its companions (``with_kwargs``, ``always_call``). runtime.copying
        leaves them out of a copy of the model."""
        found = []
        for handle in self._handles:
            if not isinstance(handle, RemovableHandle):
                continue
            table = handle.hooks_dict_ref()
            if table is None or handle.id not in table:
                continue
            extras = [ref() for ref in handle.extra_dict_ref]
            found.append((handle.id, table[handle.id], [table] + [d for d in extras if d]))
        return found

    def drop_grads_of(self, params: list[nn.Parameter]) -> None:
        """Parameters that require grad but no optimizer steps: drop their gradients."""
        for param in params:
            self._handles.append(param.register_post_accumulate_grad_hook(self._drop_grad))

    @staticmethod
    def _drop_grad(param: nn.Parameter) -> None:
        set_torch_grad(param, None)

    # ------------------------------------------------------------------ forward
    def _refuse_if_unusable(self, module, args) -> None:
        if self.refusal is not None:
            raise ConfigError(self.refusal)

    def _check_batch(self, module, args, kwargs) -> None:
        if torch.is_grad_enabled() and not in_backward():
            self.batch_guard(args, kwargs)

    def _enter_activations(self, module, args) -> None:
        if torch.is_grad_enabled() and not in_backward():
            self.activations.enter()

    def _exit_activations(self, module, args, output) -> None:
        self.activations.exit()

    def _mark(self, label) -> None:
        """Tell the profiler (while it runs) what the time from here on is spent on."""
        if self.profiler is not None and self.profiler.active:
            self.profiler.switch(label)

    def _model_pre_forward(self, module, args) -> None:
        _refuse_compiled_autograd()
        if not in_backward():
            if torch.is_grad_enabled():
                for unit in self.units:  # the gradients this forward's backward will bring
                    unit.grads.track_requires_grad()
            if self.profiler is not None:
                self.profiler.step_begins()
            self._mark("transfer")
            self.prefetcher.edge(first=True)  # the first blocks' reads overlap the root's
        if self.root is not None:
            self._fetch(self.root)
            self.root.wait_ready()
        if not in_backward():
            self._mark((self._root_name, "forward"))

    def _model_post_forward(self, module, args, output) -> None:
        if not in_backward():
            self._order_done = True  # the first full forward fixed the order
        needs_grad = any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(output)[0]
        )
        if self.root is not None and not needs_grad and not in_backward():
            self.root.release()
        if needs_grad and not in_backward():
            for tensor in tree_flatten(output)[0]:  # (a model of no blocks has a graph too)
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    self.backward_state.await_backward(tensor, _OutputHook(self._weak))
            self.prefetcher.edge(first=False)  # backward starts with the last blocks
            # the loss and the head's backward (the root's) come next
            self._mark((self._root_name, "backward"))
        elif not in_backward():
            self._mark("other")

    def _pre_forward(self, unit: Unit) -> None:
        if self.refusal is not None:  # (a block called on its own)
            raise ConfigError(self.refusal)
        if not self._order_done and not in_backward() and unit not in self.order:
            self.order.append(unit)
        forward = not in_backward()  # else a checkpoint's recompute, inside backward
        if forward:
            self._mark("transfer")
        self._fetch(unit)
        if forward:
            self.prefetcher.after(unit, step=1)
            if self.activations is not None:
                self.activations.enter_unit(unit.name)
        unit.wait_ready()
        if forward:
            self._mark((unit.name, "forward"))

    def _post_forward(self, unit: Unit, output) -> None:
        if in_backward():
            return  # checkpoint recompute: the backward that follows needs the parameters
        self._mark((self._root_name, "forward"))
        if self.activations is not None:
            self.activations.exit_unit(unit.name)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    hook = _PreBackwardHook(self._weak, unit.index)
                    self.backward_state.await_backward(tensor, hook)
        unit.release()
        if self.heap_bound is not None:
            self.heap_bound.check()

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: Unit) -> None:
        self._ensure_end_of_backward_callback()
        self.backward_state.release_finished_before(unit, self.order)
        self._mark("transfer")
        self._fetch(unit)
        self.prefetcher.after(unit, step=-1)
        unit.wait_ready()
        self._mark((unit.name, "backward"))

    def _grad_ready(self, unit: Unit, entry) -> None:
        self._ensure_end_of_backward_callback()
        param = entry.param
        grad = torch_grad(param)  # autograd's field; p.grad would read the unit's buffer
        if grad is None:
            return
        device_tier = unit.tiers.device_tier
        grad_bytes = grad.numel() * grad.element_size()
        label = f"grad in flight {unit.name}"
        # autograd allocated this gradient on the device: count it while it exists
        device_tier.reserve(grad_bytes, label)
        try:
            unit.grads.accumulate(entry, grad, self.grad_stream)
        finally:
            set_torch_grad(param, None)
            del grad
            device_tier.release(grad_bytes, label)
        unit.grads.pending -= 1
        if unit.grads.pending == 0:
            if self._reads_grads_when_final:  # they read the host buffer now
                unit.grads.wait_copies()
            if unit.grads.has_bucket:  # sharded: average across ranks, keep this rank's shard
                unit.grads.reduce()
            if unit is not self.root:
                # released before the events below: backward reads none of its trainable
                # weights again (each one's gradient is in), and a step taken in place in
                # backward may only start on a unit nothing reads through a device copy
                if unit.has_untracked_params:
                    # frozen weights may still be needed for the gradient of the unit's
                    # input: released when backward moves to an earlier unit
                    self.backward_state.release_later(unit)
                else:
                    unit.release()
            # step_in_backward: a subscriber steps the unit now, taking the gradients
            consumed = self.events.publish(Event.GRADS_GATHERED, unit)
            if not consumed:
                if self.grad_stager is not None:
                    self.grad_stager.flush(unit)  # the write overlaps the next unit's backward
                # the clip's recorded norms, a step overlapping the rest of backward
                self.events.publish(Event.GRADS_FINAL, unit)
            if unit is not self.root:
                if self.heap_bound is not None:
                    self.heap_bound.check()
                self._mark((self._root_name, "backward"))

    def _ensure_end_of_backward_callback(self) -> None:
        if not self.backward_state.starts():
            return
        for unit in self.units:  # (a parameter frozen at the forward brings none)
            unit.grads.pending = unit.expected_grads
        self.backward_state.any_frozen = any(u.has_untracked_params for u in self.block_units)
        self.events.publish(Event.BACKWARD_STARTED)

    @property
    def _reads_grads_when_final(self) -> bool:
        """Whether anything reads a unit's gradient buffer as soon as its backward is
        done (the disk write, the clip's norms, the step in backward or ahead); if not,
        the copies to the host run on until the end of backward."""
        return self.grad_stager is not None or self.events.grads_read_when_final

    @property
    def graph_alive(self) -> bool:
        """A forward's graph awaits its backward (``BackwardState.graph_alive``)."""
        return self.backward_state.graph_alive

    def _end_of_backward(self) -> None:
        self.backward_state.ended()
        for unit in self.units:
            unit.grads.wait_copies()  # gradients still crossing to the host land first
            if unit.grads.has_bucket:  # sharded, some of whose parameters got no gradient
                unit.grads.reduce()
        if self.grad_stager is not None:
            self.grad_stager.flush_all()
        for unit in self.units:
            unit.release()
        self.events.publish(Event.BACKWARD_ENDED)  # (the steps taken in backward commit)
        self._mark("other")

    def use_order(self) -> list[Unit]:
        """The units in the order a forward fetches them: the root first, then the order
        the first forward recorded."""
        return ([self.root] if self.root is not None else []) + self.order

    def _fetch(self, unit: Unit) -> None:
        unit.fetch(self.copy_stream)

    # ------------------------------------------------------------------ lifetime
    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def release(self) -> None:
        """Take every hook off and free every unit's buffers (``hetstore.release``): a
        graph built before refuses its backward, and each parameter keeps its shape with
        a zero-byte storage of its own, so nothing references the units' buffers."""
        self.remove()  # hooks, the gradient contract, the state-dict hooks
        self.released = True
        if self.activations is not None:
            self.activations.released = True
        for stager in stagers_of(self.units):
            stager.close()
        for unit in self.units:
            unit.close()
            for e in unit.entries:
                released.expose(e.param)
                # one element, expanded: never a full-size allocation
                empty = torch.empty(1, dtype=e.param.dtype, device=e.param.device)
                empty = empty.expand(e.shape)
                empty.untyped_storage().resize_(0)
                e.param.data = empty
                released.attach(e.param, released.ParamSource(None, e, _FREED))
                released.conceal(e.param)


class _GradReadyHook:
    """A parameter's post-accumulate-grad hook: holds its runtime weakly (see __init__)."""

    __slots__ = ("runtime", "unit", "entry")

    def __init__(self, runtime: weakref.ref, unit: int, entry: int):
        self.runtime, self.unit, self.entry = runtime, unit, entry

    def __call__(self, param) -> None:
        runtime = self.runtime()
        if runtime is not None:
            unit = runtime.units[self.unit]
            runtime._grad_ready(unit, unit.trainable_entries[self.entry])


class _OutputHook(GraphMarker):
    """The model output's gradient hook: the end of the model's backward is queued here,
    on its outermost graph task (``BackwardState.queue_end``); runtime held weakly."""

    __slots__ = ("runtime",)

    def __init__(self, runtime: weakref.ref):
        self.runtime = runtime

    def __call__(self, grad) -> None:
        runtime = self.runtime()
        if runtime is not None and not runtime.released:
            runtime.backward_state.queue_end()


class _PreBackwardHook:
    """A unit output's gradient hook: fetches the unit before its backward, runtime weak."""

    __slots__ = ("runtime", "unit", "__weakref__")

    def __init__(self, runtime: weakref.ref, unit: int):
        self.runtime, self.unit = runtime, unit

    def __call__(self, grad) -> None:
        runtime = self.runtime()
        if runtime is None or runtime.released:
            raise ConfigError(BACKWARD_AFTER_RELEASE)
        runtime._pre_backward(runtime.units[self.unit])
