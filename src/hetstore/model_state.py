"""What hetstore keeps for one offloaded model, in one object, reached in one way.

``offload()`` attaches a :class:`ModelState` to the model (one attribute, ``_hetstore``);
every module that needs the model's runtime, tiers or process group asks
:func:`state_of` instead of reading attributes by name. ``hetstore.release`` replaces
the state with a marker, so a released model is told apart from one never offloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from hetstore.planner import Plan
    from hetstore.runtime.hooks import OffloadRuntime
    from hetstore.runtime.sharding import ShardGroup
    from hetstore.runtime.unit import Unit
    from hetstore.tiers import Tiers

__all__ = ["ModelState", "state_of", "attach", "mark_released", "is_released"]

_ATTR = "_hetstore"
_RELEASED = "released"  # the marker left by hetstore.release


@dataclass
class ModelState:
    """An offloaded model's runtime (hooks, units, plan), tiers and process group."""

    runtime: OffloadRuntime
    tiers: Tiers
    shards: ShardGroup | None  # sharded over ranks (ZeRO-3), else None
    # hetstore.evict's record: what it moved off the device until hetstore.restore, and
    # the host buffers kept between cycles (hetstore.eviction.Eviction)
    eviction: object | None = None

    @property
    def plan(self) -> Plan:
        """The placement in effect (re-made when a larger batch moved activations)."""
        return self.runtime.plan

    @property
    def units(self) -> list[Unit]:
        return self.runtime.units


def state_of(model: nn.Module) -> ModelState | None:
    """The state of a model returned by ``hetstore.offload``; None for any other model
    (never offloaded, or released)."""
    state = model.__dict__.get(_ATTR)
    return state if isinstance(state, ModelState) else None


def attach(model: nn.Module, state: ModelState) -> None:
    model.__dict__[_ATTR] = state


def mark_released(model: nn.Module) -> None:
    model.__dict__[_ATTR] = _RELEASED


def is_released(model: nn.Module) -> bool:
    return model.__dict__.get(_ATTR) == _RELEASED
