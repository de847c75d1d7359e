"""``hetstore.memory_stats``: per-tier current, peak and capacity in bytes."""

from __future__ import annotations

from typing import Any

from torch import nn

from hetstore.model_state import state_of
from hetstore.tiers import Tiers

__all__ = ["memory_stats"]


def memory_stats(target: Any) -> dict[str, dict[str, int | None]]:
    """Return ``{"device"|"host"|"disk": {"current", "peak", "capacity"}}`` in bytes.

    ``target`` is a model returned by ``hetstore.offload`` or a ``Tiers`` object.
    ``capacity`` is None where the tier is unlimited.
    """
    if isinstance(target, Tiers):
        return target.memory_stats()
    state = state_of(target) if isinstance(target, nn.Module) else None
    if state is not None:
        return state.tiers.memory_stats()
    raise TypeError(
        f"memory_stats() takes a model returned by hetstore.offload() or a Tiers object, "
        f"got {type(target).__name__}"
    )
