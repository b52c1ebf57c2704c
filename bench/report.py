"""``report.md``: what one run measured, with its spread, and a short verdict per question.

Every figure here is read from the records this run wrote (``bandwidth.json``,
``convergence.json``); nothing is carried over from another run.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench import plots, verdict
from bench import bandwidth, curves
from bench.bandwidth import TOO_SLOW, launch_groups
from bench.records import bus_factor
from bench.text import fixed, fmt, fmt_us, human_bytes, ms, table
from commlab.plan.recommend import at_scale_from_bench

SECTIONS = ("## Run", "## Failed, skipped or unavailable", "## Bandwidth", "## Convergence", "## Scaling with N",
            "## Probes", "## Files")


def bandwidth_section(records: list[dict], cfg: dict, png: Path | None) -> list[str]:
    out = ["## Bandwidth", ""]
    if not records:
        return out + ["Not measured in this run.", ""]
    n = cfg["workers"]
    out += [f"N = {n} workers, float32, sizes {', '.join(human_bytes(s) for s in cfg['sizes'])}; per size "
            f"{cfg['warmup']} warm-up exchanges, then the repeats shown (about {human_bytes(cfg['repeat_bytes'])} moved, "
            f"between {cfg['min_iters']} and {cfg['max_iters']}). Time is per exchange, the slowest rank's, "
            "median with [min–max] and p90 (gloo's small operations have a long tail).",
            "",
            "- **algbw** = S / t: how fast each worker has its S-byte result (one definition for all).",
            f"- **busbw**: bytes each worker's link carries per second in each direction: all-reduce "
            f"algbw x 2(N-1)/N = x{bus_factor('allreduce', n):.2f} (nccl-tests); parameter server algbw x 1 "
            f"(each worker pushes S and pulls S); raw TCP and memcpy x 1; noop 0 (moves nothing). "
            f"A PS and an all-reduce at equal busbw use their links equally well.",
            "- **wrong**: elements differing from the exact reference, summed over every timed exchange and rank.",
            "- Ceilings are what plain Python reaches on this machine (raw TCP, memcpy); a library moving bytes from "
            "C++ threads (gloo) can pass the Python TCP figures.",
            ""]
    for size in sorted({r["size_bytes"] for r in records}):
        rows = []
        for r in sorted((r for r in records if r["size_bytes"] == size), key=lambda r: (r["kind"] != "regime", r["time_us"])):
            name = r["regime"] + (" *(ceiling)*" if r["kind"] == "ceiling" else "")
            rows.append([name, str(r["workers"]), str(r["iters"]),
                         f"{fmt_us(r['time_us'])} [{fmt_us(r['time_us_min'])}–{fmt_us(r['time_us_max'])}]",
                         fmt_us(r["time_us_p90"]), "— (floor)" if r["method"] == "noop" else f"{r['algbw_gbps']:.3g}",
                         f"{r['busbw_gbps']:.3g} [{r['busbw_gbps_min']:.3g}–{r['busbw_gbps_max']:.3g}]", str(r["wrong"])])
        out += [f"### {human_bytes(size)} ({size // 4} float32)", ""]
        out += table(["regime", "N", "repeats", "time median [min–max]", "p90", "algbw GB/s",
                       "busbw GB/s median [min–max]", "wrong"], rows)
        out.append("")
    out += ["### Verdict: fastest exchange per size", "",
            f"Ratios of median times, 95% intervals from this run's own iterations: {verdict.rule()}.", ""]
    out += bandwidth_verdict(records) + [""]
    out += against_peer(records)
    if png:
        out += [f"![exchange time and busbw against size]({png.name})", ""]
    return out


def _compared(records: list[dict], size: int) -> list[dict]:
    """The records at ``size`` that verdicts compare: regimes (not noop) with samples and no wrong result."""
    return [r for r in records if r["size_bytes"] == size and r["kind"] == "regime" and r["method"] != "noop"
            and not r["wrong"] and r.get("samples_us")]


def size_verdicts(records: list[dict], size: int, each_pair: bool = False) -> list[verdict.Verdict]:
    """At ``size``, from the regimes' records with samples and no wrong result: the fastest against each
    other one, or with ``each_pair`` every pair in the order the run listed them (the same lines in every
    run, whichever is fastest); bootstrap over iterations, paired when they took turns."""
    real = _compared(records, size)
    if len(real) < 2:
        return []
    return (verdict.pairs if each_pair else verdict.against_best)(
        {r["regime"]: r["samples_us"] for r in real}, paired=bandwidth.paired(real), clusters=bandwidth.clusters(real))


def bandwidth_verdict(records: list[dict]) -> list[str]:
    lines = []
    wrong = [r for r in records if r["wrong"]]
    if wrong:
        lines.append("- **Wrong results**: " + ", ".join(f"{r['regime']} at {human_bytes(r['size_bytes'])} "
                                                        f"({r['wrong']} elements)" for r in wrong)
                     + ". Their times do not count.")
    for size in sorted({r["size_bytes"] for r in records}):
        at = [r for r in records if r["size_bytes"] == size]
        real = sorted((r for r in at if r["kind"] == "regime" and r["method"] != "noop" and not r["wrong"]),
                      key=lambda r: r["time_us"])
        if not real:
            continue
        best = real[0]
        vs = size_verdicts(records, size)
        if not vs:
            text = f"- {human_bytes(size)}: only {best['regime']} ran ({fmt_us(best['time_us'])} median)"
        else:
            paired = vs[0].paired
            how = "paired over iterations (they took turns)" if paired else "unpaired (separate jobs)"
            text = (f"- {human_bytes(size)}: " + "; ".join(v.text() for v in vs) +
                    f" (ratio of median times, 95% bootstrap interval, {how})")
            if all(v.winner is None for v in vs):
                text += f". No regime is the fastest here: the best median was {best['regime']}'s, {fmt_us(best['time_us'])}"
        duplex = next((r for r in at if r["regime"] == "tcp-duplex"), None)
        if duplex and best["busbw_gbps"] > 0:
            text += f"; {best['regime']}'s busbw {best['busbw_gbps']:.3g} GB/s = {best['busbw_gbps'] / duplex['busbw_gbps']:.0%} of " \
                    f"raw TCP with both directions busy ({duplex['busbw_gbps']:.3g} GB/s)"
        floor = next((r for r in at if r["method"] == "noop"), None)
        if floor:
            text += f"; noop floor {fmt_us(floor['time_us'])}"
        ar = next((r for r in real if r["method"] == "allreduce"), None)
        ps = next((r for r in real if r["method"] == "pushpull"), None)
        if ar and ps:  # the same axis: bytes per worker per direction per second
            text += (f". Side by side: the best parameter server ({ps['regime']}) moves {ps['busbw_gbps']:.3g} GB/s per "
                     f"worker each way, the best all-reduce ({ar['regime']}) {ar['busbw_gbps']:.3g} GB/s "
                     f"({ps['busbw_gbps'] / ar['busbw_gbps']:.2f}x)")
        lines.append(text + ".")
    return lines or ["- No regime produced a result."]


def against_peer(records: list[dict], peer: str = "gloo") -> list[str]:
    """Each regime's busbw against ``peer``'s at every size, with the interval (busbw ratio = inverse
    time ratio: ``t_peer / t_regime``); "=" where it lies inside the verdicts' band, "≈" where it is
    indistinguishable (:mod:`bench.verdict`)."""
    peers = {r["size_bytes"]: r for r in records if r["regime"] == peer and not r["wrong"] and r.get("samples_us")}
    names = list(dict.fromkeys(r["regime"] for r in records if r["regime"] != peer and r["method"] != "noop"
                               and r.get("samples_us")))
    sizes = sorted(peers)
    if not peers or not names:
        return []
    rows = []
    for name in names:
        row = [name]
        for size in sizes:
            r = next((x for x in records if x["regime"] == name and x["size_bytes"] == size), None)
            if r is None or r["wrong"]:
                row.append("—")
                continue
            v = verdict.compare(name, r["samples_us"], peer, peers[size]["samples_us"],
                                paired=bandwidth.paired([r, peers[size]]),
                                clusters=bandwidth.clusters([r, peers[size]]))
            row.append(f"{'' if v.winner is not None else v.sign() + ' '}{v.ratio:.2f}x [{v.lo:.2f}, {v.hi:.2f}]")
        rows.append(row)
    return ([f"### Against {peer}: busbw / {peer}'s busbw (= {peer}'s time / the regime's), 95% interval", "",
             f"Bootstrap over the timed iterations, paired where the two took turns in one job; {verdict.rule()} "
             f"(= marks equivalent, ≈ indistinguishable). Ceilings are listed too: how far {peer} is "
             "from what plain sockets reach.", ""]
            + table(["regime"] + [human_bytes(s) for s in sizes], rows) + [""])


def convergence_section(summaries: list[dict], cfg: dict, pngs: dict, sigma: float = 0.0,
                        link: str | None = None) -> list[str]:
    out = ["## Convergence", ""]
    if not summaries:
        return out + ["Not measured in this run.", ""]
    n = cfg["workers"]
    out += [f"Model `{cfg['model']}`, seed {cfg['seed']}, {cfg['steps']} steps, batch {cfg['batch_size']} per worker "
            f"x {n} workers = global batch {cfg['batch_size'] * n} (local:// runs one worker with the whole "
            f"{cfg['batch_size'] * n}), SGD lr {cfg['lr']}, the same data order; test set evaluated on rank 0 every "
            f"{cfg['eval_every']} steps. Target accuracy {cfg['target_acc']:.0%}. Step times are rank 0's, median "
            f"[min–max] over the {cfg['steps']} steps.",
            "",
            f"**Equal samples.** Every regime processes the same samples: each of the {n} workers takes {cfg['steps']} "
            f"steps of batch {cfg['batch_size']} ({cfg['steps'] * cfg['batch_size'] * n} samples in all, as local:// "
            f"in {cfg['steps']} steps of {cfg['batch_size'] * n}). A synchronous regime applies {cfg['steps']} updates, "
            f"each of the mean gradient; an asynchronous one applies {n} x {cfg['steps']} updates, each of one worker's "
            f"gradient. **Learning rate**: at the same per-update lr ({cfg['lr']}) async/SSP move the parameters {n}x as "
            f"far per step as sync, so a faster descent there is partly a larger step, not a benefit of asynchrony; the "
            f"`-lr/N` rows use lr / {n} = {cfg['lr'] / n:g} per update, so the updates of one step add up to sync's step. "
            f"The `-lr/N` rows are the fair comparison of staleness; the others are what a user gets by changing only "
            f"the URL. Both are shown.", ""]
    rows = []
    for s in summaries:
        rows.append([s["regime"], s["kind"], str(s["workers"]), fmt(s.get("lr")), fmt(s.get("samples")),
                     fmt(len(s["staleness"])) if s.get("staleness") else ("—" if s["kind"] != "sync" else fmt(s["steps"])),
                     fixed(s["test_acc"], ".3f"), fixed(s["test_loss"]),
                     f"{s['wall_s']:.2f}", fmt(s["steps_to_target"]),
                     "—" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.2f}",
                     human_bytes(s["bytes_per_step"]),
                     f"{s['step_s_median'] * 1e3:.1f} [{s['step_s_min'] * 1e3:.1f}–{s['step_s_max'] * 1e3:.1f}]",
                     ms(s["compute_s_median"]),
                     "overlapped" if s["comm_s_median"] is None else f"{s['comm_s_median'] * 1e3:.1f}",
                     fmt(s["max_abs_test_loss_diff"], 2)])
    out += table(["regime", "kind", "N", "lr per update", "samples", "updates applied", "final test acc",
                   "final test loss", "wall s", "steps to target",
                   "s to target", "sent / worker / step", "step ms median [min–max]", "compute ms",
                   "exposed comm ms", "max abs test-loss diff vs local"], rows)
    out += ["", "### Do the synchronous regimes reproduce local:// on the combined batch?", ""]
    out += sync_check(summaries, link) + [""]
    out += ["### Verdict: fastest to accuracy", ""] + accuracy_verdict(summaries, cfg["target_acc"], sigma) + [""]
    out += ["### Verdict: the cost of staleness", ""] + staleness_verdict(summaries, sigma) + [""]
    if pngs.get("staleness"):
        out += [f"![staleness histogram]({pngs['staleness'].name})", ""]
    out += ["### Step time: compute against exposed communication", "",
            "Exposed communication is the time `step()` blocked after backward: the exchange that backward's "
            "overlap did not hide, plus applying the update (local:// shows the update alone). The plot splits the mean step (means add up; the table's medians do not): "
            "'rest' is the mean step minus mean compute and mean exposed communication (batch slicing, zero_grad, "
            "metrics).", ""]
    if pngs.get("split"):
        out += [f"![compute / communication split]({pngs['split'].name})", ""]
    if pngs.get("convergence"):
        out += [f"![loss and accuracy against step, time and bytes]({pngs['convergence'].name})", ""]
    return out


def sync_check(summaries: list[dict], link: str | None = None) -> list[str]:
    """Do the synchronous regimes' test-loss curves lie on local://'s (:func:`bench.curves.agreement`)? A
    compressed regime's line says how far it went and, on loopback (``link`` None), that no compressor pays there."""
    lines = curves.agreement(summaries, any(s["kind"] == "reference" for s in summaries), what="test-loss",
                             why="float32 summation order")
    where = ("on loopback no compressor pays (the link is memory: encoding costs more than the bytes it saves); "
             "`commlab bench compress` measures where one does" if link in (None, "loopback")
             else "`commlab bench compress` says when it pays")
    for s in summaries:  # compression changes the arithmetic by design: how far it went, not a verdict
        if s["kind"] == "compressed" and s["max_abs_test_loss_diff"] is not None:
            lines.append(f"- {s['regime']}: compressed, so not local's arithmetic by design: max |test-loss "
                         f"difference| {s['max_abs_test_loss_diff']:.3g} ({where}).")
    return lines


