"""When talking rarely pays: local steps' (``sync_every=H``, docs/localsteps.md) step time and utilization at a link
rate, from the same cost model, and the link rate below which they beat a synchronous (or compressed) step.

A local step is the step with no exchange at all (``inner``: forward, backward, the optimizer; what the bench
calls the H = infinity step). Every H steps each of the P fragments syncs once: one all-reduce of its float32
pseudo-gradient (or, under ``compress=``, the compressor's rounds on the fragment's share of the model: its
measured wire bytes, encode and decode scaled by that share), then the outer step over it (costed as the
optimizer's per byte). With ``overlap=T`` the exchange runs during the next T inner steps, so only what the link
takes beyond them is exposed::

    inner      = (fwd + bwd) x batch x compute_scale + param bytes x opt
    E_p        = T_allreduce(4 n_p)                  (compressed: the rounds' times on the fragment's share)
    exposed_p  = max(0, E_p - T x inner) + encode/decode_p + outer_p
    step       = inner + sum_p exposed_p / H         (the mean over the H steps)
    utilization = inner / step

``max(0, E_p - T x inner)`` is the bound the issue names (the part of a fragment's exchange no overlap hides).
The crossover (:func:`beats_below`) is the link rate below which this mean step is shorter than another
regime's step (:func:`commlab.plan.compression.step`: synchronous, or compressed such as PowerSGD): a step-time
comparison only, not a quality one (H steps apart, the model is not the synchronous run's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from commlab.core.localsteps import fragments
from commlab.plan import compression as K
from commlab.plan.costmodel import Calibration, CompressorCost, Regime, Topology, ring_bytes_per_rank
from commlab.plan.simulate import allreduce_bucket_time


@dataclass(frozen=True)
class LocalSteps:
    """The local-steps settings the planner models: ``sync_every=H``, ``fragments=P``, ``overlap=T``, the
    pseudo-gradient's compressor (None: float32) and ``fragment_by``."""

    H: int
    P: int = 1
    T: int = 0
    cost: CompressorCost | None = None
    by: str = "tensors"

    @property
    def label(self) -> str:
        extra = (f", P={self.P}" if self.P > 1 else "") + (" (slices)" if self.by == "slices" else "") \
            + (f", T={self.T}" if self.T else "")
        return f"H={self.H}{extra}" + (f", {self.cost.label}" if self.cost is not None else "")


def inner_s(cal: Calibration, topo: Topology, batch: int | None = None) -> float:
    """The step with no exchange: forward, backward (stretched by ``compute_scale``) and the optimizer."""
    c = cal.compute
    return (c.fwd_s_per_sample + c.bwd_s_per_sample) * (batch or c.batch) * topo.compute_scale \
        + c.param_bytes * cal.opt_s_per_byte


