"""PNG plots of one run (matplotlib, no display). Each function returns the file it wrote, or None."""

from __future__ import annotations

import math

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench import verdict  # noqa: E402
from bench.bandwidth import clusters, paired  # noqa: E402
from bench.text import human_bytes  # noqa: E402

CEILING_STYLE = {"linestyle": "--", "linewidth": 1.2, "alpha": 0.8}


def save(fig, path: Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG, close it; ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _against_size(ax, sizes, ylabel: str, title: str) -> None:
    """A panel against message size: both axes logarithmic, the sizes as ticks, a legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([human_bytes(s) for s in sizes])
    ax.set(xlabel="message size S (float32)", ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def bandwidth(records: list[dict], path: Path, workers: int, peer: str = "gloo") -> Path | None:
    """Time and busbw against size, each median with its 95% bootstrap interval as error bars, and
    (when ``peer`` ran) every regime's busbw over the peer's with the interval of the ratio: the same
    intervals the report's verdicts read."""
    if not records:
        return None
    peers = {r["size_bytes"]: r for r in records if r["regime"] == peer and r.get("samples_us")}
    fig, axes = plt.subplots(1, 3 if peers else 2, figsize=(19 if peers else 13, 5))
    ax_t, ax_b = axes[0], axes[1]
    names = list(dict.fromkeys(r["regime"] for r in records))
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour per regime in every panel
    sizes = sorted({r["size_bytes"] for r in records})
    for name in names:
        rs = sorted((r for r in records if r["regime"] == name and r.get("samples_us")), key=lambda r: r["size_bytes"])
        if not rs:
            continue
        x = [r["size_bytes"] for r in rs]
        ceiling = rs[0]["kind"] == "ceiling"
        style = dict(CEILING_STYLE if ceiling else {"marker": "o", "linewidth": 2}, color=colors[name], capsize=3)
        label = f"{name} (ceiling)" if ceiling else name
        ci = [verdict.median_interval(r["samples_us"]) for r in rs]
        if name != "memcpy":  # a copy in one process has no exchange time to compare
            med = [c[0] for c in ci]
            ax_t.errorbar(x, med, yerr=[[m - c[1] for m, c in zip(med, ci)], [c[2] - m for m, c in zip(med, ci)]],
                          label=label, **style)
        if any(r["busbw_gbps"] > 0 for r in rs):
            f = [r["busbw_gbps"] / r["algbw_gbps"] if r["algbw_gbps"] else 0.0 for r in rs]
            bw = lambda r, t, k: r["size_bytes"] / t / 1e3 * k  # t in us -> GB/s
            mid = [bw(r, c[0], k) for r, c, k in zip(rs, ci, f)]
            lo = [bw(r, c[2], k) for r, c, k in zip(rs, ci, f)]
            hi = [bw(r, c[1], k) for r, c, k in zip(rs, ci, f)]
            ax_b.errorbar(x, mid, yerr=[[m - l for m, l in zip(mid, lo)], [h - m for m, h in zip(mid, hi)]],
                          label=label, **style)
        if peers and name != peer and rs[0]["method"] not in ("noop", "memcpy"):
            pts = [(r["size_bytes"], verdict.compare(name, r["samples_us"], peer, peers[r["size_bytes"]]["samples_us"],
                                                     paired=paired([r, peers[r["size_bytes"]]]),
                                                     clusters=clusters([r, peers[r["size_bytes"]]])))
                   for r in rs if r["size_bytes"] in peers and not r["wrong"]]
            if pts:
                axes[2].errorbar([p for p, _ in pts], [v.ratio for _, v in pts],
                                 yerr=[[v.ratio - v.lo for _, v in pts], [v.hi - v.ratio for _, v in pts]],
                                 label=label, **style)
    _against_size(ax_t, sizes, "time per exchange (µs): median, 95% interval",
                  f"Exchange time, {workers} workers (lower is better)")
    _against_size(ax_b, sizes, "busbw (GB/s): at the median time, 95% interval",
                  "Bus bandwidth per worker, each direction (higher is better)")
    if peers:
        axes[2].axhline(1.0, color="black", linewidth=1)
        _against_size(axes[2], sizes, f"busbw / {peer}'s busbw, 95% interval",
                      f"Against {peer} (an interval across an edge of ±{verdict.BAND:.0%}: indistinguishable)")
    return save(fig, path)


def convergence(summaries: list[dict], curves: dict, path: Path, target: float) -> Path | None:
    if not summaries:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_acc, ax_step), (ax_time, ax_bytes) = axes
    no_bytes = []
    for s in summaries:
        ev = s["evals"]
        if not ev:
            continue
        style = ({"linewidth": 6, "color": "black", "alpha": 0.25, "zorder": 1} if s["kind"] == "reference"
                 else {"marker": ".", "linewidth": 1.3, "zorder": 2})
        if s["kind"] == "floor":
            style = {"linestyle": ":", "color": "grey"}
        label = f"{s['regime']} ({s['kind']})"
        steps = [e["step"] for e in ev]
        ax_acc.plot(steps, [e["test_acc"] for e in ev], label=label, **style)
        ax_step.plot(steps, [e["test_loss"] for e in ev], label=label, **style)  # step = samples / (N x B)
        ax_time.plot([e["time_s"] for e in ev], [e["test_loss"] for e in ev], label=label, **style)
        if ev[-1]["bytes"] > 0:
            ax_bytes.plot([e["bytes"] / 2**20 for e in ev], [e["test_loss"] for e in ev], label=label, **style)
        else:
            no_bytes.append(s["regime"])
    ax_acc.axhline(target, color="red", linewidth=0.8, linestyle="--", label=f"target {target:.0%}")
    ax_acc.set(xlabel="step", ylabel="test accuracy (rank 0's model)", title="Accuracy against step")
    ax_step.set(xlabel="step per worker (= samples processed / global batch, equal for every regime)",
                ylabel="test loss", title="Loss against step (sync regimes should lie on local://)")
    ax_time.set(xlabel="wall-clock seconds since setup (rank 0)", ylabel="test loss", title="Loss against time")
    title = "Loss against bytes sent by rank 0"
    if no_bytes:
        title += f"\n(not shown, send nothing: {', '.join(no_bytes)})"
    ax_bytes.set(xlabel="MiB sent by rank 0 (cumulative)", ylabel="test loss", title=title)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save(fig, path)


