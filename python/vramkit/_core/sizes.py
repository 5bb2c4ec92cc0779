"""Sizes as people write them and read them: ``parse_size("24GiB")`` and ``format_size(n)``.

Shared by every part that takes or prints a memory size (predictions, the pytest markers,
notebook reports), so that "24GiB" means the same bytes everywhere and "24 GB" is refused
everywhere with the same explanation.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["GiB", "MiB", "format_size", "parse_size"]

MiB = 1 << 20
GiB = 1 << 30

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"kb", "mb", "gb", "tb"}


def parse_size(value: Any, what: str = "capacity") -> int:
    """Bytes from an int or a string such as "24GiB", "40 GiB", "512MiB", "80g" (binary units).

    "24 GB" is refused: GPU makers' "24 GB" cards have 24 GiB (2^30-byte units) or a little
    less, while GB means 10^9 bytes; say which you mean ("24GiB", or "24e9" for decimal bytes).
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a size in bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{what} must be a whole number of bytes, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        text = value.strip()
        m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)", text)
        if not m:
            raise ValueError(f"{what} {value!r} is not a size: write a number with a binary unit, e.g. '24GiB', "
                             "'40 GiB', '512MiB' or a byte count")
        unit = m.group(2).lower()
        if unit in _DECIMAL:
            raise ValueError(f"{what} {value!r} is ambiguous: GB means 10^9 bytes, but a '{m.group(1)} GB' GPU has "
                             f"{m.group(1)} GiB (2^30-byte units) or slightly less; write '{m.group(1)}GiB', or "
                             f"'{m.group(1)}e9' for decimal bytes")
        if unit not in _UNITS:
            raise ValueError(f"{what} {value!r} has an unknown unit {m.group(2)!r}: use B, KiB, MiB, GiB or TiB")
        try:
            n = int(float(m.group(1)) * _UNITS[unit])
        except OverflowError:
            raise ValueError(f"{what} {value!r} is too large (at most 4 EiB)") from None
    else:
        raise TypeError(f"{what} must be a size in bytes or a string like '24GiB', got {type(value).__name__}")
    if n <= 0 or n >= 1 << 62:
        raise ValueError(f"{what} must be between 1 byte and 4 EiB, got {n}")
    return n


def format_size(n: float) -> str:
    """Bytes in binary units with two decimals ("23.65 GiB"), as the reports print them."""
    n = float(n)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
