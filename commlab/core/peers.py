"""Agreement between ranks through the rendezvous store, before any collective runs."""

from __future__ import annotations

import json
from datetime import timedelta

from commlab.base.errors import CommTimeout, ConfigError, ModelMismatch
from commlab.core.manifest import describe_optimizer, manifest_difference, model_manifest, optimizer_difference
from commlab.transport.rendezvous import RankInfo


def agree_on_model(store, info: RankInfo, model, timeout: float, optimizer=None) -> None:
    """Every rank publishes its model manifest (and its optimizer's description); each compares
    with rank 0's.

    Raises :class:`ModelMismatch` naming the first parameter that differs, or
    :class:`ConfigError` naming the first optimizer setting that differs (class, param
    groups, a hyperparameter), on the rank that differs, before any expensive collective.
    """
    manifest = model_manifest(model)
    mine = {"model": manifest,
            "optimizer": describe_optimizer(optimizer, model) if optimizer is not None else None}
    store.set(f"manifest/{info.rank}", json.dumps(mine))
    if info.rank == 0:
        return
    try:
        store.wait(["manifest/0"], timedelta(seconds=timeout))
    except Exception as exc:
        raise CommTimeout(f"{info.who()}: {info.who(0)} did not publish its model within {timeout:g}s") from exc
    theirs = json.loads(store.get("manifest/0"))
    diff = manifest_difference(manifest, [(n, tuple(s), d) for n, s, d in theirs["model"]], info.who(0))
    if diff:
        raise ModelMismatch(f"{info.who()}'s model differs from {info.who(0)}'s: {diff}")
    if mine["optimizer"] is not None and theirs["optimizer"] is not None:
        diff = optimizer_difference(json.loads(json.dumps(mine["optimizer"])), theirs["optimizer"], info.who(0))
        if diff:
            raise ConfigError(f"{info.who()}'s optimizer differs from {info.who(0)}'s: {diff}")