def staleness(summaries: list[dict], path: Path) -> Path | None:
    """Two histograms per asynchronous regime: the version gap and the clock gap (SSP's bound caps the latter)."""
    have = [s for s in summaries if s["kind"] == "async" and (s.get("staleness") or s.get("clock_gap"))]
    if not have:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, key, xlabel in ((axes[0], "staleness", "version gap: server updates between a gradient's pull and its apply"),
                            (axes[1], "clock_gap", "clock gap: the pushing worker's step minus the slowest worker's")):
        rows = [s for s in have if s.get(key)]
        if not rows:
            ax.set_title(f"{key}: not reported")
            continue
        top = max(max(s[key]) for s in rows)
        width = 0.8 / len(rows)
        for i, s in enumerate(rows):
            vals = s[key]
            counts = [vals.count(k) / len(vals) for k in range(top + 1)]
            ax.bar([k + i * width - 0.4 + width / 2 for k in range(top + 1)], counts, width=width,
                   label=f"{s['regime']} (n={len(vals)}, max {max(vals)})")
        ax.set(xlabel=xlabel, ylabel="fraction of applied updates")
        ax.set_xticks(range(top + 1))
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_title("Version gap of the asynchronous regimes")
    axes[1].set_title("Clock gap (SSP with bound S: never above S)")
    return save(fig, path)


