"""Byte sizes: parse the config's ``"512GB"``/``"1.5GiB"``/int forms, print them back;
and durations printed in a unit a person reads at a glance (:func:`format_duration`).

"GB" means GiB (2**30 bytes), as in MindSpore, whose ``max_device_memory='30GB'``
and out-of-memory report ("Device HBM memory size: 32768M" for 32GB) are binary.
Matching it means a MindSpore config means the same budget here. Decimal units are
spelled out explicitly ("GiB" and "GB" are the same; there is no decimal spelling).
"""

from __future__ import annotations

import decimal
import math
import re

__all__ = [
    "parse_size",
    "format_size",
    "format_duration",
    "short_repr",
    "SIZE_UNITS",
    "MAX_SIZE",
]

#: The largest size accepted: what fits an int64 (torch and the OS count bytes in one).
MAX_SIZE = 2**63 - 1
_TOO_LARGE = "a size must be at most 2**63 - 1 bytes (8 EiB)"

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

    Accepts a non-negative int (bytes), a finite non-negative float (truncated) or a
    string such as ``"512GB"``, ``"1.5GiB"``, ``"100MB"``, ``"4096"``, at most
    ``MAX_SIZE``. Raises ``ValueError`` with the accepted forms otherwise (never
    ``OverflowError``); callers wrap it in a ``ConfigError`` that names the key.
    """
    if isinstance(value, bool):
        raise ValueError(
            f"expected a size such as '8GB' or an int of bytes, got the bool {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {short_repr(value)}")
        if value > MAX_SIZE:
            raise ValueError(f"{_TOO_LARGE}, got {short_repr(value)}")
        return int(value)  # a plain int, not a subclass
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a size must be a finite non-negative number, got {value!r}")
        if value > MAX_SIZE:
            raise ValueError(f"{_TOO_LARGE}, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(
            f"expected a size such as '8GB', '1.5GiB', '100MB' or an int of bytes, "
            f"got {type(value).__name__} {short_repr(value)}"
        )
    if value.strip().startswith("-"):
        raise ValueError(f"a size cannot be negative, got {short_repr(value)}")
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        raise ValueError(
            f"cannot parse {short_repr(value)} as a size; use a number with an optional unit "
            f"B, KB, MB, GB, TB (binary: GB = GiB = 2**30 bytes), e.g. '30GB' or '1.5GiB'"
        )
    # Decimal, not float: exact for any digits ("9007199254740993"), and "1e400GB" is a
    # number too large rather than an infinity that int() overflows on.
    try:
        number = decimal.Decimal(match.group(1))
    except decimal.DecimalException:  # an exponent with thousands of digits
        raise ValueError(f"{_TOO_LARGE}, got {short_repr(value)}") from None
    if number > MAX_SIZE:
        raise ValueError(f"{_TOO_LARGE}, got {short_repr(value)}")
    with decimal.localcontext() as ctx:
        ctx.prec = 64  # exact for every product below 2**63 * 2**40
        ctx.Emin = decimal.MIN_EMIN  # "1e-999999999GB" is 0 bytes, not an error
        nbytes = int(number * SIZE_UNITS[match.group(2).lower()])
    if nbytes > MAX_SIZE:
        raise ValueError(f"{_TOO_LARGE}, got {short_repr(value)}")
    return nbytes


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message: cut to ``limit`` characters, and never raising
    (an int of more than 4300 digits has no repr; a user's object may have a broken one)."""
    try:
        text = repr(value)
    except Exception:
        if isinstance(value, int):
            text = f"<int of {value.bit_length()} bits>"
        else:
            text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def format_duration(seconds: float | None) -> str:
    """A duration in the unit that reads best: milliseconds under 10 s (a step of a small
    model, compared to the millisecond), then seconds, minutes and hours:
    ``format_duration(0.1372) == '137.2 ms'``, ``format_duration(465.78) == '7.8 min'``."""
    if seconds is None:
        return "unknown"
    sign = "-" if seconds < 0 else ""
    s = abs(float(seconds))
    if s < 10:
        return f"{sign}{s * 1e3:.1f} ms"
    if s < 120:
        return f"{sign}{s:.1f} s"
    if s < 2 * 3600:
        return f"{sign}{s / 60:.1f} min"
    return f"{sign}{s / 3600:.1f} h"
