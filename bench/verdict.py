"""Verdicts with their uncertainty: "A is faster than B" only when the run's own samples say so.

From two regimes' samples (times per iteration, per step or per repeat; lower is better) this
computes the ratio of their statistics (median by default) ``r = stat(B) / stat(A)`` -- A is r
times faster -- and a 95% percentile bootstrap interval for it. The bootstrap is seeded, so a
report written twice from the same records says the same thing.

- **Paired** when the regimes took turns iteration by iteration (the bandwidth harness): sample
  ``i`` of A and sample ``i`` of B were taken in the same seconds of the machine, so one resample
  draws the same iterations for both, and a slow spell that hit both cancels in the ratio.
- **Unpaired** otherwise (each regime's training run is a job of its own): A and B are resampled
  independently.

- **Launches.** A process started again runs differently (docs/bench.md, "Verdicts"), so one
  launch's samples miss the launch-to-launch spread. Samples from several launches (``clusters``:
  how many consecutive samples each launch gave, the same for both sides when paired) are resampled
  launches first, then iterations within each; comparisons of regimes that ran one launch each take
  ``launch_sigma`` (:func:`launch_sigma`, never less than :func:`spread`'s floor) as a random launch
  effect on each side of the ratio.

- **Steps to a target.** Time to a target is steps to the target x the mean step time. A synchronous
  regime reaches the target at the same step in every run (it does local's arithmetic from the same
  seed); an asynchronous one does not (the order in which pushes land is chance). ``steps_sigma_a``
  / ``steps_sigma_b`` add each side's spread of log steps to the target as a random effect
  (:data:`STEPS_SIGMA_ASYNC` for asynchronous regimes, 0 for the rest).

**The rule (an equivalence band).** A verdict has a band ``b`` (:data:`BAND`, 5%, unless the caller
passes the tolerance its goal states: tracing's "at most 1.03x" is ``b = 0.03``) and judges the span
``[min(lo, ratio), max(hi, ratio)]`` (the interval, stretched to hold its own point estimate) against
``[1/(1+b), 1+b]``, symmetric in log ratio, so a verdict says the same turned round:

- wholly above ``1+b`` (or wholly below ``1/(1+b)``): A (or B) is **faster**, the only case that names
  a winner;
- wholly inside the band: A and B are **equivalent within ±b**;
- otherwise they are **indistinguishable on this machine**.

Why: an interval over one run's samples does not carry every launch-to-launch effect, so for a
difference of a few percent, 1.0 alone as the line made run 1 of a set name A at 1.03x [1.00, 1.07]
and run 3 name B at 0.96x [0.93, 0.99] (docs/trace.md). With the band, two runs name opposite winners
only where their point estimates lie more than ``(1+b)**2`` apart (one above ``1+b``, the other
below ``1/(1+b)``): runs whose estimates lie within the band never name a winner at all. Equal
samples give the interval [1, 1] (paired) or one around 1 (unpaired): never a winner.

Pure: numpy only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0
# The launch-to-launch spread (sd of log medians) pooled over the three back-to-back default runs of
# docs/bench.md (0.090, 0.050 and 0.151 measured in each: sqrt of the mean variance, 0.105). One
# run's estimate rests on a few launches and came out as low as 0.050, which made two launches of
# equal regimes look 1.2x apart with confidence; :func:`spread` never goes below this floor.
LAUNCH_SIGMA_FLOOR = 0.10
# The spread of log steps to the target of the asynchronous regimes (ps-async, ps-async-lr/N, ps-ssp-1,
# ps-ssp-1-lr/N), pooled over eight default runs of 2026-11-23 (27 degrees of freedom; per regime 0.36,
# 0.23, 0.23, 0.06): ps-async took 30 to 70 steps to the same target. Without it one run called local
# 2.0x faster than ps-async to the target and the next called ps-async 1.4x faster than local.
STEPS_SIGMA_ASYNC = 0.25
# The equivalence band of a verdict whose goal states no tolerance of its own (module text): a winner is
# named only beyond +-5%. The 3-4% effects this machine's runs disagree on (docs/trace.md) fall inside it.
BAND = 0.05


def band_limits(band: float) -> tuple[float, float]:
    """``(1/(1+band), 1+band)``: the ratios a verdict with ``band`` calls equivalent (module text). Raises
    ValueError for a band that is negative or not finite."""
    if not (np.isfinite(band) and band >= 0):
        raise ValueError(f"band must be a finite fraction >= 0 (0.05: +-5%), got {band!r}")
    return 1.0 / (1.0 + band), 1.0 + band


def band_text(band: float) -> str:
    """``"±5%"`` for 0.05."""
    return f"±{band * 100:g}%"


def rule(band: float = BAND, named: str = "a regime is named faster") -> str:
    """The rule in one sentence, for a report's readers (``named``: what a winner is called there)."""
    low, high = band_limits(band)
    return (f"{named} only where the 95% interval of the ratio lies wholly outside "
            f"[{low:.3f}, {high:.3f}] ({band_text(band)} of 1); wholly inside it the two are equivalent within "
            f"{band_text(band)}; otherwise they are indistinguishable on this machine")