def scaling(points: list[dict], path: Path, cpus: int | None) -> Path | None:
    """Step time and exposed communication against N, medians with 95% intervals; N > cores shaded."""
    if not points:
        return None
    fig, (ax_s, ax_c) = plt.subplots(1, 2, figsize=(13, 4.8))
    ns = sorted({p["workers"] for p in points})
    for i, name in enumerate(dict.fromkeys(p["regime"] for p in points)):
        ps = sorted((p for p in points if p["regime"] == name), key=lambda p: p["workers"])
        x = [p["workers"] for p in ps]
        for ax, key in ((ax_s, "step_s_samples"), (ax_c, "comm_s_samples")):
            ci = [verdict.median_interval([v * 1e3 for v in p[key]]) for p in ps]
            ax.errorbar(x, [c[0] for c in ci], yerr=[[c[0] - c[1] for c in ci], [c[2] - c[0] for c in ci]],
                        marker="o", capsize=3, color=f"C{i % 10}", label=name)
    for ax, what in ((ax_s, "step time"), (ax_c, "exposed communication (step() blocked)")):
        if cpus and max(ns) > cpus:
            ax.axvspan(cpus + 0.5, max(ns) + 0.5, color="grey", alpha=0.15, label=f"N > {cpus} cores: oversubscribed")
        ax.set_xticks(ns)
        ax.set(xlabel="N workers (same batch per worker)", ylabel=f"{what}, ms: median, 95% interval",
               title=f"{what.capitalize()} against N")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, path)


def step_split(summaries: list[dict], path: Path) -> Path | None:
    if not summaries:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(summaries) + 1.6))
    names = [s["regime"] for s in summaries]
    comp = [(s["compute_s_mean"] or 0.0) * 1e3 for s in summaries]
    # DDP reports no exposed communication apart from compute (its all-reduces run inside backward)
    comm = [0.0 if s["comm_s_mean"] is None else s["comm_s_mean"] * 1e3 for s in summaries]
    other = [max(0.0, s["step_s_mean"] * 1e3 - c - m) for s, c, m in zip(summaries, comp, comm)]
    y = range(len(names))
    ax.barh(y, comp, label="compute (forward + backward)", color="tab:blue")
    ax.barh(y, comm, left=comp, label="step() blocked: exposed communication + update", color="tab:red")
    ax.barh(y, other, left=[c + m for c, m in zip(comp, comm)], label="rest", color="tab:grey")
    ax.set_yticks(list(y))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds per step (means over the steps, rank 0)", title="Where a training step's time goes")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    return save(fig, path)


# ----- one step's timeline (a merged trace, docs/trace.md) ---------------------------------------------------
# kind -> (colour, legend): what the training thread computed, where it sat blocked, and the communication
TIMELINE_KINDS = {"forward": ("#9ecae1", "forward"), "backward": ("#3182bd", "backward"),
                  "optimizer": ("#756bb1", "optimizer"), "codec": ("#bdbdbd", "encode / decode"),
                  "blocked": ("#de2d26", "blocked (exposed communication)"),
                  "comm": ("#fd8d3c", "communication (sends, receives, collectives)"),
                  "server": ("#31a354", "shard: receive, apply, reply")}
SHARD_PID = 1000  # docs/trace.md: rank r is pid r, shard k is pid 1000 + k


def _span_kind(e: dict) -> str | None:
    """Which bar a span of a merged trace draws (None: none)."""
    cat, name = e.get("cat"), e.get("name", "")
    if cat == "compute":
        return name if name in ("forward", "backward", "optimizer") else None
    if cat == "bucket" and name in ("encode", "decode"):
        return "codec"
    if cat in ("blocked", "comm", "server"):
        return cat
    if cat == "torch" and (name.startswith("gloo:") or name.startswith("c10d::")):  # --trace-torch's collectives
        return "comm"
    return None


