"""Gradient compression: compressors found by name, error feedback around any of them, and the seam a
regime moves their payloads through. See :mod:`commlab.compress.base` for the contract,
:mod:`commlab.compress.codecs`, :mod:`commlab.compress.quant` and :mod:`commlab.compress.powersgd` for the compressors and their byte
counts, :mod:`commlab.compress.seam` for how a regime moves payloads.

A regime that compresses takes :class:`CompressOptions` as the base of its options: ``compress=SPEC``
(``none`` by default) and ``ef=0|1``; a bad spec fails when the URL is parsed, in one line naming
``compress``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from commlab.compress.base import (REGISTRY, Compressor, ErrorFeedback, build, check_fits, known, parse_spec,
                                   register)
from commlab.compress import codecs, powersgd, quant  # noqa: F401  (the built-in compressors register themselves)
from commlab.base.config import CommonOptions, option
from commlab.base.errors import CommTimeout, ConfigError

__all__ = ["Compressor", "ErrorFeedback", "REGISTRY", "build", "check_fits", "known", "parse_spec", "register",
           "CompressOptions", "from_options", "agree"]


@dataclass(frozen=True)
class CompressOptions(CommonOptions):
    """Options of a regime that compresses gradients (besides every bucketed regime's)."""

    compress: str = option("none", "gradient compression per bucket: none, fp16, bf16, powersgd:R, topk:F, "
                                   "randomk:F, sign, int8, int4, fp4 or fp8 (settings after commas, e.g. "
                                   "powersgd:4,start_iter=10 or int8,block=64)")
    ef: bool = option(True, "error feedback: what compression lost is added to the next step's gradient")

    def __post_init__(self):
        super().__post_init__()
        build(self.compress, self.ef)  # refuses a bad spec now, before anything starts


def from_options(options, world_size: int) -> Compressor | None:
    """The compressor ``options`` ask for (None without ``compress=``, or for options that have none)."""
    comp = build(getattr(options, "compress", "none"), getattr(options, "ef", True))
    if comp is not None:
        comp.bind(world_size)
    return comp


def agree(store, info, options, timeout: float) -> None:
    """Every rank compresses as rank 0 does (``compress=`` and ``ef=``), before any payload of mismatched size
    reaches a collective: else a rank that differs, and rank 0 (which reads every rank's), raise
    :class:`ConfigError` naming both. ``store``: the exchanger's own namespace of the job's store
    (:func:`commlab.transport.rendezvous.exchanger_store`), so each exchanger agrees apart from any other. Collective."""
    mine = f"compress={getattr(options, 'compress', 'none')}&ef={int(getattr(options, 'ef', True))}"
    key = "compress/"
    store.set(key + str(info.rank), mine)
    for r in range(info.world_size) if info.rank == 0 else [0]:
        try:
            store.wait([key + str(r)], timedelta(seconds=timeout))
        except Exception as exc:
            raise CommTimeout(f"{info.who()}: {info.who(r)} did not say how it compresses within {timeout:g}s") from exc
        other = store.get(key + str(r)).decode()
        if other != mine:
            odd, odd_has, zero_has = (r, other, mine) if info.rank == 0 else (info.rank, mine, other)
            raise ConfigError(f"{info.who(odd)} has {odd_has} but {info.who(0)} has {zero_has}: every rank must "
                              f"compress alike")