def steps_sigmas(summaries: list[dict]) -> dict[str, float]:
    """Each regime's spread of log steps to the target: asynchronous regimes reach it at a different
    step from run to run (:data:`bench.verdict.STEPS_SIGMA_ASYNC`); synchronous ones and the reference
    at the same step (the same arithmetic from the same seed)."""
    return {s["regime"]: verdict.STEPS_SIGMA_ASYNC if s["kind"] == "async" else 0.0 for s in summaries}


def to_target(hit: list[dict], sigma: float, against: dict | None = None) -> list[verdict.Verdict]:
    """Time to the target (steps to it x the mean step time, bootstrapped over each regime's steps,
    unpaired, with the launch spread ``sigma`` and :func:`steps_sigmas`) of the summaries ``hit``: the
    fastest against each other one, or ``against`` (one of them) against each other one."""
    sig = steps_sigmas(hit)
    if against is None:
        return verdict.against_best({s["regime"]: s["step_s_samples"] for s in hit}, paired=False, stat="mean",
                                    scales={s["regime"]: s["steps_to_target"] for s in hit}, launch_sigma=sigma,
                                    steps_sigmas=sig)
    return [verdict.compare(against["regime"], against["step_s_samples"], s["regime"], s["step_s_samples"],
                            paired=False, stat="mean", scale_a=against["steps_to_target"], scale_b=s["steps_to_target"],
                            launch_sigma=sigma, steps_sigma_a=sig[against["regime"]], steps_sigma_b=sig[s["regime"]])
            for s in hit if s is not against]


