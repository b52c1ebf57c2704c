"""``python -m bench.plan_validate``: the planner's predictions against runs across capped links.

    sudo python -m bench.plan_validate --docs docs/plan.md       # regenerates the table in docs/plan.md
    sudo python -m bench.plan_validate --rates 1gbit --workers 2 --regimes ring,ps-1

For each link rate, a :class:`bench.netns.Links` star of network namespaces capped with ``tc tbf``
(one host per worker, one per PS shard); first the bench's raw-TCP ceiling measures what the capped
link carries each way with both directions busy (the rate the prediction uses); then each regime trains the communication-heavy model for
a few steps (:func:`bench.jobs.run`, the same path as ``commlab bench --link``), and the median step
time (every rank's steps after the warm-up) is put beside the simulator's prediction for the same
model, batch, N, K and link rate. The calibration is this machine's: the model's compute from its
hooks and the transports from a short loopback ``commlab bench bandwidth`` (or ``--bench-run``,
``--calibration``). The hosts share this machine's cores, so the prediction stretches compute by
``N / cores`` when there are more workers than cores (``Topology.compute_scale``).

With ``--compress SPEC ...`` each all-reduce regime also runs with ``compress=SPEC``: its step predicted by
:mod:`commlab.plan.compression` (the compressor measured on the model here), checked to within 15%, and
its predicted crossover rate checked against whether the measured medians say compression paid at that
link (``sudo python -m bench.plan_validate --rates 100mbit,1gbit --workers 2 --regimes ring --compress
powersgd:4,start_iter=2 --no-staleness``).

Then the asynchronous check: ``ps://?mode=async`` on loopback with one worker deliberately slowed
(:mod:`bench.plan_slow_worker`), the staleness histogram the server reports against the simulated one.

Writes ``OUT/plan_validate.json`` and ``OUT/plan_validate.md``; with ``--docs FILE`` the table also
replaces the text between ``<!-- plan-validate:begin -->`` and ``<!-- plan-validate:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from bench import bandwidth, text, verdict
from bench import regimes as R
from bench.convergence import read_staleness
from bench import jobs
from bench.jobs import read_ranks
from bench.netns import Links, link_unavailable_reason
from commlab.launch import launcher
from commlab.plan.rates import parse_rate
from commlab.plan import calibrate as C
from commlab.plan import compression
from commlab.plan.costmodel import Calibration, Straggler, Topology, parse_regime
from commlab.plan.simulate import SimResult, simulate

REGIMES = {"ring": R.BANDWIDTH["ring-torch"].url, "gloo": R.url_of("gloo"), "ps-1": R.url_of("ps-sync"),
           "ps-2": R.url_of("ps-sync-2"),
           # commlab's own ring over zmq tcp, bound to its namespace's address (no keys: the addresses exist
           # only inside the run's namespaces), as `commlab bench compress` runs it across links
           "ring-tcp": R.BANDWIDTH["ring-hosts"].url}
BEGIN, END = "<!-- plan-validate:begin -->", "<!-- plan-validate:end -->"
LOOPBACK_BPS = 1e12  # no link limit: the transports' own per-byte cost decides
# tc's rate counts whole frames: a TCP segment of a 1500-byte MTU carries 1448 bytes (timestamps on)
# in 1514 on the wire, so the transports see this share of the capped rate
TCP_GOODPUT = 1448 / 1514


def share_now(cal: Calibration, url: str, n: int, a) -> float | None:
    """:func:`commlab.plan.calibrate.cpu_share` of ``n`` processes burning the CPU of ``url``'s step and meeting
    once per bucket and round of its exchange (compressed entries only, ``--share-seconds`` > 0; else None)."""
    regime, spec, ef = compression.parse_url(url)
    if spec.strip().lower() in ("", "none") or a.share_seconds <= 0:
        return None
    cost = cal.compressors[spec if ef else f"{spec} (ef=0)"]
    syncs = sum(m != "none" for moves in cost.moves for m in moves)  # the exchange's rounds, bucket by bucket
    return C.cpu_share(n, a.share_seconds, compression.step_cpu_s(cal, cost, n, a.batch_size), max(1, syncs))


def run_point(name: str, url: str, n: int, links: Links | None, a, out: Path, module: str = "workers",
              env_extra: dict | None = None, steps: int | None = None, around=None) -> dict:
    """Train ``n`` workers under ``url`` (over ``links`` if given); the steps after the warm-up. ``around``:
    called just before and just after the run (e.g. a measurement of the machine's load)."""
    metrics = out / "raw" / f"{name}.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    steps = steps or a.steps
    args = ["--model", a.model, "--steps", str(steps), "--batch-size", str(a.batch_size), "--seed", "0",
            "--metrics", str(metrics), "--no-progress"]
    env = dict(os.environ, **(env_extra or {}))
    job = launcher.worker_job(url, n, args, module=module, name=f"plan-validate {name}", env=env)
    if around:
        around()
    res = jobs.run(job, out / "logs" / f"{name}.log", a.job_timeout, links)
    if around:
        around()
    ranks = read_ranks(metrics, n)
    times = [x["step_s"] for lines in ranks for x in lines[a.warmup:]]
    # one sample per step: the ranks' mean of step t (a synchronous step ends on every rank together,
    # so its N records are one observation, not N)
    per_step = [statistics.fmean(lines[t]["step_s"] for lines in ranks)
                for t in range(a.warmup, min((len(lines) for lines in ranks), default=0))]
    rec = {"name": name, "url": url, "workers": n, "ok": res.ok and bool(times), "error": res.error(),
           "seconds": res.seconds, "step_s": times, "steps_s": per_step}
    if times:
        rec.update(median=statistics.median(times), p25=verdict.quantile(times, 0.25),
                   p75=verdict.quantile(times, 0.75),
                   # the worker's own time in a step: its step less what it waited on the exchange (its
                   # compute_s runs until backward ends, and an overlapped exchange waits inside backward)
                   compute_median=statistics.median(x["step_s"] - x["comm_s"] for lines in ranks
                                                    for x in lines[a.warmup:]))
        cpu = [x["cpu_s"] for lines in ranks for x in lines[a.warmup:] if "cpu_s" in x]
        if cpu:  # the worker's main-thread CPU per step: against the step, the share of a core it got
            rec.update(cpu_median=statistics.median(cpu), share_median=statistics.median(
                x["cpu_s"] / x["step_s"] for lines in ranks for x in lines[a.warmup:] if "cpu_s" in x))
    rec["staleness"] = read_staleness(res.log)
    return rec


def link_goodput(links: Links, out: Path) -> tuple[float, str]:
    """Bytes/s each way that TCP carries over one capped link of ``links`` with both directions busy
    (the bench's ``tcp-duplex`` ceiling between hosts 0 and 1, 16 MiB each way); the tc rate times
    TCP's framing share if that measurement fails."""
    cfg = bandwidth.BandwidthConfig([], 2, [16 * 2**20], repeat_bytes=96 * 2**20, min_iters=3, max_iters=6,
                                    warmup=1, ceilings=("tcp-duplex",), job_timeout=90, launches=1)
    recs, _, _ = bandwidth.run(cfg, out / f"link-{links.rate}", bandwidth.Budget.of(120), links)
    dup = [r for r in recs if r["regime"] == "tcp-duplex"]
    if dup:
        rate = dup[0]["size_bytes"] / (dup[0]["time_us"] * 1e-6)
        return rate, f"measured (raw TCP both ways, {rate / 1e6:.1f} MB/s)"
    rate = parse_rate(str(links.rate)) * TCP_GOODPUT
    return rate, f"not measured (the tcp-duplex run failed): tc rate x 1448/1514 = {rate / 1e6:.1f} MB/s"


def topology(n: int, rate_bps: float, share: float = 1.0) -> Topology:
    """The validation's hosts: one worker each, all on this machine's cores. ``compute_scale`` stretches compute
    by N / cores where there are more workers than cores; ``share`` (:func:`commlab.plan.calibrate.cpu_share`
    of N busy processes, which counts that stretch too) enters as the share beyond it."""
    scale = max(1.0, n / (os.cpu_count() or 1))
    return Topology(1, rate_bps, rate_bps, scale, min(1.0, share * scale))


def predict(cal: Calibration, url: str, n: int, rate_bps: float, batch: int,
            straggler: Straggler | None = None, share: float = 1.0) -> tuple[SimResult, float | None]:
    """(the simulator's result for ``url``, None); with ``compress=`` in it, the step is the compression
    model's (:func:`commlab.plan.compression.predict_at`, identical workers, ``share`` of a core each while
    all compute), and its crossover rate (bytes/s)."""
    topo = topology(n, rate_bps, share)
    regime, spec, ef = compression.parse_url(url)
    res = simulate(cal, topo, regime, n, batch, straggler, steps=12)
    if spec.strip().lower() in ("", "none"):
        return res, None
    p = compression.predict_at(cal, spec, regime, topo, n, batch, ef)
    return replace(res, step_s=p["step_s"]), p["crossover_bps"]


def add_overhead(points: list[dict], cal: Calibration) -> None:
    """Each compressed point predicted again with its run's per-step overhead: what its uncompressed sibling's
    measured step − wait exceeds the calibrated forward, backward and optimizer by
    (:func:`commlab.plan.compression.step_overhead`; the step's own mechanics, and what the calibration's
    single process did not see of two workers sharing these cores)."""
    for p, u in compressed_pairs(points):
        topo = topology(p["workers"], p["link_bps"], p.get("cpu_share", 1.0))
        o = compression.step_overhead(cal, u["compute_median"], p["batch"], topo.compute_scale)
        regime, spec, ef = compression.parse_url(p["url"])
        pred = compression.predict_at(cal, spec, regime, topo, p["workers"], p["batch"], ef, o)["step_s"]
        p.update(overhead_s=o, predicted_with_overhead=pred,
                 error_with_overhead_pct=100 * (pred - p["median"]) / p["median"])


def compressed_pairs(points: list[dict]) -> list[tuple[dict, dict]]:
    """(compressed point, the uncompressed point of the same regime, rate and N), where both ran."""
    plain = {(p["rate"], p["workers"], p["base"]): p for p in points if p["ok"] and not p.get("compress")}
    return [(p, plain[key]) for p in points if p["ok"] and p.get("compress")
            and (key := (p["rate"], p["workers"], p["base"])) in plain]


def crossover_check(points: list[dict]) -> tuple[int, int, list[str]]:
    """Compressed points against the uncompressed point of the same regime, rate and N: whether the measured
    medians say compression paid there, and whether the predicted crossover lies on that side of the link
    rate the prediction used. Returns (checked, agreeing, misses)."""
    checked = agree = 0
    misses = []
    for p, u in compressed_pairs(points):
        checked += 1
        if (p["median"] < u["median"]) == (p["crossover_bps"] > p["link_bps"]):
            agree += 1
        else:
            misses.append(f"{p['rate']} N={p['workers']} {p['regime']}")
    return checked, agree, misses


def rank_check(points: list[dict], launch_sigma: float = verdict.LAUNCH_SIGMA_FLOOR) -> tuple[int, int, list[str]]:
    """Pairs of regimes at one (rate, N) whose measured difference lies outside its interval: the 95%
    bootstrap interval of the ratio of their median steps (:mod:`bench.verdict`, unpaired, a step's mean
    over the ranks as one sample) lies wholly outside the verdicts' equivalence band (:data:`bench.verdict.BAND`:
    a difference within a few percent ranks nothing). Each point is one launch of its own, so the interval
    carries the launch-to-launch spread as ``commlab bench``'s training verdicts do (``launch_sigma``,
    by default this machine's pooled value; 0: the steps' own spread alone). Returns (checked,
    agreeing, misses)."""
    checked = agree = 0
    misses = []
    for x, y in _pairs_at_one_point(points):
        faster = verdict.compare(x["regime"], x["steps_s"], y["regime"], y["steps_s"], paired=False,
                                 launch_sigma=launch_sigma).winner
        if faster is None:
            continue
        checked += 1
        if (faster == x["regime"]) == (x["predicted"] < y["predicted"]):
            agree += 1
        else:
            misses.append(f"{x['rate']} N={x['workers']}: {x['regime']} vs {y['regime']}")
    return checked, agree, misses


def iqr_rank_check(points: list[dict]) -> tuple[int, int]:
    """The rougher rule, for comparison: pairs whose measured [p25, p75] do not overlap (checked, agreeing)."""
    checked = agree = 0
    for x, y in _pairs_at_one_point(points):
        if x["p75"] < y["p25"] or y["p75"] < x["p25"]:
            checked += 1
            agree += (x["median"] < y["median"]) == (x["predicted"] < y["predicted"])
    return checked, agree


def _pairs_at_one_point(points: list[dict]) -> list[tuple[dict, dict]]:
    """Every pair of points that ran, with their steps, at one (rate, N), in the order ``points`` lists them."""
    ok = [p for p in points if p["ok"] and p.get("steps_s")]
    return [(x, y) for i, x in enumerate(ok) for y in ok[i + 1:]
            if (x["rate"], x["workers"]) == (y["rate"], y["workers"])]


def met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def table(points: list[dict], stale: dict | None, cal: Calibration, command: str, links_seen: dict,
          load: str = "") -> list[str]:
    ok = [p for p in points if p["ok"]]
    errs = [abs(p["error_pct"]) for p in ok]
    out = [f"Regenerated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
           f"{'; ' + load if load else ''}; model "
           f"{cal.compute.model}, batch {points[0]['batch'] if points else '?'} per worker, one host per worker and "
           f"per shard, each link capped both ways with `tc tbf`. Measured: median step over every rank's steps "
           f"after the warm-up, [p25–p75]; \"measured step − wait\": the step less the time it blocked on the "
           f"exchange (compute, optimizer, the step's own overhead). Transports the regimes use: " + "; ".join(
               f"{k} {t.alpha_s * 1e6:.0f} us + {1 / t.beta_s / 1e9 if t.beta_s else float('inf'):.2g} GB/s "
               f"({t.source})" for k, t in ((k, cal.transport(k)) for k in
                                            sorted({compression.parse_url(p["url"])[0].transport
                                                    for p in points}))) +
           ". Link rate the prediction uses: " +
           "; ".join(f"{r}: {how}" for r, how in links_seen.items()) + ".", ""]
    rows = []
    for p in points:
        head = [p["rate"], p["workers"], p["regime"], p["hosts"]]
        if not p["ok"]:
            rows.append(head + [f"failed: {p['error'][:120]}", f"{p['predicted'] * 1e3:.0f} ms", "", "", ""])
            continue
        rows.append(head + [f"{p['median'] * 1e3:.0f} ms [{p['p25'] * 1e3:.0f}–{p['p75'] * 1e3:.0f}]",
                            f"{p['predicted'] * 1e3:.0f} ms", f"{p['error_pct']:+.1f}%",
                            f"{p['compute_median'] * 1e3:.0f} ms", f"{p['predicted_compute'] * 1e3:.0f} ms"])
    out += text.table(["link", "N", "regime", "hosts", "measured step [p25–p75]", "predicted", "error",
                       "measured step − wait", "predicted compute"], rows)
    checked, agree, misses = rank_check(points)
    one_checked, one_agree, one_misses = rank_check(points, launch_sigma=0.0)
    iqr_checked, iqr_agree = iqr_rank_check(points)
    out.append("")
    if errs:
        out.append(f"- Absolute error of the predicted median step: median **{statistics.median(errs):.1f}%**, largest "
                   f"**{max(errs):.1f}%** over {len(errs)} points (criteria: median <= 10%: "
                   f"{met(statistics.median(errs) <= 10)}; none above 25%: {met(max(errs) <= 25)}).")
    out.append(f"- Ranking: of {checked} pairs of regimes at one point whose measured difference lies outside its "
               f"interval (the 95% bootstrap interval of the ratio of median steps, one sample per step, with the "
               f"launch-to-launch spread of `commlab bench`'s verdicts, sd {verdict.LAUNCH_SIGMA_FLOOR:.2f} of log medians, "
               f"since every point is a launch of its own; it lies wholly outside "
               f"{verdict.band_text(verdict.BAND)} of 1), "
               f"the prediction orders **{agree}** the same way" + (f"; not: {', '.join(misses)}" if misses else "") +
               f" (criterion: all: {met(agree == checked)}). With the steps' own spread alone (no launch spread): "
               f"{one_agree} of {one_checked}" + (f" (not: {', '.join(one_misses)})" if one_misses else "") +
               f". By the rougher rule of non-overlapping [p25–p75] (each rank's step a sample): "
               f"{iqr_agree} of {iqr_checked}.")
    squeezed = [p for p in ok if p.get("compress")]
    cpu_of = [compression.step_cpu_s(cal, cal.compressors[spec if ef else f"{spec} (ef=0)"], p["workers"], p["batch"])
              for p in squeezed for _, spec, ef in [compression.parse_url(p["url"])]]
    if squeezed:
        worst = max(abs(p["error_pct"]) for p in squeezed)
        x_checked, x_agree, x_misses = crossover_check(points)
        with_o = [p for p in squeezed if "overhead_s" in p]
        again = (f"; with the run's per-step overhead (its uncompressed point's step − wait less the calibrated "
                 f"compute): " + ", ".join(f"{p['rate']} +{p['overhead_s'] * 1e3:.0f} ms: "
                                           f"{p['predicted_with_overhead'] * 1e3:.0f} ms {p['error_with_overhead_pct']:+.1f}%"
                                           for p in with_o)) if with_o else ""
        out.append(f"- Compressed points ({', '.join(sorted({p['compress'] for p in squeezed}))}): largest error of the "
                   f"predicted step **{worst:.1f}%** over {len(squeezed)} (criterion: each within 15%: {met(worst <= 15)}; "
                   f"each worker's share of a core, N processes computing in lockstep just before and after the point: "
                   + ", ".join(f"{p['rate']} {p.get('cpu_share', 1.0):.2f}" for p in squeezed) + "; the workers' "
                   f"main-thread CPU per step, median, and its share of the step: " + ", ".join(
                       f"{p['rate']} {p['cpu_median'] * 1e3:.0f} ms, {p['share_median']:.2f}" for p in squeezed
                       if "cpu_median" in p) + f" (calibrated CPU of the step: {', '.join(sorted({f'{x * 1e3:.0f} ms' for x in cpu_of}))}))"
                   f"{again}; "
                   f"the predicted crossover lies on the side of the link rate where the measured medians say compression "
                   f"paid (or did not) at **{x_agree}** of {x_checked}" + (f"; not: {', '.join(x_misses)}" if x_misses else "")
                   + f" (criterion: all: {met(x_agree == x_checked)}).")
    if stale:
        out.append(f"- Async staleness, {stale['workers']} workers on loopback, `{stale['url']}`, rank "
                   f"{stale['slow_rank']} sleeping {stale['delay_s'] * 1e3:.0f} ms per step: measured mean "
                   f"**{stale['measured_mean']:.2f}** (p90 {stale['measured_p90']}, max {stale['measured_max']}, "
                   f"{stale['measured_updates']} updates), predicted **{stale['predicted_mean']:.2f}** (p90 "
                   f"{stale['predicted_p90']}, max {stale['predicted_max']}): {stale['error_pct']:+.1f}% "
                   f"(criterion: within 25%: {met(abs(stale['error_pct']) <= 25)}).")
    return out


def between_markers(text: str, lines: list[str]) -> str:
    """``text`` with what lies between the BEGIN and END markers replaced by ``lines``."""
    if BEGIN not in text or END not in text or text.index(END) < text.index(BEGIN):
        raise ValueError(f"no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + rest.split(END, 1)[1]


def hist_stats(values: Sequence[int]) -> tuple[float, float, float]:
    return statistics.fmean(values), verdict.quantile(values, 0.9), max(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,2gbit")
    p.add_argument("--workers", default="2,3", help="worker counts (hosts: N, plus K for a PS)")
    p.add_argument("--regimes", default="ring,gloo,ps-1,ps-2", help=f"from {', '.join(REGIMES)}")
    p.add_argument("--compress", nargs="*", default=[], metavar="SPEC",
                   help="also each all-reduce regime with compress=SPEC (e.g. powersgd:4,start_iter=3), predicted "
                        "by commlab.plan.compression and checked: step within 15%%, crossover on the measured side")
    p.add_argument("--share-seconds", type=float, default=2.0,
                   help="before and after each compressed point, N processes compute in lockstep this long to "
                        "measure the share of a core each worker gets (commlab.plan.calibrate.cpu_share); 0: "
                        "assume a core each")
    p.add_argument("--model", default="mlp-25m")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--job-timeout", type=float, default=150.0)
    p.add_argument("--budget-s", type=float, default=480.0, help="start no new job after this many seconds")
    p.add_argument("--calibration", help="a saved calibration JSON (else: measured now)")
    p.add_argument("--bench-run", help="transports from this 'commlab bench' run folder (else: a short run now)")
    p.add_argument("--stale-workers", type=int, default=3)
    p.add_argument("--stale-delay", type=float, default=0.3, help="seconds the slowed worker sleeps per step")
    p.add_argument("--stale-steps", type=int, default=16)
    p.add_argument("--no-staleness", action="store_true")
    p.add_argument("--no-link-measure", action="store_true",
                   help="predict at the tc rate x 1448/1514 instead of a measured raw TCP rate over the link")
    p.add_argument("--out", default=None, help="folder (default runs/plan-validate-<UTC time>)")
    p.add_argument("--docs", help="rewrite the table in this markdown file between the markers")
    a = p.parse_args(argv)
    command = "python -m bench.plan_validate " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        names = text.names(a.regimes, REGIMES, "--regimes")
    except ValueError as exc:
        print(f"plan_validate: {exc}", file=sys.stderr)
        return 2
    why = link_unavailable_reason()
    if why:
        print(f"plan_validate: {why}: the runs across capped links need it", file=sys.stderr)
        return 2
    out = Path(a.out or Path("runs") / time.strftime("plan-validate-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load0 = os.getloadavg()
    if a.calibration:
        cal = Calibration.load(a.calibration)
    else:
        run = a.bench_run or C.calibration_run(out / "calibration")
        cal = C.calibrate(a.model, a.batch_size, run)
    # (name, base regime, spec or None, url): each regime, then each all-reduce regime with each compressor
    entries = [(n, n, None, REGIMES[n]) for n in names] + [
        (f"{n} {spec}", n, spec, R.with_query(REGIMES[n], f"compress={spec}")) for spec in a.compress for n in names
        if compression.parse_url(REGIMES[n])[0].kind == "allreduce"]
    cal = compression.with_urls(cal, [url for *_, url in entries])
    cal.save(out / "calibration.json")
    workers = [int(x) for x in a.workers.split(",")]
    points = []
    links_seen: dict[str, str] = {}
    for rate in a.rates.split(","):
        shards = max(compression.parse_url(REGIMES[n])[0].shards if REGIMES[n].startswith("ps") else 0 for n in names)
        with Links(max(workers) + shards, rate, tag=f"pv{os.getpid() % 100000}") as links:
            goodput, how = link_goodput(links, out) if not a.no_link_measure else \
                (parse_rate(rate) * TCP_GOODPUT, "tc rate x 1448/1514")
            links_seen[rate] = how
            print(f"plan_validate: {rate}: the link carries {goodput / 1e6:.1f} MB/s each way ({how})", file=sys.stderr)
            for n in workers:
                for name, base, spec, url in entries:
                    if time.monotonic() - t0 > a.budget_s:
                        print(f"plan_validate: budget spent; {rate} N={n} {name} not run", file=sys.stderr)
                        continue
                    # what each of N workers computing in lockstep gets of this machine's cores, measured
                    # just before and just after the run (the machine's other work comes and goes): the mean
                    shares: list[float | None] = []
                    rec = run_point(f"{rate}-n{n}-{name.replace(' ', '-')}", url, n, links, a, out,
                                    around=lambda: shares.append(share_now(cal, url, n, a)))
                    share = statistics.fmean(x for x in shares if x is not None) if any(shares) else 1.0
                    pred, cross = predict(cal, url, n, goodput, a.batch_size, share=share)
                    reg = compression.parse_url(REGIMES[base])[0]
                    rec.update(rate=rate, regime=name, base=base, compress=spec, batch=a.batch_size,
                               predicted=pred.step_s, link_bps=goodput, predicted_compute=pred.compute_s,
                               hosts=n + (reg.shards if reg.kind == "ps" else 0), crossover_bps=cross,
                               cpu_share=share)
                    if rec["ok"]:
                        rec["error_pct"] = 100 * (pred.step_s - rec["median"]) / rec["median"]
                    points.append(rec)
                    print(f"plan_validate: {rate} N={n} {name}: measured "
                          f"{rec.get('median', float('nan')) * 1e3:.0f} ms, predicted {pred.step_s * 1e3:.0f} ms"
                          + ("" if rec["ok"] else f" (FAILED: {rec['error']})"), file=sys.stderr)
    add_overhead(points, cal)
    stale = None
    if not a.no_staleness:
        n, url, d = a.stale_workers, "ps://?shards=1&mode=async", a.stale_delay
        rec = run_point(f"stale-n{n}", url, n, None, a, out, module="bench.plan_slow_worker",
                        env_extra={"PLAN_SLOW_RANK": str(n - 1), "PLAN_SLOW_S": str(d)}, steps=a.stale_steps)
        strag = Straggler(slow_workers=1, slow_delay_s=d)
        pred = simulate(cal, Topology(1, LOOPBACK_BPS, LOOPBACK_BPS, max(1.0, n / (os.cpu_count() or 1))),
                        parse_regime(url), n, a.batch_size, strag, steps=a.stale_steps)
        if rec["staleness"] and pred.staleness:
            pv = [k for k, c in pred.staleness.items() for _ in range(c)]
            mm, mp, mx = hist_stats(rec["staleness"])
            pm, pp, px = hist_stats(pv)
            stale = {"workers": n, "url": url, "slow_rank": n - 1, "delay_s": d, "measured_mean": mm,
                     "measured_p90": mp, "measured_max": mx, "measured_updates": len(rec["staleness"]),
                     "predicted_mean": pm, "predicted_p90": pp, "predicted_max": px,
                     "error_pct": 100 * (pm - mm) / mm if mm else float("nan"),
                     "measured_hist": {str(k): rec["staleness"].count(k) for k in sorted(set(rec["staleness"]))},
                     "predicted_hist": {str(k): v for k, v in pred.staleness.items()}}
            print(f"plan_validate: staleness mean measured {mm:.2f}, predicted {pm:.2f}", file=sys.stderr)
        else:
            print(f"plan_validate: the async run reported no staleness ({rec['error']})", file=sys.stderr)
    load1 = os.getloadavg()
    load = (f"{os.cpu_count()} cores shared with other jobs, load average (1, 5, 15 min) "
            f"{'/'.join(f'{x:.1f}' for x in load0)} at the start, {'/'.join(f'{x:.1f}' for x in load1)} at the end, "
            f"{(time.monotonic() - t0) / 60:.0f} min")
    lines = table(points, stale, cal, command, links_seen, load)
    (out / "plan_validate.json").write_text(json.dumps({"command": command, "points": points, "staleness": stale,
                                                        "seconds": time.monotonic() - t0}, indent=1))
    (out / "plan_validate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.docs:
        doc = Path(a.docs)
        try:
            doc.write_text(between_markers(doc.read_text(), lines))
        except ValueError as exc:
            print(f"plan_validate: {doc}: {exc}; table not written there", file=sys.stderr)
            return 1
    print(f"plan_validate: wrote {out}/plan_validate.md ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
