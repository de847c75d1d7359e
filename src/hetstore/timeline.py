"""Where a step's memory went, over time: each tier's bytes in use, sampled whenever the
device or host accounting changes, with the step's phases marked.

    recorder = TimelineRecorder(model)          # a model returned by hetstore.offload
    with recorder:
        recorder.phase("forward");  loss = model(x, y)
        recorder.phase("backward"); loss.backward()
        recorder.phase("step");     optimizer.step(); optimizer.zero_grad()
    recorder.timeline.save("timeline.json")     # hetstore report timeline.json draws it

The recorder watches the tiers' own accounting (``MemoryAccount.observer``), so it sees
every reservation and release hetstore makes, not a polling interval's worth; the disk
tier is read at each of those moments. It records only inside ``with``: training
outside it pays nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetstore.tier import TIER_LABELS

__all__ = ["MemoryTimeline", "TimelineRecorder"]


@dataclass
class MemoryTimeline:
    """Samples ``(seconds, device, host, disk)`` bytes in use and phase starts
    ``(seconds, name)``, seconds from the start of recording."""

    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    phases: list[tuple[float, str]] = field(default_factory=list)
    capacities: dict[str, int | None] = field(default_factory=dict)
    title: str = ""

    def peak(self, tier: str) -> int:
        column = 1 + TIER_LABELS.index(tier)  # (samples: seconds, then each tier in order)
        return max((s[column] for s in self.samples), default=0)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MemoryTimeline:
        data = json.loads(text)
        if not isinstance(data, dict) or "samples" not in data:
            raise ValueError("not a hetstore memory timeline (no 'samples')")
        return cls(
            samples=[tuple(s) for s in data["samples"]],
            phases=[tuple(p) for p in data.get("phases", [])],
            capacities=dict(data.get("capacities", {})),
            title=data.get("title", ""),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> MemoryTimeline:
        return cls.from_json(Path(path).read_text())


class TimelineRecorder:
    """Records a :class:`MemoryTimeline` of a model returned by ``hetstore.offload``."""

    def __init__(self, model, title: str = ""):
        from hetstore.model_state import state_of

        state = state_of(model)
        if state is None:
            raise TypeError("TimelineRecorder takes a model returned by hetstore.offload()")
        tiers = state.tiers
        self.tiers = tiers
        stats = tiers.memory_stats()
        self.timeline = MemoryTimeline(
            capacities={name: s["capacity"] for name, s in stats.items()}, title=title
        )
        self._start = 0.0
        self._accounts = [tiers.device_tier.account, tiers.host.account]

    def __enter__(self) -> TimelineRecorder:
        self._start = time.perf_counter()
        for account in self._accounts:
            account.observer = self.sample
        self.sample()
        return self

    def __exit__(self, *exc) -> None:
        self.sample()
        for account in self._accounts:
            account.observer = None

    def sample(self) -> None:
        device = self.tiers.device_tier.account.current
        host = self.tiers.host.account.current
        disk = self.tiers.usage("disk").current
        self.timeline.samples.append((time.perf_counter() - self._start, device, host, disk))

    def phase(self, name: str) -> None:
        """Mark the start of a phase ("forward", "backward", "step", ...)."""
        self.timeline.phases.append((time.perf_counter() - self._start, name))
        self.sample()
