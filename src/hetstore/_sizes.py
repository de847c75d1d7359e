"""Byte sizes: parse the config's ``"512GB"``/``"1.5GiB"``/int forms, print them back.

"GB" means GiB (2**30 bytes), as in MindSpore, whose ``max_device_memory='30GB'``
and out-of-memory report ("Device HBM memory size: 32768M" for 32GB) are binary.
Matching it means a MindSpore config means the same budget here. Decimal units are
spelled out explicitly ("GiB" and "GB" are the same; there is no decimal spelling).
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_size", "format_size", "SIZE_UNITS"]

SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tb": 2**40,
    "tib": 2**40,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Return ``value`` as a number of bytes.

    Accepts a non-negative int (bytes) or a string such as ``"512GB"``, ``"1.5GiB"``,
    ``"100MB"``, ``"4096"``. Raises ``ValueError`` with the accepted forms otherwise;
    callers wrap it in a ``ConfigError`` that names the key.
    """
    if isinstance(value, bool):
        raise ValueError(
            f"expected a size such as '8GB' or an int of bytes, got the bool {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a size must be a finite non-negative number, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(
            f"expected a size such as '8GB', '1.5GiB', '100MB' or an int of bytes, "
            f"got {type(value).__name__} {value!r}"
        )
    if value.strip().startswith("-"):
        raise ValueError(f"a size cannot be negative, got {value!r}")
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        raise ValueError(
            f"cannot parse {value!r} as a size; use a number with an optional unit "
            f"B, KB, MB, GB, TB (binary: GB = GiB = 2**30 bytes), e.g. '30GB' or '1.5GiB'"
        )
    number = float(match.group(1))
    return int(number * SIZE_UNITS[match.group(2).lower()])


def format_size(nbytes: int | float | None) -> str:
    """Human-readable binary size: ``format_size(3 * 2**29) == '1.50 GiB'``."""
    if nbytes is None:
        return "unlimited"
    n = float(nbytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