def accuracy_verdict(summaries: list[dict], target: float, sigma: float = 0.0) -> list[str]:
    """Who reached the target first, with intervals: time to target = steps to target x the mean step
    time, bootstrapped over each regime's steps (unpaired: each regime ran as a job of its own)."""
    cands = [s for s in summaries if s["kind"] != "floor"]
    hit = [s for s in cands if s["time_to_target_s"] is not None and s.get("step_s_samples")]
    lines = []
    if hit:
        vs = to_target(hit, sigma)
        best = next(s for s in hit if s["regime"] == (vs[0].a if vs else hit[0]["regime"]))
        lines.append(f"- Estimated time to {target:.0%} test accuracy = steps to target x mean step time (rank 0). "
                     f"Best: {best['regime']}, step {best['steps_to_target']}, about "
                     f"{best['steps_to_target'] * statistics.fmean(best['step_s_samples']):.2f} s "
                     f"(measured wall time {best['time_to_target_s']:.2f} s, evaluations included).")
        for v in vs:
            lines.append(f"- {v.text('faster to the target')} (95% bootstrap interval over the steps, unpaired, with "
                         f"the launch spread and, for asynchronous regimes, the spread of steps to the target).")
        if any(s["kind"] == "reference" for s in hit):
            lines.append("- local:// is one process with no communication: the distributed regimes are run beside "
                         "it to show what communication costs on this machine, not to beat it on 2 cores.")
    missed = [s["regime"] for s in cands if s["time_to_target_s"] is None]
    if missed:
        lines.append(f"- Did not reach {target:.0%} within the run: {', '.join(missed)}.")
    return lines or ["- No regime ran."]


