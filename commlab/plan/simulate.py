"""A training step, simulated over the bucket timeline: when each bucket is ready, when each link is free.

One worker's step: forward, then backward, during which bucket b becomes ready at
``fwd + bwd x ready_frac[b]`` (measured with the model's hooks, :mod:`commlab.plan.calibrate`),
stretched per worker and per step by its straggler draw. Then each regime's schedule::

  all-reduce (ring: commlab's, gloo's, NCCL's)     one communication thread, buckets in order:
      start[b] = max(ready of b on the slowest worker, end[b-1])
      end[b]   = start[b] + 2(N-1) alpha + 2(N-1)/N S_b beta   (beta: the slowest ring edge)
      step     = end[last] + the worker's optimizer over S

  PS, sync, K shards (per bucket, per shard k; links are resources with a "free at" time)
      push    worker uplink:   up[i]  = max(ready[i,b], up[i]) + alpha + S_bk beta_w
              shard k inbound: in[k]  = max(max_i up[i], max(in[k], first ready) + alpha + N S_bk beta_s)
      reduce  shard k's CPU:   app[k] = max(in[k] + S_bk add, app[k] + N S_bk add) + S_bk opt
      pull    shard k outbound out[k] = max(app[k], out[k]) + alpha + N S_bk beta_s
              worker downlink: got[i] = max(max_k out[k], got[i] + S_b beta_w)
    (co-located: shard k shares host k's NIC with that host's workers, whose pushes to and pulls
    from the other shards use the same link)

  PS, async / SSP: event by event. Each worker pushes its step's gradient (its uplink fed bucket by
  bucket during backward); each shard serves pushes first come first served on its link, applies
  each on arrival (version + 1; staleness = versions applied since the worker's pull), then answers
  the worker's pull; SSP holds a worker's next step until the slowest has finished enough steps.

Sync regimes are computed with numpy over all workers at once, one step at a time, so thousands of
identical (or differently slow) workers cost a few array operations per bucket; async/SSP is a heap
of events, one per worker-step. What is left out (docs/plan.md): congestion and switch topology
(every NIC reaches every other at its rate), NCCL's tree algorithm, in-network aggregation, and CPU
contention between a host's communication threads and its compute (only ``compute_scale``).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from commlab.base.errors import ConfigError
from commlab.plan.costmodel import Calibration, Regime, Straggler, Topology
from commlab.transport.psproto import assign_shards

PIECE_BYTES = 16 * 2**20  # ps:// cuts parameters into pieces of at most piece_mb (16 MiB)
SWAP_BYTES = 4 * 2**20  # ring:// at N = 2: tensors up to swap_kb take one step


@dataclass
class SimResult:
    regime: str
    workers: int
    hosts: int
    step_s: float  # sync: median step; async/SSP: mean interval between one worker's steps
    compute_s: float  # median forward + backward of a worker
    exposed_s: float  # mean over workers of step end minus own compute end (sync); step - compute (async)
    efficiency: float  # one worker's step alone (compute + optimizer, no exchange) / step_s
    throughput: float  # samples per second, all workers
    bytes: dict = field(default_factory=dict)  # per step: per worker sent/received, busiest NIC, per shard link
    staleness: dict | None = None  # async/SSP: staleness -> updates
    staleness_mean: float | None = None
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def shard_pieces(cal: Calibration, shards: int) -> list[tuple[int, int, float]]:
    """ps://'s pieces as (bucket, shard, bytes), in the order a worker pushes them: bucket by bucket,
    each shard's pieces in turn (its thread sends them in order, the shards' threads in parallel).
    A piece is what a server reduces, updates and returns as a unit (at most 16 MiB)."""
    where = {name: b for b, bucket in enumerate(cal.compute.buckets) for name, _, _ in bucket.params}
    per: dict[tuple[int, int], list[float]] = {}
    for k, pieces in enumerate(assign_shards(list(cal.compute.manifest), shards, PIECE_BYTES)):
        for pc in pieces:
            per.setdefault((where[pc.param], k), []).append(float(pc.nbytes))
    out = []
    for b in range(len(cal.compute.buckets)):
        lists = [per.get((b, k), []) for k in range(shards)]
        for j in range(max(map(len, lists), default=0)):
            out += [(b, k, lst[j]) for k, lst in enumerate(lists) if j < len(lst)]
    return out


def shard_bytes(cal: Calibration, shards: int) -> np.ndarray:
    """Bytes of bucket b held by shard k (B x K), with ps://'s own assignment of pieces to shards."""
    out = np.zeros((len(cal.compute.buckets), shards))
    for b, k, nbytes in shard_pieces(cal, shards):
        out[b, k] += nbytes
    return out


