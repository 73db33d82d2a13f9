"""Byte sizes in presets (``deployments.byte_size``): integers, binary and decimal units, and
a ValueError naming the key and the value for anything else."""

from __future__ import annotations

import re
from typing import Any

import pytest

from deployments.byte_size import parse_byte_size


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512B", 512),
        ("4GiB", 4 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("2kib", 2048),
        ("1TiB", 2**40),
        ("3GB", 3 * 10**9),
        ("64kB", 64_000),
        ("1.5GiB", 3 * 2**29),
        ("0.5KiB", 512),
        ("1.0001KiB", 1024),  # fractions round down to whole bytes
    ],
)
def test_sizes(value: Any, size: int) -> None:
    assert parse_byte_size(value, "engine.cache_bytes") == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("4XB", "engine.cache_bytes '4XB' has an unknown unit 'XB'; known: B, kB"),
        ("4 G", "unknown unit 'G'"),
        ("lots", "engine.cache_bytes must be a byte count or a size like '4GiB', got 'lots'"),
        ("-1GiB", "got '-1GiB'"),
        ("", "got ''"),
        (0, "engine.cache_bytes must be at least 1 byte, got 0"),
        ("0MiB", "at least 1 byte, got '0MiB'"),
        (-5, "at least 1 byte, got -5"),
        (True, "got True"),
        (4.0, "got 4.0"),
        (None, "got None"),
    ],
)
def test_bad_sizes_name_the_key_and_value(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        parse_byte_size(value, "engine.cache_bytes")
    assert str(raised.value).startswith("engine.cache_bytes ")
