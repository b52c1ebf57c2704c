"""The training data: a real, small data set shipped in the repo, sharded deterministically.

Sample order is a stream of per-epoch permutations fixed by the seed. Global
step ``t`` takes the next ``world_size * batch_size`` samples of that stream;
rank ``r`` trains on slice ``[r*B, (r+1)*B)`` of them. One worker with batch
``N*B`` therefore sees exactly the union of what N workers with batch ``B``
see, which is what makes the single-process reference step comparable.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DIGITS = Path(__file__).with_name("data") / "digits.csv.gz"
TEST_FRACTION = 1 / 6


@dataclass(frozen=True)
class Dataset:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    seed: int

    def global_indices(self, step: int, global_batch: int) -> torch.Tensor:
        """Indices of the samples global step ``step`` trains on, in rank order."""
        n = len(self.train_y)
        start, out = step * global_batch, list[int]()
        while len(out) < global_batch:
            epoch, pos = divmod(start + len(out), n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            out.extend(perm[pos: pos + global_batch - len(out)].tolist())
        return torch.tensor(out)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.global_indices(step, world_size * batch_size)[rank * batch_size:(rank + 1) * batch_size]
        return self.train_x[idx], self.train_y[idx]


def load_digits(side: int, seed: int) -> Dataset:
    """Digits as 1 x side x side float images in [0, 1], split into train and test."""
    with gzip.open(DIGITS, "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(raw[:, :64]).reshape(-1, 1, 8, 8) / 16.0
    y = torch.from_numpy(raw[:, 64]).long()
    if side != 8:
        x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))  # fixed split, any seed
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train].contiguous(), y[train], x[test].contiguous(), y[test], seed)