def _stale_stats(vals: list[int]) -> str:
    return (f"mean {statistics.fmean(vals):.2f}, median {statistics.median(vals):g}, "
            f"p90 {verdict.quantile(vals, 0.9)}, max {max(vals)}")


def _bound(url: str) -> int | None:
    from urllib.parse import parse_qs, urlsplit
    q = parse_qs(urlsplit(url).query)
    return int(q["staleness"][0]) if "ssp" in q.get("mode", [""]) and "staleness" in q else None


def staleness_verdict(summaries: list[dict], sigma: float = 0.0) -> list[str]:
    asyncs = [s for s in summaries if s["kind"] == "async"]
    if not asyncs:
        return ["- No asynchronous regime ran in this run (see the failed/unavailable list), so its cost is not "
                "measured here."]
    base = next((s for s in summaries if s["regime"] == "ps-sync"), None) or \
        next((s for s in summaries if s["kind"] == "reference"), None)
    lines = []
    if base:
        lines.append(f"- Against {base['regime']} at equal samples ({base.get('samples', '?')} samples, lr "
                     f"{fmt(base.get('lr'))}): final test loss {base['test_loss']:.4f}, acc "
                     f"{base['test_acc']:.3f}. One run each: the loss differences below are one draw, not an "
                     "interval; step times come with theirs.")
    for s in asyncs:
        text = (f"- {s['regime']} (lr {fmt(s.get('lr'))} per update, {len(s['staleness']) if s.get('staleness') else '?'}"
                f" updates): final test acc {s['test_acc']:.3f}, loss {s['test_loss']:.4f}")
        if base:
            text += f" ({s['test_loss'] - base['test_loss']:+.4f} against {base['regime']})"
            if s.get("step_s_samples") and base.get("step_s_samples"):
                v = verdict.compare(s["regime"], s["step_s_samples"], base["regime"], base["step_s_samples"],
                                    paired=False, launch_sigma=sigma)
                text += f"; step time: {v.text()}"
        if s.get("staleness"):
            text += f". Version gap (server updates between pull and apply): {_stale_stats(s['staleness'])}"
        else:
            text += ". Version gap: not reported (no server printed a `staleness` histogram when it stopped)"
        if s.get("clock_gap"):
            text += f". Clock gap (the pushing worker's step minus the slowest worker's): {_stale_stats(s['clock_gap'])}"
            b = _bound(s["url"])
            if b is not None:
                text += (f"; SSP's bound S = {b}: **max clock gap {max(s['clock_gap'])}**"
                         + ("" if max(s["clock_gap"]) <= b else " (ABOVE the bound: a bug)"))
        lines.append(text + ".")
    return lines