def _draws(strag: Straggler, steps: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(speed factor, added delay) per step and worker; the slow workers are the last ranks."""
    if strag.sigma > 0:
        speed = np.exp(rng.standard_normal((steps, n)) * strag.sigma - strag.sigma ** 2 / 2)
    else:
        speed = np.ones((steps, n))
    delay = np.zeros((steps, n))
    slow = min(strag.slow_workers, n)
    if slow:
        speed[:, n - slow:] *= strag.slow_factor
        delay[:, n - slow:] += strag.slow_delay_s
    return speed, delay


class _Timeline:
    """Per step and worker: forward end, bucket ready times (steps x N x B), compute end."""

    def __init__(self, cal: Calibration, topo: Topology, batch: int, n: int, steps: int, strag: Straggler, seed: int):
        c = cal.compute
        self.fwd = c.fwd_s_per_sample * batch * topo.compute_scale
        self.bwd = c.bwd_s_per_sample * batch * topo.compute_scale
        speed, delay = _draws(strag, steps, n, np.random.default_rng(seed))
        frac = np.array([b.ready_frac for b in c.buckets])
        start_bwd = self.fwd * speed + delay
        self.ready = start_bwd[:, :, None] + self.bwd * speed[:, :, None] * frac[None, None, :]
        self.compute = start_bwd + self.bwd * speed
        self.sizes = np.array([b.nbytes for b in c.buckets], dtype=float)


def simulate(cal: Calibration, topo: Topology, regime: Regime, workers: int, batch: int | None = None,
             straggler: Straggler | None = None, steps: int | None = None, seed: int = 0) -> SimResult:
    """Simulate ``steps`` training steps of ``workers`` workers under ``regime``; see the module's text.
    ``straggler``: None for identical workers. Pure: the same arguments give the same result."""
    straggler = straggler or Straggler()
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    batch = batch or cal.compute.batch
    hosts = topo.hosts(workers)
    if regime.kind == "ps" and regime.placement == "colocated" and regime.shards > hosts:
        raise ConfigError(f"{regime.label}: {regime.shards} co-located shards need as many worker hosts "
                          f"(there are {hosts})")
    if regime.kind == "allreduce":
        steps = steps or 12
        res = _sync_allreduce(cal, topo, regime, workers, batch, straggler, steps, seed)
    elif regime.mode == "sync":
        steps = steps or 12
        res = _sync_ps(cal, topo, regime, workers, batch, straggler, steps, seed)
    else:
        steps = steps or max(6, min(40, 25_000 // max(1, workers)))
        res = _async_ps(cal, topo, regime, workers, batch, straggler, steps, seed)
    alone = (cal.compute.fwd_s_per_sample + cal.compute.bwd_s_per_sample) * batch * topo.compute_scale \
        + cal.compute.param_bytes * cal.opt_s_per_byte
    res.efficiency = alone / res.step_s if res.step_s > 0 else 1.0
    res.throughput = workers * batch / res.step_s if res.step_s > 0 else float("inf")
    return res


# ----- all-reduce --------------------------------------------------------------------------------
def ring_bytes_by_rank(nbytes: int, n: int, itemsize: int = 4) -> np.ndarray:
    """Bytes each rank sends in one ring all-reduce, from the ring's own segments and schedule
    (:func:`commlab.regimes.ring.segment_bounds`, :func:`~commlab.regimes.ring.ring_schedule`): in the
    N-1 reduce-scatter steps rank r sends every segment but (r+1) mod N, in the N-1 all-gather steps
    every segment but (r+2) mod N. Exactly ``2(N-1)/N x S`` when N divides the element count."""
    from commlab.regimes.ring import segment_bounds  # here: the ring's module imports torch (seconds)

    if n <= 1:
        return np.zeros(max(n, 1))
    bounds = np.array(segment_bounds(nbytes // itemsize, n)) * itemsize
    seg = np.diff(bounds)
    return 2 * seg.sum() - np.roll(seg, -1) - np.roll(seg, -2)


def allreduce_bucket_time(size: float, n: int, topo: Topology, regime: Regime, cal: Calibration) -> float:
    """One bucket's ring all-reduce: ``2(N-1)`` steps, each as long as the largest segment over the
    slowest edge of the ring (ranks placed host by host: one edge per host crosses its NIC, the others
    stay inside the host)."""
    if n <= 1:
        return 0.0
    alpha, beta = _ring_edge(n, topo, regime, cal)
    if regime.transport == "ring" and n == 2 and size <= SWAP_BYTES:  # commlab's one-step swap
        return alpha + size * beta
    largest = math.ceil(size / 4 / n) * 4  # segments differ by at most one element
    return 2 * (n - 1) * (alpha + largest * beta)


def allgather_time(size: float, n: int, topo: Topology, regime: Regime, cal: Calibration) -> float:
    """Every rank's ``size`` bytes to every rank over the ring: ``N-1`` steps, each forwarding one rank's
    whole payload over the slowest edge, ``(N-1)(alpha + S beta)``; each rank sends ``(N-1) S``."""
    if n <= 1:
        return 0.0
    alpha, beta = _ring_edge(n, topo, regime, cal)
    return (n - 1) * (alpha + size * beta)


def _ring_edge(n: int, topo: Topology, regime: Regime, cal: Calibration) -> tuple[float, float]:
    """(alpha, beta) of the ring's slowest edge: ranks placed host by host, one edge per host crosses its
    NIC, the others stay inside the host."""
    tr = cal.transport(regime.transport)
    rates = ([topo.nic_bps] if topo.hosts(n) > 1 else []) + ([topo.intra_bps] if topo.workers_per_host > 1 else [])
    return tr.alpha_s, max(tr.beta_over(r) for r in rates)


def _sync_allreduce(cal, topo, regime, n, batch, strag, steps, seed) -> SimResult:
    tl = _Timeline(cal, topo, batch, n, steps, strag, seed)
    comm = np.array([allreduce_bucket_time(s, n, topo, regime, cal) for s in tl.sizes])
    opt = cal.compute.param_bytes * cal.opt_s_per_byte
    last_ready = tl.ready.max(axis=1)  # steps x B: the slowest worker's bucket b
    step_s, exposed = [], []
    for t in range(steps):
        end = 0.0
        for b in range(len(comm)):
            end = max(last_ready[t, b], end) + comm[b]
        end = max(end, tl.compute[t].max()) + opt
        step_s.append(end)
        exposed.append(float(np.mean(end - tl.compute[t])))
    sent = float(sum(ring_bytes_by_rank(int(s), n).max() for s in tl.sizes)) if n > 1 else 0.0
    hosts = topo.hosts(n)
    nbytes = {"sent_per_worker": sent, "received_per_worker": sent,
              "nic_out_per_host": sent if hosts > 1 else 0.0, "nic_in_per_host": sent if hosts > 1 else 0.0}
    return SimResult(regime.label, n, hosts, float(np.median(step_s)), float(np.median(tl.compute)),
                     float(np.mean(exposed)), 0.0, 0.0, nbytes)


# ----- parameter servers -------------------------------------------------------------------------
def _ps_links(cal, topo, regime, n):
    """(transport, per-byte cost of each shard's link for its own traffic, workers on each shard's host).

    Co-located shard k shares host k's NIC with that host's workers, whose pushes to and pulls from
    the other shards cross it too: the shard gets the share of the NIC its own bytes are of all the
    bytes on it (each direction carries ``(N - W) S_k`` for the shard and ``W (S - S_k)`` for the
    workers; at K = N, W = 1 that is ``2(N-1)/N x S``, the ring's)."""
    K = regime.shards
    tr = cal.transport(regime.transport)
    beta = tr.beta_over(topo.nic_bps)
    local = np.zeros(K)
    betas = np.full(K, beta)
    if regime.placement == "colocated":
        W = topo.workers_per_host
        local = np.array([min(W, n - k * W) for k in range(K)], dtype=float)
        S = float(cal.compute.param_bytes)
        sk = shard_bytes(cal, K).sum(axis=0)
        own = (n - local) * sk
        betas = np.where(own > 0, beta * (own + local * (S - sk)) / np.maximum(own, 1.0), beta)
    return tr, betas, local


def _sync_ps(cal, topo, regime, n, batch, strag, steps, seed) -> SimResult:
    tl = _Timeline(cal, topo, batch, n, steps, strag, seed)
    K, W = regime.shards, topo.workers_per_host
    pieces = shard_pieces(cal, K)
    tr, betas, local = _ps_links(cal, topo, regime, n)
    a, add, opt = tr.alpha_s, cal.add_s_per_byte, cal.opt_s_per_byte
    wb = min(W, n) * tr.beta_over(topo.nic_bps)  # a host's workers share its NIC
    others = n - local
    step_s, exposed = [], []
    for t in range(steps):
        up = np.zeros(n)
        got = np.zeros(n)
        nic_in = np.zeros(K)  # shard k's inbound link is free at
        nic_out = np.zeros(K)
        app = np.zeros(K)
        for b, k, s in pieces:
            ready = tl.ready[t, :, b]
            up = np.maximum(ready, up) + a + s * wb  # a worker's pushes share its uplink...
            # ...but go to the K shards at once (a thread per shard): a shard's link takes a piece from
            # when its bucket is ready, not from when the worker's earlier pieces have left
            nic_in[k] = max(up.max(), max(nic_in[k], ready.min()) + a + others[k] * s * betas[k])
            # the server folds each push in as it lands: only the last one's add is left after the link
            app[k] = max(nic_in[k] + s * add, app[k] + n * s * add) + s * opt
            nic_out[k] = max(app[k], nic_out[k]) + a + others[k] * s * betas[k]
            got = np.maximum(nic_out[k], got + s * wb)
        end = max(got.max(), tl.compute[t].max())
        step_s.append(end)
        exposed.append(float(np.mean(end - tl.compute[t])))
    S = float(tl.sizes.sum())
    per_shard = shard_bytes(cal, K).sum(axis=0)
    link = others * per_shard + local * (S - per_shard)
    nbytes = {"sent_per_worker": S, "received_per_worker": S, "shard_link_in": link.tolist(),
              "shard_link_out": link.tolist()}
    return SimResult(regime.label, n, topo.hosts(n), float(np.median(step_s)), float(np.median(tl.compute)),
                     float(np.mean(exposed)), 0.0, 0.0, nbytes)


def _async_ps(cal, topo, regime, n, batch, strag, steps, seed) -> SimResult:
    """Async and SSP: a heap of push arrivals, in time order; each shard is first come first served."""
    if regime.mode == "ssp" and regime.staleness < 1:
        raise ConfigError("ssp needs staleness >= 1 (1: lockstep)")
    tl = _Timeline(cal, topo, batch, n, steps, strag, seed)
    K, W = regime.shards, topo.workers_per_host
    sbk = shard_bytes(cal, K)
    sk = sbk.sum(axis=0)
    S = float(tl.sizes.sum())
    tr, betas, local = _ps_links(cal, topo, regime, n)
    a, opt = tr.alpha_s, cal.opt_s_per_byte
    wb = min(W, n) * tr.beta_over(topo.nic_bps)
    others = n - local
    # when the last byte of step t's push leaves worker i, from the step's start (uplink fed per bucket)
    up = np.zeros((steps, n))
    for b in range(len(tl.sizes)):
        up = np.maximum(tl.ready[:, :, b], up) + a + tl.sizes[b] * wb
    ssp = regime.staleness if regime.mode == "ssp" else None
    # per shard, plain floats (this loop runs once per worker-step): link time, optimizer time per push
    c_link = [float(x) for x in sk * betas * others / n]
    c_app = [float(x) * opt for x in sk]
    shards = range(K)
    in_free, app_free, out_free = [0.0] * K, [0.0] * K, [0.0] * K
    version = [0] * K
    base = [[0] * K for _ in range(n)]
    done = [0] * n  # steps applied per worker
    at = Counter({0: n})  # workers per done-count, for the slowest's count
    slowest = 0
    waiting: dict[int, list] = {}  # the slowest's count a held worker needs -> [(worker, ready at)]
    stale: Counter[int] = Counter()
    finish = [math.inf] * n
    up_list = up.tolist()
    events = [(up_list[0][i], i, 0) for i in range(n)]
    heapq.heapify(events)
    applied_times = []
    pull_s = a + S * wb

    def start(i: int, t: int, when: float) -> None:
        if t >= steps:
            finish[i] = when
            return
        heapq.heappush(events, (when + up_list[t][i], i, t))

    while events:
        arrive, i, t = heapq.heappop(events)
        outs = 0.0
        mine = base[i]
        for k in shards:
            f = in_free[k] + c_link[k]
            f = in_free[k] = arrive if arrive > f else f
            g = app_free[k]
            g = app_free[k] = (f if f > g else g) + c_app[k]
            stale[version[k] - mine[k]] += 1
            version[k] += 1
            o = out_free[k]
            o = out_free[k] = (g if g > o else o) + a + c_link[k]
            mine[k] = version[k]
            if o > outs:
                outs = o
        pulled = max(outs, arrive + a + S * wb)
        applied_times.append(pulled)
        at[done[i]] -= 1
        done[i] += 1
        at[done[i]] += 1
        released = []
        while at[slowest] == 0:
            del at[slowest]
            slowest += 1
            released += waiting.pop(slowest, [])
        for j, ready in released:
            start(j, done[j], max(ready, pulled))
        nxt = done[i]
        need = nxt + 1 - ssp if ssp is not None else -1
        if nxt < steps and need > slowest:
            waiting.setdefault(need, []).append((i, pulled))
        else:
            start(i, nxt, pulled)
    # steady state: from when every worker has done one step until the first worker finished
    times = np.sort(np.array(applied_times))
    t0 = times[min(len(times) - 1, n - 1)]
    t1 = min(finish)
    inside = np.count_nonzero((times > t0) & (times <= t1))
    step_s = n * (t1 - t0) / inside if inside and t1 > t0 else float(times[-1]) / steps
    compute = float(np.median(tl.compute))
    hist = dict(sorted(stale.items()))
    total = sum(hist.values())
    mean = sum(k * v for k, v in hist.items()) / total if total else 0.0
    link = others * sk + local * (S - sk)
    nbytes = {"sent_per_worker": S, "received_per_worker": S, "shard_link_in": link.tolist(),
              "shard_link_out": link.tolist()}
    return SimResult(regime.label, n, topo.hosts(n), step_s, compute, max(0.0, step_s - compute), 0.0, 0.0,
                     nbytes, hist, mean)
