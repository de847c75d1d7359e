"""Ending an offloaded model's life: ``hetstore.release(model)`` and ``hetstore.offloaded``.

An offloaded model owns bytes in every tier (device buffers, pinned host blocks, a
private directory of region files and the IO threads that serve it). They are freed in
two ways:

- **Explicitly, at once**: :func:`release` (or leaving a :func:`offloaded` block) takes
  every hook off, frees each unit's buffers, stops the IO threads, closes the files and
  removes the private directory, before it returns. The model's parameters keep their
  shapes but hold no bytes and its optimizer refuses to step: save or
  export first what you want to keep (``hetstore.save``, ``hetstore.export_weights``).
- **Implicitly**, when nothing references the model any more: the hooks hetstore hangs
  on tensors hold the runtime only weakly, so ``del model`` (and the optimizer) lets the
  garbage collector free it like any other object, and the tiers' finalizers remove the
  directory. That happens when the collector runs, not at a known moment: notebooks and
  sweeps that need the bytes back now should call :func:`release`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hetstore.errors import ConfigError
from hetstore.eviction import forget as forget_eviction
from hetstore.model_state import is_released, mark_released, state_of
from hetstore.tiers.hostmem import return_free_heap

__all__ = ["release", "offloaded"]


def release(model: nn.Module) -> None:
    """Free every tier's bytes of an offloaded ``model`` now and remove its private files.

    Afterwards the model's managed parameters keep their shapes but hold no bytes and a
    forward through it, or a step of its optimizer, raises ``ConfigError``. Releasing a
    model twice does nothing the second time. Must not be called during a forward or
    backward of the model.
    """
    if is_released(model):
        return
    state = state_of(model)
    if state is None:
        raise ConfigError(
            f"release() takes a model returned by hetstore.offload(); this "
            f"{type(model).__name__} is not offloaded"
        )
    if torch._C._current_graph_task_id() != -1:
        raise ConfigError("release() called during a backward: call it between steps")
    forget_eviction(state)  # (an evicted model's copies go; its buffers are freed below)
    runtime = state.runtime
    optimizer = runtime.optimizer() if runtime.optimizer is not None else None
    if optimizer is not None:
        optimizer.release()
    runtime.release()  # hooks off, units' buffers freed, parameters left without bytes
    state.tiers.close()  # stops the IO threads, closes the files, removes the directory
    if runtime.heap_bound is not None:  # glibc trims its heap again (hetstore._malloc)
        runtime.heap_bound.close()
        runtime.heap_bound = None
    return_free_heap()  # freed CPU tensors (device tier on CPU, scratch) leave the RSS too
    mark_released(model)  # the state goes: nothing of the model's tiers is referenced
    model.register_forward_pre_hook(_refuse_released)


def _refuse_released(module: nn.Module, args) -> None:
    raise ConfigError(
        f"this {type(module).__name__} was released by hetstore.release(): its weights were "
        "freed. Save or export them before releasing (hetstore.save, "
        "hetstore.export_weights), then build and offload a new model"
    )


@contextlib.contextmanager
def offloaded(
    model: nn.Module, optimizer=None, config=None, **kwargs
) -> Iterator[tuple[nn.Module, object]]:
    """``hetstore.offload(...)`` for the duration of a ``with`` block, released at its end
    (also when the block raises)::

        with hetstore.offloaded(model, optimizer, config) as (model, optimizer):
            train(model, optimizer)
    """
    from hetstore.api import offload

    model, wrapped = offload(model, optimizer, config, **kwargs)
    try:
        yield model, wrapped
    finally:
        release(model)
