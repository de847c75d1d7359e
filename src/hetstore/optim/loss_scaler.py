"""Dynamic loss scaling for fp16 compute, with ``torch.amp.GradScaler``'s semantics.

The loss is multiplied by ``scale`` before backward; at ``step()`` gradients are
unscaled, and if any is inf/NaN the step is skipped and the scale multiplied by
``backoff_factor``; after ``growth_interval`` clean steps it is multiplied by
``growth_factor``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["DynamicLossScaler"]


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    _growth_tracker: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self._growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
