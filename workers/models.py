"""Models, from a tiny MLP for tests to a communication-heavy 25M-parameter MLP."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def mlp(side: int, widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    prev = side * side
    for w in widths[:-1]:
        layers += [nn.Linear(prev, w), nn.ReLU()]
        prev = w
    layers.append(nn.Linear(prev, widths[-1]))
    return nn.Sequential(*layers)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


# name -> (input side, builder, what it is for)
MODELS: dict[str, tuple[int, Callable[[], nn.Module], str]] = {
    "tiny": (8, lambda: mlp(8, [32, 10]), "MLP 64-32-10 (2.4K params), for tests"),
    "mlp": (28, lambda: mlp(28, [1024, 1024, 10]), "MLP 784-1024-1024-10 (1.9M params)"),
    "mlp-25m": (64, lambda: mlp(64, [4096, 2048, 10]), "MLP 4096-4096-2048-10 (25M params), communication-heavy"),
    "cnn": (28, cnn, "2 conv + 2 linear layers (0.2M params)"),
}


def build_model(name: str, seed: int) -> tuple[nn.Module, int]:
    """The model (initialised from ``seed``) and the image side it expects."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    side, builder, _ = MODELS[name]
    torch.manual_seed(seed)
    return builder(), side
