"""``report.md``: what one run measured, with its spread, and a short verdict per question.

Every figure here is read from the records this run wrote (``bandwidth.json``,
``convergence.json``); nothing is carried over from another run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench import plots
from bench.bandwidth import bus_factor
from bench.convergence import COINCIDE_TOL
from bench.text import fmt, fmt_us, human_bytes
from commlab.plan.recommend import at_scale_from_bench

SECTIONS = ("## Run", "## Failed, skipped or unavailable", "## Bandwidth", "## Convergence", "## Files")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


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
        out += _table(["regime", "N", "repeats", "time median [min–max]", "p90", "algbw GB/s",
                       "busbw GB/s median [min–max]", "wrong"], rows)
        out.append("")
    out += ["### Verdict: fastest exchange per size", ""] + bandwidth_verdict(records) + [""]
    if png:
        out += [f"![exchange time and busbw against size]({png.name})", ""]
    return out


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
        text = f"- {human_bytes(size)}: **{best['regime']}**, {fmt_us(best['time_us'])} median"
        if len(real) > 1:
            nxt = real[1]
            text += f", {nxt['time_us'] / best['time_us']:.2f}x faster than {nxt['regime']} ({fmt_us(nxt['time_us'])})"
            overlap = best["time_us_max"] >= nxt["time_us_min"]
            text += "; their [min–max] ranges overlap" if overlap else ""
        duplex = next((r for r in at if r["regime"] == "tcp-duplex"), None)
        if duplex and best["busbw_gbps"] > 0:
            text += f"; busbw {best['busbw_gbps']:.3g} GB/s = {best['busbw_gbps'] / duplex['busbw_gbps']:.0%} of " \
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


def convergence_section(summaries: list[dict], cfg: dict, pngs: dict) -> list[str]:
    out = ["## Convergence", ""]
    if not summaries:
        return out + ["Not measured in this run.", ""]
    n = cfg["workers"]
    out += [f"Model `{cfg['model']}`, seed {cfg['seed']}, {cfg['steps']} steps, batch {cfg['batch_size']} per worker "
            f"x {n} workers = global batch {cfg['batch_size'] * n} (local:// runs one worker with the whole "
            f"{cfg['batch_size'] * n}), SGD lr {cfg['lr']}, the same data order; test set evaluated on rank 0 every "
            f"{cfg['eval_every']} steps. Target accuracy {cfg['target_acc']:.0%}. Step times are rank 0's, median "
            f"[min–max] over the {cfg['steps']} steps.", ""]
    rows = []
    for s in summaries:
        rows.append([s["regime"], s["kind"], str(s["workers"]), f"{s['final_test_acc']:.3f}", f"{s['final_test_loss']:.4f}",
                     f"{s['wall_s']:.2f}", fmt(s["steps_to_target"]),
                     "—" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.2f}",
                     human_bytes(s["bytes_sent_per_worker_step"]),
                     f"{s['step_s_median'] * 1e3:.1f} [{s['step_s_min'] * 1e3:.1f}–{s['step_s_max'] * 1e3:.1f}]",
                     f"{s['compute_s_median'] * 1e3:.1f}", f"{s['comm_s_median'] * 1e3:.1f}",
                     fmt(s["max_abs_test_loss_diff"], 2)])
    out += _table(["regime", "kind", "N", "final test acc", "final test loss", "wall s", "steps to target",
                   "s to target", "sent / worker / step", "step ms median [min–max]", "compute ms",
                   "exposed comm ms", "max abs test-loss diff vs local"], rows)
    out += ["", "### Do the synchronous regimes reproduce local:// on the combined batch?", ""]
    out += sync_check(summaries) + [""]
    out += ["### Verdict: fastest to accuracy", ""] + accuracy_verdict(summaries, cfg["target_acc"]) + [""]
    out += ["### Verdict: the cost of staleness", ""] + staleness_verdict(summaries) + [""]
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


def sync_check(summaries: list[dict]) -> list[str]:
    ref = next((s for s in summaries if s["kind"] == "reference"), None)
    sync = [s for s in summaries if s["kind"] == "sync"]
    if ref is None:
        return ["- local:// did not run, so there is nothing to check against."]
    if not sync:
        return ["- No synchronous regime ran."]
    lines = []
    for s in sync:
        d = s["max_abs_test_loss_diff"]
        if d is None:
            lines.append(f"- {s['regime']}: no eval step in common with local://.")
        elif s["coincides_with_local"]:
            lines.append(f"- {s['regime']}: **coincides** with local:// (max |test-loss difference| {d:.2g} over "
                         f"{len(s['evals'])} eval steps, tolerance {COINCIDE_TOL:g}; float32 summation order).")
        else:
            lines.append(f"- {s['regime']}: **does NOT coincide** with local:// (max |test-loss difference| "
                         f"{d:.3g} > {COINCIDE_TOL:g}): a synchronous regime that changes the arithmetic is a bug.")
    return lines


def accuracy_verdict(summaries: list[dict], target: float) -> list[str]:
    cands = [s for s in summaries if s["kind"] != "floor"]
    hit = sorted((s for s in cands if s["time_to_target_s"] is not None), key=lambda s: s["time_to_target_s"])
    lines = []
    if hit:
        b = hit[0]
        lines.append(f"- **{b['regime']}** reached {target:.0%} test accuracy first: {b['time_to_target_s']:.2f} s "
                     f"(step {b['steps_to_target']}).")
        ref = next((s for s in hit if s["kind"] == "reference"), None)
        for s in hit[1:]:
            lines.append(f"- {s['regime']}: {s['time_to_target_s']:.2f} s (step {s['steps_to_target']}), "
                         f"{s['time_to_target_s'] / b['time_to_target_s']:.2f}x the best.")
        if ref is not None:
            lines.append(f"- local:// is one process with no communication: the distributed regimes are run beside "
                         f"it to show what communication costs on this machine, not to beat it on 2 cores.")
    missed = [s["regime"] for s in cands if s["time_to_target_s"] is None]
    if missed:
        lines.append(f"- Did not reach {target:.0%} within the run: {', '.join(missed)}.")
    return lines or ["- No regime ran."]


def _stale_stats(vals: list[int]) -> str:
    v = sorted(vals)
    return (f"mean {statistics.fmean(v):.2f}, median {statistics.median(v):g}, "
            f"p90 {v[min(len(v) - 1, int(0.9 * (len(v) - 1)))]}, max {v[-1]} over {len(v)} updates")


def staleness_verdict(summaries: list[dict]) -> list[str]:
    asyncs = [s for s in summaries if s["kind"] == "async"]
    if not asyncs:
        return ["- No asynchronous regime ran in this run (see the failed/unavailable list), so its cost is not "
                "measured here."]
    base = next((s for s in summaries if s["regime"] == "ps-sync"), None) or \
        next((s for s in summaries if s["kind"] == "reference"), None)
    lines = []
    for s in asyncs:
        text = f"- {s['regime']}: final test acc {s['final_test_acc']:.3f}, loss {s['final_test_loss']:.4f}"
        if base:
            text += (f" against {base['regime']}'s {base['final_test_acc']:.3f} / {base['final_test_loss']:.4f} "
                     f"(loss {s['final_test_loss'] - base['final_test_loss']:+.4f})")
            if s["time_to_target_s"] is not None and base["time_to_target_s"] is not None:
                text += (f"; to target in {s['time_to_target_s']:.2f} s / step {s['steps_to_target']} against "
                         f"{base['time_to_target_s']:.2f} s / step {base['steps_to_target']}")
        text += f"; median step {s['step_s_median'] * 1e3:.1f} ms"
        if base:
            text += f" against {base['step_s_median'] * 1e3:.1f} ms"
        if s.get("staleness"):
            text += f". Staleness: {_stale_stats(s['staleness'])}"
            if base and base.get("staleness"):
                text += (f"; the servers applied {len(s['staleness'])} updates (one per worker push) against "
                         f"{base['regime']}'s {len(base['staleness'])} (one per step, of the combined gradient)")
            text += "."
        else:
            text += (". Staleness: not reported by this regime (seam: the PS server writes "
                     "`{\"staleness\": {...}}` into `$COMMLAB_STATS_DIR/*.json`).")
        lines.append(text)
    return lines


def failures_section(failures: list[dict]) -> list[str]:
    out = ["## Failed, skipped or unavailable", ""]
    if not failures:
        return out + ["Every requested regime ran.", ""]
    rows = [[f["phase"], f["regime"], f"`{f['url']}`" if f.get("url") else "", f["status"],
             f["error"].replace("|", "\\|").replace("\n", " ")[:300] + (f" (log: `{f['log']}`)" if f.get("log") else "")]
            for f in failures]
    return out + _table(["phase", "regime", "URL", "status", "error"], rows) + [""]


def write(run_dir: Path, manifest: dict, records: list[dict], summaries: list[dict], curves: dict,
          failures: list[dict]) -> Path:
    """Plots and report.md in ``run_dir``; returns the report's path."""
    bw_cfg, cv_cfg = manifest["config"].get("bandwidth"), manifest["config"].get("convergence")
    pngs = {"busbw": plots.bandwidth(records, run_dir / "busbw.png", bw_cfg["workers"]) if bw_cfg else None}
    if cv_cfg:
        pngs["convergence"] = plots.convergence(summaries, curves, run_dir / "convergence.png", cv_cfg["target_acc"])
        pngs["staleness"] = plots.staleness(summaries, run_dir / "staleness.png")
        pngs["split"] = plots.step_split(summaries, run_dir / "split.png")
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
           + ", ".join(f"`{n}`" for n in ("bandwidth.json", "convergence.json") if (run_dir / n).exists())
           + ", `raw/`, `manifest.json`.", ""]
    out += failures_section(failures)
    out += bandwidth_section(records, bw_cfg, pngs.get("busbw")) if bw_cfg else ["## Bandwidth", "", "Not run.", ""]
    out += convergence_section(summaries, cv_cfg, pngs) if cv_cfg else ["## Convergence", "", "Not run.", ""]
    if records:  # the planner's "at scale" section, from this run's bandwidth records (docs/plan.md)
        out += at_scale_from_bench(records, cv_cfg["model"] if cv_cfg else "mlp", cv_cfg["batch_size"] if cv_cfg else 32)
    out += ["## Files", ""] + [f"- `{p.name}`" for p in sorted(run_dir.iterdir()) if p.is_file()] + \
           ["- `raw/`: per-job outputs (per-rank times, per-step metrics); `logs/`: each job's output", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(out))
    return path
