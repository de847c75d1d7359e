"""Storage tiers: device, host and disk, each with capacity and accounting.

``Tiers`` owns one of each for a run. The disk tier is created on first use, so a run
that never touches the disk makes no directory and checks no free space.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetstore.config import OffloadConfig
from hetstore.tier import TIER_LABELS, Tier
from hetstore.tiers.accounting import MemoryAccount, TierUsage, format_usage
from hetstore.tiers.device import DeviceTier
from hetstore.tiers.disk import DiskTier
from hetstore.tiers.host import HostBuffer, HostTier, PinnedMemoryWarning

__all__ = [
    "physical_memory",
    "Tiers",
    "DeviceTier",
    "HostTier",
    "HostBuffer",
    "MemoryAccount",
    "TierUsage",
    "PinnedMemoryWarning",
]


class Tiers:
    """The device, host and disk tiers of one run (one process, one rank)."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device: torch.device | None = None,
        rank: int = 0,
        world_size: int = 1,
        ranks_on_host: int = 1,
        advice: Callable[[str, int], list[str]] | None = None,
    ):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = device if device is not None else config.resolved_device()
        # Why a callback: a tier's overflow report lists the *other* tiers and advice that
        # only the runtime knows (which placement change would free enough).
        self._advice = advice
        self.device_tier = DeviceTier(
            self.device, config.max_device_memory, context=self._report_context
        )
        host_capacity = config.offload_cpu_size
        if host_capacity is None:  # ranks on one machine share its memory
            host_capacity = physical_memory() // max(ranks_on_host, 1)
        self.host = HostTier(
            capacity=host_capacity,
            block_size=config.host_mem_block_size,
            pin=config.enable_pinned_mem,
            device=self.device,
            context=self._report_context,
        )
        self._disk = None

    @property
    def disk(self) -> DiskTier:
        """The disk tier, created (directory made, free space checked) on first use."""
        if self._disk is None:
            cfg = self.config
            self._disk = DiskTier(
                root=cfg.offload_path,
                capacity=cfg.offload_disk_size,
                rank=self.rank,
                block_size=cfg.aio_block_size,
                queue_depth=cfg.aio_queue_depth,
                threads=cfg.aio_threads,
                enable_aio=cfg.enable_aio,
            )
        return self._disk

    @property
    def disk_if_created(self) -> DiskTier | None:
        """The disk tier if something has used it, else None (reading ``disk`` creates it)."""
        return self._disk

    def of(self, tier: Tier) -> DeviceTier | HostTier | DiskTier:
        """The storage of ``tier``: each has ``allocate_flat`` and ``usage``."""
        if tier is Tier.DEVICE:
            return self.device_tier
        if tier is Tier.HOST:
            return self.host
        return self.disk

    def usage(self, tier: Tier | str) -> TierUsage:
        """One tier's usage; ``tier`` may be its report name ("device", "host", "disk")."""
        tier = Tier.from_label(tier)
        if tier is Tier.DISK and self._disk is None:  # not created yet: nothing on it
            return TierUsage(tier.label, 0, 0, self.config.offload_disk_size)
        return self.of(tier).usage()

    def memory_stats(self) -> dict[str, dict[str, int | None]]:
        """``{"device"|"host"|"disk": {"current", "peak", "capacity"}}`` in bytes."""
        return {name: self.usage(name).as_dict() for name in TIER_LABELS}

    def reset_peaks(self) -> None:
        self.device_tier.account.reset_peak()
        self.host.account.reset_peak()

    def close(self) -> None:
        self.device_tier.close()
        self.host.close()
        if self._disk is not None:
            self._disk.close()

    def _report_context(self, failing: str, nbytes: int) -> list[str]:
        lines = [format_usage(self.usage(name)) for name in TIER_LABELS if name != failing]
        if self._advice is not None:
            lines.extend(self._advice(failing, nbytes))
        if self.world_size > 1:
            lines.append(
                f"  (rank {self.rank} of {self.world_size}: capacities and usage are this "
                "rank's; each rank holds 1/world_size of the model states)"
            )
        return lines


def physical_memory() -> int:
    """This machine's RAM in bytes: the host tier's capacity when ``offload_cpu_size``
    is not set (read by the tiers, ``offload()``'s pre-flight and the planner)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
