"""Parsing of the ``--exchanger`` URL into a frozen options object.

A URL is ``scheme://[host:port[,host:port...]][?key=value&...]``. The scheme
picks the regime from the registry (:mod:`commlab.registry`); the query is
parsed into that regime's ``Options`` dataclass, field by field, so an unknown
key or a value of the wrong type fails at once with a message that lists what
the regime accepts. Parsing happens once; everything downstream receives frozen
dataclasses.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from commlab.errors import ConfigError


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


def option(default, help: str, choices: tuple | None = None):
    """A field of a regime's Options: its default, one line of help, allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class CommonOptions:
    """Options every bucketed regime accepts."""

    timeout: float = option(120.0, "seconds any single wait may take before it raises")
    bucket_mb: float = option(25.0, "gradient bucket size in MiB (buckets fill in reverse parameter order)")
    heap: str = option("keep", "keep: big freed blocks (gradient temporaries, received messages) stay in the "
                               "heap instead of page-faulting in anew every step (glibc); system: C library defaults",
                       choices=("keep", "system"))
    buffers: str = option("broadcast", "module buffers (BatchNorm statistics) after every step: broadcast rank 0's "
                                       "(DDP's choice), average them, or none (each rank keeps its own)",
                          choices=("broadcast", "average", "none"))

    def __post_init__(self):
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")


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
        choices = f.metadata.get("choices")
        extra = f" one of {list(choices)}" if choices else ""
        lines.append(f"{f.name}={f.default!r} ({hints[f.name].__name__}{extra}): {f.metadata['help']}")
    return lines
