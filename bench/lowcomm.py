"""``commlab bench lowcomm``: when does talking rarely (local steps with an outer optimizer) beat talking
every step, compressed or not, and how much of the CPU does it keep busy?

    commlab bench lowcomm                                    # every cell (hours: see the budget below)
    commlab bench lowcomm --models lm --link 10mbit          # one cell
    commlab bench lowcomm --models lm --link loopback --steps 96 --tiny    # a smoke run (tests/test_bench.py)

Outside the default ``commlab bench``. Cells (2 workers): ``mlp-25m`` on loopback and at 100 Mbit/s, the char
LM (examples/charlm.py's model) at 100, 10 and 1 Mbit/s (``tc tbf`` caps between network namespaces, as root:
:class:`bench.netns.Links`). A cell is run by :mod:`bench.compress`'s machinery (one job of
:mod:`bench.compress_worker`, the entries taking turns, each from a fresh model), in this order:

1. ``alone``: no exchange (H = infinity: ``ring://?sync_every=`` beyond the run, so its inner step is the one every
   commlab entry takes): its inner step time ``t`` (its wall clock per step, steps from 1 on)
   is the denominator of every utilization; its median step sets the overlap ``T``: the smallest that fits a
   fragment, ``ceil(fragment bytes / link rate / median)``, clamped to [1, H/P - 1] (fragment bytes: int8's
   closed form of 1/P of the parameters).
2. The entries (``H`` = 10 and 48, ``P`` = 4): synchronous ``ring://`` and ``ring://?compress=powersgd:4``;
   ``sync_every=H`` with ``outer=sgd:lr=1`` (plain averaging) with and without ``compress=int8``; H = 48
   int8 with the default outer optimizer (Nesterov 0.7/0.9); streaming ``fragments=4&overlap=T`` with int8
   (``stream-int8``; ``stream-int8-slices``: the same with ``fragment_by=slices``, fragments of 1/P of every
   tensor, balanced whatever the tensors' sizes, which the rule for T above assumes), and in fp32 with
   ``alpha=0`` beside torchft's DiLoCo at equal H, P, sync delay T and alpha 0;
   torch's ``PostLocalSGDOptimizer`` at H = 48 beside commlab's ``outer=sgd:lr=1``
   (:mod:`bench.lowcomm_peers`); and a ``ring://`` H = 48 run whose rank 1 sleeps its own step time
   after each step (2x slower).
3. ``ps://?mode=async&sync_every=48`` with the same slow rank 1: a job of its own (its servers); and two
   variants, each a job of its own: ``async-int8`` (``compress=int8``: the push a quarter of the bytes, the
   pull of the anchor still float32), ``async-stream`` (``fragments=4&overlap=T``: each fragment's push
   and pull run during the next T inner steps) and ``async-int8-overlap`` (``compress=int8&overlap=T1&merge=delta``:
   the whole model's exchange runs during the next T1 inner steps, T1 the smallest that hides its int8 push
   and float32 pull at the fast rank's step, at most H - 1, and the anchor lands with the overlap's inner steps
   kept) and ``async-int8-f16`` (the same with the anchor pulled in float16, ``anchor_dtype=float16``, and the
   longest overlap the schedule allows, T = H - 1: the server's link carries both workers' exchanges, so one
   can take longer than its own bytes over the rate). ``--whole-overlap T`` gives both the same T.

**Slow synchronous baselines.** A synchronous entry whose run would take longer than ``--sync-cap-s``
at the link (its closed-form bytes over the rate, times the steps) is not run whole there: its loss per
step comes from a run on loopback (the same arithmetic, bit for bit: the link changes only the time), and
its wall time is steps x its median step time over 20 steps measured at the link. The report marks such
rows "projected".

Per entry: loss at equal inner steps (the last smoothed loss) and at equal wall time (the smoothed loss each
entry had when the fastest entry finished), time and bytes to the target loss (the synchronous ring's
smoothed loss ``--target-at`` of the way through its steps), **utilization** = inner steps x ``t`` / wall
time (both from step 1 on; ``alone``'s is 1), and the peak link rate (the largest bytes one step sent over that step's time: an upper estimate for
an overlapped fragment, whose bytes are counted at the step that starts it). Verdicts (bench/verdict.py,
95% intervals): time to target against the synchronous ring; torchft's DiLoCo against commlab's fp32
streaming and torch's post-local SGD against ``outer=sgd:lr=1`` (mean step time: a step's share of the
syncs included); async ps:// against the slow-worker ring at H = 48 (time to target).

Writes ``lowcomm.md``, ``lowcomm.json``, per cell ``lowcomm-<model>-<link>.png`` (loss against step, time,
bytes) and per model ``lowcomm-util-<model>.png``: utilization against link rate per method, with the bound of
streaming, utilization <= H t / (H t + P max(0, fragment time - T t)), marked.

**Budget.** Measured nowhere yet in full; by closed form on this 2-core machine: the char LM runs 1,056
steps an entry (22 syncs at H = 48), about 40 ms a step alone, 13 entries: ~10 min a cell at 100 Mbit/s,
more where the link binds; the MLP's 960 steps at ~0.3 s are ~5 min an entry, ~1 h a cell. The whole case
takes hours; ``--budget-s`` (default 4 h) stops starting cells after it and reports the rest as skipped.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import compress as K
from bench import records as rec
from bench import verdict
from bench.curves import smoothed, time_to_target
from bench.lowcomm_peers import ring_bytes
from bench.script_compare import Outcome, plot, table
from bench.text import names, slug

CASE = "lowcomm"
DEFAULT_CELLS = (("lm", "10mbit"), ("lm", "1mbit"), ("lm", "100mbit"), ("mlp", "100mbit"), ("mlp", "loopback"))
STEPS = {"mlp": 960, "lm": 1056}
H_SHORT, H_LONG, FRAGMENTS = 10, 48, 4
PLAIN = "outer=sgd:lr=1"
ASYNC = f"ps://?mode=async&sync_every={H_LONG}&{PLAIN}"
ASYNC_LABEL = f"{ASYNC} (rank 1 2x slower)"
SLOW_SYNC_LABEL = f"ring://?sync_every={H_LONG}&{PLAIN} (rank 1 2x slower)"
TIMING_STEPS = 20  # a projected synchronous entry's steps at the link
DEFAULT_BUDGET_S = 4 * 3600.0
SYNC = "ring://"
INT8_SCALE_BLOCK = 256  # int8's default block: a float32 scale per 256 elements


def async_urls(t: int, whole: int = 1, f16: int = H_LONG - 1) -> dict[str, str]:
    """The async entries' job URLs, by short name (``t``: the overlap of a fragment; ``whole``: of the whole
    model's int8 push and float32 pull, :func:`overlap_whole`; ``f16``: async-int8-f16's)."""
    return {"async": ASYNC, "async-int8": f"{ASYNC}&compress=int8",
            "async-stream": f"ps://?mode=async&sync_every={H_LONG}&fragments={FRAGMENTS}&overlap={t}&{PLAIN}",
            "async-int8-overlap": f"{ASYNC}&compress=int8&overlap={whole}&merge=delta",
            "async-int8-f16": f"{ASYNC}&compress=int8&anchor_dtype=float16&overlap={f16}&merge=delta"}


def overlap_whole(numel: int, rate: float | None, step_s: float, h: int = H_LONG) -> int:
    """The smallest overlap T that hides one async sync of the whole model on ps:// (its int8 push and its
    float32 anchor pull, one after the other on the worker's link), clamped to [1, H - 1]."""
    if not rate or step_s <= 0:
        return 1
    return max(1, min(h - 1, math.ceil((int8_bytes(numel) + 4 * numel) / rate / step_s)))


