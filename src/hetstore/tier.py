"""``Tier``: where a piece of training state lives (device, host or disk).

One enum, read by the config, the runtime, the planner and the cost model alike, so a
tier is never a bare string compared in many places. Its value is the config spelling
(MindSpore's keys: ``offload_param="none"`` means "not offloaded: on the device"), and a
``StrEnum`` member equals that string, so configs written as strings keep working.
``label`` is the name reports and ``memory_stats()`` use ("device", "host", "disk").

Everything that differs by tier and is not its storage lives here, in one table per
property (label, capacity key, share key, the next tier toward the device, report
colour, where its transfers are staged, which machine measurements price its link),
so that reports, budgets, the planner and its cost model walk ``Tier`` in order
instead of naming three. Adding a tier: see docs/how-it-works.md, "Where a new piece
plugs in".
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Tier", "TIER_LABELS"]


class Tier(StrEnum):
    DEVICE = "none"
    HOST = "cpu"
    DISK = "disk"

    def __repr__(self) -> str:  # what a config's repr shows: evaluable, names the tier
        return f"Tier.{self.name}"

    @property
    def label(self) -> str:
        """The tier's name in reports, errors and ``memory_stats()``."""
        return _LABELS[self]

    @property
    def capacity_key(self) -> str:
        """The config key that sets this tier's capacity."""
        return _CAPACITY_KEYS[self]

    @property
    def share_key(self) -> str | None:
        """The config key of the share of this tier the planner may fill (``hbm_ratio``,
        ``cpu_ratio``); None where it may fill all of it."""
        return _SHARE_KEYS[self]

    @property
    def color(self) -> str:
        """The tier's colour in the memory timeline's plot."""
        return _COLORS[self]

    @property
    def closer(self) -> Tier | None:
        """The next tier toward the device (faster, smaller); None for the device."""
        return _CLOSER[self]

    @property
    def farther(self) -> Tier | None:
        """The next tier away from the device (slower, larger); None for the last."""
        return _FARTHER[self]

    @property
    def staging(self) -> Tier | None:
        """The tier whose buffers this tier's reads and writes pass through: None where
        its buffers are addressable (tensors, used in place: device and host memory),
        else the addressable tier that holds its staging (disk: pinned host memory,
        O_DIRECT needs aligned host buffers). The cost model counts the staging there."""
        return _STAGING[self]

    @property
    def addressable(self) -> bool:
        """Whether this tier's buffers are tensors used in place (``tiers.store.
        addressable``), not moved through staging."""
        return self.staging is None

    @property
    def path_key(self) -> str | None:
        """The config key of the directory whose free space is this tier's capacity
        when its capacity key is unset (disk: ``offload_path``); None for a tier sized
        otherwise."""
        return _PATH_KEYS[self]

    @property
    def link_rates(self) -> tuple[str, str] | None:
        """The ``MachineRates`` measurements (bytes per second) of the link between this
        tier and the next one toward the device: ``(toward the device, away from it)``;
        None for the device."""
        return _LINK_RATES[self]

    @classmethod
    def from_label(cls, label: str) -> Tier:
        """The tier a report name ("device", "host", "disk") or a config spelling names."""
        for tier in cls:
            if label in (tier.label, tier.value):
                return tier
        allowed = ", ".join(repr(t.label) for t in cls)
        raise KeyError(f"unknown tier {label!r}; tiers are {allowed}")


_LABELS = {Tier.DEVICE: "device", Tier.HOST: "host", Tier.DISK: "disk"}
_CAPACITY_KEYS = {
    Tier.DEVICE: "max_device_memory",
    Tier.HOST: "offload_cpu_size",
    Tier.DISK: "offload_disk_size",
}
_SHARE_KEYS = {Tier.DEVICE: "hbm_ratio", Tier.HOST: "cpu_ratio", Tier.DISK: None}
_COLORS = {Tier.DEVICE: "#d62728", Tier.HOST: "#1f77b4", Tier.DISK: "#2ca02c"}
_CLOSER = {Tier.DEVICE: None, Tier.HOST: Tier.DEVICE, Tier.DISK: Tier.HOST}
_FARTHER = {t: next((f for f, c in _CLOSER.items() if c is t), None) for t in Tier}
_STAGING = {Tier.DEVICE: None, Tier.HOST: None, Tier.DISK: Tier.HOST}
_PATH_KEYS = {Tier.DEVICE: None, Tier.HOST: None, Tier.DISK: "offload_path"}
_LINK_RATES = {
    Tier.DEVICE: None,
    Tier.HOST: ("to_device", "from_device"),
    Tier.DISK: ("disk_read", "disk_write"),
}


def by_label(owner: object, table: dict | None, name: str):
    """``table[tier]`` for the tier whose report name is ``name``: the ``__getattr__`` of
    an object keyed by ``Tier`` that reads ``x.device``, ``x.host``, ``x.disk``."""
    if table is not None and not name.startswith("_"):
        for tier, value in table.items():
            if tier.label == name:
                return value
    raise AttributeError(f"{type(owner).__name__!r} object has no attribute {name!r}")


# report names, nearest first: the keys of memory_stats() and of the planner's peaks
TIER_LABELS = tuple(t.label for t in Tier)
