"""What ranks (and servers) compare before training: the model's parameters and the optimizer.

Both are plain data (names, shapes, dtypes; the optimizer's class and each param group's
parameter names and hyperparameters), so they cross the rendezvous store or a msgpack
header as they are, and a server can check them without importing any model code.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import nn

from commlab.base.errors import ConfigError

Manifest = list  # [(name, shape tuple, dtype name)]


def model_manifest(model: nn.Module) -> Manifest:
    """(name, shape, dtype) of every trainable parameter, in registration order."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()
            if p.requires_grad]


def manifest_difference(mine: list, theirs: list, who: str) -> str | None:
    """First difference between two manifests, in words, or None if equal."""
    if len(mine) != len(theirs):
        return f"{who} has {len(theirs)} trainable parameters, this rank has {len(mine)}"
    for (n1, s1, d1), (n2, s2, d2) in zip(mine, theirs):
        if n1 != n2:
            return f"parameter {n1!r} here is {n2!r} on {who}"
        if tuple(s1) != tuple(s2) or d1 != d2:
            return f"parameter {n1!r} is {d1}{list(s1)} here but {d2}{list(s2)} on {who}"
    return None


def _plain(value: Any) -> tuple[bool, Any]:
    """(is plain data, the value as msgpack/JSON-able data). One-element tensors (a capturable
    optimizer's lr) count as their number; anything else that is not a number, string, bool,
    None or a list of those (callables, objects) is not part of the description."""
    if value is None or isinstance(value, (bool, str)):
        return True, value
    if isinstance(value, numbers.Integral):
        return True, int(value)
    if isinstance(value, numbers.Real):
        return True, float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return True, value.item()
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if all(ok for ok, _ in items):
            return True, [v for _, v in items]
    return False, None


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """The optimizer as data: ``{"class": "torch.optim.adamw.AdamW", "groups": [{"params": [names],
    "hyper": {"lr": ..., "weight_decay": ..., ...}}]}``.

    Raises :class:`ConfigError` when the optimizer holds a tensor that is not one of ``model``'s
    parameters (an exchanger only makes the model's parameters consistent: anything else would
    silently diverge between ranks).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ConfigError(f"the optimizer's param group {gi} holds a tensor {str(p.dtype).removeprefix('torch.')}{list(p.shape)} that is "
                                  f"not a parameter of the model given to setup(); build the optimizer over "
                                  f"model.parameters() (or groups of them)")
            params.append(name)
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            ok, data = _plain(value)
            if ok:
                hyper[key] = data
        groups.append({"params": params, "hyper": hyper})
    return {"class": optimizer_class_name(optimizer), "groups": groups}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def optimizer_difference(mine: dict, theirs: dict, who: str) -> str | None:
    """First difference between two :func:`describe_optimizer` results, in words, or None."""
    if mine["class"] != theirs["class"]:
        return f"the optimizer is {mine['class']} here but {theirs['class']} on {who}"
    g1, g2 = mine["groups"], theirs["groups"]
    if len(g1) != len(g2):
        return f"the optimizer has {len(g1)} param group(s) here but {len(g2)} on {who}"
    for i, (a, b) in enumerate(zip(g1, g2)):
        if a["params"] != b["params"]:
            if len(a["params"]) != len(b["params"]):
                return f"param group {i} holds {len(a['params'])} parameters here but {len(b['params'])} on {who}"
            j = next(j for j, (x, y) in enumerate(zip(a["params"], b["params"])) if x != y)
            return f"param group {i}'s parameter {j} is {a['params'][j]!r} here but {b['params'][j]!r} on {who}"
        for key in sorted(set(a["hyper"]) | set(b["hyper"])):
            if key not in a["hyper"] or key not in b["hyper"]:
                where = "here" if key in a["hyper"] else f"on {who}"
                return f"param group {i} has hyperparameter {key!r} only {where}"
            if not _same(a["hyper"][key], b["hyper"][key]):
                return (f"param group {i}'s {key} is {a['hyper'][key]!r} here but {b['hyper'][key]!r} "
                        f"on {who}")
    return None