def int8_bytes(numel: int) -> int:
    return numel + 4 * math.ceil(numel / INT8_SCALE_BLOCK)


def overlap(numel: int, rate: float | None, step_s: float, h: int = H_LONG, p: int = FRAGMENTS) -> int:
    """The smallest overlap T (inner steps) that hides one int8 fragment's exchange, clamped to [1, H/P - 1]."""
    if not rate or step_s <= 0:
        return 1
    return max(1, min(h // p - 1, math.ceil(int8_bytes(numel // p) / rate / step_s)))


def exposed_bound(numel: int, rate: float | None, step_s: float, t: int, p: int = FRAGMENTS) -> float:
    """max(0, fragment time - T x step time): what a fragment's exchange leaves exposed per sync (seconds)."""
    return max(0.0, int8_bytes(numel // p) / rate - t * step_s) if rate else 0.0


def util_bound(numel: int, rate: float | None, step_s: float, t: int, h: int = H_LONG, p: int = FRAGMENTS) -> float:
    return h * step_s / (h * step_s + p * exposed_bound(numel, rate, step_s, t, p)) if step_s > 0 else 1.0


def entries(t: int, start_iter: int, whole: int = 1, f16: int = H_LONG - 1) -> dict[str, K.Entry]:
    """Every entry but ``alone``, by its short name (``--entries``), in the order they run (``t``: the overlap,
    ``whole``, ``f16``: async-int8-overlap's and async-int8-f16's). The async entries run each in a job of its own (its ps:// servers)."""
    E = K.Entry
    stream = f"ring://?sync_every={H_LONG}&fragments={FRAGMENTS}&overlap={t}"
    psgd = f"ring://?compress=powersgd:4,start_iter={start_iter}"
    url = lambda query: E(f"ring://?{query}", f"ring://?{query}", compressor="int8" if "int8" in query else None)
    return {"sync": E(SYNC, SYNC), "powersgd": E(psgd, psgd, compressor="powersgd:4"),
            "h10": url(f"sync_every={H_SHORT}&{PLAIN}"), "h10-int8": url(f"sync_every={H_SHORT}&compress=int8&{PLAIN}"),
            "h48": url(f"sync_every={H_LONG}&{PLAIN}"), "h48-int8": url(f"sync_every={H_LONG}&compress=int8&{PLAIN}"),
            "h48-int8-nesterov": url(f"sync_every={H_LONG}&compress=int8"),
            "stream-int8": E(f"{stream}&compress=int8&{PLAIN}", f"{stream}&compress=int8&{PLAIN}", compressor="int8"),
            "stream-int8-slices": E(f"{stream}&fragment_by=slices&compress=int8&{PLAIN}",
                                    f"{stream}&fragment_by=slices&compress=int8&{PLAIN}", compressor="int8"),
            "stream-fp32": E(f"{stream}&alpha=0&{PLAIN}", f"{stream}&alpha=0&{PLAIN}"),
            "torchft": E(f"torchft DiLoCo H={H_LONG} P={FRAGMENTS} T={t} alpha=0", "local://", peer="torchft",
                         settings=(("H", H_LONG), ("P", FRAGMENTS), ("T", t), ("alpha", 0.0))),
            "postlocal": E(f"torch PostLocalSGD H={H_LONG}", "local://", peer="postlocal", settings=(("H", H_LONG),)),
            "slow": E(SLOW_SYNC_LABEL, f"ring://?sync_every={H_LONG}&{PLAIN}", settings=(("slow_rank", 1),)),
            **{name: E(f"{url} (rank 1 2x slower)", "job", settings=(("slow_rank", 1),))
               for name, url in async_urls(t, whole, f16).items()}}


ENTRY_NAMES = tuple(entries(1, 2))




def is_local(e: K.Entry) -> bool:
    """A local-steps entry of the main job (H = 10 or 48, streaming): not a peer, not the slow-rank ring."""
    return not e.peer and "sync_every" in e.url and e.label != SLOW_SYNC_LABEL


def is_sync(e: K.Entry) -> bool:
    return not e.peer and "sync_every" not in e.url


def numel_of(rows: list[dict]) -> int | None:
    """The model's parameter count: the ``alone`` row's first line says it (bench.compress_worker)."""
    lines = [x for x in rows if x]
    return int(lines[0]["numel"]) if lines and lines[0].get("numel") else None


def median_step(o: Outcome | None) -> float | None:
    """Rank 0's median step time from step 1 on (step 0: first-touch allocations), or None if it did not run."""
    times = [x["step_s"] for x in o.ranks[0] if x["step"] >= 1 and x.get("step_s")] if o and o.status == "ok" else []
    return statistics.median(times) if times else None


def inner_step(o: Outcome | None) -> float | None:
    """Rank 0's wall time per step from step 1 on (step 0: first-touch allocations): utilization's ``t`` for the
    run with no exchange (a run's step time as its wall clock sees it, so that run's own utilization is 1; the
    median step would leave out what a step costs beyond its median, about 4% of the char LM's)."""
    pts = [x for x in o.ranks[0] if x.get("time_s") is not None] if o and o.status == "ok" else []
    return (pts[-1]["time_s"] - pts[0]["time_s"]) / (len(pts) - 1) if len(pts) > 1 else None


def projected(loopback: Outcome, timing: Outcome) -> Outcome:
    """``loopback``'s lines (loss per step) with every step's time set to the median step time ``timing``
    measured at the link (steps from 1 on), and the wall clock to steps x that."""
    med = median_step(timing)
    if loopback.status != "ok" or med is None:
        why = loopback.error or timing.error or "no step timed at the link"
        return replace(timing, status="failed", error=f"projection impossible: {why}")
    ranks = [[dict(x, step_s=med, time_s=(x["step"] + 1) * med, comm_s=None) for x in lines] for lines in loopback.ranks]
    return Outcome(replace(timing.regime, kind="projected"), "ok", "", timing.seconds, ranks, timing.log)


def per_row(rows: list[dict], t_alone: float | None) -> None:
    """Utilization, loss at equal wall time, bytes to target and peak link rate, into each row."""
    have = [r for r in rows if r.get("curve")]
    equal_wall = min((r["curve"][-1]["time_s"] for r in have if r["regime"] != "alone"), default=None)
    for r in have:
        pts, sm = r["curve"], smoothed(r["curve"])
        wall = pts[-1]["time_s"] - pts[0]["time_s"]  # steps 1 on, as t_alone
        r["utilization"] = (len(pts) - 1) * t_alone / wall if t_alone and wall > 0 else None
        if equal_wall is not None:
            at = [i for i, p in enumerate(pts) if p["time_s"] <= equal_wall]
            r["loss_at_equal_wall"] = sm[at[-1]] if at else None
            r["equal_wall_s"] = equal_wall
        hit = r.get("steps_to_target")
        r["bytes_to_target"] = pts[hit - 1]["bytes"] if hit else None
        rates = [p["bytes_sent"] / p["step_s"] for p in pts if p.get("bytes_sent") and p.get("step_s")]
        r["peak_bytes_per_s"] = max(rates) if rates else 0.0


def held_out(rows: list[dict], target_at: float) -> float | None:
    """The held-out target: the synchronous ring's held-out loss (rank 0's model, evaluated every ``--eval-every``
    steps) at the first evaluation ``target_at`` of the way through its steps or later; into each row, the first
    evaluation at or below it (``held_steps``: steps to it, ``held_s``, ``held_bytes``) and the last one
    (``held_final``). A local-steps run is evaluated at its syncs (every H steps): the global model, what
    DiLoCo's papers compare; its train loss is its replicas' own, between averages."""
    plain = next((r for r in rows if r["regime"] == SYNC and r.get("curve")), None)
    evals = [p for p in plain["curve"] if p.get("test_loss") is not None] if plain else []
    at = [p for p in evals if p["step"] + 1 >= target_at * len(plain["curve"])] if plain else []
    target = at[0]["test_loss"] if at else None
    for r in rows:
        pts = [p for p in r.get("curve") or [] if p.get("test_loss") is not None]
        r["held_final"] = pts[-1]["test_loss"] if pts else None
        hit = first_at_or_below(r, target) if target is not None else None
        r["held_steps"] = hit["step"] + 1 if hit else None
        r["held_s"] = hit["time_s"] if hit else None
        r["held_bytes"] = hit["bytes"] if hit else None
    return target


def first_at_or_below(row: dict, loss: float) -> dict | None:
    """A row's first held-out evaluation at or below ``loss`` (None: never)."""
    return next((p for p in row.get("curve") or [] if p.get("test_loss") is not None and p["test_loss"] <= loss), None)


def held_against_slow(rows: list[dict]) -> list[dict]:
    """Each async entry against the slow-rank ring at H = 48 at equal held-out loss, for runs where neither reaches
    the synchronous ring's target: the lower loss both reach (the worse of the two last held-out losses: the
    async entry's, or the ring's final one when the async job, run longer with ``--async-steps``, goes below it),
    the first time each side's held-out loss is at or below it, and their ratio (async / ring: below 1, the async
    job got there sooner). One run's figure, without an interval (one evaluation curve a side); the medians of
    several runs say more."""
    slow = next((r for r in rows if r["regime"] == SLOW_SYNC_LABEL and r.get("curve")), None)
    if slow is None:
        return []
    out = []
    ring_last = [p["test_loss"] for p in slow["curve"] if p.get("test_loss") is not None][-1]

    def first(row: dict, loss: float) -> float | None:
        hit = first_at_or_below(row, loss)
        return hit["time_s"] if hit else None

    for r in rows:
        pts = [p for p in r.get("curve") or [] if p.get("test_loss") is not None]
        if not r["regime"].startswith("ps://?mode=async") or not pts:
            continue
        loss = max(pts[-1]["test_loss"], ring_last)
        mine, theirs = first(r, loss), first(slow, loss)
        out.append({"regime": r["regime"], "loss": loss, "async_s": mine, "slow_s": theirs,
                    "ratio": mine / theirs if mine is not None and theirs else None})
    return out


def windows(samples: list[float], h: int = H_LONG) -> list[float]:
    """The step times summed over consecutive windows of ``h`` steps (each holds one sync of every fragment)."""
    return [sum(samples[i:i + h]) for i in range(0, len(samples) - h + 1, h)]


def mean_verdict(a: dict, b: dict) -> verdict.Verdict:
    """``b``'s mean step over ``a``'s (> 1: ``a`` faster), from windows of H steps: with local steps a step's share
    of the syncs is in the mean, and a window's time (one sync each) is not bimodal as a step's is, so its
    interval says what the runs say."""
    xa, xb = windows(a["step_s_samples"]), windows(b["step_s_samples"])
    if min(len(xa), len(xb)) < 2:  # a run shorter than two windows: its steps
        xa, xb = a["step_s_samples"], b["step_s_samples"]
    return verdict.compare(a["regime"], xa, b["regime"], xb, paired=False, stat="mean",
                           launch_sigma=verdict.spread(0.0))


def cell_verdicts(rows: list[dict], t: int) -> list[tuple[str, verdict.Verdict]]:
    by = K._by(rows)
    out = []
    for r in rows:
        if r["regime"] in (SYNC, "alone") or r["regime"] not in by or SYNC not in by:
            continue
        v = K.target_verdict(by[r["regime"]], by[SYNC])
        if v is not None:
            out.append((f"time to target, {SYNC} / {r['regime']}", v))
    pairs = [(f"torchft DiLoCo H={H_LONG} P={FRAGMENTS} T={t} alpha=0",
              f"ring://?sync_every={H_LONG}&fragments={FRAGMENTS}&overlap={t}&alpha=0&{PLAIN}"),
             (f"torch PostLocalSGD H={H_LONG}", f"ring://?sync_every={H_LONG}&{PLAIN}")]
    for peer, ours in pairs:
        if peer in by and ours in by:
            out.append((f"mean step, {peer} / {ours}", mean_verdict(by[ours], by[peer])))
    for label in [r["regime"] for r in rows if r["regime"].startswith("ps://?mode=async")]:
        v = K.target_verdict(by[label], by[SLOW_SYNC_LABEL]) if SLOW_SYNC_LABEL in by and label in by else None
        if v is not None:
            out.append((f"time to target, {SLOW_SYNC_LABEL} / {label}", v))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench lowcomm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,lm", help="comma-separated, of: " + ", ".join(K.MODELS))
    p.add_argument("--link", help="comma-separated rates (loopback, 100mbit, 10mbit, 1mbit, ...) for every model "
                                  "(default: " + ", ".join(f"{m}@{x}" for m, x in DEFAULT_CELLS) + ")")
    p.add_argument("--entries", default=",".join(ENTRY_NAMES), help="comma-separated, of: " + ", ".join(ENTRY_NAMES)
                   + " (alone, no exchange, always runs: utilization's denominator)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, help="inner steps an entry (default: mlp 960, lm 1056)")
    p.add_argument("--start-iter", type=int, default=2, help="PowerSGD's uncompressed warm-up")
    p.add_argument("--rounds", type=int, default=1, help="every entry this many times, entries taking turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-at", type=float, default=0.75, help="the target loss: the synchronous ring's smoothed "
                                                                 "loss this far through its steps")
    p.add_argument("--eval-every", type=int, default=H_LONG, help="rank 0's held-out loss every this many steps "
                   "(at the syncs of H = 48: the global model), the held-out target's curve; 0: at the end only")
    p.add_argument("--sync-cap-s", type=float, default=600.0, help="a synchronous entry expected to run longer at "
                                                                   "a link is projected (module text)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="start no cell after this many seconds")
    p.add_argument("--cell-timeout", type=float, default=7200.0, help="seconds one job may take")
    p.add_argument("--whole-overlap", type=int, default=0, help="the T of both whole-model async entries (1 to 47; "
                   "default 0: async-int8-overlap's the smallest that hides its exchange by the closed form, "
                   "async-int8-f16's 47), to compare them at one T")
    p.add_argument("--overlap", type=int, default=0, help=f"the T of the streaming entries and torchft's (1 to "
                   f"{H_LONG // FRAGMENTS - 1}; default 0: the smallest that hides an int8 fragment by the closed form)")
    p.add_argument("--async-steps", type=int, default=0, help="inner steps of each rank in the async entries (their "
                   "learning-rate schedule spans them; default 0: --steps): an async job does not wait for its slow "
                   "rank, so in the slow-rank ring's time its fast rank can take more steps")
    p.add_argument("--local-steps-run", type=int, default=0, help="inner steps of the local-steps entries (H = 10, "
                   "48, streaming), run in a job of their own with their schedule spanning them (default 0: --steps, "
                   "in the main job); the synchronous entries keep --steps and set the target: bytes to the target "
                   "for a local-steps run that needs more steps than the synchronous one to get there")
    p.add_argument("--out", help="folder (default runs/lowcomm-<UTC time>)")
    p.add_argument("--tiny", action="store_true", help="test-size models: a smoke run of the plumbing")
    p.set_defaults(rank_r=4)  # bench.compress's job passes it on (torch's PowerSGD hook: no entry here)
    return p


def check(a) -> list[tuple[str, str]]:
    """The cells to run; ValueError (one line, naming the option) for anything wrong, before anything starts."""
    if a.workers < 2:
        raise ValueError("--workers must be >= 2")
    if a.rounds < 1 or (a.steps is not None and a.steps < 2):
        raise ValueError("--rounds must be >= 1 and --steps >= 2")
    names(a.entries, ENTRY_NAMES, "--entries")
    if not 0 < a.target_at <= 1:
        raise ValueError("--target-at must be in (0, 1]")
    if a.eval_every < 0:
        raise ValueError("--eval-every must be >= 0")
    if not 0 <= a.whole_overlap < H_LONG:
        raise ValueError(f"--whole-overlap must be between 1 and {H_LONG - 1} (0: the closed form)")
    if a.local_steps_run < 0 or 0 < a.local_steps_run < 2:
        raise ValueError("--local-steps-run must be >= 2 (0: --steps)")
    if a.async_steps < 0 or 0 < a.async_steps < 2:
        raise ValueError("--async-steps must be >= 2 (0: --steps)")
    if not 0 <= a.overlap < H_LONG // FRAGMENTS:
        raise ValueError(f"--overlap must be between 1 and {H_LONG // FRAGMENTS - 1} (0: the closed form)")
    return K.cells_of(a, DEFAULT_CELLS)


class Run:
    """One invocation: the options, the output folder, the deadline, what failed, and each model's loopback
    runs of the synchronous entries (shared by every link that projects them)."""

    def __init__(self, a, out: Path, progress):
        self.a, self.out, self.progress = a, out, progress
        self.deadline = time.monotonic() + a.budget_s
        self.failures: list[dict] = []
        self.loopback: dict[str, dict[str, list[Outcome]]] = {}

    def job(self, es, model, link, steps, links, tag, job_url="local://") -> dict[str, list[Outcome]]:
        left = self.deadline - time.monotonic()
        self.progress(f"commlab bench lowcomm: {model} at {link}{tag}: {len(es)} entries, {steps} steps")
        return K.run_job_of_cell(es, model, link, steps, self.a, self.out, links,
                                 max(1.0, min(self.a.cell_timeout, left)), job_url, tag)

    def cell(self, model: str, link: str, links) -> dict:
        from commlab.plan.rates import parse_rate

        a = self.a
        steps = a.steps or STEPS[model]
        rate = None if link == "loopback" else parse_rate(link)
        wanted = names(a.entries, ENTRY_NAMES, "--entries")
        # H = infinity: commlab's own local steps with H beyond the run (its bucketed gradients and optimizer step,
        # as every entry's inner step: a plain loop's fresh gradient tensors each step cost the 25M MLP ~40 ms more)
        alone_entry = K.Entry("alone", f"ring://?sync_every={steps + 1}&{PLAIN}")
        outcomes: dict[str, list[Outcome]] = {}
        if rate is not None:  # T depends on the step time alone: measured first, in a job of its own
            outcomes = self.job([alone_entry], model, link, steps, links, "-alone")
        alone = outcomes.get("alone", [None])[0]
        t_alone, t_median = inner_step(alone), median_step(alone)
        numel = numel_of(alone.ranks[0] if alone and alone.ranks else [])
        t = a.overlap or overlap(numel or 0, rate, t_median or 0.0)  # on loopback: 1, known before anything runs
        t_whole = a.whole_overlap or overlap_whole(numel or 0, rate, t_median or 0.0)
        t_f16 = a.whole_overlap or H_LONG - 1
        chosen = entries(t, a.start_iter, t_whole, t_f16)
        jobs = async_urls(t, t_whole, t_f16)
        es = [chosen[name] for name in wanted if name not in jobs]
        slow_links = [e for e in es if is_sync(e) and rate and numel
                      and steps * ring_bytes(4 * numel, a.workers) / rate > a.sync_cap_s]
        whole = [e for e in es if e not in slow_links]
        longer = [e for e in whole if a.local_steps_run and is_local(e)]  # run apart, --local-steps-run steps
        whole = [e for e in whole if e not in longer]
        if whole or rate is None:
            outcomes.update(self.job(([alone_entry] if rate is None else []) + whole, model, link, steps, links,
                                     "-main"))
        if longer:
            outcomes.update(self.job(longer, model, link, a.local_steps_run, links, "-longer"))
        if rate is None:
            alone = outcomes["alone"][0]
            t_alone, t_median = inner_step(alone), median_step(alone)
            numel = numel_of(alone.ranks[0] if alone.ranks else [])
        if slow_links:
            if model not in self.loopback:
                self.loopback[model] = self.job(slow_links, model, "loopback", steps, None, "-curves")
            timing = self.job(slow_links, model, link, TIMING_STEPS, links, "-timing")
            for e in slow_links:
                outcomes[e.label] = [projected(lo, ti) for lo, ti in zip(self.loopback[model][e.label], timing[e.label])]
        for name in [n for n in wanted if n in jobs]:  # each a job of its own, with its servers
            # (across namespaces the servers bind the hosts' addresses with --insecure: bench.jobs.place_servers)
            outcomes.update(self.job([chosen[name]], model, link, a.async_steps or steps, links, f"-{name}",
                                     jobs[name]))
        for label, outs in outcomes.items():
            self.failures += [rec.failure(CASE, f"{label} ({model}@{link})", o.error, o.regime.url, o.status)
                              for o in outs if o.status != "ok"]
        rows, target = K.cell_rows(outcomes, a.start_iter + 1, SYNC, None)
        plain = next((r for r in rows if r["regime"] == SYNC and r.get("curve")), None)
        if plain is not None:  # the target: the synchronous ring's smoothed loss --target-at of the way through
            target = smoothed(plain["curve"])[max(0, math.ceil(a.target_at * len(plain["curve"])) - 1)]
            for row in rows:
                if row.get("curve"):
                    row.update(time_to_target(row["curve"], smoothed(row["curve"]), target))
        per_row(rows, t_alone)
        held = held_out(rows, a.target_at)
        png = plot(rows, self.out / f"lowcomm-{model}-{slug(link)}.png", f"{model} at {link}")
        return {"model": model, "model_name": (K.TINY if a.tiny else K.MODELS)[model], "link": link,
                "rate_bytes_per_s": rate, "steps": steps, "local_steps_run": a.local_steps_run or None,
                "async_steps": a.async_steps or None, "t_alone_s": t_alone, "t_alone_median_s": t_median,
                "numel": numel, "overlap": t, "overlap_whole": t_whole, "overlap_f16": t_f16,
                "exposed_bound_s": exposed_bound(numel or 0, rate, t_alone or 0.0, t),
                "util_bound": util_bound(numel or 0, rate, t_alone or 0.0, t), "target": target,
                "held_out_target": held, "rows": rows,
                "projected": [e.label for e in slow_links], "verdicts": cell_verdicts(rows, t),
                "held_vs_slow": held_against_slow(rows),
                "png": png.name if png else None}


def run(a, cells, out: Path, progress=print) -> tuple[list[dict], list[dict]]:
    from bench.netns import Links, link_unavailable_reason

    r = Run(a, out, progress)
    done = []
    by_link: dict[str, list[str]] = {}
    for model, link in cells:
        by_link.setdefault(link, []).append(model)
    for link, models in by_link.items():
        why = None if link == "loopback" else link_unavailable_reason()
        if why:
            r.failures += [rec.failure(CASE, f"{m}@{link}", why, status="unavailable") for m in models]
            continue
        links = None
        try:
            if link != "loopback":  # a host for each rank, and one for the async entry's server (bench.jobs)
                links = Links(a.workers + any(n.startswith("async") for n in names(a.entries, ENTRY_NAMES, "--entries")),
                              link).__enter__()
            for model in models:
                if r.deadline - time.monotonic() < K.MIN_CELL_S:
                    r.failures.append(rec.failure(CASE, f"{model}@{link}", "the time budget (--budget-s) ran out",
                                                  status="skipped"))
                    continue
                done.append(r.cell(model, link, links))
        finally:
            if links is not None:
                links.close()
    return done, r.failures


def method(label: str) -> str:
    """A row's method without its cell's overlap (T varies by link)."""
    return re.sub(r"(overlap=| T=)\d+", r"\1T", label)


def util_plot(cells: list[dict], out: Path) -> list[str]:
    """Per model, utilization against link rate per method (loopback drawn at 10 Gbit/s), streaming's bound
    marked; returns the files written."""
    from bench.plots import plt, save

    files = []
    for model in sorted({c["model"] for c in cells}):
        mine = sorted((c for c in cells if c["model"] == model), key=lambda c: c["rate_bytes_per_s"] or 1.25e9)
        fig, ax = plt.subplots(figsize=(8, 5))
        lines: dict[str, list[tuple[float, float]]] = {}
        for c in mine:
            x = (c["rate_bytes_per_s"] or 1.25e9) * 8
            for r in c["rows"]:
                if r.get("utilization") is not None and r["regime"] != "alone":
                    lines.setdefault(method(r["regime"]), []).append((x, r["utilization"]))
        for name, pts in lines.items():
            ax.plot(*zip(*pts), marker="o", label=name[:70])
        ax.plot([(c["rate_bytes_per_s"] or 1.25e9) * 8 for c in mine], [c["util_bound"] for c in mine], "k_",
                markersize=20, label="streaming int8 bound: Ht / (Ht + P max(0, fragment time - T t))")
        ax.set_xscale("log")
        ax.set_xlabel("link rate, bit/s (loopback at 10 Gbit/s)")
        ax.set_ylabel("utilization")
        ax.set_title(f"{model}: inner steps x step time alone / wall time")
        ax.legend(fontsize=6)
        path = out / f"lowcomm-util-{model}.png"
        save(fig, path)
        files.append(path.name)
    return files


def fmt(x, spec=".4f") -> str:
    return "—" if x is None else format(x, spec)


def write(out: Path, cells: list[dict], failures: list[dict], config: dict, seconds: float) -> Path:
    md = ["# Local steps: when talking rarely pays", "",
          f"- `commlab bench lowcomm {' '.join(config['argv'])}`: {config['workers']} ranks; this case ran "
          f"{seconds:.0f} s ({seconds / 60:.1f} min). The machine may be shared: quote ratios from one run, "
          "medians of several.",
          "- Utilization = inner steps x the inner step time with no exchange (`alone`'s wall clock per step) / "
          "wall time, both from step 1 on. "
          "Peak link rate: the largest bytes one step sent over that step's time.",
          "- Rows marked `projected`: the synchronous entry's loss per step from a loopback run (the same "
          f"arithmetic) and its wall time steps x its median step time over {TIMING_STEPS} steps at the link.", ""]
    for c in cells:
        md += [f"## {c['model']} ({c['model_name']}) at {c['link']}", "",
               f"{c['steps']} inner steps an entry"
               + "".join(f" ({what}: {c.get(k)})" for k, what in (("local_steps_run", "the local-steps entries"),
                                                                 ("async_steps", "the async entries")) if c.get(k))
               + f"; step alone {fmt(c['t_alone_s'] and c['t_alone_s'] * 1e3, '.1f')} ms "
               f"(median {fmt(c.get('t_alone_median_s') and c['t_alone_median_s'] * 1e3, '.1f')}); "
               f"{c['numel'] or 0:,} parameters; overlap T = {c['overlap']} (streaming bound: "
               f"{c['exposed_bound_s']:.3f} s exposed per fragment, utilization <= {c['util_bound']:.3f}); target "
               f"loss {fmt(c['target'])} (train), held-out {fmt(c.get('held_out_target'))}"
               + (f"; projected: {', '.join(c['projected'])}" if c["projected"] else ""), ""]
        md += table(c["rows"], [
            ("utilization", lambda r: fmt(r.get("utilization"), ".3f")),
            ("loss at equal wall", lambda r: fmt(r.get("loss_at_equal_wall"))),
            ("bytes to target", lambda r: "—" if r.get("bytes_to_target") is None else f"{r['bytes_to_target'] / 2**20:.3g} MiB"),
            ("peak Mbit/s", lambda r: "—" if r.get("peak_bytes_per_s") is None else f"{r['peak_bytes_per_s'] * 8 / 1e6:.3g}"),
            ("held-out loss (last)", lambda r: fmt(r.get("held_final"))),
            ("held-out: steps / s / bytes to target", lambda r: "—" if r.get("held_steps") is None else
             f"{r['held_steps']} / {r['held_s']:.1f} / {r['held_bytes'] / 2**20:.3g} MiB")]) + [""]
        md += ["Verdicts (ratio > 1: the entry after the slash is faster; 95% intervals):", ""]
        md += [f"- {rec.ratio_line(label, v)}" for label, v in c["verdicts"]] + [""]
        if c.get("held_vs_slow"):
            md += [f"At equal held-out loss (the worse of the async entry's last and the ring's last; time to it "
                   f"over {SLOW_SYNC_LABEL}'s, one run, no interval):", ""]
            md += [f"- {h['regime']}: {fmt(h['loss'])} at {fmt(h['async_s'], '.1f')} s, the ring at "
                   f"{fmt(h['slow_s'], '.1f')} s: **{fmt(h['ratio'], '.3f')}**" for h in c["held_vs_slow"]] + [""]
        if c.get("png"):
            md += [f"![loss against step, time and bytes]({c['png']})", ""]
    for name in util_plot(cells, out) if cells else []:
        md += [f"![utilization against link rate]({name})", ""]
    return K.save(out, CASE, md, cells, failures, config, seconds)


def main(argv: list[str] | None = None) -> int:
    return K.main_of(CASE, argv, parser, check, run,
                     lambda out, done, failures, config, seconds, a: write(out, done, failures, config, seconds))


if __name__ == "__main__":
    sys.exit(main())