def step_timeline_bars(trace: dict | str | Path, step: int) -> tuple[list[tuple[str, list[tuple[float, float, str]]]], float]:
    """The bars of ``step``'s timeline in a merged trace (a ``trace.json`` path or its object): rows
    ``(label, [(start_ms, length_ms, kind), ...])`` and the window's length in ms.

    The window runs from the first rank's start of that step to the last rank's end of it (the training
    thread's ``step`` spans with ``args.step == step``), times in ms from its start. A rank's spans are clipped
    to its own step (its neighbours' steps stay out), a shard's to the window. Rows: per rank its training thread (forward, backward,
    optimizer, encode/decode, blocked) and its communication on any thread; per shard its handling of
    requests. Raises ValueError when no rank has that step."""
    import json

    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = trace["traceEvents"]
    steps = {(e["pid"], e["tid"]): e for e in events
             if e.get("ph") == "X" and e.get("cat") == "step" and (e.get("args") or {}).get("step") == step}
    if not steps:
        raise ValueError(f"the trace has no step {step} on any rank")
    t0 = min(e["ts"] for e in steps.values())
    t1 = max(e["ts"] + e["dur"] for e in steps.values())
    training = {pid: tid for pid, tid in steps}
    own = {pid: (e["ts"], e["ts"] + e["dur"]) for (pid, _), e in steps.items()}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows: dict[tuple, list] = {}
    for pid in sorted(training):
        rows[(pid, 0)], rows[(pid, 1)] = [], []
    for e in events:
        kind = _span_kind(e) if e.get("ph") == "X" else None
        pid = e.get("pid")
        if kind is None or not (pid in training or (pid >= SHARD_PID and kind == "server")):
            continue
        lo, hi = own.get(pid, (t0, t1))
        start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if end <= start:
            continue
        row = (pid, 0) if pid >= SHARD_PID else (pid, 1) if kind == "comm" else (pid, 0)
        if row == (pid, 0) and pid < SHARD_PID and e["tid"] != training[pid]:
            continue  # another thread's compute-like span (none today): only the training thread's row
        rows.setdefault(row, []).append(((start - t0) / 1e3, (end - start) / 1e3, kind))
    out = []
    for (pid, sub), bars in sorted(rows.items()):
        name = names.get(pid, f"rank {pid}" if pid < SHARD_PID else f"shard {pid - SHARD_PID}")
        out.append((f"{name} comm" if sub else name, sorted(bars)))
    return out, (t1 - t0) / 1e3


def plot_step_timelines(panels: list[tuple[str, dict | str | Path, int]], path: Path) -> Path | None:
    """One panel per ``(title, merged trace, step)``, stacked, on one time axis: each rank's training
    thread and communication and each shard as rows of coloured bars (:func:`step_timeline_bars`), so
    whether communication ran under backward or after it is seen at a glance. None without panels."""
    if not panels:
        return None
    drawn = [(title, *step_timeline_bars(trace, step), step) for title, trace, step in panels]
    heights = [max(1, len(rows)) * 0.42 + 0.9 for _, rows, _, _ in drawn]
    fig, axes = plt.subplots(len(drawn), 1, figsize=(11, sum(heights) + 0.9), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, rows, length, step) in zip(axes[:, 0], drawn):
        for y, (_, bars) in enumerate(rows):
            for kind in TIMELINE_KINDS:
                xs = [(s, d) for s, d, k in bars if k == kind]
                if xs:
                    ax.broken_barh(xs, (y - 0.36, 0.72), color=TIMELINE_KINDS[kind][0], linewidth=0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([label for label, _ in rows], fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(f"{title}: step {step}, {length:.1f} ms from the first rank's start to the last rank's end",
                     fontsize=9, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("milliseconds from the step's start (one clock: docs/trace.md)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in TIMELINE_KINDS.values()]
    fig.legend(handles, [label for _, label in TIMELINE_KINDS.values()], loc="lower center", ncol=4, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.07 if len(drawn) > 1 else 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_timeline(trace: dict | str | Path, step: int, path: Path, title: str = "") -> Path:
    """``step``'s timeline of one merged trace as a PNG at ``path`` (:func:`plot_step_timelines`, one panel)."""
    out = plot_step_timelines([(title or Path(str(trace)).parent.name if not isinstance(trace, dict) else title,
                                trace, step)], path)
    assert out is not None
    return out
