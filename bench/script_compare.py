"""``commlab bench script``: the user's own training script under each chosen regime, side by side.

    commlab bench script --regimes 'local://,allreduce://?backend=gloo,ring://' --workers 2 \\
        --local-args '--batch-size 64' -- train.py --batch-size 32 --steps 200

Each regime is one launcher job of the script, as ``commlab run`` runs it (:func:`run_regime`). The
script reports with ``commlab.report(step, loss=..., ...)``; every rank's lines become one curve per
regime (:func:`bench.curves.curve`: the loss is the mean over the ranks, times and bytes are rank 0's).
Writes, in ``--out``: ``script.md`` (one row per regime: final loss, time to a target loss, median step
time, exposed communication and bytes per step, "—" for what the script did not report, or why the
regime did not run), ``script.json`` (the same, with each regime's curve), ``script.png`` (loss against
step, wall time and bytes sent), ``raw/`` and ``logs/``. ``local://`` runs one rank, with
``--local-args`` appended (the combined batch). The fields and how they are read: docs/bench.md, "Your
own script in the comparison".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import text
from bench import curves
from bench.curves import smooth_window, smoothed, time_to_target
from bench import jobs
from bench.jobs import read_ranks
from commlab.launch import launcher
from bench.regimes import unavailable
from commlab.base.config import ExchangerURL


def kind_of(url: str) -> str:
    """``reference`` (local://), ``floor`` (noop://), ``async`` (ps:// in async or ssp mode), else ``sync``.
    Raises ValueError (ConfigError) for a URL that does not parse."""
    parsed = ExchangerURL.parse(url)
    if parsed.scheme == "local":
        return "reference"
    if parsed.scheme == "noop":
        return "floor"
    if parsed.scheme == "ps" and dict(parsed.query).get("mode") in ("async", "ssp"):
        return "async"
    return "sync"


def split_regimes(text: str) -> list[str]:
    """``'local://,ps://h:1,h:2?mode=sync,ring://'`` -> the three URLs: a comma starts a new regime only
    where a scheme (``name://``) follows it, so a PS's HOST:PORT list stays in one URL."""
    return [u.strip() for u in re.split(r",(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)", text) if u.strip()]


@dataclass(frozen=True)
class Regime:
    """One job of the comparison: the script's ranks under ``url``."""

    label: str  # the table's name for it (the URL, or a short name)
    url: str
    workers: int
    args: tuple[str, ...]  # the script's arguments for this job
    kind: str = "sync"


@dataclass
class Outcome:
    """What one job produced: its status and every rank's metric lines."""

    regime: Regime
    status: str  # "ok" | "failed" | "unavailable" | "skipped"
    error: str = ""
    seconds: float = 0.0
    ranks: list[list[dict]] = field(default_factory=list)
    log: str = ""


def run_regime(command: tuple[str, ...], regime: Regime, out: Path, timeout: float,
               env: dict | None = None) -> Outcome:
    """Run the script under one regime as ``commlab run`` would; never raises for the regime's own failure.

    ``command`` is what follows the interpreter (``("train.py",)`` or ``("-m", "pkg.train")``).
    Blocks at most ``timeout`` seconds (plus the kill); leaves no process behind.
    """
    why = unavailable(regime.url)
    if why:
        return Outcome(regime, "unavailable", why)
    name = text.slug(regime.label)
    metrics = out / "raw" / f"{name}.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    head, rest = (command[:2], command[2:]) if command[0] == "-m" else (command[:1], command[1:])
    job = launcher.Job(head, (*rest, *regime.args), regime.workers, regime.url, env=env, metrics=str(metrics),
                       name=f"bench script {regime.label}")
    res = jobs.run(job, out / "logs" / f"{name}.log", timeout)
    ranks = read_ranks(metrics, regime.workers)
    log = str(res.log.relative_to(out))
    if not res.ok:
        return Outcome(regime, "failed", res.error(), res.seconds, ranks, log)
    if not any(rec.get("loss") is not None for rec in ranks[0]):
        return Outcome(regime, "failed", "rank 0 reported no loss (commlab.report(step, loss=...))",
                       res.seconds, ranks, log)
    return Outcome(regime, "ok", "", res.seconds, ranks, log)


# ----- from lines to curves and summaries ---------------------------------------------------------

def summarize(o: Outcome, target: float | None = None) -> dict:
    """The table's row for one outcome: :func:`bench.curves.summary`'s figures (and curve), with the final
    smoothed loss (``final_loss``), the last one (``last_loss``) and the time to ``target``."""
    r = o.regime
    row = {"regime": r.label, "url": r.url, "kind": r.kind, "workers": r.workers, "status": o.status,
           "error": o.error, "job_s": o.seconds, "log": o.log, "curve": []}
    row.update(curves.summary(o.ranks) if o.status == "ok" else {})
    pts = row["curve"]
    if not pts:
        return row
    sm = smoothed(pts)
    row.update({"final_loss": sm[-1], "last_loss": pts[-1]["loss"], "smooth_window": smooth_window(len(pts))})
    row.update(time_to_target(pts, sm, target))
    return row


def default_target(rows: list[dict]) -> float | None:
    """The loss every regime that finished reached: the highest of their final (smoothed) losses."""
    finals = [r["final_loss"] for r in rows if r.get("final_loss") is not None and math.isfinite(r["final_loss"])]
    return max(finals) if finals else None


def summarize_all(outcomes: list[Outcome], target: float | None = None) -> tuple[list[dict], float | None]:
    rows = [summarize(o) for o in outcomes]
    target = default_target(rows) if target is None else target
    for row in rows:
        if row.get("curve"):
            row.update(time_to_target(row["curve"], smoothed(row["curve"]), target))
    return rows, target


# ----- the table, the JSON, the plot --------------------------------------------------------------

def table(rows: list[dict], extra: list[tuple[str, callable]] = ()) -> list[str]:
    """Markdown: one row per regime (those that did not run say why in the last column)."""
    header = ["regime", "kind", "N", "steps", "final loss", "test loss", "steps to target", "s to target",
              "step ms (median)", "exposed comm ms (median)", "sent / rank / step", *[h for h, _ in extra], "status"]
    out = []
    for r in rows:
        ok = bool(r.get("curve"))
        status = "ok" if r["status"] == "ok" else f"{r['status']}: " + r["error"][:240]
        cells = [f"`{r['regime']}`" if "://" in r["regime"] else r["regime"], r["kind"], str(r["workers"])]
        if ok:
            cells += [str(r["steps"]), text.fixed(r["final_loss"]), text.fixed(r["test_loss"]),
                      text.fixed(r["steps_to_target"], "d"), text.fixed(r["time_to_target_s"], ".2f"),
                      text.ms(r["step_s_median"]), text.ms(r["comm_s_median"]), text.human_bytes(r["bytes_per_step"])]
        else:
            cells += ["—"] * 8
        out.append(cells + [fn(r) for _, fn in extra] + [status])
    return text.table(header, out)


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Loss against step, wall time and MiB sent by rank 0, one line per regime; None if nothing ran."""
    have = [r for r in rows if r.get("curve")]
    if not have:
        return None
    from bench.plots import plt, save

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    silent = []
    for r in have:
        pts = r["curve"]
        style = ({"linewidth": 5, "color": "black", "alpha": 0.25, "zorder": 1} if r["kind"] == "reference"
                 else {"linestyle": ":", "color": "grey"} if r["kind"] == "floor" else {"linewidth": 1.2, "zorder": 2})
        label = f"{r['regime']} ({r['kind']})"
        axes[0].plot([p["step"] + 1 for p in pts], [p["loss"] for p in pts], label=label, **style)
        timed = [p for p in pts if p["time_s"] is not None]
        if timed:
            axes[1].plot([p["time_s"] for p in timed], [p["loss"] for p in timed], label=label, **style)
        if pts[-1]["bytes"] > 0:
            axes[2].plot([p["bytes"] / 2**20 for p in pts], [p["loss"] for p in pts], label=label, **style)
        else:
            silent.append(r["regime"])
    axes[0].set(xlabel="step", ylabel="training loss (mean over ranks)", title=f"{title}: loss against step")
    axes[1].set(xlabel="seconds since training began (rank 0)", ylabel="training loss", title="loss against wall time")
    axes[2].set(xlabel="MiB sent by rank 0 (cumulative)", ylabel="training loss",
                title="loss against bytes sent" + (f"\n(not shown, sent nothing: {', '.join(silent)})" if silent else ""))
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save(fig, path, dpi=100)


def write(out: Path, rows: list[dict], target: float | None, command: list[str], png: Path | None,
          target_given: bool = False) -> Path:
    """``script.md`` and ``script.json`` in ``out``; returns the markdown's path."""
    md = [f"# Your script under each regime", "",
          f"- Command: `{' '.join(shlex.quote(c) for c in command)}`",
          f"- Target loss: {text.fixed(target)} ({'given' if target_given else 'the highest final loss among the regimes that finished: every one reached it'}); "
          "final loss and time to target use the trailing mean over a tenth of each curve's reported steps.",
          "- Loss is the mean over the ranks of each rank's reported loss (with equal batches: the combined "
          "batch's); step time, exposed communication (time spent waiting on the exchange) and bytes are rank 0's; "
          "\"—\" where the script did not report the field.", ""]
    md += table(rows) + [""]
    if png:
        md += [f"![loss against step, wall time and bytes]({png.name})", ""]
    path = out / "script.md"
    path.write_text("\n".join(md))
    (out / "script.json").write_text(json.dumps({"command": command, "target_loss": target, "regimes": rows},
                                                indent=1))
    return path


# ----- command line -------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench script", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="commlab bench script --regimes URL,URL,... [--workers N] [options] -- "
                                      "SCRIPT.py [ARGS] | -m MODULE [ARGS]")
    p.add_argument("--regimes", required=True,
                   help="comma-separated exchanger URLs (a comma inside a ps:// HOST:PORT list stays in its URL)")
    p.add_argument("--workers", type=int, default=2, help="ranks per regime (local:// always runs one)")
    p.add_argument("--local-args", default="", help="extra arguments for local:// (e.g. '--batch-size 64')")
    p.add_argument("--target-loss", type=float, help="time and steps to this loss (default: the loss every regime reached)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each regime's job may run")
    p.add_argument("--out", help="folder for script.md, script.json, script.png (default runs/script-<UTC time>)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py ARGS (or -m MODULE ARGS)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command or (command[0] == "-m" and len(command) < 2):
        print("commlab bench script: give the script after --: ... -- train.py [ARGS]", file=sys.stderr)
        return 2
    if a.workers < 1:
        print("commlab bench script: --workers must be >= 1", file=sys.stderr)
        return 2
    urls = split_regimes(a.regimes)
    if not urls:
        print("commlab bench script: --regimes names no regime", file=sys.stderr)
        return 2
    n_script = 2 if command[0] == "-m" else 1
    head, script_args = tuple(command[:n_script]), tuple(command[n_script:])
    if head[0] != "-m" and not Path(head[0]).exists():
        print(f"commlab bench script: {head[0]}: no such script", file=sys.stderr)
        return 2
    out = Path(a.out or Path("runs") / time.strftime("script-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for url in urls:
        try:
            kind = kind_of(url)
        except ValueError as exc:
            outcomes.append(Outcome(Regime(url, url, a.workers, script_args), "unavailable", str(exc)))
            continue
        local = kind == "reference"
        regime = Regime(url, url, 1 if local else a.workers,
                        script_args + (tuple(shlex.split(a.local_args)) if local else ()), kind)
        print(f"commlab bench script: {url} x{regime.workers} ...", file=sys.stderr, flush=True)
        o = run_regime(head, regime, out, a.timeout)
        print(f"commlab bench script: {url}: {o.status}" + (f" ({o.error})" if o.error else f" in {o.seconds:.1f} s"),
              file=sys.stderr, flush=True)
        outcomes.append(o)
    rows, target = summarize_all(outcomes, a.target_loss)
    png = plot(rows, out / "script.png", Path(head[-1]).name)
    path = write(out, rows, target, ["commlab", "bench", "script", *argv], png, a.target_loss is not None)
    print(path.read_text().split("\n\n", 1)[1] if "\n\n" in path.read_text() else "")
    print(f"commlab bench script: {path}, {out / 'script.json'}" + (f", {png}" if png else ""), file=sys.stderr)
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
