"""Convergence: the same model, seed, data order and global batch under every regime.

Each regime runs through ``commlab train`` as a job of its own (``python -m
commlab.cli train ... --metrics F --eval-every K``); the workers write one JSON
line per step (loss, acc, compute_s, comm_s, step_s, bytes_sent, time_s, and on
rank 0 test_loss/test_acc at eval steps). ``local://`` runs one worker on the
combined batch (N x B): the reference every synchronous regime must reproduce,
step for step. From the lines this module derives:

- loss and accuracy against step, wall-clock time and bytes sent;
- time (and step) to a target test accuracy;
- each step split into compute (forward + backward), exposed communication (the
  time ``step()`` blocked) and the rest;
- for synchronous regimes, max |test_loss - local's test_loss| over eval steps;
- for asynchronous ones, the staleness distribution (see :func:`read_staleness`).
"""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench import regimes as R
from bench.bandwidth import Budget
from bench.jobs import python, run_job

# A synchronous regime "coincides" with local:// when its test loss at every eval
# step is within this of local's. Summation order differs (bucketed all-reduce vs one
# big batch), so float32 rounding, not algorithmic error, is what is left.
COINCIDE_TOL = 1e-3


@dataclass
class ConvergenceConfig:
    regimes: list[str]
    workers: int = 2
    model: str = "mlp"
    steps: int = 120
    batch_size: int = 32  # per worker; local:// gets workers x this
    lr: float = 0.1
    seed: int = 0
    eval_every: int = 10
    target_acc: float = 0.85
    job_timeout: float = 120.0


