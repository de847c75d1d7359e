"""Per-tier byte accounting: capacity, current, peak and who holds what.

Every tier (device, host, disk) owns one ``MemoryAccount``. Reservations are labelled
("params unit 3", "activations") so an out-of-memory report can name the largest holders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetstore._sizes import format_size
from hetstore.errors import OutOfDeviceMemory, OutOfTierMemory
from hetstore.tier import Tier

__all__ = ["MemoryAccount", "TierUsage", "FlatAllocation", "format_usage"]


@dataclass(eq=False)  # identity: two allocations are never "equal" by their contents
class FlatAllocation:
    """A flat buffer a tier handed out: ``data`` (a tensor, or a ``DiskArray`` on disk)
    and ``free``, which gives its bytes back to the tier. Every tier's ``allocate_flat``
    returns one, so an owner frees what it holds without knowing which tier made it."""

    data: object
    free: Callable[[], None]
    # the buffer's accounting label changed (held for another purpose, the bytes kept);
    # None where a tier has no use for it yet
    rename: Callable[[str], None] | None = None
    # the tier that made it (hetstore.evict moves what the device tier holds)
    tier: Tier | None = None


@dataclass(frozen=True)
class TierUsage:
    """A snapshot of one tier: what ``hetstore.memory_stats`` reports."""

    name: str
    current: int
    peak: int
    capacity: int | None

    def as_dict(self) -> dict[str, int | None]:
        return {"current": self.current, "peak": self.peak, "capacity": self.capacity}


def format_usage(usage: TierUsage) -> str:
    free = "" if usage.capacity is None else f", free {format_size(usage.capacity - usage.current)}"
    key = Tier.from_label(usage.name).capacity_key
    capacity = format_size(usage.capacity) + (f" ({key})" if key else "")
    return (
        f"  {usage.name}: capacity {capacity}, in use {format_size(usage.current)}, "
        f"peak {format_size(usage.peak)}{free}"
    )


class MemoryAccount:
    """Bytes reserved on one tier, checked against its capacity.

    ``capacity=None`` means unlimited. ``context`` is called when a request fails, to add
    the other tiers' usage and advice to the message; it returns extra lines.
    """

    def __init__(
        self,
        tier: Tier,
        capacity: int | None,
        *,
        context: Callable[[str, int], list[str]] | None = None,
    ):
        self.tier = tier
        self.name = tier.label
        self.capacity = capacity
        self._current = 0
        self._peak = 0
        self._holders: dict[str, int] = {}
        self._context = context
        # called after every change while set (hetstore.timeline records with it)
        self.observer: Callable[[], None] | None = None

    @property
    def current(self) -> int:
        return self._current

    @property
    def peak(self) -> int:
        return self._peak

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self._current, self._peak, self.capacity)

    def holders(self, n: int = 5) -> list[tuple[str, int]]:
        """The ``n`` largest holders, largest first."""
        return sorted(self._holders.items(), key=lambda kv: -kv[1])[:n]

    def would_fit(self, nbytes: int) -> bool:
        return self.capacity is None or self._current + nbytes <= self.capacity

    def reserve(self, nbytes: int, label: str) -> None:
        """Count ``nbytes`` against the capacity, or raise before anything is allocated."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size ({nbytes})")
        if not self.would_fit(nbytes):
            raise self.overflow_error(nbytes, label)
        self._current += nbytes
        self._peak = max(self._peak, self._current)
        self._holders[label] = self._holders.get(label, 0) + nbytes
        if self.observer is not None:
            self.observer()

    def release(self, nbytes: int, label: str) -> None:
        held = self._holders.get(label, 0)
        if nbytes > held:
            raise ValueError(
                f"{self.name} tier: releasing {nbytes} bytes for {label!r}, which holds {held}"
            )
        if held == nbytes:
            del self._holders[label]
        else:
            self._holders[label] = held - nbytes
        self._current -= nbytes
        if self.observer is not None:
            self.observer()

    def take_all(self) -> dict[str, int]:
        """Give back every holder's bytes at once and return who held what: the bytes
        left this tier together (``hetstore.evict``); :meth:`give_back_all` undoes it."""
        held, self._holders, self._current = self._holders, {}, 0
        if self.observer is not None:
            self.observer()
        return held

    def give_back_all(self, held: dict[str, int]) -> None:
        """Reserve again what :meth:`take_all` returned (``hetstore.restore``): all of it,
        or, past the capacity, none of it and raise."""
        total = sum(held.values())
        if not self.would_fit(total):
            raise self.overflow_error(total, "restored " + ", ".join(held))
        for label, nbytes in held.items():
            self.reserve(nbytes, label)

    def reset_peak(self) -> None:
        self._peak = self._current

    def overflow_error(self, nbytes: int, label: str) -> OutOfTierMemory:
        key = self.tier.capacity_key
        lines = [
            f"hetstore: out of {self.name} memory: requested {format_size(nbytes)} for {label!r}",
            format_usage(self.usage()),
        ]
        if self._context is not None:
            lines.extend(self._context(self.name, nbytes))
        if self._holders:
            top = ", ".join(f"{k} {format_size(v)}" for k, v in self.holders())
            lines.append(f"  largest holders on {self.name}: {top}")
        if self.capacity is not None:
            need = self._current + nbytes
            lines.append(
                f"  to fit this request: {key} >= {format_size(need)} ({need} bytes), "
                f"or move more state off the {self.name} tier"
            )
        cls = OutOfDeviceMemory if self.tier is Tier.DEVICE else OutOfTierMemory
        return cls("\n".join(lines), tier=self.name, requested=nbytes, capacity=self.capacity)
