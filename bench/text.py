"""The one renderer of ``bench/``: sizes and numbers as people write them, markdown tables, file names.

Every bench module writes its tables with :func:`table`, its sizes with :func:`human_bytes` (commlab's
own, :func:`commlab.core.metrics.human_bytes`: binary units, a 4096-byte message is "4 KiB"), and names its
files with :func:`slug`.
"""

from __future__ import annotations

import re

from commlab.core.metrics import human_bytes  # noqa: F401  (the one size renderer; bench writes sizes as commlab does)

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


def fmt_us(us: float) -> str:
    if us >= 1e4:
        return f"{us / 1e3:.1f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds with one decimal (``'12.3'``); None -> ``'—'``."""
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def fixed(x: float | None, spec: str = ".4f") -> str:
    """``format(x, spec)``; None -> ``'—'``."""
    return "—" if x is None else format(x, spec)


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != x:
            return "—"
        return f"{x:.{digits}g}"
    return str(x)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table: the header, the rule, one line per row. A ``|`` inside a cell is
    escaped and a line break becomes a space, so no cell breaks its row."""
    cell = lambda c: re.sub(r"(?<!\\)\|", r"\\|", str(c)).replace("\n", " ")
    return (["| " + " | ".join(map(cell, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def names(text: str, known=None, option: str = "") -> list[str]:
    """The comma-separated names in ``text`` (``none``: none). Raises ValueError naming ``option`` for a
    name not in ``known`` (where given)."""
    out = [] if text.strip().lower() == "none" else [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in out if known is not None and n not in known]
    if bad:
        raise ValueError(f"{option}: unknown {bad}; known: {', '.join(known)}")
    return out


def slug(name: str) -> str:
    """A name or URL as a file name: every run of other characters than ``A-Za-z0-9_.-`` becomes one ``_``
    (``ps-async-lr/N`` -> ``ps-async-lr_N``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "_"
