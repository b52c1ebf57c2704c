"""``commlab bench compress``: when does gradient compression pay, for this model and this link?

    commlab bench compress                                  # the default cells (about 10 minutes, at most 15)
    commlab bench compress --models mlp --link 100mbit      # one cell: the lead's runs for a median
    commlab bench compress --models lm --link 10mbit --rounds 2
    commlab bench compress --models mlp --link loopback --steps 8 --compressors powersgd:4 --peers ddp

A cell is one model at one link rate (``loopback``, or a ``tc tbf`` cap between network namespaces, as
root: :class:`bench.netns.Links`), run as one job (:mod:`bench.compress_worker`) whose entries take turns,
each from a fresh model: ``REGIME`` uncompressed (``ring://`` by default), ``REGIME?compress=C`` for each
compressor, and the peers DDP, DDP with torch's PowerSGD hook and DDP with torch's fp16 hook. Per entry:
step time, bytes per step (and their ratio to uncompressed), the loss against step and time, and the time
to a target loss; every "faster" is :mod:`bench.verdict`'s ratio with its 95% interval, and the issue's
goals are checked where their cell ran. Models: ``mlp`` (the 25M MLP) and ``lm`` (examples/charlm.py's).
Writes ``compress.md``, ``compress.json`` and one ``compress-<model>-<link>.png`` per cell in ``--out``
(default ``runs/compress-<UTC time>/``). docs/bench.md ("When compression pays") has the details.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import records as rec
from bench import verdict
from bench import jobs
from bench.jobs import read_ranks
from commlab.launch import launcher
from bench.curves import smoothed, time_to_target
from bench.script_compare import Outcome, Regime, plot, summarize_all, table
from bench.regimes import unavailable, with_query
from bench.text import names, slug

CASE = "compress"
MODELS = {"mlp": "mlp-25m", "lm": "charlm"}
TINY = {"mlp": "tiny", "lm": "charlm-tiny"}  # --tiny: the same cells at test size (tests/test_bench.py)
COMPRESSORS = ("fp16", "bf16", "powersgd:4", "topk:0.01", "randomk:0.01", "sign")
PEERS = ("ddp", "ddp+powersgd", "ddp+fp16")
# the cells run by default, in this order (the goals first, so a spent budget skips the others)
DEFAULT_CELLS = (("mlp", "100mbit"), ("lm", "10mbit"), ("mlp", "loopback"), ("lm", "loopback"), ("lm", "1gbit"),
                 ("mlp", "1gbit"))
# steps per job in each cell: a 25M MLP step at 100 Mbit/s moves 100 MB (about 8 s uncompressed)
STEPS = {("mlp", "loopback"): 10, ("mlp", "1gbit"): 6, ("mlp", "100mbit"): 5, ("lm", "loopback"): 40,
         ("lm", "1gbit"): 40, ("lm", "100mbit"): 40, ("lm", "10mbit"): 30}
BATCH = {"mlp": 32, "lm": 16}
DEFAULT_BUDGET_S = 840.0
MIN_CELL_S = 120.0  # a cell is not started with less of the budget left (it would be cut short, half measured)
# the goals of issue 26 (speed): ratio >= goal over the whole interval
GOAL_PSGD_OVER_RING_100M = 20.0
GOAL_TTT_LM_10M = 2.0
# On loopback no compressor pays (the "link" is memory: encoding and decoding cost more than the bytes they
# save). The goal there (decided by the team, issue 39) is that commlab's seam costs no more than torch's own:
# REGIME?compress=powersgd:R's step never slower than DDP with torch's PowerSGD hook at the same rank R, the
# median of three runs' step-time ratios (hook / ours) at least this:
GOAL_PSGD_OVER_HOOK_LOOPBACK = 1.0
NO_COMPRESSOR_PAYS_ON_LOOPBACK = ("On loopback no compressor pays: the link is memory, and encoding and decoding "
                                  "cost more than the bytes they save (docs/compress.md). Compression is for slow "
                                  "links; see the capped cells.")
# the default target loss: the uncompressed regime's (smoothed) loss this far through its steps; an entry that
# learns as fast per step reaches it within the run, one that learns slower may not ("—")
TARGET_AT = 1 / 2


@dataclass(frozen=True)
class Entry:
    """One job of a cell: a commlab URL, or a DDP peer (``peer``, with the URL ``local://``)."""

    label: str
    url: str  # "job": the job's own URL (a ps:// job, whose servers the launcher starts)
    peer: str | None = None
    compressor: str | None = None  # None: uncompressed
    settings: tuple[tuple[str, object], ...] = ()  # more fields of the worker's entry ("slow_rank", a peer's "H")

    @property
    def kind(self) -> str:
        return "peer" if self.peer else "regime"


def spec_of(compressor: str, start_iter: int) -> str:
    """The ``compress=`` spec: PowerSGD gets the warm-up ``start_iter`` (torch's hook gets the same)."""
    return f"{compressor},start_iter={start_iter}" if compressor.startswith("powersgd") else compressor


def entries(regime: str, compressors, peers, start_iter: int, rank_r: int) -> list[Entry]:
    out = [Entry(regime, regime)]
    for c in compressors:
        url = with_query(regime, f"compress={spec_of(c, start_iter)}")
        out.append(Entry(url, url, compressor=c))
    out += [Entry(p if p != "ddp+powersgd" else f"ddp+powersgd:{rank_r}", "local://", peer=p,
                  compressor={"ddp": None, "ddp+fp16": "fp16"}.get(p, f"powersgd:{rank_r}")) for p in peers]
    return out


def over_link(url: str) -> str:
    """A ring's URL across namespaces: tcp (shared memory would bypass the capped link), bound to the address
    its rank reaches others on (no keys: the addresses exist only inside this run's namespaces)."""
    if not url.startswith("ring://") or "host=" in url or "transport=torch" in url:
        return url
    return with_query(url, ("" if "transport=" in url else "transport=tcp&") + "host=auto&insecure=1")


def run_job_of_cell(es: list[Entry], model: str, link: str, steps: int, a, out: Path, links,
                    timeout: float, job_url: str = "local://", tag: str = "") -> dict[str, list[Outcome]]:
    """One job for the whole cell (model, link): every entry that can run, ``a.rounds`` times, taking turns
    (:mod:`bench.compress_worker`), under ``job_url`` (``local://``; a ``ps://`` URL for entries whose url is
    ``"job"``), its files named after the cell and ``tag``. Returns each entry's outcome per round; never
    raises for a failure."""
    outcomes: dict[str, list[Outcome]] = {e.label: [] for e in es}  # in the entries' order
    runnable = []
    for e in es:
        url = job_url if e.url == "job" else e.url if links is None or e.peer else over_link(e.url)
        regime = Regime(e.label, url, a.workers, (), e.kind)
        why = None if e.peer else unavailable(url)
        if why:
            outcomes[e.label] = [Outcome(regime, "unavailable", why)]
        else:
            runnable.append((e, regime))
    if not runnable:
        return outcomes
    tag = f"{model}-{slug(link)}{tag}"
    base = out / "raw" / f"{tag}.jsonl"
    base.parent.mkdir(parents=True, exist_ok=True)
    spec = [{**({"peer": e.peer} if e.peer else {"url": "job" if e.url == "job" else r.url}), **dict(e.settings)}
            for e, r in runnable]
    args = ["--entries", json.dumps(spec), "--rounds", str(a.rounds), "--model", (TINY if a.tiny else MODELS)[model],
            "--steps", str(steps), "--batch-size", str(BATCH[model]), "--seed", str(a.seed), "--metrics", str(base),
            "--rank-r", str(a.rank_r), "--start-iter", str(a.start_iter),
            *(["--eval-every", str(a.eval_every)] if getattr(a, "eval_every", 0) else [])]
    job = launcher.worker_job(job_url, a.workers, args, module="bench.compress_worker", name=f"{CASE} {tag}")
    res = jobs.run(job, out / "logs" / f"{tag}.log", timeout, links)
    log = str(res.log.relative_to(out))
    for i, (e, regime) in enumerate(runnable):
        outcomes[e.label] = []
        for rnd in range(a.rounds):
            path = Path(f"{base}.{i}.{rnd}")
            ranks = read_ranks(path, a.workers)
            said = [p.read_text() for p in sorted(path.parent.glob(path.name + ".error.rank*"))]
            if said or len(ranks[0]) < steps:
                why = said[0] if said else f"{res.error()} (rank 0 wrote {len(ranks[0])} of {steps} steps)"
                outcomes[e.label].append(Outcome(regime, "failed", why.strip(), res.seconds, ranks, log))
            else:
                outcomes[e.label].append(Outcome(regime, "ok", "", res.seconds, ranks, log))
    return outcomes


def cell_rows(outcomes: dict[str, list[Outcome]], skip: int, base: str, given: float | None
              ) -> tuple[list[dict], float | None]:
    """The table's rows of one cell: script_compare's summary (curve, final loss, time to target) of each
    entry's first round, with the step time (median, p90: every round's steps from 1 on, PowerSGD's from ``skip``
    on, after its uncompressed warm-up) and bytes
    per step (and ratio to uncompressed) over the same steps. The target loss: ``given``, else the smoothed
    loss the uncompressed ``base`` reached :data:`TARGET_AT` of the way through its steps (else, if it did
    not run, the highest final loss among the entries)."""
    target = given
    firsts, extra = [], {}
    for label, outs in outcomes.items():
        ok = [o for o in outs if o.status == "ok"]
        firsts.append(ok[0] if ok else outs[-1])
        first = skip if "powersgd" in label else 1  # step 0: every entry's first-touch allocations
        extra[label] = [x for o in ok for x in o.ranks[0] if x["step"] >= first and x.get("step_s")]
    rows, target = summarize_all(firsts, target)
    plain = next((r for r in rows if r["regime"] == base and r.get("curve")), None)
    if given is None and plain is not None:  # what the uncompressed run reached TARGET_AT of the way through
        target = smoothed(plain["curve"])[max(0, math.ceil(TARGET_AT * len(plain["curve"])) - 1)]
        for row in rows:
            if row.get("curve"):
                row.update(time_to_target(row["curve"], smoothed(row["curve"]), target))
    for row in rows:
        lines = extra[row["regime"]]
        row["rounds"] = len([o for o in outcomes[row["regime"]] if o.status == "ok"])
        if not lines:
            continue
        times = [x["step_s"] for x in lines]
        row["step_s_samples"] = times
        row["step_s_median"] = statistics.median(times)
        row["step_s_p90"] = verdict.quantile(times, 0.9)
        row["bytes_per_step"] = statistics.fmean(x["bytes_sent"] for x in lines)
        raw = statistics.fmean(x.get("bytes_uncompressed") or x["bytes_sent"] for x in lines)
        row["bytes_ratio"] = row["bytes_per_step"] / raw if raw else None
        row["step_s_mean"] = statistics.fmean(times)
    return rows, target


def _by(rows: list[dict]) -> dict[str, dict]:
    return {r["regime"]: r for r in rows if r.get("step_s_samples")}


def step_verdict(a: dict, b: dict) -> verdict.Verdict:
    """``b``'s median step over ``a``'s (> 1: ``a`` faster), one launch a side (the machine's launch spread added)."""
    return verdict.compare(a["regime"], a["step_s_samples"], b["regime"], b["step_s_samples"], paired=False,
                           launch_sigma=verdict.spread(0.0))


def target_verdict(a: dict, b: dict) -> verdict.Verdict | None:
    """Time to the target, ``b``'s over ``a``'s: steps to the target x the mean time of those steps (warm-up
    included: it is part of the way there), each side's mean bootstrapped over those steps."""
    if not (a.get("steps_to_target") and b.get("steps_to_target")):
        return None
    way = lambda r: [p["step_s"] for p in r["curve"][:r["steps_to_target"]]]
    return verdict.compare(a["regime"], way(a), b["regime"], way(b), paired=False, stat="mean",
                           scale_a=a["steps_to_target"], scale_b=b["steps_to_target"], launch_sigma=verdict.spread(0.0))


def cell_verdicts(rows: list[dict], base: str, rank_r: int) -> list[tuple[str, verdict.Verdict]]:
    """Every entry against the uncompressed ``base`` (step time; time to target), and each commlab
    PowerSGD entry against DDP's PowerSGD hook: ``label: ratio`` with > 1 meaning the first named is faster."""
    by = _by(rows)
    out = []
    if base in by:
        for r in rows:
            if r["regime"] == base or r["regime"] not in by:
                continue
            out.append((f"step time, {base} / {r['regime']}", step_verdict(by[r["regime"]], by[base])))
            v = target_verdict(by[r["regime"]], by[base])
            if v is not None:
                out.append((f"time to target, {base} / {r['regime']}", v))
    psgd = f"ddp+powersgd:{rank_r}"
    for r in rows:
        if f"powersgd:{rank_r}" in r["regime"] and "://" in r["regime"] and psgd in by and r["regime"] in by:
            out.append((f"step time, {psgd} / {r['regime']}", step_verdict(by[r["regime"]], by[psgd])))
    return out


def goals(model: str, link: str, rows: list[dict], base: str, rank_r: int) -> list[str]:
    """The issue's speed goals that this cell measures, each with its ratio, interval and outcome."""
    by = _by(rows)
    psgd = next((r["regime"] for r in rows if "://" in r["regime"] and f"compress=powersgd:{rank_r}" in r["regime"]),
                None)
    out = []
    if psgd not in by or base not in by:
        return out
    v = step_verdict(by[psgd], by[base])
    if (model, link) == ("mlp", "100mbit"):
        out.append(f"step time {base} / {psgd}: {v.ratio:.2f}x [{v.lo:.2f}, {v.hi:.2f}]; "
                   + rec.goal_text(v, GOAL_PSGD_OVER_RING_100M))
        peer = f"ddp+powersgd:{rank_r}"
        if peer in by:
            w = step_verdict(by[psgd], by[peer])
            out.append(f"step time {peer} / {psgd}: {w.ratio:.2f}x [{w.lo:.2f}, {w.hi:.2f}]; never slower: "
                       + rec.meets(w, 1.0))
    if link == "loopback":
        peer = f"ddp+powersgd:{rank_r}"
        out.append(f"on loopback no compressor pays (no goal for them against uncompressed): step {psgd} / {base} "
                   f"{1 / v.ratio:.2f}x [{1 / v.hi:.2f}, {1 / v.lo:.2f}]")
        if peer in by:
            w = step_verdict(by[psgd], by[peer])
            out.append(f"step time {peer} / {psgd}: {w.ratio:.2f}x [{w.lo:.2f}, {w.hi:.2f}]; goal: never slower than "
                       f"torch's hook, the median of three runs' ratios >= {GOAL_PSGD_OVER_HOOK_LOOPBACK:g}x "
                       f"(this run: {'>=' if w.ratio >= GOAL_PSGD_OVER_HOOK_LOOPBACK else '<'} "
                       f"{GOAL_PSGD_OVER_HOOK_LOOPBACK:g}x; over its interval: {rec.meets(w, GOAL_PSGD_OVER_HOOK_LOOPBACK)})")
        else:
            out.append(f"the loopback goal (never slower than {peer}) is not measured: this run has no "
                       f"`--peers ddp+powersgd`")
    if (model, link) == ("lm", "10mbit"):
        ttt = [(r["regime"], target_verdict(by[r["regime"]], by[base])) for r in rows
               if r["regime"] in by and "compress=" in r["regime"]]
        ttt = [(n, v) for n, v in ttt if v is not None]
        if ttt:
            name, best = max(ttt, key=lambda nv: nv[1].ratio)
            out.append(f"time to target {base} / {name} (the fastest compressed): {best.ratio:.2f}x "
                       f"[{best.lo:.2f}, {best.hi:.2f}]; " + rec.goal_text(best, GOAL_TTT_LM_10M))
    return out


def does_not_pay(rows: list[dict], base: str, vs: list[tuple[str, verdict.Verdict]]) -> str | None:
    """The compressed entries that are not faster than uncompressed ``base`` here (step time, and time to target
    where known): the report says so in words."""
    slower = []
    for r in rows:
        if "compress=" not in r["regime"] and not r["regime"].startswith("ddp+"):
            continue
        said = [v for label, v in vs if label.endswith(f" {base} / {r['regime']}")]
        if said and all(v.winner != r["regime"] for v in said):
            slower.append(f"`{r['regime']}`")
    if not slower:
        return None
    return ("Compression does not pay here: " + ", ".join(slower)
            + f" {'is' if len(slower) == 1 else 'are'} not faster than `{base}` (slower, equivalent within the "
            f"verdicts' band, or indistinguishable).")


def planner_lines(rows: list[dict], link: str, predictions: dict | None) -> list[str]:
    """"planner predicted X, measured Y" for each entry with a prediction: ``predictions[(entry, link)]``
    holds ``step_s`` (and optionally ``crossover_bytes_per_s``) from ``commlab plan``."""
    out = []
    for r in rows:
        p = (predictions or {}).get((r["regime"], link))
        if not p or not r.get("step_s_median"):
            continue
        pred = p["step_s"]
        out.append(f"- `{r['regime']}`: planner predicted {pred * 1e3:.1f} ms a step, measured "
                   f"{r['step_s_median'] * 1e3:.1f} ms ({r['step_s_median'] / pred:.2f}x the prediction)")
    return out


def section(cells: list[dict], predictions: dict | None = None, heading: str = "#") -> list[str]:
    """Markdown for the cells that ran (each: model, link, rows, verdicts, goals, png, target, note)."""
    md = []
    for c in cells:
        md += [f"{heading}# {c['model']} ({c['model_name']}) at {c['link']}", "",
               f"{c['steps']} steps a job, step times from step 1 on (PowerSGD's from {c['skip']}, after its "
               f"warm-up), "
               f"{c['rounds']} round(s); target loss {c['target']:.4f} (\"—\": not reached in the run)"
               if c["target"] is not None else
               f"{c['steps']} steps a job; no target loss (no entry finished)", ""]
        md += table(c["rows"], [("step ms p90", lambda r: "—" if r.get("step_s_p90") is None
                                 else f"{r['step_s_p90'] * 1e3:.1f}"),
                                ("bytes / uncompressed", lambda r: "—" if r.get("bytes_ratio") is None
                                 else f"{r['bytes_ratio']:.4g}")]) + [""]
        if c["goals"]:
            md += ["Goals (issues 26 and 39):", ""] + [f"- {g}" for g in c["goals"]] + [""]
        md += ["Verdicts (ratio > 1: the entry after the slash is faster; 95% intervals):", ""]
        md += [f"- {rec.ratio_line(label, v)}" for label, v in c["verdicts"]] + [""]
        if c.get("note"):
            md += [c["note"], ""]
        md += planner_lines(c["rows"], c["link"], predictions)
        if c.get("png"):
            md += [f"![loss against step, time and bytes]({c['png']})", ""]
    return md


def read_predictions(path: str | None) -> dict | None:
    """``--predictions``' file as :func:`planner_lines` takes it: ``{(entry, link): {"step_s": X}}``."""
    if not path:
        return None
    doc = json.loads(Path(path).read_text())
    return {tuple(key.rsplit("@", 1)): value for key, value in doc.items()}


def cells_of(a, defaults=DEFAULT_CELLS) -> list[tuple[str, str]]:
    """The (model, link) cells ``--models`` and ``--link`` name (else ``defaults``' of those models); ValueError
    naming the option for an unknown model or a rate that does not parse."""
    from commlab.plan.rates import parse_rate

    models = names(a.models, MODELS, "--models")
    cells = [(m, link) for m in models for link in names(a.link)] if a.link else \
        [c for c in defaults if c[0] in models]
    for _, link in cells:
        if link != "loopback":
            try:
                parse_rate(link)
            except ValueError as exc:
                raise ValueError(f"--link: {exc}") from None
    return cells


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench compress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,lm", help="comma-separated, of: " + ", ".join(MODELS))
    p.add_argument("--link", help="comma-separated rates (loopback, 100mbit, 1gbit, 10mbit, ...) for every model "
                                  "(default: " + ", ".join(f"{m}@{x}" for m, x in DEFAULT_CELLS) + ")")
    p.add_argument("--regime", default="ring://", help="the commlab regime, uncompressed and with each compressor")
    p.add_argument("--compressors", default=",".join(COMPRESSORS), help="compress= specs ('none': only the peers)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ", ".join(PEERS) + " ('none')")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, help="steps a job in every cell (default: per cell, see bench/compress.py)")
    p.add_argument("--start-iter", type=int, default=2, help="PowerSGD's uncompressed warm-up (commlab and torch's hook; "
                                                            "torch needs >= 2 with error feedback)")
    p.add_argument("--rank-r", type=int, default=4, help="torch's PowerSGD hook: matrix_approximation_rank")
    p.add_argument("--rounds", type=int, default=1, help="every entry this many times, entries taking turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-loss", type=float, help="default: the uncompressed regime's loss half way through")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="start no job after this many seconds")
    p.add_argument("--cell-timeout", type=float, default=600.0, help="seconds one cell's job may take")
    p.add_argument("--out", help="folder (default runs/compress-<UTC time>)")
    p.add_argument("--predictions", help="JSON file {\"ENTRY@LINK\": {\"step_s\": X}, ...}: the planner's predicted "
                                         "step times, set beside the measured ones")
    p.add_argument("--tiny", action="store_true", help="test-size models (a 2.4K MLP, a 1-layer LM): a smoke run")
    return p


def check(a) -> list[tuple[str, str]]:
    """The cells to run; ValueError (one line, naming the option) for anything wrong, before anything starts."""
    from commlab.compress import build

    if a.workers < 2:
        raise ValueError("--workers must be >= 2")
    if a.rounds < 1 or (a.steps is not None and a.steps < a.start_iter + 2):
        raise ValueError(f"--rounds must be >= 1 and --steps >= --start-iter + 2 ({a.start_iter + 2})")
    if a.start_iter < 2 and "ddp+powersgd" in names(a.peers, PEERS, "--peers"):
        raise ValueError("--start-iter must be >= 2 with the ddp+powersgd peer (torch's hook with error feedback)")
    for c in names(a.compressors):
        try:
            build(spec_of(c, a.start_iter))
        except ValueError as exc:
            raise ValueError(f"--compressors: {exc}") from None
    try:
        read_predictions(a.predictions)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--predictions: {exc}") from None
    return cells_of(a)


def run(a, cells: list[tuple[str, str]], out: Path, progress=print) -> tuple[list[dict], list[dict]]:
    """Run the cells (grouped by link, one namespace topology per rate); returns (cells, failures)."""
    from bench.netns import Links, link_unavailable_reason

    es = entries(a.regime, names(a.compressors), names(a.peers, PEERS, "--peers"), a.start_iter, a.rank_r)
    deadline = time.monotonic() + a.budget_s
    done, failures = [], []
    by_link: dict[str, list[str]] = {}
    for model, link in cells:
        by_link.setdefault(link, []).append(model)
    for link, models in by_link.items():
        links = None
        why = None if link == "loopback" else link_unavailable_reason()
        if why:
            failures += [rec.failure(CASE, f"{m}@{link}", why, status="unavailable") for m in models]
            continue
        try:
            if link != "loopback":
                links = Links(a.workers, link).__enter__()
            for model in models:
                done.append(run_cell(a, model, link, es, out, links, deadline, progress, failures))
        finally:
            if links is not None:
                links.close()
    return done, failures


def run_cell(a, model, link, es, out, links, deadline, progress, failures) -> dict:
    steps = a.steps or STEPS.get((model, link), STEPS[(model, "100mbit" if model == "lm" else "1gbit")])
    left = deadline - time.monotonic()
    if left < MIN_CELL_S:
        outcomes = {e.label: [Outcome(Regime(e.label, e.url, a.workers, (), e.kind), "skipped",
                                      "the case's time budget (--budget-s) ran out before this cell")] for e in es}
    else:
        progress(f"commlab bench compress: {model} at {link}: {len(es)} entries x {a.rounds} round(s), {steps} steps")
        outcomes = run_job_of_cell(es, model, link, steps, a, out, links, min(a.cell_timeout, left))
    for label, outs in outcomes.items():
        failures += [rec.failure(CASE, f"{label} ({model}@{link})", o.error, o.regime.url, o.status)
                     for o in outs if o.status != "ok"]
    skip = a.start_iter + 1  # PowerSGD's uncompressed warm-up and the first compressed step's allocations
    rows, target = cell_rows(outcomes, skip, a.regime, a.target_loss)
    vs = cell_verdicts(rows, a.regime, a.rank_r)
    png = plot(rows, out / f"compress-{model}-{slug(link)}.png", f"{model} at {link}")
    return {"model": model, "model_name": (TINY if a.tiny else MODELS)[model], "link": link, "steps": steps,
            "skip": skip, "rounds": a.rounds, "target": target, "rows": rows, "verdicts": vs,
            "goals": goals(model, link, rows, a.regime, a.rank_r),
            "note": " ".join(x for x in (does_not_pay(rows, a.regime, vs),
                                         NO_COMPRESSOR_PAYS_ON_LOOPBACK if link == "loopback" else None) if x) or None,
            "png": png.name if png else None}


def write(out: Path, cells: list[dict], failures: list[dict], config: dict, seconds: float,
          predictions: dict | None = None) -> Path:
    """``compress.md`` and ``compress.json`` in ``out``; returns the markdown's path."""
    md = ["# Gradient compression: when it pays", "",
          f"- `commlab bench compress {' '.join(config['argv'])}`: {config['workers']} ranks, "
          f"{config['regime']} beside DDP (gloo) with torch's hooks; this case ran {seconds:.0f} s "
          f"({seconds / 60:.1f} min).",
          "- Every entry trains the same model, seed, data and batch (bench/compress_worker.py); DDP's bytes are the "
          "closed form of what its hook all-reduces, counted as a ring counts. Ratios carry 95% bootstrap "
          f"intervals over the steps, with a launch-to-launch spread of {verdict.LAUNCH_SIGMA_FLOOR} (sd of log "
          "medians) on each side, since every entry is one launch.",
          "- The machine may be shared with other jobs: quote ratios from one run, medians of several runs.", ""]
    md += section(cells, predictions)
    return save(out, CASE, md, cells, failures, config, seconds)


def save(out: Path, case: str, md: list[str], cells: list[dict], failures: list[dict], config: dict,
         seconds: float) -> Path:
    """``<case>.md`` (``md``, then what failed) and ``<case>.json`` (the cells, their verdicts as dicts) in
    ``out``; returns the markdown's path."""
    if failures:
        md = md + ["## Failed, skipped or unavailable", ""] + \
            [f"- {f['regime']}: {f['status']}: {f['error']}" for f in failures] + [""]
    path = out / f"{case}.md"
    path.write_text("\n".join(md))
    doc = {"case": case, "config": config, "seconds": seconds, "failures": failures,
           "cells": [dict(c, verdicts=[dict(label=label, **v.as_dict()) for label, v in c["verdicts"]]) for c in cells]}
    (out / f"{case}.json").write_text(json.dumps(doc, indent=1, default=str))
    return path


def main_of(case: str, argv: list[str] | None, parser, check, run, write) -> int:
    """A cell-by-cell case's ``main``: parse and ``check`` (a ValueError: one line, exit 2, before anything
    starts), ``run`` the cells into ``--out`` (default ``runs/<case>-<UTC time>``), ``write(out, cells,
    failures, config, seconds, a)`` the report and print it. Ctrl-C: 130, every job stopped."""
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        cells, out = check(a), Path(a.out or Path("runs") / time.strftime(f"{case}-%Y%m%dT%H%M%SZ", time.gmtime()))
    except ValueError as exc:  # one line naming the option, before anything starts
        print(f"commlab bench {case}: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    progress = lambda what: print(what, file=sys.stderr, flush=True)
    try:
        done, failures = run(a, cells, out, progress)
    except KeyboardInterrupt:
        print(f"commlab bench {case}: interrupted; every job was stopped", file=sys.stderr)
        return 130
    path = write(out, done, failures, dict(vars(a), argv=argv), time.monotonic() - t0, a)
    print(path.read_text())
    print(f"commlab bench {case}: {path} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_of(CASE, argv, parser, check, run,
                   lambda out, done, failures, config, seconds, a: write(out, done, failures, config, seconds,
                                                                         read_predictions(a.predictions)))


if __name__ == "__main__":  # python -m bench.compress: the same as commlab bench compress
    sys.exit(main())
