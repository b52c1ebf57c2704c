"""URL scheme -> regime. The one table a new regime adds a line to.

Entries name modules, not classes, so a regime's heavy imports (CUDA, NCCL)
happen only when it is asked for.
"""

from __future__ import annotations

import importlib

from commlab.config import ExchangerURL, parse_options
from commlab.errors import ConfigError
from commlab.exchanger import Exchanger
from commlab.rendezvous import RankInfo, from_env

REGIMES: dict[str, str] = {
    "local": "commlab.regimes.local:LocalExchanger",
    "noop": "commlab.regimes.local:NoopExchanger",
    "allreduce": "commlab.regimes.allreduce:AllReduceExchanger",
    "ring": "commlab.regimes.ring:RingExchanger",
    "ps": "commlab.regimes.ps:PSExchanger",
}


def regime_class(scheme: str) -> type[Exchanger]:
    target = REGIMES.get(scheme)
    if target is None:
        raise ConfigError(f"unknown exchanger scheme {scheme + '://'!r}; known: "
                          + ", ".join(s + "://" for s in sorted(REGIMES)))
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def connect(url: str | ExchangerURL, rank: RankInfo | None = None) -> Exchanger:
    """Build the exchanger ``url`` names for this process (rank from the launcher's environment).

    Does not block: peers are met in :meth:`Exchanger.setup`.
    """
    parsed = url if isinstance(url, ExchangerURL) else ExchangerURL.parse(url)
    cls = regime_class(parsed.scheme)
    rank = rank if rank is not None else from_env()
    return cls.from_url(parsed, rank) if hasattr(cls, "from_url") else cls(parse_options(cls.Options, parsed), rank)
