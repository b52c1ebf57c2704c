"""URL scheme -> regime. The one table a new regime adds a line to.

Entries name modules, not classes, so a regime's heavy imports (CUDA, NCCL)
happen only when it is asked for. :func:`resolve` is the one place a URL is
checked: the CLI, the launcher, the benchmarks and :func:`connect` all call it,
so a bad URL fails the same way, in one line naming the option, everywhere.
"""

from __future__ import annotations

import importlib
import os

from commlab.base.config import ExchangerURL
from commlab.base.errors import ConfigError
from commlab.core.exchanger import Exchanger
from commlab.transport.rendezvous import RankInfo, from_env

REGIMES: dict[str, str] = {
    "local": "commlab.regimes.local:LocalExchanger",
    "noop": "commlab.regimes.local:NoopExchanger",
    "allreduce": "commlab.regimes.allreduce:AllReduceExchanger",
    "ring": "commlab.regimes.ring:RingExchanger",
    "ps": "commlab.regimes.ps:PSExchanger",
}

ENV_URL = "COMMLAB_EXCHANGER"  # what commlab.connect() reads when given no URL (commlab run sets it)


def regime_class(scheme: str) -> type[Exchanger]:
    target = REGIMES.get(scheme)
    if target is None:
        raise ConfigError(f"unknown exchanger scheme {scheme + '://'!r}; known: "
                          + ", ".join(s + "://" for s in sorted(REGIMES)))
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def resolve(url: str | ExchangerURL) -> tuple[type[Exchanger], object]:
    """Check ``url`` completely, without connecting: ``(regime class, its frozen options)``.

    Raises :class:`ConfigError` whose message is one line naming what is wrong (the scheme,
    an unknown option, a value out of its choices)."""
    parsed = url if isinstance(url, ExchangerURL) else ExchangerURL.parse(url)
    cls = regime_class(parsed.scheme)
    return cls, cls.options_from_url(parsed)


def url_from_env(url: str | ExchangerURL | None = None) -> str | ExchangerURL:
    if url is not None:
        return url
    text = os.environ.get(ENV_URL, "").strip()
    if not text:
        raise ConfigError(f"commlab.connect() was given no URL and ${ENV_URL} is not set: pass one, e.g. "
                          f"commlab.connect('allreduce://?backend=gloo'), or start the script with "
                          f"'commlab run --exchanger URL script.py'")
    return text


def connect(url: str | ExchangerURL | None = None, rank: RankInfo | None = None, group=None) -> Exchanger:
    """Build the exchanger ``url`` names for this process (default: ``$COMMLAB_EXCHANGER``); the rank
    and peers come from the launcher's environment (torchrun's, Slurm's or Open MPI's).

    ``group``: exchange among these of the job's global ranks only (this rank's replica group), a list
    of ranks or a 1-D ``DeviceMesh`` (``mesh["dp"]``; see :mod:`commlab.core.groups`); the exchanger's rank
    and world size are then the position in the group and its size. Default: every rank of the job.

    Does not block: peers are met in :meth:`Exchanger.setup`.
    """
    url = url_from_env(url)
    parsed = url if isinstance(url, ExchangerURL) else ExchangerURL.parse(url)
    cls, options = resolve(parsed)
    rank = rank if rank is not None else from_env()
    torch_group = None
    if group is not None:
        from commlab.core.groups import resolve as resolve_group
        rank, torch_group = resolve_group(group, rank)
    ex = cls(options, rank)
    ex.torch_group = torch_group
    return ex
