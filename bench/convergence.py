"""Convergence: the same model, seed, data order and global batch under every regime.

Each regime runs the built-in worker (or a peer's module taking its flags, :func:`rank_args`) as a
launcher job of its own (:func:`bench.jobs.run`). ``local://`` runs one worker on the combined batch
(N x B): the reference every synchronous regime must reproduce, step for step. From the workers'
per-step lines :func:`summarize` derives the loss and accuracy against step, time and bytes, the time
to a target accuracy and the step split (compute, exposed communication, the rest);
:func:`compare_with_reference` how far each curve lies from local's; :func:`read_staleness` the
asynchronous regimes' staleness, from the servers.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench import curves
from bench import regimes as R
from bench.bandwidth import Budget
from bench import jobs
from bench.jobs import read_ranks
from bench.records import failure
from commlab.launch import launcher
from commlab.core.metrics import metrics_path
from commlab.plan.calibrate import cpu_share
from bench.text import slug

# A synchronous regime "coincides" with local:// when its test loss at every eval
# step is within this of local's. Summation order differs (bucketed all-reduce vs one
# big batch), so float32 rounding, not algorithmic error, is what is left.
COINCIDE_TOL = 1e-3


def rank_args(model: str, *, steps: int, batch: int, lr: float, seed: int, eval_every: int, metrics: Path) -> list[str]:
    """Every rank's flags: the built-in worker's (``python -m workers``), which a peer's module takes too
    (:func:`workers.loop.add_training_args`). Each rank writes one JSON line per step to ``metrics`` (rank
    r > 0: ``metrics.rank<r>``) with ``step, loss, compute_s, comm_s, step_s, bytes_sent, time_s`` and, on
    rank 0 at eval steps, ``test_loss`` and ``test_acc``."""
    return ["--model", model, "--steps", str(steps), "--batch-size", str(batch), "--lr", repr(lr), "--seed", str(seed),
            "--eval-every", str(eval_every), "--metrics", str(metrics), "--no-progress"]


def machine_slowdown(procs: int, seconds: float = 0.5) -> float:
    """How many times slower than on a quiet machine ``procs`` processes that compute in lockstep run here
    now: the share of a core each would get on this machine alone (``min(1, cores / procs)``) over the
    share each gets now (:func:`commlab.plan.calibrate.cpu_share`, measured for ``seconds``); at least 1.
    Blocks about ``seconds`` plus the start of ``procs`` interpreters."""
    quiet = min(1.0, len(os.sched_getaffinity(0)) / procs)
    return max(1.0, quiet / cpu_share(procs, seconds=seconds, step_cpu_s=0.02))


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
    job_timeout: float = 120.0  # one job's deadline on a quiet machine, stretched by ``slowdown`` at its start
    # how many times slower than on a quiet machine the jobs run here: None measures it at each job's start
    # (:func:`machine_slowdown`); a number fixes it (1: the deadline is job_timeout)
    slowdown: float | None = None

    def lr_for(self, entry: R.ConvergenceEntry, workers: int) -> float:
        return self.lr / workers if entry.lr_over_n else self.lr


def quiet_for(metrics: Path, ranks: int, started: float) -> float:
    """Seconds since any of a job's ranks last wrote a metrics line (the files' last change; since the
    job started, at ``started`` on ``time.time()``'s clock, when none wrote one): how long it had gone
    without progress."""
    stamps = [p.stat().st_mtime for p in (metrics_path(metrics, r) for r in range(ranks)) if p.exists()]
    return time.time() - max(stamps, default=started)


SERVER_STATS = re.compile(r"^commlab server (?P<name>[^:]+): (?P<json>\{.*\})\s*$")


def read_staleness(log: Path, key: str = "staleness") -> list[int] | None:
    """Every applied update's staleness, from the stats line each PS server prints when it stops
    (``commlab server NAME: {json}``, in the job's log ``log``): its ``key`` histogram (``{"0": count,
    "1": count, ...}``), the last line of each server, shards added up. ``key``: ``"staleness"`` (the
    version gap: server updates between the parameters a gradient was computed on and the ones it is
    applied to) or ``"clock_gap"`` (the pushing worker's step minus the slowest worker's). None where no
    server reported it (a regime without servers)."""
    last: dict[str, dict] = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        m = SERVER_STATS.match(line.strip())
        if m:
            try:
                last[m.group("name")] = json.loads(m.group("json"))
            except ValueError:
                continue
    hists = [doc[key] for doc in last.values() if isinstance(doc, dict) and isinstance(doc.get(key), dict)]
    if not hists:
        return None
    return [int(k) for h in hists for k, n in h.items() for _ in range(int(n))]


def summarize(name: str, entry: R.ConvergenceEntry, ranks: list[list[dict]], target: float, batch: int = 0,
              lr: float = float("nan")) -> dict:
    """One regime's summary: :func:`bench.curves.summary`'s figures (``test_loss`` / ``test_acc``: the
    last evaluation's), with the evaluations (``evals``: step counted from 1, time, test loss and
    accuracy, bytes rank 0 sent so far), the steps and time to ``target`` test accuracy, the per-step
    samples the scaling phase and the verdicts use, ``lr`` and ``samples`` (every rank's)."""
    r0 = ranks[0]
    evals = [{"step": x["step"] + 1, "time_s": x["time_s"], "test_loss": x["test_loss"], "test_acc": x["test_acc"],
              "bytes": sum(x2["bytes_sent"] for x2 in r0[: x["step"] + 1])} for x in r0 if "test_acc" in x]
    return {"regime": name, "url": entry.url, "kind": entry.kind, "workers": len(ranks), **curves.summary(ranks),
            **curves.reach(test_loss_curve({"evals": evals}), [e["test_acc"] for e in evals], lambda a: a >= target),
            "evals": evals, "batch_per_worker": batch, "lr": lr, "samples": batch * sum(map(len, ranks)),
            "step_s_samples": [x["step_s"] for x in r0], "comm_s_samples": [x["comm_s"] for x in r0]}


def run(cfg: ConvergenceConfig, run_dir: Path, budget: Budget, links=None, progress=None) -> tuple[list[dict], list[dict], dict]:
    """Train under each regime; return (summaries, failures, curves). Never raises for a regime's failure.

    ``curves[name]`` holds rank 0's per-step lines (and the staleness values, if any).
    """
    failures: list[dict] = []
    todo = [(name, cfg.workers) for name in _runnable(cfg.regimes, "convergence", links, failures)]
    summaries = _train_each(cfg, "convergence", todo, cfg.steps, run_dir, budget, links, progress, failures)
    curves = {s["regime"]: s.pop("curve") for s in summaries}
    compare_with_reference(summaries)
    return summaries, failures, curves


def _runnable(names: list[str], phase: str, links, failures: list[dict]) -> list[str]:
    """The regimes of ``names`` that can run here (over ``links``, if given); the others are appended to
    ``failures`` as unavailable, with the reason."""
    out = []
    for name in names:
        e = R.CONVERGENCE[name]
        why = R.unavailable(e.url)
        if why is None and links is not None and e.loopback_only:
            why = "not run over --link: this regime's addresses are chosen on loopback (127.0.0.1)"
        if why:
            failures.append(failure(phase, name, why, e.url, "unavailable"))
        else:
            out.append(name)
    return out


def _train_each(cfg: ConvergenceConfig, phase: str, todo: list[tuple[str, int]], steps: int, run_dir: Path,
                budget: Budget, links, progress, failures: list[dict]) -> list[dict]:
    """:func:`train` each (regime, N) of ``todo`` in turn; the summaries of those that finished, the others
    appended to ``failures`` (a job starts only while the budget holds one more; Ctrl-C or SIGTERM stops
    the phase, which keeps what finished)."""
    scaling = phase == "scaling"
    done = []
    bar = progress(total=len(todo), desc=phase, unit="run") if progress else None
    try:
        for name, n in todo:
            at = f"N={n}: " if scaling else ""
            bar and bar.set_postfix_str(f"{name} N={n}" if scaling else name)
            if not budget.fits(8.0):
                failures.append(dict(failure(phase, name, at + "the benchmark's time budget ran out before this run",
                                             R.CONVERGENCE[name].url, "skipped"), workers=n))
            else:
                s, failed = train(cfg, name, n, steps, run_dir, budget, links,
                                  f"scale-{slug(name)}-n{n}" if scaling else f"conv-{slug(name)}")
                if failed:
                    failures.append(dict(failed, phase=phase, error=at + failed["error"]))
                else:
                    done.append(s)
            bar and bar.update(1)
    except KeyboardInterrupt:
        failures.append(failure(phase, "-", "interrupted (Ctrl-C or SIGTERM): the report covers the runs that "
                                "finished", status="interrupted"))
    if bar:
        bar.close()
    return done


def train(cfg: ConvergenceConfig, name: str, workers: int, steps: int, run_dir: Path, budget: Budget, links,
          tag: str) -> tuple[dict | None, dict | None]:
    """One training job of ``cfg``'s workload under regime ``name`` with ``workers`` ranks (local://: one,
    with the combined batch). Returns (summary, None) or (None, failure)."""
    e = R.CONVERGENCE[name]
    ranks_n, batch = (1, workers * cfg.batch_size) if e.kind == "reference" else (workers, cfg.batch_size)
    lr = cfg.lr_for(e, workers)
    metrics = run_dir / "raw" / f"{tag}.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    args = rank_args(cfg.model, steps=steps, batch=batch, lr=lr, seed=cfg.seed, eval_every=cfg.eval_every,
                     metrics=metrics)
    job = launcher.worker_job(e.url, ranks_n, args, module=e.module or "workers", name=f"convergence {name}")
    # the deadline scales with this machine's speed now: a loaded machine gets the time it needs, and a run
    # its deadline still stops is too slow to judge here, not failed (bench.bandwidth.Budget.outcome)
    slowdown = machine_slowdown(ranks_n) if cfg.slowdown is None else cfg.slowdown
    deadline = cfg.job_timeout * slowdown
    started = time.time()
    res = jobs.run(job, run_dir / "logs" / f"{tag}.log", min(deadline, budget.left()),
                   None if e.kind == "reference" else links)
    budget.note(res.seconds)
    ranks = read_ranks(metrics, ranks_n)
    if not res.ok or len(ranks[0]) < steps:
        status, error = (budget.outcome(res, quiet_for(metrics, ranks_n, started)) if not res.ok
                         else ("failed", ""))
        if res.timed_out:
            error += (f" (rank 0 had done {len(ranks[0])} of {steps} steps; deadline {deadline:.0f}s: "
                      f"{cfg.job_timeout:g}s on a quiet machine x {slowdown:.2f}, this machine's slowdown at the start)")
        return None, dict(failure("convergence", name, error or f"rank 0 wrote {len(ranks[0])} of {steps} steps",
                                  e.url, status), workers=workers, log=str(res.log.relative_to(run_dir)),
                          deadline_s=deadline, slowdown=slowdown)
    s = summarize(name, e, ranks, cfg.target_acc, batch, lr)
    s["staleness"] = read_staleness(res.log)
    s["clock_gap"] = read_staleness(res.log, key="clock_gap")
    s["curve"] = ranks[0]  # the raw lines (convergence.json's curves), not bench.curves' points
    return s, None