def scaling_section(points: list[dict], cfg: dict | None, png: Path | None, cpus: int | None,
                    sigma: float = 0.0) -> list[str]:
    out = ["## Scaling with N", ""]
    if not points:
        return out + ["Not measured in this run.", ""]
    out += [f"The same model and per-worker batch ({cfg['batch_size']}) at each N; step time and exposed "
            f"communication are rank 0's medians with a 95% bootstrap interval over the steps "
            f"({cfg['scale_steps']} steps per run, the first {cfg['scale_warmup']} dropped; N = {cfg['workers']} "
            f"reuses the convergence run). **This machine has {cpus} cores: N > {cpus} puts more ranks than cores "
            f"on it (oversubscribed), so growth there measures CPU sharing as much as communication.**", ""]
    rows = []
    for p in points:
        st = verdict.median_interval(p["step_s_samples"])
        cm = verdict.median_interval(p["comm_s_samples"]) if min(p["comm_s_samples"]) > 0 else (p["comm_s_median"],) * 3
        rows.append([p["regime"], str(p["workers"]), f"{st[0] * 1e3:.1f} [{st[1] * 1e3:.1f}, {st[2] * 1e3:.1f}]",
                     f"{cm[0] * 1e3:.1f} [{cm[1] * 1e3:.1f}, {cm[2] * 1e3:.1f}]"])
    out += table(["regime", "N", "step ms, median [95%]", "exposed comm ms, median [95%]"], rows) + [""]
    for name in dict.fromkeys(p["regime"] for p in points):
        ps = sorted((p for p in points if p["regime"] == name), key=lambda p: p["workers"])
        for a, b in zip(ps, ps[1:]):
            v = verdict.compare(f"N={a['workers']}", a["step_s_samples"], f"N={b['workers']}", b["step_s_samples"],
                                paired=False, launch_sigma=sigma)
            out.append(f"- {name}: step at N={b['workers']} / N={a['workers']}: {1 / v.ratio:.2f}x "
                       f"[{1 / v.hi:.2f}, {1 / v.lo:.2f}]" + (f" ({v.said()})" if v.winner is None else ""))
    out.append("")
    if png:
        out += [f"![step time and exposed communication against N]({png.name})", ""]
    return out


