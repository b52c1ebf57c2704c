"""Parsing of the ``--exchanger`` URL into a frozen options object.

A URL is ``scheme://[host:port[,host:port...]][?key=value&...]``. The scheme
picks the regime from the registry (:mod:`commlab.core.registry`); the query is
parsed into that regime's ``Options`` dataclass, field by field, so an unknown
key or a value of the wrong type fails at once with a message that lists what
the regime accepts. Parsing happens once; everything downstream receives frozen
dataclasses.

Every number is checked where it is declared: a float field must be finite, and an
:func:`option` states its range (``gt``, ``ge``, ``le``), so ``chunk_mb=nan`` or
``shards=1000000`` fails here, in one line naming the option, before any process starts.
:func:`check_number` is the same rule for the CLI's and the launcher's own flags.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from commlab.base.errors import ConfigError


@dataclass(frozen=True)
class ExchangerURL:
    scheme: str
    endpoints: tuple[str, ...]
    query: tuple[tuple[str, str], ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> "ExchangerURL":
        if "://" not in text:
            raise ConfigError(f"exchanger URL {text!r} has no scheme: expected e.g. 'allreduce://?backend=gloo'")
        parts = urlsplit(text)
        scheme = parts.scheme.lower()
        endpoints = tuple(e for e in parts.netloc.split(",") if e)
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ConfigError(f"exchanger URL {text!r} repeats query key(s) {dup}")
        return cls(scheme, endpoints, tuple(pairs), text)


MAX_MB = float(2**20)  # a size in MiB above this (1 TiB) is a typo, not a size: no host holds it
MAX_WAIT_S = 7 * 86400.0  # a wait longer than a week is a hang; far longer ones overflow torch's timedelta


def check_number(name: str, value, *, gt: float | None = None, ge: float | None = None,
                 lt: float | None = None, le: float | None = None, why: str = "") -> None:
    """Raise :class:`ConfigError`, one line naming ``name``, unless ``value`` is a finite number (not a
    bool) with ``value > gt``, ``value >= ge``, ``value < lt`` and ``value <= le`` (each where given).
    ``why`` follows the range in the message (what makes it the range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    finite = not isinstance(value, float) or math.isfinite(value)  # (an int is: isfinite would overflow on 10**400)
    if finite and (gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt) \
            and (le is None or value <= le):
        return
    bounds = _bounds(gt, ge, lt, le)
    what = "a finite number" + (f" {bounds}" if bounds else "") if not finite else bounds
    raise ConfigError(f"{name} must be {what}{f' ({why})' if why else ''}, got {value!r}")


def _bounds(gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None,
            **_) -> str:
    """``> 0 and <= 1024``: a range as a message says it."""
    said = [f"{op} {int(b) if float(b).is_integer() else b!r}"
            for op, b in ((">", gt), (">=", ge), ("<", lt), ("<=", le)) if b is not None]
    return " and ".join(said)


def option(default, help: str, choices: tuple | None = None, *, gt: float | None = None, ge: float | None = None,
           le: float | None = None, why: str = ""):
    """A field of a regime's Options: its default, one line of help, allowed values, and for a number its
    range (:func:`check_number`'s ``gt``, ``ge``, ``le``, ``why``), checked when the options are built."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "range": {"gt": gt, "ge": ge, "le": le, "why": why}})


def check_ranges(options) -> None:
    """Every number of a frozen options object is finite and in its declared range (else ConfigError)."""
    hints = typing.get_type_hints(type(options))
    for f in dataclasses.fields(options):
        if hints.get(f.name) in (int, float) and f.metadata.get("choices") is None:
            check_number(f.name, getattr(options, f.name), **f.metadata.get("range", {}))


@dataclass(frozen=True)
class CommonOptions:
    """Options every bucketed regime accepts."""

    timeout: float = option(120.0, "seconds any single wait may take before it raises", gt=0, le=MAX_WAIT_S,
                            why="a week: longer is a hang")
    bucket_mb: float = option(25.0, "gradient bucket size in MiB (buckets fill in reverse parameter order)", gt=0,
                              le=MAX_MB)
    heap: str = option("keep", "keep: big freed blocks (gradient temporaries, received messages) stay in the "
                               "heap instead of page-faulting in anew every step (glibc); system: C library defaults",
                       choices=("keep", "system"))
    buffers: str = option("broadcast", "module buffers (BatchNorm statistics) after every step: broadcast rank 0's "
                                       "(DDP's choice), average them, or none (each rank keeps its own)",
                          choices=("broadcast", "average", "none"))

    def __post_init__(self):
        check_ranges(self)  # every subclass's numbers too: each calls this first


def _convert(name: str, raw: str, kind, choices):
    try:
        if kind is bool:
            low = raw.lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            value = low in ("1", "true", "yes", "on")
        elif kind in (int, float, str):
            value = kind(raw)
        else:
            raise ConfigError(f"option {name!r} cannot be set from a URL")
    except ValueError:
        raise ConfigError(f"option {name!r}: {raw!r} is not a valid {kind.__name__}") from None
    if choices and value not in choices:
        raise ConfigError(f"option {name!r}: {raw!r} is not one of {list(choices)}")
    return value


def parse_options(options_cls, url: ExchangerURL, **fixed):
    """Build ``options_cls`` from the URL's query; ``fixed`` fields come from code, not the URL."""
    fields = {f.name: f for f in dataclasses.fields(options_cls) if f.init}
    hints = typing.get_type_hints(options_cls)
    values = dict(fixed)
    for key, raw in url.query:
        f = fields.get(key)
        if f is None or key in fixed:
            known = ", ".join(sorted(k for k in fields if k not in fixed)) or "(none)"
            raise ConfigError(f"{url.scheme}:// does not know option {key!r}; known options: {known}")
        values[key] = _convert(key, raw, hints[key], f.metadata.get("choices"))
    return options_cls(**values)


def describe_options(options_cls) -> list[str]:
    """One line per option, for ``--help`` texts and error messages."""
    hints = typing.get_type_hints(options_cls)
    lines = []
    for f in dataclasses.fields(options_cls):
        if not f.init or "help" not in f.metadata:
            continue
        choices, bounds = f.metadata.get("choices"), _bounds(**f.metadata.get("range", {}))
        extra = f" one of {list(choices)}" if choices else f" {bounds}" if bounds else ""
        lines.append(f"{f.name}={f.default!r} ({hints[f.name].__name__}{extra}): {f.metadata['help']}")
    return lines