@dataclass(frozen=True)
class Verdict:
    """``a`` against ``b``: ``ratio = stat(b) / stat(a)`` with its interval ``[lo, hi]`` (lower samples
    are better, so ``ratio > 1`` means ``a`` is faster), judged against the equivalence band ``band``
    (module text: a winner only beyond it)."""

    a: str
    b: str
    ratio: float
    lo: float
    hi: float
    paired: bool
    n_a: int
    n_b: int
    level: float = LEVEL
    band: float = BAND

    def __post_init__(self):
        band_limits(self.band)  # refuses a bad band where the verdict is made

    def _span(self) -> tuple[float, float] | None:
        """The interval stretched to hold the point estimate; None where the samples cannot say."""
        if not (np.isfinite(self.lo) and np.isfinite(self.hi) and np.isfinite(self.ratio)):
            return None
        return min(self.lo, self.ratio), max(self.hi, self.ratio)

    @property
    def winner(self) -> str | None:
        """The faster one where the span lies wholly outside the band, else None."""
        span = self._span()
        if span is None:
            return None
        low, high = band_limits(self.band)
        if span[0] > high:
            return self.a
        if span[1] < low:
            return self.b
        return None

    @property
    def equivalent(self) -> bool:
        """Whether the span lies wholly inside the band: equal within ``±band``."""
        span = self._span()
        low, high = band_limits(self.band)
        return span is not None and low <= span[0] and span[1] <= high

    def said(self) -> str:
        """The judgement alone: ``"A faster"``, ``"equivalent within ±5%"`` or ``"indistinguishable on this
        machine"``."""
        if self.winner is not None:
            return f"{self.winner} faster"
        if self.equivalent:
            return f"equivalent within {band_text(self.band)}"
        return "indistinguishable on this machine"

    def sign(self) -> str:
        """``>`` (``a`` faster), ``<`` (``b`` faster), ``=`` (equivalent) or ``≈`` (indistinguishable)."""
        return ">" if self.winner == self.a else "<" if self.winner == self.b else "=" if self.equivalent else "≈"

    def oriented(self) -> "Verdict":
        """The same verdict with the winner (or, if none, the one with the better statistic) as ``a``."""
        if self.winner == self.b or (self.winner is None and self.ratio < 1.0):
            return Verdict(self.b, self.a, 1 / self.ratio, 1 / self.hi if self.hi else float("inf"),
                           1 / self.lo if self.lo else float("inf"), self.paired, self.n_b, self.n_a, self.level,
                           self.band)
        return self

    def text(self, what: str = "faster") -> str:
        """``"A faster than B, 1.42x [1.21, 1.63]"``, ``"A and B equivalent within ±5% (1.01x [0.98, 1.03])"``
        or ``"A and B indistinguishable on this machine (1.03x [0.91, 1.18])"``; the interval is the
        bootstrap's, at ``level``."""
        v = self.oriented()
        span = f"{v.ratio:.2f}x [{v.lo:.2f}, {v.hi:.2f}]"
        if v.winner is None:
            return f"{v.a} and {v.b} {v.said()} ({span})"
        return f"{v.a} {what} than {v.b}, {span}"

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "ratio": self.ratio, "lo": self.lo, "hi": self.hi, "paired": self.paired,
                "n_a": self.n_a, "n_b": self.n_b, "level": self.level, "band": self.band, "winner": self.winner,
                "equivalent": self.equivalent}


def quantile(values, q: float):
    """The ``q``-quantile of ``values`` as one of them (numpy's nearest rank), a Python number."""
    return np.quantile(np.asarray(values), q, method="nearest").item()


def _stat(x: np.ndarray, stat: str, axis=None):
    if stat == "median":
        return np.median(x, axis=axis)
    if stat == "mean":
        return np.mean(x, axis=axis)
    raise ValueError(f"stat must be 'median' or 'mean', got {stat!r}")


def _draw(rng, n: int, clusters, resamples: int) -> np.ndarray:
    """Indices of ``resamples`` bootstrap samples of ``n``: iid, or two-stage over ``clusters`` (sizes)."""
    if not clusters or len(clusters) < 2:
        return rng.integers(0, n, size=(resamples, n))
    sizes = np.asarray(clusters, dtype=np.int64)
    if sizes.sum() != n or np.any(sizes <= 0):
        raise ValueError(f"clusters {list(clusters)} do not add up to the {n} samples")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty((resamples, n), dtype=np.int64)
    picks = rng.integers(0, len(sizes), size=(resamples, len(sizes)))
    for i in range(resamples):
        parts = [starts[c] + rng.integers(0, sizes[c], size=sizes[c]) for c in picks[i]]
        row = np.concatenate(parts)
        out[i] = row[:n] if row.size >= n else np.resize(row, n)
    return out