def probes_section(probes: dict) -> list[str]:
    from bench.probes import lines
    out = ["## Probes", ""]
    if not probes:
        return out + ["Not run.", ""]
    return out + ["Facts about this machine that tests do not assert (they depend on it): measured here, "
                  "in this run.", ""] + lines(probes) + [""]


def _short(v: verdict.Verdict) -> str:
    v = v.oriented()
    return f"{v.a} {v.sign()} {v.b} {v.ratio:.2f}x [{v.lo:.2f}, {v.hi:.2f}]"


def bandwidth_pairs(records: list[dict]) -> dict[int, list[verdict.Verdict]]:
    """:func:`size_verdicts` of every pair at every size of the run, smallest first."""
    return {size: size_verdicts(records, size, each_pair=True) for size in sorted({r["size_bytes"] for r in records})}


def glance(records: list[dict], summaries: list[dict], sigma: float = 0.0,
           pairs: dict[int, list[verdict.Verdict]] | None = None) -> list[str]:
    """Every verdict of the run on one line each, ``A > B`` (A faster), ``A = B`` (equivalent within the
    band) or ``A ≈ B`` (indistinguishable),
    with the ratio and its 95% interval: what to compare between runs. ``pairs``: :func:`bandwidth_pairs`
    of ``records`` where the caller has it already."""
    out = []
    for size, vs in (bandwidth_pairs(records) if pairs is None else pairs).items():
        if vs:
            out.append(f"- bandwidth {human_bytes(size)}: " + "; ".join(_short(v) for v in vs))
    hit = [s for s in summaries if s["kind"] != "floor" and s["time_to_target_s"] is not None and s.get("step_s_samples")]
    if len(hit) > 1:
        # against the one-process reference where it ran (the same lines in every run), else the best
        ref = next((s for s in hit if s["kind"] == "reference"), None)
        out.append("- time to target: " + "; ".join(_short(v) for v in to_target(hit, sigma, ref)))
    base = next((s for s in summaries if s["regime"] == "ps-sync"), None)
    for s in summaries:
        if base and s["kind"] == "async" and s.get("step_s_samples") and base.get("step_s_samples"):
            v = verdict.compare(s["regime"], s["step_s_samples"], base["regime"], base["step_s_samples"], paired=False,
                                launch_sigma=sigma)
            out.append(f"- step time {s['regime']} vs {base['regime']}: {_short(v)}")
    return out


