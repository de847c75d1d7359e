"""The exceptions hetstore raises. Each message names the value at fault and the fix."""

from __future__ import annotations

import torch

__all__ = [
    "HetstoreError",
    "ConfigError",
    "OutOfTierMemory",
    "OutOfDeviceMemory",
    "DiskIOError",
    "DistributedError",
    "GradientAccessError",
    "OffloadedParameterError",
]


class HetstoreError(Exception):
    """Base class of every error hetstore raises on purpose."""


class ConfigError(HetstoreError, ValueError):
    """A configuration key or value is not allowed. Raised before any work is done."""


class OutOfTierMemory(HetstoreError, torch.OutOfMemoryError):
    """A request would pass a tier's capacity. ``tier`` names it ("device", "host", "disk")."""

    def __init__(self, message: str, *, tier: str, requested: int, capacity: int | None):
        super().__init__(message)
        self.tier = tier
        self.requested = requested
        self.capacity = capacity


class OutOfDeviceMemory(OutOfTierMemory):
    """The device budget (``max_device_memory``) would be passed.

    A ``torch.OutOfMemoryError``, so code that already handles CUDA OOM handles this too.
    """


class DiskIOError(HetstoreError, OSError):
    """A disk-tier read or write failed (disk full, IO error, short read).

    Carries ``path``, ``offset`` and ``errno``; the message says what to change.
    """

    def __init__(self, message: str, *, path: str, offset: int, errno: int | None = None):
        OSError.__init__(self, message)
        self.path = path
        self.offset = offset
        self.errno = errno

    def __str__(self) -> str:  # OSError's __str__ would print the args tuple
        return self.args[0]


class DistributedError(HetstoreError, RuntimeError):
    """A collective across ranks failed: another rank died, hung past the process
    group's timeout, or called a different collective. The message names this rank,
    the operation and the unit, and how to lengthen the timeout."""


class GradientAccessError(HetstoreError, RuntimeError):
    """``p.grad`` of a parameter whose gradient has no whole tensor to show (on disk, or
    sharded over ranks). The message names the parameter and the way out."""


class OffloadedParameterError(HetstoreError, RuntimeError):
    """A write into an offloaded parameter between uses (it would change a copy, not the
    master), or a read that cannot be served (sharded, freed). The message names the
    parameter and the way out (``load_state_dict``, ``state_dict``)."""


# Raised (as ConfigError) by a backward through a graph whose model was released: its
# parameters and offloaded activations are gone. Shared by runtime.hooks and
# runtime.activations, which each meet it first in some graph.
BACKWARD_AFTER_RELEASE = (
    "backward through a model that was released by hetstore.release() (or dropped and "
    "collected): its parameters and offloaded activations are freed. Run backward (and "
    "the optimizer step) before releasing the model"
)