def launch_sigma(groups, *, seed: int = SEED, resamples: int = 200) -> float:
    """The spread of a regime's median between launches, from ``groups`` (each: one regime and
    size's per-launch sample lists): the pooled variance of the launches' log medians less what the
    sampling of each median alone explains (its bootstrap variance), as a standard deviation. 0.0
    without a group of two or more launches, or where sampling explains all the spread."""
    rng = np.random.default_rng(seed)
    between, within, dof, count = 0.0, 0.0, 0, 0
    for launches in groups:
        xs = [np.asarray(x, dtype=np.float64) for x in launches if len(x)]
        if len(xs) < 2:
            continue
        meds = np.log([np.median(x) for x in xs])
        between += float(np.sum((meds - meds.mean()) ** 2))
        dof += len(xs) - 1
        for x in xs:
            boot = np.log(np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1))
            within += float(np.var(boot, ddof=1))
            count += 1
    if not dof:
        return 0.0
    return float(np.sqrt(max(0.0, between / dof - within / count)))


def spread(measured: float, floor: float = LAUNCH_SIGMA_FLOOR) -> float:
    """The launch spread a one-launch comparison carries: this run's estimate, or ``floor`` (this
    machine's pooled value, :data:`LAUNCH_SIGMA_FLOOR`) where the run measured less."""
    return max(float(measured), float(floor))


def interval(a, b, *, paired: bool, stat: str = "median", resamples: int = RESAMPLES, seed: int = SEED,
             level: float = LEVEL, scale_a: float = 1.0, scale_b: float = 1.0, clusters=None,
             launch_sigma: float = 0.0, steps_sigma_a: float = 0.0, steps_sigma_b: float = 0.0
             ) -> tuple[float, float, float]:
    """``(ratio, lo, hi)`` of ``scale_b * stat(b) / (scale_a * stat(a))`` with a percentile bootstrap interval.

    ``scale_*`` turn a per-sample statistic into a total (time to a target = steps x mean step time).
    Paired samples must have equal lengths. ``clusters`` (paired only): the sizes of the launches
    the samples came from, in order; ``launch_sigma``: a launch-to-launch spread to add where each
    side is one launch (module text); ``steps_sigma_*``: each side's spread of log ``scale_*`` where
    that scale is itself one random draw (steps to a target). Raises ValueError on empty samples or
    non-positive data.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"need samples on both sides, got {a.size} and {b.size}")
    if not (np.all(a > 0) and np.all(b > 0)):
        raise ValueError("samples must be positive (times)")
    if paired and a.size != b.size:
        raise ValueError(f"paired samples need equal lengths, got {a.size} and {b.size}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ratio = float(scale_b * _stat(b, stat) / (scale_a * _stat(a, stat)))
    rng = np.random.default_rng(seed)
    if clusters and not paired:
        raise ValueError("clusters are for paired samples (both sides from the same launches)")
    ia = _draw(rng, a.size, clusters, resamples)
    ib = ia if paired else rng.integers(0, b.size, size=(resamples, b.size))
    boot = (scale_b * _stat(b[ib], stat, axis=1)) / (scale_a * _stat(a[ia], stat, axis=1))
    if launch_sigma > 0:  # one launch each side: each carries its own launch effect
        boot = boot * np.exp(rng.normal(0.0, launch_sigma * np.sqrt(2.0), size=resamples))
    steps_sigma = float(np.hypot(steps_sigma_a, steps_sigma_b))
    if steps_sigma > 0:  # the scales themselves are draws: steps to a target
        boot = boot * np.exp(rng.normal(0.0, steps_sigma, size=resamples))
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return ratio, float(lo), float(hi)


def per_launch(a_name: str, a, b_name: str, b, clusters, *, stat: str = "median", seed: int = SEED,
               resamples: int = RESAMPLES, band: float = BAND) -> list[Verdict]:
    """One paired verdict per launch of paired samples (``clusters``: the launches' sample counts, in
    order), each from that launch's iterations alone: whether the launches agree on the winner."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size != b.size or sum(clusters) != a.size:
        raise ValueError(f"per-launch verdicts need paired samples in launches {list(clusters)}, "
                         f"got {a.size} and {b.size}")
    out, at = [], 0
    for n in clusters:
        out.append(compare(a_name, a[at:at + n], b_name, b[at:at + n], paired=True, stat=stat, seed=seed,
                           resamples=resamples, band=band))
        at += n
    return out


