"""``commlab bench train-step``: training-step time of commlab regimes beside DistributedDataParallel.

    commlab bench train-step --model mlp-25m --workers 2 --batch-size 64 \\
        --regimes 'allreduce://?backend=gloo' 'ring://' 'ps://?shards=1&mode=sync' --json step.json

Every entry trains the same model on the same data with the same per-rank batch, 1 torch thread
per rank, as a job of the launcher (:func:`bench.records.run_ranks`). Entries run in interleaved
rounds (DDP, regime A, regime B, DDP, ...) so drift of the machine hits them alike; each entry's
samples are all its post-warm-up steps of all rounds (rank 0's step times). The peers, beside
the regimes: ``ddp`` (DistributedDataParallel over gloo, :mod:`bench.ddp_worker`), ``ddp+heap``
(DDP with the heap setting commlab's exchangers make, :mod:`commlab.core.heap`; in the run in
bench/results/train_step-mlp25m.json the setting alone took DDP's step from 250 to 206 ms), and
``local`` (one process, no exchange, for scale). The ratio to ``ddp+heap`` shows what the
exchange itself gains over DDP's, the ratio to plain ``ddp`` what a user gains by switching.

Records (:mod:`bench.records`): time = one training step, with ``step_ms`` and ``comm_ms`` (the median
time ``step()`` blocked); each ratio carries its 95% bootstrap interval (docs/bench.md, "Cases with
flags of their own").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import records as rec
from bench import verdict
from bench import regimes as R
from bench.text import human_bytes, names
from commlab.base.trace import folder_problem as trace_folder_problem

CASE = "train-step"
PEERS = {"local": "one process, the same per-rank batch, no exchange", "ddp": "DistributedDataParallel (gloo)",
         "ddp+heap": "DDP with commlab's heap setting (commlab.core.heap)"}


def gradient_bytes(model: str, seed: int = 0) -> int:
    """Bytes of one step's float32 gradients: what every entry exchanges."""
    from workers.models import build_model

    return 4 * sum(p.numel() for p in build_model(model, seed)[0].parameters())


TRACED = " +trace"  # an entry run with the timeline on (--trace): the same regime, each rank recording
# The goal of tracing (docs/trace.md): a traced step costs at most 1.03x an untraced one. Its 3% is the
# equivalence band of the "+trace / untraced" verdicts (bench.verdict: a winner only beyond it).
TRACE_COST_BAND = 0.03


def url_of(entry: str) -> str:
    """The exchanger URL an entry's ranks get ("" for DDP, which is no commlab regime)."""
    return "" if entry.startswith("ddp") else R.url_of(entry.removesuffix(TRACED))


def run_entry(entry: str, a) -> list[dict]:
    """One job of ``entry`` (a peer's name or a regime URL); rank 0's step lines, warm-up included."""
    common = ["--model", a.model, "--steps", str(a.steps + a.warmup), "--batch-size", str(a.batch_size),
              "--lr", "0.01"]
    if entry.startswith("ddp"):
        heap = ["--heap", "keep"] if entry == "ddp+heap" else []
        ranks = rec.run_ranks(f"train-step {entry}", ("-m", "bench.ddp_worker"), [*common, *heap],
                              workers=a.workers, deadline_s=a.timeout)
    else:
        traced = None
        if entry.endswith(TRACED):  # this round's timeline, in a folder of its own
            a.trace_runs = getattr(a, "trace_runs", 0) + 1
            traced = str(Path(a.trace) / f"regime{a.regimes.index(entry.removesuffix(TRACED))}-run{a.trace_runs}")
        ranks = rec.run_ranks(f"train-step {entry}", ("-m", "workers"), [*common, "--no-progress"],
                              workers=1 if entry == "local" else a.workers, deadline_s=a.timeout,
                              exchanger=url_of(entry), url_flag="--exchanger", trace=traced)
    return [r for r in ranks[0] if "step_s" in r]


def to_record(entry: str, rows: list[dict], a, size: int) -> dict:
    kind = "reference" if entry == "local" else "peer" if entry in PEERS else "regime"
    steps = [r["step_s"] for r in rows]
    comm = [r["comm_s"] for r in rows if r.get("comm_s") is not None]
    return rec.record(CASE, entry, kind=kind, method="allreduce" if entry.startswith("ddp") else
                      rec.method_of(url_of(entry)), workers=1 if entry == "local" else a.workers, size_bytes=size,
                      times_s=steps, url=url_of(entry), warmup=a.warmup, model=a.model, batch_size=a.batch_size,
                      rounds=a.rounds, step_ms=statistics.median(steps) * 1e3,
                      comm_ms=statistics.median(comm) * 1e3 if comm else None)


