"""``hetstore.memory_stats``: per-tier current, peak and capacity in bytes; and
``hetstore.peak_rss``: the process's own peak resident set, to check them against."""

from __future__ import annotations

import resource
import sys
from typing import Any

from torch import nn

from hetstore.model_state import state_of
from hetstore.tiers import Tiers

__all__ = ["memory_stats", "peak_rss"]


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


def peak_rss() -> int:
    """This process's peak resident set in bytes: ``VmHWM`` of /proc/self/status on
    Linux. Not ``getrusage``'s ``ru_maxrss``: Linux carries it over fork and exec, so a
    process started by a large one reports its parent's size until it outgrows it
    (measured: a child of a 0.8 GiB parent said 813 MiB, its own peak being 13 MiB).
    Elsewhere, ``ru_maxrss`` (bytes on macOS, KiB on other systems)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
