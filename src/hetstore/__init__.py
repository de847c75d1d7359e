"""hetstore: train PyTorch models whose states do not fit the accelerator.

Parameters, gradients, optimizer states and activations live in the tier where they
cost least (device, pinned host memory, disk) and reach the device just before use.
"""

from hetstore.accumulation import no_sync
from hetstore.api import offload
from hetstore.checkpoint import CheckpointError, export_weights, load, save
from hetstore.config import OffloadConfig
from hetstore.dry_run import plan
from hetstore.errors import (
    ConfigError,
    DiskIOError,
    DistributedError,
    GradientAccessError,
    HetstoreError,
    OffloadedParameterError,
    OutOfDeviceMemory,
    OutOfTierMemory,
)
from hetstore.eviction import EvictionReport, evict, restore
from hetstore.lifetime import offloaded, release
from hetstore.model_state import ModelState, state_of
from hetstore.named_weights import named_weights
from hetstore.planner import Plan, Trace
from hetstore.stats import memory_stats, peak_rss
from hetstore.tier import Tier
from hetstore.weights import load_weights

__all__ = [
    "offload",
    "offloaded",
    "release",
    "no_sync",
    "state_of",
    "ModelState",
    "OffloadConfig",
    "Tier",
    "ConfigError",
    "OutOfDeviceMemory",
    "OutOfTierMemory",
    "DiskIOError",
    "DistributedError",
    "GradientAccessError",
    "OffloadedParameterError",
    "HetstoreError",
    "memory_stats",
    "peak_rss",
    "load_weights",
    "named_weights",
    "evict",
    "restore",
    "EvictionReport",
    "save",
    "load",
    "export_weights",
    "CheckpointError",
    "plan",
    "Plan",
    "Trace",
]
__version__ = "0.1.0"