def verdicts(records: list[dict], regimes: list[str]) -> list[tuple[str, verdict.Verdict]]:
    """``X / P step time`` for every entry X against each DDP peer P that ran, and every later regime
    against the first of ``regimes`` (``ps:// / allreduce://``): ratio, interval, winner. A traced entry
    against itself untraced is judged with the tracing goal's band (:data:`TRACE_COST_BAND`), the rest with
    :data:`bench.verdict.BAND`."""
    by = {r["regime"]: r for r in records}
    bases = [p for p in ("ddp", "ddp+heap") if p in by]
    if regimes[0] in by:
        bases.append(regimes[0])
    out = [(f"{r['regime']} / {r['regime'].removesuffix(TRACED)} step time",
            verdict.compare(r["regime"].removesuffix(TRACED), by[r["regime"].removesuffix(TRACED)]["samples_us"],
                            r["regime"], r["samples_us"], paired=False, band=TRACE_COST_BAND))
           for r in records if r["regime"].endswith(TRACED) and r["regime"].removesuffix(TRACED) in by]
    for base in bases:
        others = [r for r in records if r["regime"] != base and not r["regime"].endswith(TRACED)] if base in PEERS else \
            [by[x] for x in regimes[1:] if x in by]
        out += [(f"{r['regime']} / {base} step time",
                 verdict.compare(base, by[base]["samples_us"], r["regime"], r["samples_us"], paired=False))
                for r in others]
    return out


def timeline_png(a) -> Path | None:
    """``DIR/timeline.png``: one step of each regime's last traced round (the middle measured step), a panel per
    regime on one time axis (:func:`bench.plots.plot_step_timelines`): whether its communication ran under
    backward or after it, at a glance. A regime without a trace of that step is left out, and says why."""
    from bench import plots

    step = a.warmup + a.steps // 2
    panels = []
    for i, url in enumerate(a.regimes):
        runs = sorted(Path(a.trace).glob(f"regime{i}-run*/trace.json"), key=lambda p: int(p.parent.name.rsplit("run", 1)[1]))
        if not runs:
            print(f"timeline: {url} left a trace of no round", file=sys.stderr)
            continue
        try:
            trace = json.loads(runs[-1].read_text())
            plots.step_timeline_bars(trace, step)
        except (ValueError, KeyError, OSError) as exc:  # (JSONDecodeError is a ValueError)
            print(f"timeline: {url}: {runs[-1]}: {exc}", file=sys.stderr)
            continue
        panels.append((url, trace, step))
    out = plots.plot_step_timelines(panels, Path(a.trace) / "timeline.png")
    if out is not None:
        print(f"wrote {out} (step {step} of each regime's last traced round; docs/bench.md)", file=sys.stderr)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench train-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp-25m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="seconds one entry's job may take")
    p.add_argument("--regimes", nargs="+", default=["allreduce://?backend=gloo"], help="exchanger URLs")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ", ".join(PEERS))
    p.add_argument("--json", help="write the records, verdicts and failures here")
    p.add_argument("--trace", metavar="DIR", help="also run each regime with its timeline on (docs/trace.md; kept in "
                                                  "DIR/<regime>-<round>), taking turns with it off: what tracing costs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    try:
        peers = names(a.peers, PEERS, "--peers")
    except ValueError as exc:
        p.error(str(exc))
    if a.workers < 2 or a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--workers must be >= 2, --steps and --rounds >= 1, --warmup >= 0")
    from commlab.tools.cli import check_url
    problems = [x for x in map(check_url, a.regimes) if x]
    if problems:
        p.error("; ".join(problems))
    entries = [*peers, *a.regimes]
    if a.trace:  # each regime beside itself traced, one after the other in every round
        problem = trace_folder_problem(a.trace)
        if problem:
            p.error(f"--trace: {problem}")
        entries = [*peers, *(e for url in a.regimes for e in (url, f"{url}{TRACED}"))]
    size = gradient_bytes(a.model)
    got, failures = rec.take_turns(CASE, entries, a.rounds, lambda e: run_entry(e, a)[a.warmup:],
                                   lambda rnd, e, rows: print(f"[round {rnd + 1}/{a.rounds}] {e}: {len(rows)} steps",
                                                              file=sys.stderr, flush=True))
    rows = {e: [r for part in got[e] for r in part] for e in entries}
    records = [to_record(e, rows[e], a, size) for e in entries if rows[e] and e not in failures]
    if a.trace:
        timeline_png(a)
    return rec.conclude(CASE, f"{a.model} ({human_bytes(size)} of gradients), {a.workers} ranks x batch "
                        f"{a.batch_size}, 1 thread each, {a.rounds} rounds x {a.steps} steps "
                        f"(after {a.warmup} warm-up)",
                        records, [("step ms", "step_ms"), ("blocked ms", "comm_ms")], verdicts(records, a.regimes),
                        failures, url_of, a.json, vars(a))


if __name__ == "__main__":  # python -m bench.train_step: the same as commlab bench train-step
    sys.exit(main())
