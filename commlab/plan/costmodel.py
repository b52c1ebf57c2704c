"""The cost model: what one message, one byte, one add and one sample cost, and the regimes' closed forms.

A message of S bytes over a transport costs ``alpha + S x beta`` (Hockney's
alpha-beta model). ``beta`` is the larger of the transport's own per-byte cost
(CPU, copies: what it reaches on loopback) and the link's ``1 / rate``: the
bytes go through both stages in a pipeline, so the slower one sets the pace.

Closed forms the simulator reproduces (and tests check):

- ring all-reduce of S bytes over N ranks (baidu-allreduce, Patarasuk & Yuan 2009):
  ``2(N-1)`` steps, each rank sends and receives ``2(N-1)/N x S``;
  time ``2(N-1) alpha + 2(N-1)/N x S x beta``.
- parameter server, K shards, N workers, each shard on a link of rate B (BytePS, Jiang et al.
  OSDI'20): every worker pushes S and pulls S; each shard's link carries ``N x S / K`` in and the
  same out (``2 N S / K`` in all); the exchange takes ``max(S / B, N S / (K B))``, against the
  ring's ``2(N-1) S / (N B)``. Dedicated shards beat the ring where ``K > N^2 / (2(N-1))``... and
  only once ``N S / (K B)`` falls below ``2(N-1)/N S/B``; co-located shards (one per worker host)
  carry ``2(N-1)/N x S`` per NIC, the ring's bytes, so they can at best tie it.
- a synchronous step waits for the slowest of N workers; a worker slowed by d delays the step by d.

Everything here is plain data (frozen dataclasses that read and write JSON) and arithmetic.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from commlab.base.config import ExchangerURL
from commlab.base.errors import ConfigError

GBIT = 1e9 / 8  # bytes per second in one gigabit per second


# what `commlab plan` weighs unless told (--compress): each costs a measurement on a first call, so the block
# quantizers (int8, int4, fp4, fp8: local steps' pseudo-gradients) are weighed when named. Here, not in
# commlab.plan.compression (which imports torch to measure), so the command's defaults cost no torch import.
BUILTIN_COMPRESSORS = ("fp16", "bf16", "powersgd:4", "topk:0.01", "randomk:0.01", "sign")

@dataclass(frozen=True)
class Transport:
    """Per-message latency ``alpha_s`` and per-byte cost ``beta_s`` (s/byte, CPU path) of one transport."""

    alpha_s: float
    beta_s: float
    source: str = "assumed"

    def beta_over(self, rate_bps: float | None) -> float:
        """Per-byte cost over a link of ``rate_bps`` bytes/s: the slower of the transport and the link."""
        return max(self.beta_s, 1.0 / rate_bps) if rate_bps else self.beta_s


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its bytes, when it is ready (fraction of backward), its parameters."""

    nbytes: int
    ready_frac: float
    params: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype), as model_manifest


@dataclass(frozen=True)
class Compute:
    """A model's compute on one worker: forward and backward seconds per sample, the bucket timeline."""

    model: str
    batch: int  # the batch it was measured at
    fwd_s_per_sample: float
    bwd_s_per_sample: float
    buckets: tuple[Bucket, ...]  # in the order backward fills them (reverse parameter order)
    manifest: tuple[tuple[str, tuple[int, ...], str], ...]  # registration order (for shard assignment)

    @property
    def param_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class CompressorCost:
    """One compressor (``compress=`` spec, with error feedback or not) on a model's buckets, measured here by
    :func:`commlab.plan.compression.measure`: what the regime moves in each round and what encoding and
    decoding cost on this CPU, once past the compressor's uncompressed warm-up. Per bucket, per round:"""

    spec: str
    ef: bool
    world: int  # ranks the measurement simulated (decoding a gathered round costs one decode per rank)
    sums: tuple[str, ...]  # dtypes the measured regime sums exactly (else it gathers; commlab.compress.seam)
    moves: tuple[tuple[str, ...], ...]  # "sum" (an all-reduce) or "gather" (every rank's payload)
    wire_bytes: tuple[tuple[int, ...], ...]  # the tensor the regime moves (the payload; round 0 with the
    #                                           bucket's presence flags)
    encode_s: tuple[tuple[float, ...], ...]  # round 0: start (in the backward hook); round r: advance
    decode_s: tuple[float, ...]  # per bucket: finish, with error feedback's residual, at ``world`` ranks

    @property
    def label(self) -> str:
        return self.spec if self.ef else f"{self.spec} (ef=0)"

    @classmethod
    def from_dict(cls, d: dict) -> "CompressorCost":
        return cls(d["spec"], d["ef"], d["world"], tuple(d["sums"]), tuple(map(tuple, d["moves"])),
                   tuple(map(tuple, d["wire_bytes"])), tuple(map(tuple, d["encode_s"])), tuple(d["decode_s"]))


