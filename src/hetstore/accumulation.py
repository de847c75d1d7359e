"""``hetstore.no_sync(model)``: the backward passes inside are not the last before a step.

With gradient accumulation, only the last micro-batch's backward leaves final gradients.
Units stepped ahead during backward (``overlap_step``, :mod:`hetstore.optim.step_ahead`)
would otherwise be stepped on an earlier micro-batch and then discarded: exact, but the
disk traffic of a step for nothing. Saying which backward is not the last, with the
convention of DDP's and FSDP's ``no_sync()``, avoids that from the first step on::

    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else hetstore.no_sync(model):
            model(batch).backward()
    optimizer.step()

Without it, a loop still trains exactly: hetstore learns the number of micro-batches at
the first step and speculates only on that backward from then on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from hetstore.errors import ConfigError
from hetstore.model_state import state_of

__all__ = ["no_sync"]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    state = state_of(model)
    if state is None:
        raise ConfigError(
            f"no_sync() takes a model returned by hetstore.offload(); this "
            f"{type(model).__name__} is not offloaded"
        )
    optimizer = state.runtime.optimizer() if state.runtime.optimizer is not None else None
    ahead = optimizer.step_ahead if optimizer is not None else None
    # (nothing stepped ahead: nothing to hold back)
    with contextlib.nullcontext() if ahead is None else ahead.no_sync():
        yield
