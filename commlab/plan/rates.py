"""Link rates as people write them (tc's units), for the planner and the bench's capped links."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate: str) -> float:
    """``1gbit`` / ``500mbit`` / ``100mbps`` -> bytes per second (tc's units: bit or bytes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"--link {rate!r}: expected a tc rate such as 1gbit, 500mbit or 100mbps")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    return value / 8 if m.group(3) == "bit" else value
