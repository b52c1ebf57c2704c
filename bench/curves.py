"""The one training-curve summary of ``bench/``: loss against step and time, time to a target, and
whether a curve coincides with the reference's.

A *curve* is a list of points ``{"step", "loss", "time_s", ...}``, ``step`` counted from 0, as
:func:`curve` reads them from the ranks' metrics lines (``commlab bench script``, the workloads,
``commlab bench compress``, the convergence phase); the convergence phase's evaluations are such
points too (``loss``: the test loss). :func:`summary` is the one set of figures every phase states
about a run (steps, wall time, step / compute / exposed-communication times, bytes per step, the last
evaluation), under the same keys; a phase adds its own beside them. :func:`reach` finds the first point
at a target, :func:`coincidence` compares a curve with the reference's (``local://`` on the combined
batch) step by step, and :func:`agreement` words those comparisons for a report, one line per
synchronous regime.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence


def number(x) -> float | None:
    """``x`` as a float if it is a number (not a bool), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def first_lines(lines: list[dict]) -> dict[int, dict]:
    """One rank's lines by step, each step's first line that reports a loss (a script's closing line
    repeating the last step adds its held-out figures, not a second point)."""
    first: dict[int, dict] = {}
    for rec in lines:
        if number(rec.get("loss")) is not None:
            first.setdefault(rec["step"], rec)
    return first


def curve(ranks: list[list[dict]]) -> list[dict]:
    """One point per step rank 0 reported a loss for: ``step``, ``loss`` (mean over the ranks that
    reported that step), ``time_s`` (rank 0's), ``bytes`` (rank 0's bytes sent up to that step) and
    ``step_s`` / ``comm_s`` / ``bytes_sent`` where rank 0 reported them (:func:`first_lines`)."""
    per_rank = [first_lines(lines) for lines in ranks]
    if not per_rank or not per_rank[0]:
        return []
    r0 = per_rank[0]
    stamps = [number(rec.get("unix_s")) for rec in r0.values()]
    t0_unix = min((t for t in stamps if t is not None), default=None)
    points, sent = [], 0.0
    steps = sorted(r0)
    contiguous = steps == list(range(steps[0], steps[0] + len(steps)))
    mean_sent = statistics.fmean([b for b in (number(r0[s].get("bytes_sent")) for s in steps) if b is not None] or [0.0])
    for s in steps:
        rec = r0[s]
        losses = [number(pr[s]["loss"]) for pr in per_rank if s in pr]
        t = number(rec.get("time_s"))
        if t is None and t0_unix is not None and number(rec.get("unix_s")) is not None:
            t = rec["unix_s"] - t0_unix
        b = number(rec.get("bytes_sent"))
        # bytes up to this step: exact when every step was reported, else the mean per reported step x steps
        sent = (sent + (b or 0.0)) if contiguous else mean_sent * (s + 1)
        points.append({"step": s, "loss": statistics.fmean(losses), "ranks": len(losses), "time_s": t,
                       "bytes": sent, "step_s": number(rec.get("step_s")), "comm_s": number(rec.get("comm_s")),
                       "bytes_sent": b, **({"test_loss": number(rec["test_loss"])} if "test_loss" in rec else {})})
    return points


def smooth_window(n: int) -> int:
    """Points in the trailing mean that the final loss and the time to target use: a tenth of the curve."""
    return max(1, round(n / 10))


def smoothed(points: list[dict]) -> list[float]:
    """Trailing mean of the loss over :func:`smooth_window` points (a per-batch loss is noisy)."""
    w = smooth_window(len(points))
    losses = [p["loss"] for p in points]
    return [statistics.fmean(losses[max(0, i + 1 - w): i + 1]) for i in range(len(losses))]


def median(values) -> float | None:
    """The median of the finite values among ``values`` (None skipped); None if there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def mean(values) -> float | None:
    """The mean of the finite values among ``values`` (None skipped); None if there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(vals) if vals else None


def summary(ranks: list[list[dict]]) -> dict:
    """The figures every training-curve summary of ``bench/`` states, under these keys, from the ranks'
    metrics lines (each step's first line, :func:`first_lines`); ``{}`` when rank 0 reported no loss.

    ``steps`` (rank 0's last step + 1), ``wall_s`` (its time then), ``step_s_median`` / ``_mean`` /
    ``_min`` / ``_max`` (:func:`step_times` of rank 0), ``compute_s_median`` / ``_mean`` and
    ``comm_s_median`` / ``_mean`` (rank 0's; None where it did not report them: DDP's communication
    overlaps its compute), ``bytes_per_step`` (bytes sent per rank per step, over every rank's reported
    steps) and ``bytes_sent_total``, ``test_loss`` / ``test_acc`` (rank 0's last evaluation, None
    without one) and ``curve`` (:func:`curve`).
    """
    pts = curve(ranks)
    if not pts:
        return {}
    r0 = list(first_lines(ranks[0]).values())
    sent = [b for lines in ranks for b in (number(x.get("bytes_sent")) for x in first_lines(lines).values())
            if b is not None]
    last_eval = next((rec for rec in reversed(ranks[0]) if "test_loss" in rec or "test_acc" in rec), {})
    steps = step_times(pts)
    of = lambda key: [number(x.get(key)) for x in r0]
    return {"steps": pts[-1]["step"] + 1, "wall_s": pts[-1]["time_s"],
            "step_s_median": median(steps), "step_s_mean": mean(steps),
            "step_s_min": min(steps, default=None), "step_s_max": max(steps, default=None),
            "compute_s_median": median(of("compute_s")), "compute_s_mean": mean(of("compute_s")),
            "comm_s_median": median(of("comm_s")), "comm_s_mean": mean(of("comm_s")),
            "bytes_per_step": statistics.fmean(sent) if sent else None, "bytes_sent_total": sum(sent),
            "test_loss": number(last_eval.get("test_loss")), "test_acc": number(last_eval.get("test_acc")),
            "curve": pts}