def read_metrics(path: Path, workers: int) -> list[list[dict]]:
    """Per rank, the JSON lines it wrote (rank r > 0 writes PATH.rank<r>)."""
    out = []
    for r in range(workers):
        p = path if r == 0 else Path(f"{path}.rank{r}")
        out.append([json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else [])
    return out


SERVER_STATS = re.compile(r"^commlab server (?P<name>[^:]+): (?P<json>\{.*\})\s*$")


def server_stats_from_log(log: Path) -> list[dict]:
    """The last stats line each PS server printed (``commlab server NAME: {json}``, at exit)."""
    last: dict[str, dict] = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        m = SERVER_STATS.match(line.strip())
        if m:
            try:
                last[m.group("name")] = json.loads(m.group("json"))
            except ValueError:
                continue
    return list(last.values())


def read_staleness(stats_dir: Path, ranks: list[list[dict]], log: Path | None = None) -> list[int] | None:
    """The staleness of every applied update, or None if the regime did not report it.

    The seam, in order of preference:
      1. files ``*.json`` in ``stats_dir`` (the job's ``COMMLAB_STATS_DIR``), each a JSON object
         with ``"staleness"``: either a list of per-update staleness values, or a histogram
         ``{"0": count, "1": count, ...}``;
      2. the stats line each PS server prints when it stops (``commlab server NAME: {json}`` with a
         ``"staleness"`` histogram), read from the job's log; shards' histograms are added up;
      3. a ``"staleness"`` field (int or list of ints) in the workers' per-step lines.
    """
    values: list[int] = []
    found = False
    docs = []
    for p in sorted(stats_dir.glob("*.json")) if stats_dir.exists() else []:
        try:
            docs.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not any(isinstance(d, dict) and "staleness" in d for d in docs) and log is not None:
        docs = server_stats_from_log(log)
    for doc in docs:
        st = doc.get("staleness") if isinstance(doc, dict) else None
        if isinstance(st, dict):
            found = True
            for k, n in st.items():
                values += [int(k)] * int(n)
        elif isinstance(st, list):
            found = True
            values += [int(v) for v in st]
    if found:
        return values
    for lines in ranks:
        for rec in lines:
            st = rec.get("staleness")
            if st is None:
                continue
            found = True
            values += [int(v) for v in st] if isinstance(st, list) else [int(st)]
    return values if found else None


def summarize(name: str, entry: R.ConvergenceEntry, ranks: list[list[dict]], target: float) -> dict:
    r0 = ranks[0]
    evals = [{"step": x["step"] + 1, "time_s": x["time_s"], "test_loss": x["test_loss"], "test_acc": x["test_acc"],
              "bytes": sum(x2["bytes_sent"] for x2 in r0[: x["step"] + 1])} for x in r0 if "test_acc" in x]
    hit = next((e for e in evals if e["test_acc"] >= target), None)
    med = lambda key: statistics.median(x[key] for x in r0) if r0 else float("nan")
    mean = lambda key: statistics.fmean(x[key] for x in r0) if r0 else float("nan")
    bytes_total = sum(x["bytes_sent"] for lines in ranks for x in lines)
    return {"regime": name, "url": entry.url, "kind": entry.kind, "workers": len(ranks), "steps": len(r0),
            "wall_s": r0[-1]["time_s"] if r0 else float("nan"),
            "final_test_acc": evals[-1]["test_acc"] if evals else float("nan"),
            "final_test_loss": evals[-1]["test_loss"] if evals else float("nan"),
            "bytes_sent_total": bytes_total, "bytes_sent_per_worker_step": bytes_total / max(1, sum(map(len, ranks))),
            "step_s_median": med("step_s"), "compute_s_median": med("compute_s"), "comm_s_median": med("comm_s"),
            "step_s_mean": mean("step_s"), "compute_s_mean": mean("compute_s"), "comm_s_mean": mean("comm_s"),
            "step_s_min": min((x["step_s"] for x in r0), default=float("nan")),
            "step_s_max": max((x["step_s"] for x in r0), default=float("nan")),
            "time_to_target_s": hit["time_s"] if hit else None, "steps_to_target": hit["step"] if hit else None,
            "evals": evals}


def run(cfg: ConvergenceConfig, run_dir: Path, budget: Budget, links=None, progress=None) -> tuple[list[dict], list[dict], dict]:
    """Train under each regime; return (summaries, failures, curves). Never raises for a regime's failure.

    ``curves[name]`` holds rank 0's per-step lines (and the staleness values, if any).
    """
    summaries, failures, curves = [], [], {}
    (run_dir / "raw").mkdir(parents=True, exist_ok=True)
    todo = []
    for name in cfg.regimes:
        e = R.CONVERGENCE[name]
        why = R.unavailable(e.url)
        if why is None and links is not None and e.loopback_only:
            why = "not run over --link: this regime's addresses are chosen on loopback (127.0.0.1)"
        if why:
            failures.append({"phase": "convergence", "regime": name, "url": e.url, "status": "unavailable", "error": why})
        else:
            todo.append(name)
    bar = progress(total=len(todo), desc="convergence", unit="run") if progress else None
    try:
        _run_jobs(cfg, todo, run_dir, budget, links, bar, summaries, failures, curves)
    except KeyboardInterrupt:
        failures.append({"phase": "convergence", "regime": "-", "url": "", "status": "interrupted",
                         "error": "interrupted (Ctrl-C or SIGTERM): the report covers the runs that finished"})
    if bar:
        bar.close()
    compare_with_reference(summaries)
    return summaries, failures, curves


def _run_jobs(cfg, todo, run_dir, budget, links, bar, summaries, failures, curves) -> None:
    for name in todo:
        e = R.CONVERGENCE[name]
        bar and bar.set_postfix_str(name)
        if not budget.fits(8.0):
            failures.append({"phase": "convergence", "regime": name, "url": e.url, "status": "skipped",
                             "error": "the benchmark's time budget ran out before this run"})
            bar and bar.update(1)
            continue
        workers, batch = (1, cfg.workers * cfg.batch_size) if e.kind == "reference" else (cfg.workers, cfg.batch_size)
        metrics = run_dir / "raw" / f"conv-{name}.jsonl"
        stats_dir = run_dir / "raw" / f"conv-{name}.stats"
        stats_dir.mkdir(exist_ok=True)
        train_args = ["--model", cfg.model, "--steps", str(cfg.steps), "--batch-size", str(batch), "--lr", str(cfg.lr),
                      "--seed", str(cfg.seed), "--eval-every", str(cfg.eval_every), "--metrics", str(metrics),
                      "--no-progress"]
        if links is None or e.kind == "reference":
            argv = [python(), "-m", "commlab.cli", "train", "--exchanger", e.url, "--workers", str(workers), *train_args]
        else:
            argv = [python(), "-m", "bench.launch_job", "--url", e.url, "--workers", str(workers), "--module", "workers",
                    "--link", links.rate, "--link-tag", links.tag, "--", *train_args]
        env = dict(os.environ, COMMLAB_STATS_DIR=str(stats_dir))
        res = run_job(argv, run_dir / "logs" / f"conv-{name}.log", min(cfg.job_timeout, budget.left()), env=env)
        budget.note(res.seconds)
        ranks = read_metrics(metrics, workers)
        if not res.ok or len(ranks[0]) < cfg.steps:
            status, error = budget.outcome(res) if not res.ok else ("failed", "")
            failures.append({"phase": "convergence", "regime": name, "url": e.url, "status": status,
                             "error": error or f"rank 0 wrote {len(ranks[0])} of {cfg.steps} steps",
                             "log": str(res.log.relative_to(run_dir))})
        else:
            s = summarize(name, e, ranks, cfg.target_acc)
            s["staleness"] = read_staleness(stats_dir, ranks, res.log)
            summaries.append(s)
            curves[name] = ranks[0]
        bar and bar.update(1)


def compare_with_reference(summaries: list[dict]) -> None:
    """Set ``max_abs_test_loss_diff`` (against local://, at the eval steps both have) on every summary."""
    ref = next((s for s in summaries if s["kind"] == "reference"), None)
    for s in summaries:
        s["max_abs_test_loss_diff"] = None
        s["coincides_with_local"] = None
        if ref is None or s is ref:
            continue
        mine = {e["step"]: e["test_loss"] for e in s["evals"]}
        common = [(mine[e["step"]], e["test_loss"]) for e in ref["evals"] if e["step"] in mine]
        if common:
            s["max_abs_test_loss_diff"] = max(abs(a - b) for a, b in common)
            s["coincides_with_local"] = s["max_abs_test_loss_diff"] <= COINCIDE_TOL
