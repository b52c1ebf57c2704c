"""N ranks' compressors in one process, in lockstep: the reference a regime's compressed exchange must match.

:func:`exchange` runs one bucket's step through ``comps`` (one compressor per simulated rank) as every
regime does, round by round: summable payloads added elementwise in rank order in at least float32,
gather-only payloads handed over as the list of every rank's. Returns each rank's aggregate. Tests use it
for closed forms (no process, no socket) and as the oracle of multi-process runs.

``per_hop=True`` adds float16/bfloat16 payloads as a ring does when it sums them per hop
(:func:`ring_per_hop_sum`) instead of in rank order.
"""

from __future__ import annotations

from typing import Any

import torch

from commlab.compress.base import Compressor
from commlab.compress.seam import by_dtype, summed

NARROW = (torch.float16, torch.bfloat16)


def ring_per_hop_sum(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The sum of N flat narrow tensors as a ring adds them per hop: segment s (elements [s n/N, (s+1) n/N),
    rounded down) starts at rank s as it was sent; rank s+1, then s+2, ... each adds its own value to what
    arrived, in float32, and rounds the partial once to the dtype; the last one's is the result."""
    N, n = len(per_rank), per_rank[0].numel()
    out = torch.empty_like(per_rank[0])
    for s in range(N):
        lo, hi = s * n // N, (s + 1) * n // N
        w = per_rank[s][lo:hi]
        for k in range(1, N):
            w = (per_rank[(s + k) % N][lo:hi].float() + w.float()).to(w.dtype)
        out[lo:hi] = w
    return out


def combine(copies: list[list[torch.Tensor]], per_hop: bool) -> list[torch.Tensor]:
    """One summable round: each payload tensor summed over ranks (at least float32)."""
    sums: list = summed(copies)
    if per_hop:
        for group in by_dtype(copies[0]):
            if copies[0][group[0]].dtype in NARROW:
                flat = ring_per_hop_sum([torch.cat([p[i].reshape(-1) for i in group]) for p in copies]).float()
                offset = 0
                for i in group:
                    sums[i] = flat[offset:offset + sums[i].numel()].view(sums[i].shape)
                    offset += sums[i].numel()
    return sums


def exchange(comps: list[Compressor], key: int, xs: list[torch.Tensor], shapes,
             per_hop: bool = False) -> list[torch.Tensor]:
    payloads = [c.start(key, x, shapes) for c, x in zip(comps, xs)]
    for rnd in range(comps[0].rounds):
        copies = [[t.detach().clone() for t in p] for p in payloads]  # what travels: no aliasing of inputs
        combined: Any
        if comps[0].summable:
            combined = combine(copies, per_hop) if copies[0] else []
        else:
            combined = copies
        if rnd + 1 < comps[0].rounds:
            payloads = [c.advance(key, rnd + 1, combined) for c in comps]
    outs = [torch.empty_like(x) for x in xs]
    for c, out in zip(comps, outs):
        c.finish(key, combined, out)
    return outs