def step_times(points: list[dict]) -> list[float]:
    """Seconds per step: the reported ``step_s``, else the time between reported steps per step."""
    if any(p["step_s"] is not None for p in points):
        return [p["step_s"] for p in points if p["step_s"] is not None]
    out = []
    for a, b in zip(points, points[1:]):
        if a["time_s"] is not None and b["time_s"] is not None and b["step"] > a["step"]:
            out.append((b["time_s"] - a["time_s"]) / (b["step"] - a["step"]))
    return out


def reach(points: Sequence[dict], values: Sequence[float], reached: Callable[[float], bool]) -> dict:
    """The first point whose value (``values[i]`` belongs to ``points[i]``) is ``reached``:
    ``{"steps_to_target": its step + 1 (steps done), "time_to_target_s": its time_s}``, both None if none is."""
    hit = next((p for p, v in zip(points, values) if reached(v)), None)
    return {"steps_to_target": hit["step"] + 1 if hit else None, "time_to_target_s": hit["time_s"] if hit else None}


def time_to_target(pts: list[dict], sm: list[float], target: float | None) -> dict:
    """The first reported step (and its wall time) whose smoothed loss ``sm`` is at or below ``target``."""
    if target is None:
        return {"target_loss": None, "steps_to_target": None, "time_to_target_s": None}
    return {"target_loss": target, **reach(pts, sm, lambda v: v <= target)}


def coincidence(reference: list[dict], points: list[dict], tol: float) -> dict:
    """Compare two curves' losses at the steps both reported.

    Returns ``{"steps_compared", "max_abs_diff", "at_step", "tolerance", "coincides"}``;
    ``coincides`` is None when they share no step (nothing to judge), else whether every common
    step's losses differ by at most ``tol`` and every step of the reference was compared (a curve
    that stops early is compared where it has points, says so through ``steps_compared``, and does
    not coincide).
    """
    ref = {p["step"]: p["loss"] for p in reference}
    diffs = [(abs(p["loss"] - ref[p["step"]]), p["step"]) for p in points if p["step"] in ref]
    if not diffs:
        return {"steps_compared": 0, "max_abs_diff": None, "at_step": None, "tolerance": tol, "coincides": None}
    worst, at = max(diffs, key=lambda d: (not math.isfinite(d[0]), d[0]))
    return {"steps_compared": len(diffs), "max_abs_diff": worst, "at_step": at, "tolerance": tol,
            "coincides": math.isfinite(worst) and worst <= tol and len(diffs) == len(ref)}


def agreement(rows: list[dict], reference_ran: bool, *, what: str, why: str, judged: bool = True,
              why_not: str = "") -> list[str]:
    """Markdown lines: does each synchronous row's curve lie on the reference's?

    ``rows`` carry ``regime``, ``kind`` ("reference", "sync", ...) and, on the rows compared,
    ``vs_local`` (:func:`coincidence`); ``reference_ran``: whether local:// gave a curve. ``what`` names the loss compared ("test-loss", "loss"),
    ``why`` what is left within the tolerance (rounding). With ``judged`` False the differences are
    shown with ``why_not`` instead of a verdict.
    """
    if not reference_ran:
        return ["- local:// did not run, so there is nothing to check against."]
    sync = [r for r in rows if r["kind"] == "sync" and r.get("vs_local")]
    if not sync:
        return ["- No synchronous regime finished."]
    lines = []
    for r in sync:
        v = r["vs_local"]
        if v["max_abs_diff"] is None:
            lines.append(f"- {r['regime']}: no step in common with local://.")
            continue
        d = (f"max |{what} difference| {v['max_abs_diff']:.2g} at step {v['at_step'] + 1}, "
             f"over {v['steps_compared']} steps")
        if not judged:
            lines.append(f"- {r['regime']}: {d} (not judged: {why_not}).")
        elif v["coincides"]:
            lines.append(f"- {r['regime']}: **coincides** with local:// ({d}; tolerance {v['tolerance']:g}: {why}).")
        else:
            lines.append(f"- {r['regime']}: **does NOT coincide** with local:// ({d} > {v['tolerance']:g}, or steps "
                         "missing): a synchronous regime that changes the arithmetic is a bug.")
    return lines