def fragment_elements(cal: Calibration, parts: int, by: str = "tensors") -> list[int]:
    """Elements of each fragment, by the exchanger's own rule (:func:`commlab.core.localsteps.fragments`, or with
    ``by="slices"`` :func:`~commlab.core.localsteps.slices`: torch.tensor_split's sizes of every tensor)."""
    numels = [math.prod(shape) for _, shape, _ in cal.compute.manifest]
    if not numels:  # a calibration without a manifest: its buckets, as whole tensors
        numels = [b.nbytes // 4 for b in cal.compute.buckets]
    if by == "slices":
        return [sum(n // parts + (p < n % parts) for n in numels) for p in range(parts)]
    return [sum(numels[i] for i in idx) for idx in fragments([n * 4 for n in numels], parts)]


def predict(cal: Calibration, ls: LocalSteps, regime: Regime, topo: Topology, n: int,
            batch: int | None = None) -> dict:
    """Local steps' mean step (seconds), utilization, the exposed time and bound per fragment, and the bytes a
    rank sends per step (the mean over H), for ``n`` identical workers at ``topo.nic_bps``."""
    inner = inner_s(cal, topo, batch)
    elements = fragment_elements(cal, ls.P, ls.by)
    total = sum(elements) or 1
    exposed, bounds, sent = [], [], 0.0
    for numel in elements:
        size = 4 * numel
        if ls.cost is None:
            link = allreduce_bucket_time(size, n, topo, regime, cal)
            work = 0.0
            sent += ring_bytes_per_rank(size, n)
        else:
            share = numel / total
            rounds = max(len(ms) for ms in ls.cost.moves)
            link = 0.0
            for r in range(rounds):
                move = next(ms[r] for ms in ls.cost.moves if len(ms) > r)
                wire = share * sum(ws[r] for ws in ls.cost.wire_bytes if len(ws) > r)
                link += K._round_time(move, int(wire), n, topo, regime, cal)
            work = K.encode_decode_s(ls.cost, n) * share * topo.compute_scale
            sent += K.bytes_per_step(ls.cost, n) * share
        bound = max(0.0, link - ls.T * inner)
        bounds.append(bound)
        exposed.append(bound + work + size * cal.opt_s_per_byte)
    step = inner + sum(exposed) / ls.H
    return {"settings": ls.label, "inner_s": inner, "step_s": step, "utilization": inner / step,
            "exposed_per_sync_s": exposed, "bound_s": bounds, "bytes_per_step": sent / ls.H,
            "link_bps": topo.nic_bps, "world": n}


def beats_below(cal: Calibration, ls: LocalSteps, regime: Regime, topo: Topology, n: int,
                against: CompressorCost | None = None, batch: int | None = None) -> float:
    """The link rate (bytes/s) below which local steps' mean step is shorter than ``regime``'s step compressed
    by ``against`` (None: synchronous, uncompressed): ``inf`` at every rate up to 10 Tbyte/s, 0 at none down to
    1 kbyte/s (:func:`commlab.plan.compression.highest_rate`)."""
    def pays(rate: float) -> bool:
        at = replace(topo, nic_bps=rate)
        return predict(cal, ls, regime, at, n, batch)["step_s"] < K.step(cal, against, regime, at, n, batch)

    return K.highest_rate(pays)


def section(cal: Calibration, settings: list[LocalSteps], regime: Regime, topo: Topology, workers: list[int],
            against: list[str], batch: int | None = None) -> tuple[list[str], dict]:
    """The plan's "Local steps" section (markdown) and the predictions behind it: per N and setting, the mean
    step and utilization at the user's link, and the link rate below which it beats the synchronous step and
    each compressor in ``against`` that the calibration holds."""
    others = [s for s in against if s in cal.compressors]
    head = [f"### Local steps ({regime.url})", "",
            "Each setting's mean step at this link (the step with no exchange, plus each fragment's sync beyond "
            "what its overlap hides, spread over H) and its utilization (no-exchange step / mean step); \"beats "
            "below\": the link rate under which its mean step is shorter than the synchronous one's, or a "
            "compressor's (step time only, not quality; docs/plan.md#local-steps).", "",
            "| N | setting | mean step | utilization | exposed per H | bytes per step | beats sync below |"
            + "".join(f" beats {s} below |" for s in others),
            "|---|---|---|---|---|---|---|" + "---|" * len(others)]
    data: dict = {}
    for n in workers:
        data[n] = {}
        for ls in settings:
            x = predict(cal, ls, regime, topo, n, batch)
            x["beats_sync_below_bps"] = beats_below(cal, ls, regime, topo, n, None, batch)
            x["beats_below_bps"] = {s: beats_below(cal, ls, regime, topo, n, cal.compressors[s], batch) for s in others}
            data[n][ls.label] = x
            cells = [K.fmt_rate(x["beats_sync_below_bps"])] + [K.fmt_rate(x["beats_below_bps"][s]) for s in others]
            head.append(f"| {n} | {ls.label} | {K._fmt_s(x['step_s'])} | {x['utilization']:.1%} | "
                        f"{K._fmt_s(sum(x['exposed_per_sync_s']))} | {x['bytes_per_step'] / 2**20:.3g} MiB | "
                        + " | ".join(cells) + " |")
    return head + [""], data