# Figures for transports this machine cannot measure (no GPU): NCCL's ring over a NIC is link-bound,
# with a few microseconds per step. Every use of them is marked "assumed" in the output.
ASSUMED = {
    "nccl": Transport(8e-6, 1 / 200e9, "assumed: NCCL ring, link-bound"),
    "gloo": Transport(60e-6, 1 / 1.5e9, "assumed: gloo on a 2-core box (BASELINES.md)"),
    "ring": Transport(45e-6, 1 / 2.0e9, "assumed: commlab ring on a 2-core box (BASELINES.md)"),
    "ring-ipc": Transport(45e-6, 1 / 2.2e9, "assumed: commlab ring over ipc on a 2-core box (BASELINES.md)"),
    "ring-torch": Transport(60e-6, 1 / 1.5e9, "assumed: commlab ring over gloo p2p, as gloo"),
    "ps": Transport(80e-6, 1 / 2.0e9, "assumed: commlab PS on a 2-core box (BASELINES.md)"),
}


@dataclass(frozen=True)
class Calibration:
    """Everything the simulator needs that is measured: transports, server costs, the model's compute."""

    transports: dict[str, Transport]
    add_s_per_byte: float  # a server adding one worker's gradient (sync mean)
    opt_s_per_byte: float  # applying the optimizer (on a server, or on a worker after an all-reduce)
    compute: Compute
    facts: dict = field(default_factory=dict)
    compressors: dict[str, CompressorCost] = field(default_factory=dict)  # by CompressorCost.label

    def transport(self, name: str) -> Transport:
        if name in self.transports:
            return self.transports[name]
        if name in ASSUMED:
            return ASSUMED[name]
        raise ConfigError(f"no calibration for transport {name!r}; calibrated: {', '.join(sorted(self.transports))}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        c = d["compute"]
        tup = lambda ps: tuple((n, tuple(s), t) for n, s, t in ps)
        compute = Compute(c["model"], c["batch"], c["fwd_s_per_sample"], c["bwd_s_per_sample"],
                          tuple(Bucket(b["nbytes"], b["ready_frac"], tup(b["params"])) for b in c["buckets"]),
                          tup(c["manifest"]))
        return cls({k: Transport(**v) for k, v in d["transports"].items()}, d["add_s_per_byte"],
                   d["opt_s_per_byte"], compute, d.get("facts", {}),
                   {k: CompressorCost.from_dict(v) for k, v in d.get("compressors", {}).items()})

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def with_transports(self, **transports: Transport) -> "Calibration":
        return replace(self, transports={**self.transports, **transports})

    def with_compressors(self, *costs: CompressorCost) -> "Calibration":
        return replace(self, compressors={**self.compressors, **{c.label: c for c in costs}})


@dataclass(frozen=True)
class Topology:
    """Hosts x workers per host; each host has one NIC (full duplex, ``nic_bps`` each way) and an
    intra-host path (``intra_bps``). ``compute_scale`` stretches every worker's compute (e.g. more
    processes than cores: the validation's hosts share one 2-core machine). ``cpu_share`` is the share of
    a core each worker gets while all of them compute at once on a machine that runs other work too
    (:func:`commlab.plan.calibrate.cpu_share`; 1: a core each): a step whose worker computes throughout
    cannot be shorter than its CPU time over that share (:func:`commlab.plan.compression.step`)."""

    workers_per_host: int = 1
    nic_bps: float = 100 * GBIT
    intra_bps: float = 20e9
    compute_scale: float = 1.0
    cpu_share: float = 1.0

    def hosts(self, workers: int) -> int:
        return math.ceil(workers / self.workers_per_host)


@dataclass(frozen=True)
class Straggler:
    """Per-worker speed: each step's compute is multiplied by a lognormal factor (``sigma``; 0: identical
    workers) and ``slow_workers`` workers (the last ranks) take ``slow_delay_s`` longer per step and run
    ``slow_factor`` times slower."""

    sigma: float = 0.0
    slow_workers: int = 0
    slow_delay_s: float = 0.0
    slow_factor: float = 1.0

    @classmethod
    def parse(cls, text: str | None) -> "Straggler":
        """``none``, ``lognormal:0.2``, ``slow:0.05`` (one worker +50 ms), ``slow:0.05:2`` (two), ``factor:3``,
        joined with ``+`` (``lognormal:0.1+slow:0.05``)."""
        s = cls()
        for part in (text or "none").split("+"):
            name, *args = part.strip().split(":")
            try:
                if name == "none":
                    continue
                if name == "lognormal":
                    s = replace(s, sigma=float(args[0]))
                elif name == "slow":
                    s = replace(s, slow_delay_s=float(args[0]), slow_workers=int(args[1]) if len(args) > 1 else 1)
                elif name == "factor":
                    s = replace(s, slow_factor=float(args[0]), slow_workers=int(args[1]) if len(args) > 1 else 1)
                else:
                    raise ValueError(name)
            except (ValueError, IndexError):
                raise ConfigError(f"straggler {part!r}: expected none, lognormal:SIGMA, slow:SECONDS[:COUNT] or "
                                  f"factor:F[:COUNT]") from None
        return s


@dataclass(frozen=True)
class Regime:
    """A regime as the planner sees it. ``transport`` names the calibrated constants it uses."""

    url: str
    kind: str  # "allreduce" | "ps"
    transport: str  # "ring" | "gloo" | "nccl" | "ring-torch" | "ps"
    shards: int = 1
    mode: str = "sync"  # ps: sync | async | ssp
    staleness: int = 0
    placement: str = "dedicated"  # ps: dedicated server hosts, or colocated with the first K worker hosts

    @property
    def label(self) -> str:
        if self.kind == "allreduce":
            return self.transport
        mode = self.mode + (str(self.staleness) if self.mode == "ssp" else "")
        return f"ps-{mode}-K{self.shards}" + ("-colo" if self.placement == "colocated" else "")

    @property
    def synchronous(self) -> bool:
        return self.kind == "allreduce" or self.mode == "sync"


# the options of each scheme's URL that the planner models (the others, such as timeout, change no cost here)
PLANNED_OPTIONS = {"ring": {"transport"}, "allreduce": {"backend"}, "ps": {"shards", "mode", "staleness", "placement"}}


def parse_regime(text: str) -> Regime:
    """``ring://[?transport=torch]``, ``allreduce://?backend=gloo|nccl``,
    ``ps://?shards=K&mode=sync|async|ssp&staleness=S&placement=dedicated|colocated``."""
    url = ExchangerURL.parse(text.strip())
    q = dict(url.query)
    known = PLANNED_OPTIONS
    if url.scheme not in known:
        raise ConfigError(f"plan: regime {text!r}: scheme must be one of {', '.join(known)}")
    extra = set(q) - known[url.scheme]
    if extra:
        raise ConfigError(f"plan: regime {text!r}: unknown option(s) {sorted(extra)}; known: {sorted(known[url.scheme])}")
    if url.scheme == "ring":
        t = q.get("transport", "tcp")
        return Regime(text, "allreduce", "ring" if t in ("tcp", "ipc") else f"ring-{t}")
    if url.scheme == "allreduce":
        backend = q.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"plan: regime {text!r}: backend must be gloo or nccl")
        return Regime(text, "allreduce", backend)
    mode = q.get("mode", "sync")
    if mode not in ("sync", "async", "ssp"):
        raise ConfigError(f"plan: regime {text!r}: mode must be sync, async or ssp")
    placement = q.get("placement", "dedicated")
    if placement not in ("dedicated", "colocated"):
        raise ConfigError(f"plan: regime {text!r}: placement must be dedicated or colocated")
    try:
        shards, staleness = int(q.get("shards", 1)), int(q.get("staleness", 1 if mode == "ssp" else 0))
    except ValueError:
        raise ConfigError(f"plan: regime {text!r}: shards and staleness are integers") from None
    if shards < 1 or staleness < 0:
        raise ConfigError(f"plan: regime {text!r}: shards must be >= 1 and staleness >= 0")
    return Regime(text, "ps", "ps", shards, mode, staleness, placement)


# ----- closed forms (the simulator must agree with these; tests check it) -----------------------------
def ring_bytes_per_rank(size: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``size`` bytes over ``n`` ranks."""
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def ring_time(size: float, n: int, alpha: float, beta: float) -> float:
    """``2(N-1) alpha + 2(N-1)/N x S x beta``."""
    return 2 * (n - 1) * alpha + ring_bytes_per_rank(size, n) * beta if n > 1 else 0.0


def ps_server_bytes(size: float, n: int, k: int) -> float:
    """Bytes on each of K shards' links per step, in and out together: ``2 N S / K``."""
    return 2 * n * size / k


def ps_time(size: float, n: int, k: int, rate: float) -> float:
    """BytePS's dedicated-server exchange time, ``max(S/B, N S/(K B))`` (bandwidth terms only)."""
    return max(size / rate, n * size / (k * rate))


def shards_to_beat_ring(n: int) -> int | None:
    """The fewest dedicated shards for which ``max(S/B, N S/(K B)) < 2(N-1) S/(N B)`` (bandwidth terms
    only): ``K > N^2 / (2(N-1))``. None at N <= 2, where the ring's S bytes equal a worker's own push."""
    if n <= 2:
        return None
    return math.floor(n * n / (2 * (n - 1))) + 1
