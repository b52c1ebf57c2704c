"""Sizes and numbers as people write them."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
           "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``4K`` / ``256KiB`` / ``16M`` / ``4096`` -> bytes (binary units). Must be a multiple of 4 (float32)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _SUFFIX:
        raise ValueError(f"size {text!r}: expected e.g. 4096, 4K, 256KiB, 16M")
    n = int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if n <= 0 or n % 4:
        raise ValueError(f"size {text!r} = {n} bytes: must be a positive multiple of 4 (float32 elements)")
    return n


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human_bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_us(us: float) -> str:
    if us >= 1e4:
        return f"{us / 1e3:.1f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != x:
            return "—"
        return f"{x:.{digits}g}"
    return str(x)
