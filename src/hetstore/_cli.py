"""What the command line's subcommands share: errors that name their flags, and progress
lines on stderr.

The library's messages name ``OffloadConfig`` keys ("raise offload_disk_size", "point
offload_path at ..."): right for a script, wrong on the command line, where the user
types ``--disk`` and ``--path``. Each command passes its own key-to-flag table.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping

__all__ = ["PLAN_FLAGS", "BENCH_FLAGS", "in_flags", "progress"]

# OffloadConfig key -> the flag of `hetstore plan` that sets it
PLAN_FLAGS = {
    "max_device_memory": "--device-memory",
    "offload_cpu_size": "--host-memory",
    "offload_disk_size": "--disk",
    "offload_path": "--path",
    "compute_dtype": "--dtype",
    "optimizer_state_format": "--state-format",
    "step_in_backward": "--step-in-backward",
    "device": "--device",
}
BENCH_FLAGS = {"offload_path": "--path", "device": "--device"}


def in_flags(
    message: str, flags: Mapping[str, str], fixed: Iterable[str] = ("hbm_ratio", "cpu_ratio")
) -> str:
    """``message`` with each config key in ``flags`` named by its flag: ``key='x'``
    becomes ``--flag 'x'``, and a key named in the text (one with an underscore: a
    plain word such as ``device`` is also the tier's name) becomes the flag. ``fixed``:
    keys the command leaves at their defaults and has no flag for; advice to change
    them is dropped ("raise max_device_memory or hbm_ratio" -> "raise --device-memory")."""
    for key in fixed:
        if key not in flags:
            message = re.sub(rf" x {key} [0-9.]+", "", message)
            message = re.sub(rf" or {key}\b", "", message)
    for key, flag in flags.items():
        message = re.sub(rf"(?<![\w-]){key}=", f"{flag} ", message)
        if "_" in key:
            message = re.sub(rf"(?<![\w-]){key}\b", flag, message)
    return message


def progress(command: str, what: str) -> None:
    """One line on stderr saying what ``hetstore command`` is doing now (a step that
    takes seconds), so a silent terminal does not look hung."""
    print(f"hetstore {command}: {what}...", file=sys.stderr, flush=True)
