"""Agreement between ranks through the rendezvous store, before any collective runs."""

from __future__ import annotations

import json
from datetime import timedelta

from commlab.errors import CommTimeout, ModelMismatch
from commlab.exchanger import manifest_difference, model_manifest
from commlab.rendezvous import RankInfo


def agree_on_model(store, info: RankInfo, model, timeout: float) -> None:
    """Every rank publishes its model manifest; each compares with rank 0's.

    Raises :class:`ModelMismatch` naming the first parameter that differs, on
    the rank that differs, before any expensive collective starts.
    """
    mine = model_manifest(model)
    store.set(f"manifest/{info.rank}", json.dumps(mine))
    if info.rank == 0:
        return
    try:
        store.wait(["manifest/0"], timedelta(seconds=timeout))
    except Exception as exc:
        raise CommTimeout(f"rank {info.rank}: rank 0 did not publish its model within {timeout:g}s") from exc
    theirs = [(n, tuple(s), d) for n, s, d in json.loads(store.get("manifest/0"))]
    diff = manifest_difference(mine, theirs, "rank 0")
    if diff:
        raise ModelMismatch(f"rank {info.rank}'s model differs from rank 0's: {diff}")
