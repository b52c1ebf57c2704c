"""N ranks' compressors in one process, in lockstep: the reference a regime's compressed exchange must match.

:func:`exchange` runs one bucket's step through ``comps`` (one compressor per simulated rank) as every
regime does, round by round: summable payloads added elementwise in rank order in at least float32,
gather-only payloads handed over as the list of every rank's. Returns each rank's aggregate. Tests use it
for closed forms (no process, no socket) and as the oracle of multi-process runs.
"""

from __future__ import annotations

from typing import Any

import torch

from commlab.compress.base import Compressor
from commlab.compress.seam import summed


def exchange(comps: list[Compressor], key: int, xs: list[torch.Tensor], shapes) -> list[torch.Tensor]:
    payloads = [c.start(key, x, shapes) for c, x in zip(comps, xs)]
    for rnd in range(comps[0].rounds):
        copies = [[t.detach().clone() for t in p] for p in payloads]  # what travels: no aliasing of inputs
        combined: Any
        if comps[0].summable:
            combined = summed(copies) if copies[0] else []
        else:
            combined = copies
        if rnd + 1 < comps[0].rounds:
            payloads = [c.advance(key, rnd + 1, combined) for c in comps]
    outs = [torch.empty_like(x) for x in xs]
    for c, out in zip(comps, outs):
        c.finish(key, combined, out)
    return outs