def median_interval(x, *, seed: int = SEED, resamples: int = RESAMPLES, level: float = LEVEL
                    ) -> tuple[float, float, float]:
    """``(median, lo, hi)``: one sample's median with its percentile bootstrap interval (plots' error bars)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        raise ValueError("need at least one sample")
    boot = np.median(x[np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))], axis=1)
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return float(np.median(x)), float(lo), float(hi)


def compare(a_name: str, a, b_name: str, b, *, paired: bool, level: float = LEVEL, band: float = BAND,
            **options) -> Verdict:
    """Which of two regimes is faster, from their samples (lower is better): :func:`interval`'s ratio and
    interval (``options``: its other keywords) under the two names, judged with the equivalence band
    ``band`` (the tolerance of the goal it checks, where that states one); see the module's text."""
    band_limits(band)
    ratio, lo, hi = interval(a, b, paired=paired, level=level, **options)
    return Verdict(a_name, b_name, ratio, lo, hi, paired, len(a), len(b), level, band)


def pairs(samples: dict[str, list[float]], *, paired: bool, stat: str = "median", seed: int = SEED,
          clusters=None, launch_sigma: float = 0.0, band: float = BAND) -> list[Verdict]:
    """Every pair of regimes, in the order ``samples`` lists them (``a`` the earlier one): the same
    pairs in every run, whichever is fastest, so that two runs' verdicts compare line by line."""
    names = list(samples)
    return [compare(a, samples[a], b, samples[b], paired=paired, stat=stat, seed=seed, clusters=clusters,
                    launch_sigma=launch_sigma, band=band) for i, a in enumerate(names) for b in names[i + 1:]]


def against_best(samples: dict[str, list[float]], *, paired: bool, stat: str = "median", seed: int = SEED,
                 scales: dict[str, float] | None = None, clusters=None, launch_sigma: float = 0.0,
                 steps_sigmas: dict[str, float] | None = None, band: float = BAND) -> list[Verdict]:
    """The regime with the best statistic against each of the others, best first in every verdict's
    ``a`` (before orientation). Empty for fewer than two regimes."""
    scales = scales or {}
    sig = steps_sigmas or {}
    if len(samples) < 2:
        return []
    total = lambda n: scales.get(n, 1.0) * float(_stat(np.asarray(samples[n], dtype=np.float64), stat))
    order = sorted(samples, key=total)
    best = order[0]
    return [compare(best, samples[best], other, samples[other], paired=paired, stat=stat, seed=seed,
                    scale_a=scales.get(best, 1.0), scale_b=scales.get(other, 1.0), clusters=clusters,
                    launch_sigma=launch_sigma, steps_sigma_a=sig.get(best, 0.0), steps_sigma_b=sig.get(other, 0.0),
                    band=band)
            for other in order[1:]]


def rate_ratio(a_name: str, a_counts, a_seconds, b_name: str, b_counts, b_seconds, *, seed: int = SEED,
               resamples: int = RESAMPLES, level: float = LEVEL, band: float = BAND) -> Verdict:
    """``a``'s rate over ``b``'s, ``(sum a_counts / sum a_seconds) / (sum b_counts / sum b_seconds)`` (> 1: ``a``
    got more done per second), from per-bin counts and bin lengths (``commlab bench chaos``: samples that
    entered applied updates per bin of its window), with a percentile bootstrap interval resampling each
    side's bins independently (a bin of nothing counts: the kills' stalls are what is measured). A rate is
    a ratio of sums, not a median of per-bin rates, so this is not :func:`interval`."""
    ac, as_ = np.asarray(a_counts, dtype=np.float64), np.asarray(a_seconds, dtype=np.float64)
    bc, bs = np.asarray(b_counts, dtype=np.float64), np.asarray(b_seconds, dtype=np.float64)
    if ac.size == 0 or bc.size == 0 or ac.size != as_.size or bc.size != bs.size:
        raise ValueError(f"need as many bins as bin lengths on both sides, got {ac.size}/{as_.size} and "
                         f"{bc.size}/{bs.size}")
    if bc.sum() <= 0 or np.any(as_ <= 0) or np.any(bs <= 0):
        raise ValueError(f"{b_name} got nothing done, or a bin has no length: no rate to compare against")
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, ac.size, size=(resamples, ac.size))
    ib = rng.integers(0, bc.size, size=(resamples, bc.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = (ac[ia].sum(1) / as_[ia].sum(1)) / (bc[ib].sum(1) / bs[ib].sum(1))
    boot = boot[np.isfinite(boot)]
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail]) if boot.size else (float("nan"), float("nan"))
    ratio = float((ac.sum() / as_.sum()) / (bc.sum() / bs.sum()))
    return Verdict(a_name, b_name, ratio, float(lo), float(hi), False, int(ac.size), int(bc.size), level, band)
