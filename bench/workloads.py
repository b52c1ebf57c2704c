"""Real workloads under every regime: the examples themselves, driven as a user runs them.

    commlab bench workloads                                 # both, the default regimes
    commlab bench workloads --workloads pipeline --workers 2 --regimes local,gloo   # the pipeline's bubble
    commlab bench workloads --workloads charlm --regimes local,gloo,ring,ps-sync --lm-steps 300

The examples (:data:`WORKLOADS`) are started unchanged, one job per regime, as ``commlab run`` runs
them (:func:`bench.script_compare.run_regime`); their ``commlab.report`` lines are the only thing read,
and give each regime's curve, time to a target loss, median step time, exposed communication and bytes
per step. ``local://`` is the reference: one process on the combined batch. A synchronous regime's loss
curve must lie on local's within :data:`COINCIDE_TOL` at every step (:func:`bench.curves.coincidence`),
except where a workload says why it cannot (the ResNet's BatchNorm: the difference is shown, not
judged). A regime that is unknown here or whose job fails is a row with the reason; the rest still run.
docs/bench.md ("Real workloads") has the details.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench import script_compare as sc
from bench import curves
from bench import regimes as R
from bench import text

ROOT = Path(__file__).resolve().parent.parent

# A synchronous regime "coincides" with local:// when the mean-over-ranks training loss at every
# reported step is within this of local's. What is left between them is rounding: bf16 autocast and
# a different summation order (two half batches averaged against one whole batch); measured here:
# at most 3.0e-4 over 40 LM steps, 4.7e-4 over 120 and 7.9e-4 over 150 (gloo and ring alike), a
# tenth of the tolerance or less. The loss falls by ~2.4 over those steps, so a regime that changes
# the update (an unaveraged or stale gradient, a lost schedule step) leaves it within a few steps.
COINCIDE_TOL = 0.01

# name -> URL; --regimes takes these names or URLs
REGIMES = {n: R.url_of(n) for n in ("local", "gloo", "ring", "ps-sync", "ps-async", "ps-ssp-2")}
DEFAULT_REGIMES = list(REGIMES)
# the default `commlab bench` runs the all-reduce ones (the parameter servers are in its training comparison)
BENCH_REGIMES = ["local", "gloo", "ring"]


@dataclass(frozen=True)
class Workload:
    name: str
    script: str  # relative to the checkout
    what: str  # one line for the report
    args: Callable[[int], tuple[str, ...]]  # steps -> the arguments every rank gets
    batch_size: int  # per rank
    reference: Callable[[int, int], tuple[str, ...]]  # (workers, batch) -> local://'s extra arguments
    steps: int
    target_loss: float | None  # None: the loss every regime reached
    coincide: bool  # does a synchronous regime reproduce local:// here?
    why_not: str = ""  # ... and if not, why
    url_options: tuple[tuple[str, str], ...] = ()  # (scheme, "key=value"): added to that scheme's URLs

    def url(self, url: str) -> str:
        """``url`` with this workload's options for its scheme (an option the URL names itself wins)."""
        scheme = url.split("://", 1)[0]
        for s, opt in self.url_options:
            if s == scheme and opt.split("=", 1)[0] + "=" not in url:
                url = R.with_query(url, opt)
        return url


def _lm_args(steps: int) -> tuple[str, ...]:
    return ("--steps", str(steps), "--log-every", "1", "--d-model", "64", "--layers", "2", "--heads", "4",
            "--context", "64", "--batch-size", "8", "--accum", "2", "--lr", "1e-2", "--warmup", "10",
            "--eval-batches", "4", "--threads", "1")


