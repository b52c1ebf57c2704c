"""Optimizer specification shared by workers and parameter servers.

The spec is plain data so it can cross the wire in a msgpack header: a
parameter server builds the very same ``torch.optim`` optimizer over its flat
shard that an all-reduce worker builds over its model, which is what makes the
two reproduce each other to rounding error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from commlab.errors import ConfigError

OPTIMIZERS = ("sgd", "adam")


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
        if not self.lr > 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")

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
