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

The verdict names a winner only when the whole interval lies on one side of 1.0; otherwise the
two are "indistinguishable on this machine". Equal samples give the interval [1, 1] (paired) or
one around 1 (unpaired), so they never name a winner.

Pure: numpy only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0


@dataclass(frozen=True)
class Verdict:
    """``a`` against ``b``: ``ratio = stat(b) / stat(a)`` with its interval ``[lo, hi]`` (lower samples
    are better, so ``ratio > 1`` means ``a`` is faster)."""

    a: str
    b: str
    ratio: float
    lo: float
    hi: float
    paired: bool
    n_a: int
    n_b: int
    level: float = LEVEL

    @property
    def winner(self) -> str | None:
        """The faster one, or None when the interval contains 1.0 (or the samples cannot say)."""
        if not (np.isfinite(self.lo) and np.isfinite(self.hi)):
            return None
        if self.lo > 1.0:
            return self.a
        if self.hi < 1.0:
            return self.b
        return None

    @property
    def loser(self) -> str | None:
        w = self.winner
        return None if w is None else (self.b if w == self.a else self.a)

    def oriented(self) -> "Verdict":
        """The same verdict with the winner (or, if none, the one with the better statistic) as ``a``."""
        if self.winner == self.b or (self.winner is None and self.ratio < 1.0):
            return Verdict(self.b, self.a, 1 / self.ratio, 1 / self.hi if self.hi else float("inf"),
                           1 / self.lo if self.lo else float("inf"), self.paired, self.n_b, self.n_a, self.level)
        return self

    def text(self, what: str = "faster") -> str:
        """``"A faster than B, 1.42x [1.21, 1.63]"`` or ``"A and B indistinguishable on this machine
        (1.03x [0.91, 1.18])"``; the interval is the bootstrap's, at ``level``."""
        v = self.oriented()
        span = f"{v.ratio:.2f}x [{v.lo:.2f}, {v.hi:.2f}]"
        if v.winner is None:
            return f"{v.a} and {v.b} indistinguishable on this machine ({span})"
        return f"{v.a} {what} than {v.b}, {span}"

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "ratio": self.ratio, "lo": self.lo, "hi": self.hi, "paired": self.paired,
                "n_a": self.n_a, "n_b": self.n_b, "level": self.level, "winner": self.winner}


def _stat(x: np.ndarray, stat: str, axis=None):
    if stat == "median":
        return np.median(x, axis=axis)
    if stat == "mean":
        return np.mean(x, axis=axis)
    raise ValueError(f"stat must be 'median' or 'mean', got {stat!r}")


def interval(a, b, *, paired: bool, stat: str = "median", resamples: int = RESAMPLES, seed: int = SEED,
             level: float = LEVEL, scale_a: float = 1.0, scale_b: float = 1.0) -> tuple[float, float, float]:
    """``(ratio, lo, hi)`` of ``scale_b * stat(b) / (scale_a * stat(a))`` with a percentile bootstrap interval.

    ``scale_*`` turn a per-sample statistic into a total (time to a target = steps x mean step time).
    Paired samples must have equal lengths. Raises ValueError on empty samples or non-positive data.
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
    ia = rng.integers(0, a.size, size=(resamples, a.size))
    ib = ia if paired else rng.integers(0, b.size, size=(resamples, b.size))
    boot = (scale_b * _stat(b[ib], stat, axis=1)) / (scale_a * _stat(a[ia], stat, axis=1))
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return ratio, float(lo), float(hi)


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


def compare(a_name: str, a, b_name: str, b, *, paired: bool, stat: str = "median", seed: int = SEED,
            resamples: int = RESAMPLES, level: float = LEVEL, scale_a: float = 1.0, scale_b: float = 1.0) -> Verdict:
    """Which of two regimes is faster, from their samples (lower is better): see the module's text."""
    ratio, lo, hi = interval(a, b, paired=paired, stat=stat, resamples=resamples, seed=seed, level=level,
                             scale_a=scale_a, scale_b=scale_b)
    return Verdict(a_name, b_name, ratio, lo, hi, paired, len(a), len(b), level)


def against_best(samples: dict[str, list[float]], *, paired: bool, stat: str = "median", seed: int = SEED,
                 scales: dict[str, float] | None = None) -> list[Verdict]:
    """The regime with the best statistic against each of the others, best first in every verdict's
    ``a`` (before orientation). Empty for fewer than two regimes."""
    scales = scales or {}
    if len(samples) < 2:
        return []
    total = lambda n: scales.get(n, 1.0) * float(_stat(np.asarray(samples[n], dtype=np.float64), stat))
    order = sorted(samples, key=total)
    best = order[0]
    return [compare(best, samples[best], other, samples[other], paired=paired, stat=stat, seed=seed,
                    scale_a=scales.get(best, 1.0), scale_b=scales.get(other, 1.0)) for other in order[1:]]
