"""When compression pays: each compressor's bytes and compute on the user's model, a compressed step's time at
a link rate, and the rate below which it beats the uncompressed exchange.

**What a compressor costs** (:func:`measure`, on this CPU, one thread and its CPU time as
:func:`~commlab.plan.calibrate.measure_compute`, big freed blocks kept in the heap as a worker's exchanger
keeps them, :mod:`commlab.core.heap`): the model's own buckets (commlab's bucketing, with their presence flags)
go through the real seam (:func:`commlab.compress.seam.start_compressed`) and the real compressor, with
error feedback, for N simulated ranks that are all this one (a mover whose sums and gathers are done when
issued: the wire is the cost model's part). Per bucket and round: what the regime moves (sum or gather, by
the seam's own rule and the regime's declared sums; the bytes: the compressor's closed form,
:meth:`~commlab.compress.base.Compressor.payload_nbytes`, plus the presence flags in round 0), the encode
time (round 0: ``start``, in the backward hook; round r: ``advance``) and the decode time (``finish`` and
error feedback). Timed after the compressor's uncompressed warm-up (``start_iter``), median of ``reps``
steps.

**A compressed step** (all-reduce regimes: commlab's ring, gloo; identical workers), one communication
thread serving buckets in the order they are issued::

    bucket b ready   r_b = fwd + bwd x ready_frac[b] + enc0[0..b-1]   (earlier hooks' encoding delays backward)
    round 0 issued   r_b + enc0[b]; sent when the thread is free: end0[b] = max(issued, free) + T(round 0)
    backward ends    c = fwd + bwd + sum(enc0)
    later rounds     for b, then r = 1 .. R-1: t = max(t, end[r-1][b]) + enc_r[b]; end_r[b] = max(t, free) + T
    decode           for b: t = max(t, end[R-1][b]) + dec[b]       (gathered rounds: dec x N / N_measured)
    step             max(t + the optimizer over the parameters, the CPU bound)
    CPU bound        (fwd + bwd + every round's encoding + decoding + the optimizer) / cpu_share

    T(sum of P bytes)    = the ring all-reduce, 2(N-1)(alpha + ceil(P/N) beta)      sends 2(N-1)/N x P
    T(gather of P bytes) = the ring all-gather, (N-1)(alpha + P beta)              sends (N-1) x P

with ``beta = max(transport's own, 1 / link rate)`` (:mod:`commlab.plan.costmodel`). ``cpu_share``
(:class:`~commlab.plan.costmodel.Topology`, measured by :func:`commlab.plan.calibrate.cpu_share`) is the share
of a core a worker gets while all workers compute on a machine that runs other work too: the path above
assumes a core whenever the worker computes, which holds for a worker that mostly waits on the link (the
scheduler serves a process that slept at once) but not for one that computes throughout, as a compressed
step does; that one gets its fair share, so its step is at least its CPU time over the share. Uncompressed (one
summed round of the whole bucket, nothing to encode) this is :func:`commlab.plan.simulate.simulate`'s
all-reduce step. PowerSGD's second round waits for the first's sum: its latency is paid twice, after
backward. **The crossover** of a compressor is the link rate below which its predicted step is shorter than
the uncompressed one: the root of ``compressed(B) = uncompressed(B)``, found on a log grid of rates and
refined by bisection; ``inf`` where it pays at any rate (the transport's own per-byte cost is the limit),
``0`` where it never does.
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
from dataclasses import replace
from typing import cast
from urllib.parse import urlencode

import torch
from torch import nn

from commlab.compress import seam
from commlab.compress.base import Compressor, build
from commlab.base.config import ExchangerURL
from commlab.base.errors import ConfigError
from commlab.core.exchanger import make_buckets
from commlab.base.handles import DoneHandle
from commlab.core.heap import keep_freed_gradients, release_freed_memory
from commlab.plan.calibrate import cpu_clock
from commlab.plan.rates import parse_rate
from commlab.plan.costmodel import (BUILTIN_COMPRESSORS, PLANNED_OPTIONS, Calibration, Compute, CompressorCost,
                                    Regime, Topology, parse_regime)
from commlab.plan.simulate import allgather_time, allreduce_bucket_time
from commlab.core.registry import regime_class

BUILTIN = BUILTIN_COMPRESSORS  # what `commlab plan` weighs unless told (commlab.plan.costmodel)
MBIT, GBIT = 1e6 / 8, 1e9 / 8  # bytes per second
WIDE = ("float32", "float64")


# ----- measuring -----------------------------------------------------------------------------------
class _AllMe:
    """The seam's mover for N ranks that are all this one: sums and gathers are done when issued (a sum
    leaves the tensor as it is; a gather returns it N times), so what is timed is the compressor and the
    seam, never a wire."""

    def __init__(self, world: int, sums: tuple[str, ...]):
        self.world_size, self.sums = world, sums

    def allreduce_async(self, tensor: torch.Tensor, what: str = "sum") -> DoneHandle:
        return DoneHandle(None, what)

    def allreduce_per_hop_async(self, tensor: torch.Tensor, what: str = "sum per hop") -> DoneHandle:
        return DoneHandle(None, what)

    def allgather_async(self, tensor: torch.Tensor, what: str = "gather") -> DoneHandle:
        return DoneHandle([tensor] * self.world_size, what)

    def sums_exactly(self, dtype: torch.dtype) -> bool:
        return str(dtype).removeprefix("torch.") in self.sums and dtype.itemsize >= 4

    def sums_per_hop(self, dtype: torch.dtype) -> bool:
        return str(dtype).removeprefix("torch.") in self.sums and dtype.itemsize < 4


class _Timed:
    """``inner`` (a compressor) with its ``advance`` timed and, per bucket and round, how the seam moves
    what it hands the regime and how many bytes (:func:`_how`: taken as each payload is made, so no payload
    outlives its round; ``untimed_s`` adds up the seconds that took, which no timing may count); everything
    else is ``inner``'s own. ``flags``: each bucket's presence flags, which round 0 carries."""

    def __init__(self, inner: Compressor, mover, flags: dict[int, torch.Tensor]):
        self.inner, self.mover, self.flags = inner, mover, flags
        self.advance_s: dict[tuple[int, int], float] = {}
        self.moves: dict[tuple[int, int], tuple[str, int]] = {}
        self.untimed_s = 0.0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _note(self, key, rnd, payload, flags) -> None:
        t0 = cpu_clock()
        self.moves[key, rnd] = _how(self.inner, payload, flags, self.mover)
        self.untimed_s += cpu_clock() - t0

    def start(self, key, x, shapes):
        payload = self.inner.start(key, x, shapes)
        self._note(key, 0, payload, self.flags[key])
        return payload

    def advance(self, key, rnd, combined):
        t0 = cpu_clock()
        payload = self.inner.advance(key, rnd, combined)
        self.advance_s[key, rnd] = cpu_clock() - t0
        self._note(key, rnd, payload, None)
        return payload


def exchange_buckets(compute: Compute, which: range | None = None):
    """The model's buckets (those ``which`` numbers, else all) as a regime holds them
    (:func:`commlab.core.exchanger.make_buckets`, presence flags included), from the calibration's parameter
    lists; gradients zero."""
    out = []
    for b in which if which is not None else range(len(compute.buckets)):
        bucket = compute.buckets[b]
        # the parameters give make_buckets their names, shapes and dtype, never their values: one element each,
        # expanded (no 100 MB of parameters beside the 25M model's buckets)
        named = [(name, nn.Parameter(torch.empty(1, dtype=getattr(torch, dtype)).expand(shape), requires_grad=False))
                 for name, shape, dtype in reversed(bucket.params)]  # make_buckets reverses them again
        (one,) = make_buckets(named, 2**62, carry_presence=True)
        out.append(replace(one, index=b))
    return out


def regime_sums(regime: Regime) -> tuple[str, ...]:
    """The dtypes ``regime`` sums in float32 or wider: exactly at their own width (its class's
    ``sums_exactly``) or per hop (``sums_per_hop``, a ring's half types), each a property of the regime, not
    of a connection (a static method). Without that declaration: float32 and float64 exactly, nothing per hop."""
    cls = regime_class(regime.url.split(":", 1)[0])
    out = []
    for d in ("float16", "bfloat16", "float32", "float64"):
        for ability, default in (("sums_exactly", d in WIDE), ("sums_per_hop", False)):
            declared = inspect.getattr_static(cls, ability, None)
            if declared.__func__(getattr(torch, d)) if isinstance(declared, staticmethod) else default:
                out.append(d)
                break
    return tuple(out)


def measure(compute: Compute, spec: str, ef: bool = True, world: int = 2, sums: tuple[str, ...] = WIDE,
            reps: int = 3, threads: int = 1, seed: int = 0) -> CompressorCost:
    """Time ``spec`` (a ``compress=`` value) on ``compute``'s buckets; see the module's text. Blocks for the
    compressor's warm-up steps plus ``reps`` steps per bucket, one thread. A bad spec raises
    :class:`ConfigError` naming ``compress``.

    Each bucket is measured on its own (a compressor of its own, warmed up on that bucket alone): a
    compressor's state and temporaries are per bucket, and one bucket's at a time (with the heap's freed
    memory handed back between them) keep the peak at the largest bucket's, not the model's (docs/plan.md)."""
    if build(spec, ef) is None:
        raise ConfigError(f"option 'compress': {spec!r} is the uncompressed exchange, the baseline: nothing to measure")
    per = []
    for b in range(len(compute.buckets)):
        per.append(_measure_bucket(compute, b, spec, ef, world, sums, reps, threads, seed))
        gc.collect()  # the compressor's state and its exchanges hold one another
        release_freed_memory()
    med = lambda xs: statistics.median(xs) if xs else 0.0
    return CompressorCost(spec, ef, world, tuple(sums), tuple(tuple(m for m, _ in mv) for _, _, mv in per),
                          tuple(tuple(n for _, n in mv) for _, _, mv in per),
                          tuple(tuple(med(x) for x in enc) for enc, _, _ in per), tuple(med(dec) for _, dec, _ in per))


def _measure_bucket(compute: Compute, b: int, spec: str, ef: bool, world: int, sums: tuple[str, ...], reps: int,
                    threads: int, seed: int) -> tuple[list[list[float]], list[float], tuple]:
    """Bucket ``b`` alone through a fresh ``spec``: (encode seconds per round, decode seconds, per step past the
    warm-up; how each round moves and its bytes)."""
    comp = cast(Compressor, build(spec, ef))
    comp.bind(world)
    mover = _AllMe(world, sums)
    (bk,) = exchange_buckets(compute, range(b, b + 1))
    timed = _Timed(comp, mover, {bk.index: bk.flags})
    keep_freed_gradients(bk.params)  # as a worker's exchanger does (heap=keep)
    g = torch.Generator().manual_seed(seed + b)
    bk.grads.copy_(torch.randn(bk.numel, generator=g))  # once: what the compressor leaves is gradients as good
    nr = comp.rounds
    enc: list[list[float]] = [[] for _ in range(nr)]
    dec: list[float] = []
    state = seam.CompressState(cast(Compressor, timed))
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(comp.warmup_steps + reps):
            timed.advance_s.clear()
            bk.flags.fill_(1)
            t0, untimed = cpu_clock(), timed.untimed_s
            h = seam.start_compressed(state, bk, mover, f"bucket {bk.index}", True)
            t1, untimed1, before = cpu_clock(), timed.untimed_s, sum(timed.advance_s.values())
            enc[0].append(t1 - t0 - (untimed1 - untimed))
            h.wait(600.0)
            dec.append(cpu_clock() - t1 - (sum(timed.advance_s.values()) - before) - (timed.untimed_s - untimed1))
            del h
            for (_, r), sec in timed.advance_s.items():
                enc[r].append(sec)
            if step < comp.warmup_steps:
                enc, dec = [[] for _ in range(nr)], []
        moves = tuple(timed.moves[bk.index, r] for r in range(nr))
    finally:
        torch.set_num_threads(old_threads)
    return enc, dec, moves


def _how(comp: Compressor, payload: list[torch.Tensor], flags: torch.Tensor | None, mover) -> tuple[str, int]:
    """(how the seam moves this round, the bytes of the tensor it hands the regime)."""
    tensors = list(payload) + ([flags] if flags is not None and flags.numel() else [])
    if not tensors or sum(t.numel() for t in tensors) == 0:
        return "none", 0
    return seam.how(comp, tensors, mover), seam.nbytes(tensors)


def with_compressors(cal: Calibration, specs, regime: Regime, world: int = 2, ef: bool = True,
                     reps: int = 3) -> Calibration:
    """``cal`` with every spec in ``specs`` measured for ``regime`` (those measured already for the same
    sums are kept)."""
    sums = regime_sums(regime)
    label = lambda s: s if ef else f"{s} (ef=0)"
    todo = [s for s in specs if label(s) not in cal.compressors or cal.compressors[label(s)].sums != sums]
    costs = []
    for s in todo:
        costs.append(measure(cal.compute, s, ef, world, sums, reps))
        gc.collect()  # the compressor's state and its exchanges hold one another
        release_freed_memory()  # each compressor's buffers go before the next one's come (docs/plan.md)
    return cal.with_compressors(*costs)


# ----- predicting ------------------------------------------------------------------------------------
def _flags_bytes(bucket) -> int:
    return len(bucket.params) * getattr(torch, bucket.params[0][2]).itemsize if bucket.params else 0


def _baseline(compute: Compute) -> CompressorCost:
    """The uncompressed exchange as a 'compressor': each bucket (with its flags) summed in one round."""
    b = compute.buckets
    return CompressorCost("none", False, 1, WIDE, tuple(("sum",) for _ in b),
                          tuple((x.nbytes + _flags_bytes(x),) for x in b), tuple((0.0,) for _ in b),
                          tuple(0.0 for _ in b))


def _round_time(move: str, nbytes: int, n: int, topo: Topology, regime: Regime, cal: Calibration) -> float:
    if move == "sum":
        return allreduce_bucket_time(nbytes, n, topo, regime, cal)
    if move == "gather":
        return allgather_time(nbytes, n, topo, regime, cal)
    return 0.0


def _decode_s(cost: CompressorCost, b: int, n: int) -> float:
    return cost.decode_s[b] * (n / cost.world if "gather" in cost.moves[b] else 1.0)


def step(cal: Calibration, cost: CompressorCost | None, regime: Regime, topo: Topology, n: int,
         batch: int | None = None) -> float:
    """The predicted step (seconds) of ``n`` identical workers under all-reduce ``regime``, compressed by
    ``cost`` (None: uncompressed); see the module's text. ``topo.compute_scale`` stretches the worker's CPU
    work: forward, backward, encoding and decoding (the optimizer stays as measured, as in the simulator).
    ``topo.cpu_share`` bounds the step from below by the worker's CPU time (that work and the optimizer)
    over the share of a core it gets while every worker computes."""
    if regime.kind != "allreduce":
        raise ConfigError(f"plan: compression is modelled for all-reduce regimes (ring://, allreduce://), "
                          f"not {regime.url}")
    c = cal.compute
    cost = cost or _baseline(c)
    batch = batch or c.batch
    k = topo.compute_scale
    fwd, bwd = c.fwd_s_per_sample * batch * k, c.bwd_s_per_sample * batch * k
    T = [[_round_time(m, w, n, topo, regime, cal) for m, w in zip(ms, ws)] for ms, ws in zip(cost.moves, cost.wire_bytes)]
    end = [[0.0] * len(t) for t in T]
    free, hooks = 0.0, 0.0
    for b, bucket in enumerate(c.buckets):
        issued = fwd + bwd * bucket.ready_frac + hooks + cost.encode_s[b][0] * k
        hooks += cost.encode_s[b][0] * k
        free = end[b][0] = max(issued, free) + T[b][0]
    t = fwd + bwd + hooks
    for b in range(len(T)):
        for r in range(1, len(T[b])):
            t = max(t, end[b][r - 1]) + cost.encode_s[b][r] * k
            free = end[b][r] = max(t, free) + T[b][r]
    for b in range(len(T)):
        t = max(t, end[b][-1]) + _decode_s(cost, b, n) * k
    return max(t + c.param_bytes * cal.opt_s_per_byte, step_cpu_s(cal, cost, n, batch, k) / topo.cpu_share)


def step_cpu_s(cal: Calibration, cost: CompressorCost | None, n: int, batch: int | None = None,
               compute_scale: float = 1.0) -> float:
    """A worker's CPU time per step (``cost`` None: uncompressed): forward, backward, every round's encoding
    and decoding (stretched by ``compute_scale``) and the optimizer."""
    c = cal.compute
    batch = batch or c.batch
    work = (c.fwd_s_per_sample + c.bwd_s_per_sample) * batch + (encode_decode_s(cost, n) if cost else 0.0)
    return work * compute_scale + c.param_bytes * cal.opt_s_per_byte


def step_overhead(cal: Calibration, measured_s: float, batch: int | None = None, compute_scale: float = 1.0) -> float:
    """A run's per-step overhead beyond the model: ``measured_s``, the "step − wait" of the run's uncompressed
    step (what a worker does besides waiting on the exchange), less the calibrated forward, backward and
    optimizer. It is the step's own mechanics (copying gradients into buckets, zero_grad, the loss, the
    data) and, on a shared machine, what the calibration's single process did not see (two workers' memory
    traffic on the same cores); a compressed step pays it too, so :func:`predict`'s ``overhead_s`` adds it
    to both steps (the crossover does not move)."""
    c = cal.compute
    batch = batch or c.batch
    return measured_s - (c.fwd_s_per_sample + c.bwd_s_per_sample) * batch * compute_scale - c.param_bytes * cal.opt_s_per_byte


def bytes_per_step(cost: CompressorCost, n: int) -> int:
    """Bytes each rank sends per step: a sum round 2(N-1)/N of its tensor, a gathered one (N-1) x it (the
    exchangers' own count, ``StepReport.bytes_sent``)."""
    total = 0
    for ms, ws in zip(cost.moves, cost.wire_bytes):
        for m, w in zip(ms, ws):
            total += 2 * (n - 1) * w // n if m == "sum" else (n - 1) * w if m == "gather" else 0
    return total


def crossover(cal: Calibration, cost: CompressorCost, regime: Regime, topo: Topology, n: int,
              batch: int | None = None, lo: float = 1e3, hi: float = 1e13) -> float:
    """The link rate (bytes/s) below which ``cost``'s compressor makes the step shorter than uncompressed:
    ``inf`` if it does at every rate up to ``hi``, 0 if at none down to ``lo``. Where the sign of the
    difference changes more than once on the grid, the highest rate at which it still pays."""
    def pays(rate: float) -> bool:
        at = replace(topo, nic_bps=rate)
        return step(cal, cost, regime, at, n, batch) < step(cal, None, regime, at, n, batch)

    return highest_rate(pays, lo, hi)


def highest_rate(pays, lo: float = 1e3, hi: float = 1e13) -> float:
    """The link rate (bytes/s) below which ``pays(rate)`` holds: ``inf`` if it does at every rate up to ``hi``, 0
    if at none down to ``lo``; found on a log grid and refined by bisection. Where the sign changes more than once
    on the grid, the highest rate at which it still pays."""
    grid = [lo * (hi / lo) ** (i / 120) for i in range(121)]
    paying = [r for r in grid if pays(r)]
    if not paying:
        return 0.0
    top = max(paying)
    if top == grid[-1]:
        return math.inf
    a, b = top, grid[grid.index(top) + 1]  # pays at a, not at b
    for _ in range(60):
        mid = math.sqrt(a * b)
        a, b = (mid, b) if pays(mid) else (a, mid)
    return math.sqrt(a * b)


def _rate(link) -> float:
    return parse_rate(link) if isinstance(link, str) else float(link)


def predict(cal: Calibration, spec: str, link, world: int, regime: str | Regime = "ring://",
            workers_per_host: int = 1, batch: int | None = None, compute_scale: float = 1.0, ef: bool = True,
            overhead_s: float = 0.0, cpu_share: float = 1.0) -> dict:
    """The planner's prediction for ``compress=spec`` on ``cal``'s model at ``world`` workers, each host's NIC
    at ``link`` (bytes/s, or a tc rate such as ``'100mbit'``), ``workers_per_host`` to a host. Pure
    arithmetic: ``spec`` must be measured in ``cal`` already (:func:`with_compressors`), else
    :class:`ConfigError`; ``spec='none'`` gives the uncompressed step. Returns a dict::

        step_s, bytes_per_step                 the compressed step and the bytes a rank sends in it
        uncompressed_step_s, uncompressed_bytes_per_step
        bytes_ratio                            bytes_per_step / uncompressed_bytes_per_step
        encode_decode_s                        the step's compressor compute (all buckets, all rounds)
        pays                                   step_s < uncompressed_step_s
        crossover_bps                          the link rate (bytes/s) below which it pays (inf: any; 0: none)

    ``overhead_s``: a per-step overhead the model leaves out, added to both steps (:func:`step_overhead`
    measures it on a run's uncompressed step). ``cpu_share``: the share of a core each worker gets while all
    compute (:attr:`Topology.cpu_share <commlab.plan.costmodel.Topology>`).
    """
    reg = parse_regime(regime) if isinstance(regime, str) else regime
    return predict_at(cal, spec, reg, Topology(workers_per_host, _rate(link), compute_scale=compute_scale,
                                                cpu_share=cpu_share), world,
                      batch, ef, overhead_s)


def predict_at(cal: Calibration, spec: str, regime: Regime, topo: Topology, world: int, batch: int | None = None,
               ef: bool = True, overhead_s: float = 0.0) -> dict:
    """:func:`predict` on a whole :class:`Topology` (its ``nic_bps`` the link)."""
    cost = None
    if spec.strip().lower() not in ("", "none"):
        cost = cal.compressors.get(spec if ef else f"{spec} (ef=0)")
        if cost is None:
            raise ConfigError(f"plan: compress={spec} (ef={int(ef)}) is not in this calibration (it has: "
                              f"{', '.join(cal.compressors) or 'none'}); measure it with "
                              f"commlab.plan.compression.with_compressors")
    unc_s = step(cal, None, regime, topo, world, batch) + overhead_s
    unc_b = bytes_per_step(_baseline(cal.compute), world)
    out = {"spec": "none", "step_s": unc_s, "bytes_per_step": unc_b, "uncompressed_step_s": unc_s,
           "uncompressed_bytes_per_step": unc_b, "bytes_ratio": 1.0, "encode_decode_s": 0.0, "pays": False,
           "crossover_bps": None, "link_bps": topo.nic_bps, "world": world, "regime": regime.url}
    if cost is not None:
        s, nbytes = step(cal, cost, regime, topo, world, batch) + overhead_s, bytes_per_step(cost, world)
        out.update(spec=cost.label, step_s=s, bytes_per_step=nbytes, bytes_ratio=nbytes / unc_b if unc_b else 1.0,
                   encode_decode_s=encode_decode_s(cost, world) * topo.compute_scale, pays=s < unc_s,
                   crossover_bps=crossover(cal, cost, regime, topo, world, batch))
    return out


def parse_url(url: str) -> tuple[Regime, str, bool]:
    """(the planner's regime, the ``compress=`` spec, ``ef``) of an exchanger URL as the bench names its entries,
    e.g. ``ring://?compress=powersgd:4,start_iter=5&ef=0``; options the planner does not model (timeout,
    bucket_mb, host...) are left out of the regime."""
    u = ExchangerURL.parse(url)
    q = dict(u.query)
    keep: dict[str, str] = {k: v for k, v in q.items() if k in PLANNED_OPTIONS.get(u.scheme, ())}
    regime = parse_regime(f"{u.scheme}://" + ("?" + urlencode(keep) if keep else ""))
    return regime, q.get("compress", "none"), q.get("ef", "1").strip().lower() not in ("0", "false", "no", "off")


def with_urls(cal: Calibration, urls, world: int = 2, reps: int = 3) -> Calibration:
    """``cal`` with every compressor the exchanger ``urls`` name measured (each for its own regime)."""
    for url in urls:
        regime, spec, ef = parse_url(url)
        if spec.strip().lower() not in ("", "none"):
            cal = with_compressors(cal, [spec], regime, world, ef, reps)
    return cal


def predict_url(cal: Calibration, url: str, link, world: int, workers_per_host: int = 1, batch: int | None = None,
                compute_scale: float = 1.0, overhead_s: float = 0.0, cpu_share: float = 1.0) -> dict:
    """:func:`predict` for an exchanger URL (:func:`parse_url`); its compressor measured by :func:`with_urls`."""
    regime, spec, ef = parse_url(url)
    return predict(cal, spec, link, world, regime, workers_per_host, batch, compute_scale, ef, overhead_s,
                   cpu_share)


def encode_decode_s(cost: CompressorCost, n: int) -> float:
    return sum(sum(e) for e in cost.encode_s) + sum(_decode_s(cost, b, n) for b in range(len(cost.decode_s)))


# ----- reporting -------------------------------------------------------------------------------------
def fmt_rate(bps: float | None) -> str:
    """Bytes/s as a link rate in bits: '95.3 Mbit/s'; 'any rate' for inf, 'never' for 0."""
    if bps is None:
        return ""
    if math.isinf(bps):
        return "any rate"
    if bps <= 0:
        return "never"
    bits = bps * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def table(cal: Calibration, specs, regime: Regime, topo: Topology, workers, batch: int | None = None) -> tuple[list[str], dict]:
    """Markdown rows (per N: uncompressed, then each spec) and the predictions behind them, by N then spec
    (each :func:`predict_at`'s dict, with ``step_s_100mbit`` and ``step_s_1gbit``)."""
    out = [f"| N | compress= | bytes per step (ratio) | encode+decode | step at {fmt_rate(topo.nic_bps)} | "
           f"at 100 Mbit/s | at 1 Gbit/s | pays below |", "|---|---|---|---|---|---|---|---|"]
    data: dict = {}
    for n in workers:
        data[n] = {}
        for spec in ["none", *specs]:
            x = predict_at(cal, spec, regime, topo, n, batch)
            cost = cal.compressors.get(spec)
            at = {f"step_s_{name}": step(cal, cost, regime, replace(topo, nic_bps=rate), n, batch)
                  for name, rate in (("100mbit", 100 * MBIT), ("1gbit", GBIT))}
            data[n][spec] = x = {**x, **at}
            mib = x["bytes_per_step"] / 2**20
            out.append(f"| {n} | {x['spec']} | {f'{mib:,.0f}' if mib >= 1000 else f'{mib:.3g}'} MiB ({x['bytes_ratio']:.3g}x) | "
                       f"{_fmt_s(x['encode_decode_s'])} | {_fmt_s(x['step_s'])} | {_fmt_s(x['step_s_100mbit'])} | "
                       f"{_fmt_s(x['step_s_1gbit'])} | "
                       f"{fmt_rate(x['crossover_bps']) if topo.hosts(n) > 1 or spec == 'none' else 'n/a: one host'} |")
    return out, data


def recommend(data: dict, topo: Topology) -> list[str]:
    """Per N, the compressors that pay at the user's link (fastest first), and nothing about those that do not."""
    lines = []
    for n, per in data.items():
        base = per["none"]
        paying = sorted((x for s, x in per.items() if s != "none" and x["pays"]), key=lambda x: x["step_s"])
        if not paying:
            where = f"at {fmt_rate(topo.nic_bps)}" if topo.hosts(n) > 1 else "on one host"
            lines.append(f"- N = {n}: no compressor pays {where}: the uncompressed exchange is the fastest "
                         f"({_fmt_s(base['step_s'])} a step).")
            continue
        best = paying[0]

        def below(x: dict) -> str:
            if topo.hosts(n) == 1:
                return "on one host, whatever the link"
            if math.isinf(x["crossover_bps"]):
                return "at any link rate (the transport's own per-byte cost is the limit)"
            return f"below {fmt_rate(x['crossover_bps'])}"

        text = (f"- **N = {n}: compress={best['spec']}**, step {_fmt_s(best['step_s'])} against "
                f"{_fmt_s(base['step_s'])} uncompressed ({base['step_s'] / best['step_s']:.2f}x), "
                f"{best['bytes_ratio']:.3g}x the bytes; it pays {below(best)}")
        others = [f"{x['spec']} ({base['step_s'] / x['step_s']:.2f}x, {below(x)})" for x in paying[1:]]
        lines.append(text + (f". Also paying: {', '.join(others)}." if others else "."))
    return lines