def _lm_reference(workers: int, batch: int) -> tuple[str, ...]:
    # the ranks' windows, together; the held-out windows too (4 batches of B = 4/N batches of N x B)
    return ("--batch-size", str(workers * batch), "--data-shards", str(workers),
            "--eval-batches", str(max(1, 4 // workers)))


PP_STAGES, PP_MICRO = 2, 4  # the pipeline workload's stages and micro-batches per step


def _pp_args(steps: int) -> tuple[str, ...]:
    return ("--steps", str(steps), "--log-every", "1", "--d-model", "64", "--layers", "2", "--heads", "4",
            "--context", "64", "--batch-size", "8", "--microbatches", str(PP_MICRO), "--stages", str(PP_STAGES),
            "--lr", "1e-2", "--warmup", "10", "--threads", "1", "--bubble")


def _pp_reference(workers: int, batch: int) -> tuple[str, ...]:
    # one process, one stage, every replica's slices of the text at once
    replicas = max(1, workers // PP_STAGES)
    return ("--stages", "1", "--batch-size", str(replicas * batch), "--data-shards", str(replicas))


def pipeline_figures(ranks: list[list[dict]]) -> dict:
    """From a pipeline job's metric lines (examples/pipeline_lm.py): the bubble, the median over steps (the
    first left out: it warms up) of ``bubble_s / pipeline_s``, per rank and its mean over the ranks; rank 0's
    activation bytes per step (sent to its neighbour stages, forward and back) beside its gradient bytes
    (``bytes_sent``: within its replica group). Empty where the job reported none."""
    per_rank = []
    for lines in ranks:
        fr = [rec["bubble_s"] / rec["pipeline_s"] for rec in lines[1:]
              if isinstance(rec.get("bubble_s"), (int, float)) and rec.get("pipeline_s")]
        if fr:
            per_rank.append(sorted(fr)[len(fr) // 2])
    if not per_rank:
        return {}
    first = next((rec for rec in ranks[0] if "activation_bytes" in rec), {})
    return {"bubble_per_rank": per_rank, "bubble": sum(per_rank) / len(per_rank),
            "activation_bytes_per_step": first.get("activation_bytes")}


def _cnn_args(steps: int) -> tuple[str, ...]:
    return ("--steps", str(steps), "--log-every", "1000", "--batch-size", "32", "--width", "8", "--threads", "1")


WORKLOADS = {
    "charlm": Workload("charlm", "examples/charlm.py",
                       "GPT-style character LM on pydoc_data.topics (2 layers, d=64, context 64, 2 micro-batches "
                       "of 8 sequences per rank per step, AdamW groups, warm-up + cosine, clipping, bf16 autocast)",
                       _lm_args, 8, _lm_reference, steps=120, target_loss=2.6, coincide=True),
    "resnet": Workload("resnet", "examples/resnet_digits.py",
                       "BatchNorm ResNet (width 8) on 16x16 digits, batch 32 per rank, SGD momentum 0.9, StepLR",
                       _cnn_args, 32, lambda n, b: ("--batch-size", str(n * b)), steps=60, target_loss=0.6,
                       coincide=False,
                       why_not="each rank normalises with the BatchNorm statistics of its own batch, local:// with "
                               "those of the combined batch (as DDP without SyncBatchNorm): the curves differ by design",
                       # ps:// carries no module buffers yet: each rank keeps its own running statistics (they
                       # change only the held-out loss; training normalises with the batch's own)
                       url_options=(("ps", "buffers=none"),)),
    "pipeline": Workload("pipeline", "examples/pipeline_lm.py",
                         f"the character LM in {PP_STAGES} pipeline stages (torch.distributed.pipelining, 1F1B over "
                         f"{PP_MICRO} micro-batches of 2 sequences) x N/{PP_STAGES} replicas, each stage's gradients "
                         f"exchanged within its replica group (2 layers, d=64, context 64, AdamW groups, clipping "
                         f"across stages, float32)",
                         _pp_args, 8, _pp_reference, steps=60, target_loss=None, coincide=True),
}
DEFAULT_WORKLOADS = ["charlm", "resnet"]
# seconds the default `commlab bench` (after bandwidth and the MLP convergence) may spend starting
# workload jobs; the LM's regimes go first, what does not fit is listed as skipped
BENCH_BUDGET_S = 300.0  # a cap: the default workloads and regimes finish well within it


def resolve_regimes(text: str | None) -> list[tuple[str, str]]:
    """``(label, URL)`` for each comma-separated name (see :data:`REGIMES`) or URL."""
    if not text:
        return [(n, REGIMES[n]) for n in DEFAULT_REGIMES]
    out = []
    for item in sc.split_regimes(text) if "://" in text else [t.strip() for t in text.split(",") if t.strip()]:
        if "://" in item:
            out.append((item, item))
        elif item in REGIMES:
            out.append((item, REGIMES[item]))
        else:
            raise ValueError(f"unknown regime {item!r}: give a URL or one of {', '.join(REGIMES)}")
    return out


@dataclass
class WorkloadsConfig:
    workloads: list[str] = field(default_factory=lambda: list(DEFAULT_WORKLOADS))
    regimes: list[tuple[str, str]] = field(default_factory=lambda: resolve_regimes(None))
    workers: int = 2
    steps: dict = field(default_factory=dict)  # workload -> steps (default: the workload's)
    job_timeout: float = 120.0


def run(cfg: WorkloadsConfig, out: Path, budget_s: float, progress: Callable[[str], None] | None = None) -> dict:
    """Every workload under every regime; returns ``{workload: result}``.

    Jobs go regime by regime (local:// first, then in the order given), each regime for every
    workload, so when ``budget_s`` runs out the regimes skipped are the last ones, in every workload
    alike. A job starts only while the budget holds another like that workload's last (the rows of
    those that do not say "skipped"); a started job may run ``cfg.job_timeout``. A result holds the
    workload's config, each regime's summary row (:func:`bench.script_compare.summarize`, with its
    curve and ``vs_local`` from :func:`bench.curves.coincidence`) and the target loss. Never raises for a regime's
    failure.
    """
    deadline = time.monotonic() + budget_s
    order = sorted(cfg.regimes, key=lambda lr: not lr[1].startswith("local://"))  # the reference first
    steps = {n: int(cfg.steps.get(n, WORKLOADS[n].steps)) for n in cfg.workloads}
    outcomes: dict[str, list[sc.Outcome]] = {n: [] for n in cfg.workloads}
    for label, url in order:
        for wname in cfg.workloads:
            outcomes[wname].append(_one(WORKLOADS[wname], steps[wname], label, url, cfg, out, deadline,
                                        outcomes[wname], progress))
    results = {}
    for wname in cfg.workloads:
        w = WORKLOADS[wname]
        rows, target = sc.summarize_all(outcomes[wname], w.target_loss)
        ref = next((r for r in rows if r["kind"] == "reference" and r.get("curve")), None)
        for r, o in zip(rows, outcomes[wname]):
            r["vs_local"] = (curves.coincidence(ref["curve"], r["curve"], COINCIDE_TOL)
                             if ref and r is not ref and r.get("curve") else None)
            if wname == "pipeline" and o.status == "ok":
                r.update(pipeline_figures(o.ranks))
        results[wname] = {"workload": wname, "script": w.script, "what": w.what, "steps": steps[wname],
                          "workers": cfg.workers, "batch_per_rank": w.batch_size, "args": list(w.args(steps[wname])),
                          "reference_args": list(w.reference(cfg.workers, w.batch_size)),
                          "coincide": w.coincide, "why_not": w.why_not, "tolerance": COINCIDE_TOL,
                          "target_loss": target, "rows": rows}
    return results


def _one(w: Workload, steps: int, label: str, url: str, cfg: WorkloadsConfig, out: Path, deadline: float,
         before: list[sc.Outcome], progress) -> sc.Outcome:
    """One job of :func:`run`: workload ``w`` under ``url`` (or the reason it did not run)."""
    base = w.args(steps)
    try:
        kind = sc.kind_of(url)
    except ValueError as exc:
        return sc.Outcome(sc.Regime(label, url, cfg.workers, base), "unavailable", str(exc))
    local = kind == "reference"
    regime = sc.Regime(label, w.url(url), 1 if local else cfg.workers,
                       base + (w.reference(cfg.workers, w.batch_size) if local else ()), kind)
    need = max(10.0, max((x.seconds for x in before), default=0.0))
    if deadline - time.monotonic() < need:
        progress and progress(f"{w.name} {label}: skipped (the workloads' time budget ran out)")
        return sc.Outcome(regime, "skipped", "the workloads' time budget ran out before this run")
    progress and progress(f"{w.name} {label}")
    o = sc.run_regime((str(ROOT / w.script),), regime, out / "workloads" / w.name, cfg.job_timeout)
    if o.status == "ok" and len(curves.curve(o.ranks)) < steps:
        o.status, o.error = "failed", f"rank 0 reported {len(curves.curve(o.ranks))} of {steps} steps"
    return o


# ----- the report ---------------------------------------------------------------------------------

def sync_verdict(res: dict) -> list[str]:
    """One line per synchronous regime: does its curve lie on local://'s? (:func:`bench.curves.agreement`)"""
    ref = next((r for r in res["rows"] if r["kind"] == "reference"), None)
    return curves.agreement(res["rows"], bool(ref and ref.get("curve")), what="loss",
                            why="bf16 autocast and summation order", judged=res["coincide"], why_not=res["why_not"])


def _vs_local(r: dict) -> str:
    v = r.get("vs_local")
    if not v or v["max_abs_diff"] is None:
        return "—"
    return f"{v['max_abs_diff']:.2g}"


def section(results: dict, pngs: dict | None = None) -> list[str]:
    """The report's "Real workloads" section (markdown lines)."""
    out = ["## Real workloads: the examples under each regime", ""]
    if not results:
        return out + ["Not run.", ""]
    for name, res in results.items():
        out += [f"### {name}: `{res['script']}`", "",
                f"{res['what']}. {res['steps']} steps, {res['workers']} ranks x {res['batch_per_rank']} per rank; "
                f"local:// runs one process on the combined batch (`{' '.join(res['reference_args'])}`). "
                f"Started with `commlab run` per regime: `{res['script']} {' '.join(res['args'])}`. Loss is the "
                f"training loss, mean over the ranks at each step; final loss and time to target use the trailing "
                f"mean over a tenth of the steps; target loss {text.fixed(res['target_loss'])}. Step time, exposed "
                f"communication (time spent waiting on the exchange: backward's end and, for ps://, the pull) and "
                f"bytes are rank 0's medians.", ""]
        out += ["Regimes: " + ", ".join(f"{r['regime']} = `{r['url']}`" for r in res["rows"]) + ".", ""]
        extra = [("max abs loss diff vs local", _vs_local)]
        if name == "pipeline":
            extra += [("bubble (measured: mean; per rank)", _bubble),
                      ("activations / rank / step", lambda r: text.human_bytes(r.get("activation_bytes_per_step")))]
            out += [pipeline_note(res), ""]
        out += sc.table(res["rows"], extra) + [""]
        out += ["Do the synchronous regimes reproduce local:// on the combined batch?", ""] + sync_verdict(res) + [""]
        png = (pngs or {}).get(name)
        if png:
            out += [f"![{name}: loss against step, wall time and bytes]({png})", ""]
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _bubble(r: dict) -> str:
    per = r.get("bubble_per_rank")
    return "—" if not per else f"{_pct(r['bubble'])}; " + ", ".join(_pct(x) for x in per)


def pipeline_note(res: dict) -> str:
    """The pipeline workload's bubble beside the schedule's theory, and what each dimension moves."""
    p, m = PP_STAGES, PP_MICRO
    return (f"The bubble is the part of a step's schedule a stage spends not computing: its time in "
            f"`schedule.step` less the time the same stage then takes for the same {m} micro-batches alone "
            f"(`--bubble`: timed right after, so under the same load), as a fraction of the former; the median "
            f"over steps, the mean over the ranks. GPipe's and 1F1B's theory: (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = "
            f"{100 * (p - 1) / (m + p - 1):.0f}% for p = {p} stages and m = {m} micro-batches (equal stages, "
            f"free sends); where ranks share cores, time-slicing inflates it, so read it at {p} ranks on "
            f"{p} free cores. Activations are rank 0's sends to its neighbour stages per step (activations "
            f"forward, their gradients back); \"sent / rank / step\" is its gradient exchange within its "
            f"replica group (nothing with one replica: N = {p}).")


def write(out: Path, results: dict) -> tuple[Path, dict]:
    """``workloads.json``, one PNG per workload and ``workloads.md`` in ``out``."""
    pngs = {}
    for name, res in results.items():
        png = sc.plot(res["rows"], out / f"workloads-{name}.png", name)
        if png:
            pngs[name] = png.name
    (out / "workloads.json").write_text(json.dumps(results, indent=1))
    path = out / "workloads.md"
    path.write_text("\n".join(["# commlab bench workloads", ""] + section(results, pngs)))
    return path, pngs


def append_section(report: Path, results: dict, pngs: dict) -> None:
    """Put :func:`section` into a finished ``report.md``, before its "## Files" section (or at its end)."""
    text = report.read_text()
    block = "\n".join(section(results, pngs)) + "\n"
    at = text.find("\n## Files")
    report.write_text(text[:at + 1] + block + text[at + 1:] if at >= 0 else text.rstrip("\n") + "\n\n" + block)


def names_arg(arg: str) -> list[str]:
    """``--workloads charlm,resnet`` -> the names (``none``: []); argparse's ``type``."""
    try:
        return text.names(arg, WORKLOADS, "--workloads")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or none") from None


def run_default(run_dir: Path, budget_s: float, workers: int = 2, *, progress=None,
                names: list[str] | None = None) -> tuple[dict, dict]:
    """What the default ``commlab bench`` runs: the workloads ``names`` (default both; :func:`names_arg`
    checked them) under :data:`BENCH_REGIMES`; writes the files."""
    names = list(DEFAULT_WORKLOADS) if names is None else names
    if progress is None:
        progress = lambda what: print(f"commlab bench: workload {what}", file=sys.stderr, flush=True)
    results = run(WorkloadsConfig(names, [(n, REGIMES[n]) for n in BENCH_REGIMES], workers=workers), run_dir,
                  budget_s, progress)
    _, pngs = write(run_dir, results)
    return results, pngs


# ----- command line -------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench workloads", description=__doc__.split("\n\n")[0],
                                epilog="regimes: " + ", ".join(f"{k} = {v}" for k, v in REGIMES.items()))
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), type=names_arg, help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--regimes", help="comma-separated names or URLs (default: " + ",".join(DEFAULT_REGIMES) + ")")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lm-steps", type=int, default=WORKLOADS["charlm"].steps)
    p.add_argument("--cnn-steps", type=int, default=WORKLOADS["resnet"].steps)
    p.add_argument("--pipeline-steps", type=int, default=WORKLOADS["pipeline"].steps)
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting jobs after this many seconds")
    p.add_argument("--job-timeout", type=float, default=120.0)
    p.add_argument("--out", help="folder (default runs/workloads-<UTC time>)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        names = a.workloads
        if a.workers < 2:
            raise ValueError("--workers must be >= 2")
        cfg = WorkloadsConfig(names, resolve_regimes(a.regimes), a.workers,
                              {"charlm": a.lm_steps, "resnet": a.cnn_steps, "pipeline": a.pipeline_steps},
                              a.job_timeout)
    except ValueError as exc:
        print(f"commlab bench workloads: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out or Path("runs") / time.strftime("workloads-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run(cfg, out, a.budget_s, lambda what: print(f"commlab bench workloads: {what} ...", file=sys.stderr,
                                                           flush=True))
    path, _ = write(out, results)
    print(path.read_text())
    print(f"commlab bench workloads: {path} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