def launch_notes(records: list[dict], pairs: dict[int, list[verdict.Verdict]] | None = None) -> list[str]:
    """The bandwidth pairs called indistinguishable although a launch alone (the bootstrap over its own
    iterations, paired) names a winner: the launches disagree (gloo's small all-reduces do,
    docs/bench.md), and with a few launches the interval, which resamples launches, reaches across 1.
    Each launch's verdict, so a reader sees why; not a verdict of the run. ``pairs``: as for :func:`glance`."""
    out = []
    for size, vs in (bandwidth_pairs(records) if pairs is None else pairs).items():
        real = _compared(records, size)
        clusters = bandwidth.clusters(real)
        if not clusters or len(clusters) < 2:
            continue
        samples = {r["regime"]: r["samples_us"] for r in real}
        for v in vs:
            if v.winner is not None or v.equivalent:  # the run said something: nothing to explain
                continue
            each = verdict.per_launch(v.a, samples[v.a], v.b, samples[v.b], clusters)
            if any(x.winner is not None for x in each):
                out.append(f"- bandwidth {human_bytes(size)}, {v.a} vs {v.b}: "
                           + "; ".join(f"launch {i + 1} {_short(x)}" for i, x in enumerate(each)))
    return out


def failures_section(failures: list[dict]) -> list[str]:
    """The runs that did not give a result: the failures first, then those too slow to judge here now
    (stopped by a deadline that had already scaled with this machine's load), skipped or unavailable."""
    out = ["## Failed, skipped or unavailable", ""]
    if not failures:
        return out + ["Every requested regime ran.", ""]
    failures = sorted(failures, key=lambda f: f["status"] != "failed")  # stable: each group in run order
    slow = sum(f["status"] == TOO_SLOW for f in failures)
    if slow:
        out += [f"{slow} run(s) **{TOO_SLOW}**: stopped by their deadline while they still progressed, on a "
                f"machine too busy to finish them even with the deadline stretched by its measured slowdown. "
                f"They are not failures: nothing is known about them from this run; rerun on a quieter machine.", ""]
    rows = [[f["phase"], f["regime"], f"`{f['url']}`" if f.get("url") else "", f["status"],
             f["error"][:300] + (f" (log: `{f['log']}`)" if f.get("log") else "")]
            for f in failures]
    return out + table(["phase", "regime", "URL", "status", "error"], rows) + [""]