def run_scaling(cfg: ConvergenceConfig, names: list[str], workers: list[int], steps: int, run_dir: Path,
                budget: Budget, links=None, progress=None, have: list[dict] | None = None
                ) -> tuple[list[dict], list[dict]]:
    """Step time and exposed communication of each regime at each N (the same per-worker batch):
    one short training job per (regime, N). ``have``: convergence summaries of this run at
    ``cfg.workers``, reused for that N. Returns (points, failures); a point holds the per-step samples."""
    points, failures = [], []
    todo = []
    for name in _runnable(names, "scaling", links, failures):
        for n in workers:
            old = next((s for s in have or [] if s["regime"] == name and s["workers"] == n), None)
            if old is not None:
                points.append(_point(old, steps_dropped=0))
            else:
                todo.append((name, n))
    for s in _train_each(cfg, "scaling", todo, steps, run_dir, budget, links, progress, failures):
        s.pop("curve")
        points.append(_point(s, steps_dropped=SCALING_WARMUP))
    return sorted(points, key=lambda p: (names.index(p["regime"]), p["workers"])), failures


SCALING_WARMUP = 3  # first steps of a short run: allocation, connection, first buckets


def _point(s: dict, steps_dropped: int) -> dict:
    step, comm = s["step_s_samples"][steps_dropped:], s["comm_s_samples"][steps_dropped:]
    return {"regime": s["regime"], "url": s["url"], "kind": s["kind"], "workers": s["workers"],
            "step_s_median": statistics.median(step), "comm_s_median": statistics.median(comm),
            "step_s_samples": step, "comm_s_samples": comm}


def test_loss_curve(s: dict) -> list[dict]:
    """A summary's evaluations as a curve (:mod:`bench.curves`): step counted from 0, loss = test loss."""
    return [{"step": e["step"] - 1, "loss": e["test_loss"], "time_s": e["time_s"]} for e in s["evals"]]


def compare_with_reference(summaries: list[dict]) -> None:
    """Set ``vs_local`` (:func:`bench.curves.coincidence` of the test-loss curves, at the eval steps both
    have), ``max_abs_test_loss_diff`` and ``coincides_with_local`` (its figures) on every summary."""
    ref = next((s for s in summaries if s["kind"] == "reference"), None)
    for s in summaries:
        v = None if ref is None or s is ref else curves.coincidence(test_loss_curve(ref), test_loss_curve(s),
                                                                      COINCIDE_TOL)
        s["vs_local"] = v
        s["max_abs_test_loss_diff"] = v and v["max_abs_diff"]
        s["coincides_with_local"] = v and v["coincides"]
