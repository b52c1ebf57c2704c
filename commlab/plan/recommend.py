"""Sweeps over worker counts and regimes, the crossovers, a recommendation with its reasons, plots.

Everything here reads :class:`~commlab.plan.simulate.SimResult` values; nothing is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from commlab.base.errors import ConfigError
from commlab.plan.costmodel import Calibration, Regime, Straggler, Topology, parse_regime, shards_to_beat_ring
from commlab.plan.simulate import SimResult, simulate

DEFAULT_REGIMES = ("ring://", "allreduce://?backend=gloo", "allreduce://?backend=nccl", "ps://?shards=1&mode=sync",
                   "ps://?shards=8&mode=sync", "ps://?shards=8&mode=sync&placement=colocated",
                   "ps://?shards=8&mode=async", "ps://?shards=8&mode=ssp&staleness=2")


@dataclass
class Plan:
    workers: list[int]
    regimes: list[Regime]
    results: dict  # (label, N) -> SimResult, or a str saying why it could not be simulated
    crossovers: dict  # N -> {"closed_form": K or None, "simulated": K or None, "against": label}
    sources: dict  # regime label -> where its transport's constants come from ("fitted: ...", "assumed: ...")
    topology: Topology
    straggler: Straggler
    batch: int


def sweep(cal: Calibration, topo: Topology, regimes: list[Regime], workers: list[int], batch: int | None = None,
          straggler: Straggler | None = None, max_shards: int = 256, seed: int = 0) -> Plan:
    """Simulate every (regime, N); for each N, the fewest dedicated sync shards that beat the fastest
    all-reduce (searched by doubling, then halving the gap; closed form beside it)."""
    batch = batch or cal.compute.batch
    straggler = straggler or Straggler()
    results: dict = {}
    for n in workers:
        for r in regimes:
            try:
                results[(r.label, n)] = simulate(cal, topo, r, n, batch, straggler, seed=seed)
            except ConfigError as exc:
                results[(r.label, n)] = str(exc)
    crossovers = {}
    for n in workers:
        # against commlab's ring if it is in the sweep, else the fastest all-reduce
        ring = [results[(r.label, n)] for r in regimes if r.kind == "allreduce"
                and isinstance(results[(r.label, n)], SimResult)]
        if not ring:
            continue
        best = next((x for x in ring if x.regime == "ring"), None) or min(ring, key=lambda x: x.step_s)
        crossovers[n] = {"against": best.regime, "closed_form": shards_to_beat_ring(n),
                         "simulated": _fewest_shards(cal, topo, n, batch, straggler, best.step_s, max_shards, seed)}
    sources = {r.label: cal.transport(r.transport).source for r in regimes}
    return Plan(workers, regimes, results, crossovers, sources, topo, straggler, batch)


def _fewest_shards(cal, topo, n, batch, straggler, target, max_shards, seed) -> int | None:
    def beats(k: int) -> bool:
        r = parse_regime(f"ps://?shards={k}&mode=sync")
        return simulate(cal, topo, r, n, batch, straggler, steps=3, seed=seed).step_s < target
    k = 1
    while not beats(k):
        if k >= max_shards:
            return None
        k = min(2 * k, max_shards)
    lo, hi = k // 2, k  # beats(hi); not beats(lo) (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if beats(mid) else (mid, hi)
    return hi


def fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def table(plan: Plan) -> list[str]:
    """Markdown: one row per (N, regime)."""
    out = ["| N | regime | step | exposed comm | efficiency | samples/s | busiest NIC per step | staleness mean (p90, max) |",
           "|---|---|---|---|---|---|---|---|"]
    for n in plan.workers:
        for r in plan.regimes:
            res = plan.results[(r.label, n)]
            if isinstance(res, str):
                out.append(f"| {n} | {r.label} | n/a: {res} | | | | | |")
                continue
            link = max([res.bytes.get("nic_out_per_host", 0.0)] + res.bytes.get("shard_link_in", [0.0]))
            out.append(f"| {n} | {r.label} | {fmt_s(res.step_s)} | {fmt_s(res.exposed_s)} | {res.efficiency:.0%} | "
                       f"{res.throughput:,.0f} | {link / 2**20:,.0f} MiB | "
                       f"{_staleness(res)} |")
    return out


def _staleness(res: SimResult) -> str:
    if not res.staleness:
        return ""
    total = sum(res.staleness.values())
    run, p90 = 0, None
    for k, c in sorted(res.staleness.items()):
        run += c
        if p90 is None and run >= 0.9 * total:
            p90 = k
    return f"{res.staleness_mean:.1f} ({p90}, {max(res.staleness)})"


def recommend(plan: Plan) -> list[str]:
    """One recommendation per N, with the reasons (the figures that decided it)."""
    lines = []
    for n in plan.workers:
        ok = [plan.results[(r.label, n)] for r in plan.regimes if isinstance(plan.results[(r.label, n)], SimResult)]
        sync = sorted((x for x, r in zip(ok, plan.regimes) if r.synchronous), key=lambda x: x.step_s)
        loose = sorted((x for x, r in zip(ok, plan.regimes) if not r.synchronous), key=lambda x: x.step_s)
        if not sync:
            continue
        best = sync[0]
        text = f"- **N = {n}: {best.regime}**, step {fmt_s(best.step_s)}, efficiency {best.efficiency:.0%}"
        if len(sync) > 1:
            text += f"; next {sync[1].regime} {fmt_s(sync[1].step_s)} ({sync[1].step_s / best.step_s:.2f}x)"
        text += "."
        reasons = []
        if plan.sources.get(best.regime, "").startswith("assumed"):
            reasons.append(f"its constants are not measured here ({plan.sources[best.regime]})")
        if best.exposed_s > 0.5 * best.step_s:
            reasons.append(f"communication-bound: {fmt_s(best.exposed_s)} of the step is exposed exchange")
        else:
            reasons.append(f"compute-bound: backward hides all but {fmt_s(best.exposed_s)} of the exchange")
        cx = plan.crossovers.get(n)
        if cx:
            if cx["simulated"] is None:
                reasons.append(f"no dedicated PS up to the shards searched beats {cx['against']}")
            else:
                reasons.append(f"a dedicated sync PS needs K >= {cx['simulated']} shards to beat {cx['against']} "
                               f"(bandwidth terms alone: K > N^2/(2(N-1)), "
                               f"{'never at N <= 2' if cx['closed_form'] is None else 'K >= ' + str(cx['closed_form'])})")
        if loose:
            a = loose[0]
            gain = best.step_s / a.step_s
            if gain > 1.05:
                reasons.append(f"{a.regime} steps {gain:.2f}x as often per worker at mean staleness "
                               f"{a.staleness_mean:.1f}: worth it only if the model tolerates that staleness")
            else:
                reasons.append(f"asynchrony buys nothing here ({a.regime}: {a.step_s / best.step_s:.2f}x the step)")
        lines.append(text + " " + "; ".join(reasons) + ".")
    return lines


def crossover_lines(plan: Plan) -> list[str]:
    out = ["| N | fastest all-reduce | dedicated sync shards to beat it (simulated) | closed form K > N^2/(2(N-1)) |",
           "|---|---|---|---|"]
    for n, cx in plan.crossovers.items():
        out.append(f"| {n} | {cx['against']} | {cx['simulated'] if cx['simulated'] is not None else 'none found'} | "
                   f"{cx['closed_form'] if cx['closed_form'] is not None else 'never (N <= 2)'} |")
    return out


def plots(plan: Plan, path: Path) -> Path | None:
    """Step time and efficiency against N per regime, and the shards a PS needs to beat the ring."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in plan.regimes:
        pts = [(n, plan.results[(r.label, n)]) for n in plan.workers
               if isinstance(plan.results[(r.label, n)], SimResult)]
        if not pts:
            continue
        ls = "-" if r.synchronous else "--"
        ax[0].plot([n for n, _ in pts], [x.step_s for _, x in pts], ls, marker="o", label=r.label)
        ax[1].plot([n for n, _ in pts], [x.efficiency for _, x in pts], ls, marker="o", label=r.label)
    for a, title, ylab in ((ax[0], "step time", "seconds"), (ax[1], "scaling efficiency", "one worker alone / step")):
        a.set_xscale("log", base=2)
        a.set_title(title)
        a.set_xlabel("workers N")
        a.set_ylabel(ylab)
        a.grid(alpha=0.3)
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=7)
    ns = list(plan.crossovers)
    ax[2].plot(ns, [plan.crossovers[n]["simulated"] or float("nan") for n in ns], "o-", label="simulated")
    ax[2].plot(ns, [plan.crossovers[n]["closed_form"] or float("nan") for n in ns], "x--",
               label="bandwidth terms: N^2/(2(N-1))")
    ax[2].set_xscale("log", base=2)
    if any(plan.crossovers[n]["simulated"] or plan.crossovers[n]["closed_form"] for n in ns):
        ax[2].set_yscale("log", base=2)  # (with nothing to draw, as at N = 2 alone, a log axis cannot be drawn)
    ax[2].set_title("dedicated sync PS shards needed to beat the ring")
    ax[2].set_xlabel("workers N")
    ax[2].legend(fontsize=7)
    ax[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def describe_topology(topo: Topology) -> str:
    return (f"{topo.workers_per_host} worker(s) per host, NIC {topo.nic_bps * 8 / 1e9:g} Gbit/s each way, "
            f"intra-host {topo.intra_bps / 1e9:g} GB/s, compute x{topo.compute_scale:g}")


def describe_straggler(s: Straggler) -> str:
    parts = [f"lognormal sigma {s.sigma:g} per worker and step"] if s.sigma else []
    if s.slow_workers:
        parts.append(f"{s.slow_workers} worker(s) {s.slow_delay_s * 1e3:g} ms slower and x{s.slow_factor:g}")
    return ", ".join(parts) or "none (identical workers)"


def report(plan: Plan, cal: Calibration, png: Path | None = None) -> list[str]:
    """The whole plan as markdown."""
    c = cal.compute
    out = [f"Model {c.model}: {c.param_bytes / 2**20:.1f} MiB of gradients in {len(c.buckets)} bucket(s), batch "
           f"{plan.batch} per worker: forward {fmt_s(c.fwd_s_per_sample * plan.batch)}, backward "
           f"{fmt_s(c.bwd_s_per_sample * plan.batch)}. Topology: {describe_topology(plan.topology)}. Stragglers: "
           f"{describe_straggler(plan.straggler)}.", "", "Transports: " + "; ".join(
               f"{name} alpha {t.alpha_s * 1e6:.0f} us, {1 / t.beta_s / 1e9 if t.beta_s else float('inf'):.2g} GB/s "
               f"({t.source})" for name, t in sorted({**_used(plan, cal)}.items())), ""]
    out += table(plan) + ["", "### Crossovers", ""] + crossover_lines(plan)
    out += ["", "### Recommendation", ""] + recommend(plan) + [""]
    if png:
        out += [f"![step time, efficiency and crossovers]({png.name})", ""]
    return out


def _used(plan: Plan, cal: Calibration) -> dict:
    return {r.transport: cal.transport(r.transport) for r in plan.regimes}


def at_scale_from_bench(records: list[dict], model: str, batch: int) -> list[str]:
    """The "at scale" section for a ``commlab bench`` report: transports fitted to its bandwidth records,
    the model's compute measured now (a few steps). Never raises: says why when it cannot."""
    from commlab.plan import calibrate as C
    try:
        transports = C.transports_from_records(records)
        if not transports:
            raise ConfigError("no bandwidth record of a regime the planner knows")
        net, shape = C.load_model(model)
        add, opt = C.measure_server_costs()
        cal = Calibration(transports, add, opt, C.measure_compute(net, shape, batch, model, reps=3))
        return at_scale_section(cal)
    except (ConfigError, ValueError, RuntimeError, ImportError) as exc:
        return ["## At scale (simulated)", "", f"Not available for this run: {exc}", ""]


AT_SCALE_REGIMES = ("ring://", "allreduce://?backend=gloo", "allreduce://?backend=nccl", "ps://?shards=8&mode=sync",
                    "ps://?shards=8&mode=async")


def at_scale_section(cal: Calibration, workers=(8, 512, 4096), nic_gbit: float = 100.0,
                     workers_per_host: int = 8) -> list[str]:
    """A short "at scale" section for the ``commlab bench`` report, from this calibration."""
    topo = Topology(workers_per_host=workers_per_host, nic_bps=nic_gbit * 1e9 / 8)
    names = [u for u in AT_SCALE_REGIMES if parse_regime(u).transport in cal.transports or "nccl" in u]
    plan = sweep(cal, topo, [parse_regime(u) for u in names], list(workers), max_shards=64)
    return (["## At scale (simulated)", "",
             f"`commlab plan` from this run's calibration (transports fitted to `bandwidth.json`; the model's compute "
             f"measured here); {describe_topology(topo)}. A prediction, not a measurement: see docs/plan.md for "
             f"what the simulator leaves out and how well it matched runs here.", ""]
            + table(plan) + ["", "### Recommendation", ""] + recommend(plan) + [""])