def write(run_dir: Path, manifest: dict, records: list[dict], summaries: list[dict], curves: dict,
          failures: list[dict], scaling: list[dict] | None = None, probes: dict | None = None) -> Path:
    """Plots and report.md in ``run_dir``; returns the report's path."""
    bw_cfg, cv_cfg = manifest["config"].get("bandwidth"), manifest["config"].get("convergence")
    sc_cfg = manifest["config"].get("scaling")
    pngs = {"busbw": plots.bandwidth(records, run_dir / "busbw.png", bw_cfg["workers"]) if bw_cfg else None}
    if cv_cfg:
        pngs["convergence"] = plots.convergence(summaries, curves, run_dir / "convergence.png", cv_cfg["target_acc"])
        pngs["staleness"] = plots.staleness(summaries, run_dir / "staleness.png")
        pngs["split"] = plots.step_split(summaries, run_dir / "split.png")
    if scaling:
        pngs["scaling"] = plots.scaling(scaling, run_dir / "scaling.png", manifest["environment"].get("cpus"))
    env = manifest["environment"]
    t = manifest["transport"]
    out = [f"# commlab bench: {manifest['started_utc']}", "",
           "## Run", "",
           f"- Command: `{manifest['command']}`",
           f"- Machine: {env['cpu']} ({env['cpus']} CPUs), {env['memory_gib']:.1f} GiB memory; "
           f"the machine may be shared with other work: quote ratios from one run, not absolute figures.",
           f"- Transport: {t['link']}; CUDA {'yes' if t['cuda'] else 'no'}; NCCL {t['nccl_version'] or '—'}; "
           f"GPUDirect RDMA: {t['gpudirect_rdma']}.",
           *([f"- Asked for `--link {manifest['config']['link']}`, but {t['link_note']}: ran on loopback instead."]
             if t.get("link_note") else []),
           f"- Code: git {manifest['git']['revision'][:12]}{' (uncommitted changes)' if manifest['git']['dirty'] else ''}; "
           f"torch {env['packages'].get('torch')}, pyzmq {env['packages'].get('pyzmq')}.",
           f"- Took {manifest.get('seconds', 0):.0f} s. Every figure below comes from this run: "
           + ", ".join(f"`{n}`" for n in ("bandwidth.json", "convergence.json", "scaling.json", "probes.json")
                       if (run_dir / n).exists())
           + ", `raw/`, `manifest.json`.", ""]
    # the spread between launches of one regime, from the bandwidth phase's launches: training jobs run
    # one launch each, so their comparisons carry it as a random launch effect (bench.verdict)
    measured = verdict.launch_sigma(launch_groups(records))
    sigma = verdict.spread(measured)
    pairs = bandwidth_pairs(records)  # the glance's bandwidth lines and the launch notes read the same verdicts
    at_a_glance = glance(records, summaries, sigma, pairs)
    if at_a_glance:
        out += ["## Verdicts at a glance", "", f"`A > B`: A faster, `A = B`: equivalent, `A ≈ B`: indistinguishable: "
                f"{verdict.rule()}. Bandwidth intervals resample the run's launches, then the "
                "iterations within each; training comparisons (one launch per regime) add the spread between "
                f"launches (sd of log medians {sigma:.3f}, i.e. x{math.exp(sigma):.2f}: measured here {measured:.3f}, "
                f"never less than this machine's pooled {verdict.LAUNCH_SIGMA_FLOOR:.2f}); times to the target of "
                f"asynchronous regimes also carry the spread of their steps to the target (sd of log steps "
                f"{verdict.STEPS_SIGMA_ASYNC:.2f}, pooled over eight default runs: the order of their updates is "
                "chance; synchronous regimes reach it at the same step every run). Bandwidth lists every pair of "
                "regimes in the same order in every run. "
                "Details in the sections below.", ""] + at_a_glance + [""]
        notes = launch_notes(records, pairs)
        if notes:
            out += ["Indistinguishable above, though a launch alone names a winner: the launches disagree, and "
                    "this run's launches are too few for its interval to settle it "
                    "(docs/bench.md, \"Why lines move\"). Each launch's own verdict (its iterations alone), not a "
                    "verdict of the run; more launches (`--launches 6`) can settle these.", ""] + notes + [""]
    out += failures_section(failures)
    out += bandwidth_section(records, bw_cfg, pngs.get("busbw")) if bw_cfg else ["## Bandwidth", "", "Not run.", ""]
    out += convergence_section(summaries, cv_cfg, pngs, sigma, manifest["config"].get("link")) if cv_cfg else ["## Convergence", "", "Not run.", ""]
    out += scaling_section(scaling or [], sc_cfg, pngs.get("scaling"), manifest["environment"].get("cpus"), sigma) \
        if sc_cfg else ["## Scaling with N", "", "Not run.", ""]
    out += probes_section(probes or {})
    if records:  # the planner's "at scale" section, from this run's bandwidth records (docs/plan.md)
        out += at_scale_from_bench(records, cv_cfg["model"] if cv_cfg else "mlp", cv_cfg["batch_size"] if cv_cfg else 32)
    out += ["## Files", ""] + [f"- `{p.name}`" for p in sorted(run_dir.iterdir()) if p.is_file()] + \
           ["- `raw/`: per-job outputs (per-rank times, per-step metrics); `logs/`: each job's log (`JOB.log`) "
            "and its processes' (`JOB/rank<r>.log`, `JOB/server<i>.log`)", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(out))
    return path
