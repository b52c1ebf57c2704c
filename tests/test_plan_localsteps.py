"""The planner's local steps (commlab/plan/localsteps.py): the mean step and utilization equal the closed form of
docs/plan.md#local-steps written out here, and the crossover is the root of "local steps' mean step = the other
regime's step". Pure arithmetic on a hand-made calibration; no time is asserted."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from commlab.base.errors import ConfigError
from commlab.plan import compression as K
from commlab.plan import localsteps as L
from commlab.plan.__main__ import local_settings
from commlab.plan.costmodel import Bucket, Calibration, Compute, Topology, Transport, parse_regime

ALPHA, BETA, OPT = 1e-6, 1e-10, 1e-8  # a costly optimizer: the outer step's cost makes a finite crossover
FWD, BWD, BATCH = 2e-4, 4e-4, 16
SIZES = [3000, 1000, 1000]  # elements of the model's three tensors: fragments=2 takes 0, then 1 and 2


def calibration() -> Calibration:
    """Two buckets as backward fills them: the last tensor's alone at the end, the big ones early (their
    all-reduce hidden behind backward at a fast link)."""
    manifest = tuple((f"p{i}", (n,), "float32") for i, n in enumerate(SIZES))
    buckets = (Bucket(4 * (SIZES[0] + SIZES[1]), 0.2, manifest[1::-1]), Bucket(4 * SIZES[2], 1.0, manifest[2:]))
    return Calibration({"ring": Transport(ALPHA, BETA, "test")}, 0.0, OPT, Compute("hand", 1, FWD, BWD, buckets, manifest))


def ring(size: float, n: int, rate: float) -> float:
    """commlab's ring all-reduce over one NIC per worker: 2(N-1) steps of the largest segment (N > 2)."""
    return 2 * (n - 1) * (ALPHA + math.ceil(size / 4 / n) * 4 * max(BETA, 1 / rate))


@pytest.mark.parametrize("rate", [1e6, 1e8, 1e10])
def test_mean_step_and_utilization_equal_the_closed_form(rate):
    cal, regime, n, H, T = calibration(), parse_regime("ring://"), 4, 8, 1
    topo = Topology(1, rate, rate)
    inner = (FWD + BWD) * BATCH + 4 * sum(SIZES) * OPT
    assert L.fragment_elements(cal, 2) == [3000, 2000]
    assert L.fragment_elements(cal, 3, "slices") == [sum(n // 3 + (p < n % 3) for n in SIZES) for p in range(3)]
    exposed = [max(0.0, ring(4 * e, n, rate) - T * inner) + 4 * e * OPT for e in (3000, 2000)]
    got = L.predict(cal, L.LocalSteps(H, 2, T), regime, topo, n, BATCH)
    want = inner + sum(exposed) / H
    assert got["step_s"] == pytest.approx(want, rel=1e-12)
    assert got["utilization"] == pytest.approx(inner / want, rel=1e-12)
    assert got["bound_s"] == pytest.approx([max(0.0, ring(4 * e, n, rate) - T * inner) for e in (3000, 2000)])
    assert got["bytes_per_step"] == pytest.approx(2 * (n - 1) / n * 4 * sum(SIZES) / H)


def test_overlap_hides_the_exchange_up_to_t_inner_steps():
    cal, regime, n = calibration(), parse_regime("ring://"), 4
    topo = Topology(1, 1e9, 1e9)  # fast: every fragment's exchange fits in one inner step
    x = L.predict(cal, L.LocalSteps(8, 2, 1), regime, topo, n, BATCH)
    assert x["bound_s"] == [0.0, 0.0]
    assert x["utilization"] > L.predict(cal, L.LocalSteps(8, 2, 0), regime, topo, n, BATCH)["utilization"]


def test_the_crossover_is_the_root_of_equal_steps():
    """Local steps (H=8) beat the synchronous step below a link rate, and not above it."""
    cal, regime, n = calibration(), parse_regime("ring://"), 4
    topo = Topology(1, 1e9, 1e9)
    ls = L.LocalSteps(8)
    r = L.beats_below(cal, ls, regime, topo, n, None, BATCH)
    assert 0 < r < math.inf

    def diff(rate):
        at = replace(topo, nic_bps=rate)
        return L.predict(cal, ls, regime, at, n, BATCH)["step_s"] - K.step(cal, None, regime, at, n, BATCH)

    assert diff(r * 0.99) < 0 <= diff(r * 1.01)


def test_local_steps_options_are_the_urls_and_refused_by_name():
    assert local_settings(["sync_every=48&fragments=4&overlap=2", "sync_every=10&compress=int8",
                           "sync_every=48&fragments=4&fragment_by=slices"]) == \
        [(48, 4, 2, "", "tensors"), (10, 1, 0, "int8", "tensors"), (48, 4, 0, "", "slices")]
    for bad in ["fragments=2", "sync_every=4&bogus=1", "sync_every=4&fragments=2&overlap=2"]:
        with pytest.raises(ConfigError, match="--local-steps"):
            local_settings([bad])
