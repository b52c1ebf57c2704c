"""Optimizer specification shared by workers and parameter servers.

The spec is plain data so it can cross the wire in a msgpack header: a
parameter server builds the very same ``torch.optim`` optimizer over its flat
shard that an all-reduce worker builds over its model, which is what makes the
two reproduce each other to rounding error.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, fields

import torch

from commlab.base.config import check_number
from commlab.base.errors import ConfigError

OPTIMIZERS = ("sgd", "adam")


def warm_up(autograd: bool = True) -> None:
    """Pay now what a process's first optimizer (and first backward) pays once: every ``torch.optim`` constructor
    imports ``torch._dynamo`` the first time (0.9 s here uncapped, about 2 s under the chaos case's 0.45 CPU cap),
    and autograd starts its engine at the first backward. A spare calls it while idle (commlab.launch.spare), a
    new backup shard before it takes its primary's state, which the primary's replies wait for
    (servers.replication). On a throwaway parameter: no random numbers drawn, nothing of the user's touched."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    if autograd:
        torch.nn.functional.linear(p.view(1, 2), p.view(1, 2)).sum().backward()
    else:
        p.grad = torch.ones(2)
    opt.step()


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.name!r}; known: {list(OPTIMIZERS)}")
        check_number("learning rate", self.lr, gt=0)
        for name in ("momentum", "weight_decay", "eps"):
            check_number(name, getattr(self, name), ge=0)
        for name in ("beta1", "beta2"):
            check_number(name, getattr(self, name), ge=0, lt=1)

    def build(self, params) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.Adam(params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                                weight_decay=self.weight_decay)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "OptimizerSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"optimizer spec has unknown field(s) {sorted(unknown)}")
        return cls(**data)


def torch_optimizer(name: str) -> type[torch.optim.Optimizer] | None:
    """The torch.optim class a description names (``torch.optim.adamw.AdamW``), or None: only torch.optim's
    own classes, looked up by name; nothing is imported or unpickled."""
    cls = getattr(torch.optim, name.rsplit(".", 1)[-1], None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) \
            and f"{cls.__module__}.{cls.__qualname__}" == name:
        return cls
    return None


def check_hyper(class_name: str, hyper: dict, where: str) -> None:
    """Raise :class:`ConfigError` naming ``where`` and the key unless every hyperparameter in ``hyper`` (from
    the wire) has the kind its default has in the optimizer's signature: a finite number (``lr`` always),
    a list of as many finite numbers as a default tuple (``betas``), a bool. A class that is not
    torch.optim's is checked for ``lr`` alone."""
    cls = torch_optimizer(class_name)
    defaults = {"lr": 0.0}
    if cls is not None:
        defaults.update((k, p.default) for k, p in inspect.signature(cls).parameters.items())
    for key, value in hyper.items():
        default, name = defaults.get(key), f"{where}'s {key}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r:.60}")
        elif isinstance(default, (int, float, torch.Tensor)):
            check_number(name, value)
        elif isinstance(default, tuple) and all(isinstance(d, (int, float)) for d in default):
            if not (isinstance(value, (list, tuple)) and len(value) == len(default)):
                raise ConfigError(f"{name} must be {len(default)} numbers, got {value!r:.60}")
            for v in value:
                check_number(name, v)
