"""``hetstore demo``: the tiers in action (grows into the full demo with the runtime)."""

from __future__ import annotations

import torch

from hetstore import OffloadConfig, OutOfDeviceMemory, memory_stats
from hetstore._sizes import format_size
from hetstore.tiers import Tiers


def run_demo() -> int:
    config = OffloadConfig(max_device_memory="64MB", offload_cpu_size="1GB")
    tiers = Tiers(config)
    try:
        held = [tiers.device_tier.empty(2**22, torch.float32, f"unit {i}") for i in range(5)]
    except OutOfDeviceMemory as exc:
        print(exc)
        held = []
    for name, stats in memory_stats(tiers).items():
        print(f"{name:>6}: peak {format_size(stats['peak'])} of {format_size(stats['capacity'])}")
    del held
    tiers.close()
    return 0
