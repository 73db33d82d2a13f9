"""Byte sizes in presets: an integer count of bytes, or a string such as ``"4GiB"``,
``"512 MiB"``, ``"1.5GB"`` or ``"4096"``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024 and decimal units (kB, MB, GB, TB) powers
of 1000, as their standards say; a unit is matched case-insensitively ("4gib" is 4 GiB), and a
fractional size is rounded down to whole bytes.
"""

from __future__ import annotations

import re
from typing import Any

UNITS = {  # lower-cased unit -> bytes
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
UNIT_NAMES = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_byte_size(value: Any, where: str = "size") -> int:
    """``value`` in bytes (a positive int); ``ValueError`` naming ``where`` and the value."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a byte count or a size like '4GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        size = _parse_text(value, where)
    else:
        raise ValueError(f"{where} must be a byte count or a size like '4GiB', got {value!r}")
    if size < 1:
        raise ValueError(f"{where} must be at least 1 byte, got {value!r}")
    return size


def _parse_text(text: str, where: str) -> int:
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{where} must be a byte count or a size like '4GiB', got {text!r}")
    number, unit = match.groups()
    factor = UNITS.get(unit.lower() or "b")
    if factor is None:
        raise ValueError(f"{where} {text!r} has an unknown unit {unit!r}; known: {UNIT_NAMES}")
    if "." in number:  # exact for the sizes people write ("1.5GiB"), no float rounding up
        whole, frac = number.split(".")
        return (int(whole + frac) * factor) // 10 ** len(frac)
    return int(number) * factor
