"""The planner: closed forms the simulator must reproduce, the field's qualitative results, calibration
arithmetic, and `commlab plan` end to end. One process (plus one CLI subprocess); no time is asserted.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from commlab.base.errors import ConfigError
from commlab.plan import calibrate as C
from commlab.plan.costmodel import (Bucket, Calibration, Compute, Straggler, Topology, Transport, parse_regime,
                                    ps_time, ring_bytes_per_rank, shards_to_beat_ring)
from commlab.plan.simulate import ring_bytes_by_rank, shard_bytes, simulate
from commlab.regimes.ring import ring_schedule, segment_bounds

from conftest import run_group

ROOT = Path(__file__).resolve().parent.parent
RATE = 1e9  # bytes/s on every NIC in these tests


def synth(params: int = 64, numel: int = 16384, buckets: int = 1, fwd: float = 0.0, bwd: float = 0.0,
          alpha: float = 0.0, beta: float = 0.0, add: float = 0.0, opt: float = 0.0) -> Calibration:
    """A calibration with ``params`` equal float32 tensors in ``buckets`` equal buckets; times per sample
    at batch 1; every transport with the same alpha and CPU-side beta."""
    manifest = tuple((f"p{i}", (numel,), "float32") for i in range(params))
    per = params // buckets
    rev = list(reversed(manifest))
    bks = tuple(Bucket(per * numel * 4, (j + 1) / buckets, tuple(rev[j * per:(j + 1) * per])) for j in range(buckets))
    tr = Transport(alpha, beta, "test")
    return Calibration({"ring": tr, "ring-torch": tr, "gloo": tr, "ps": tr}, add, opt, Compute("synth", 1, fwd, bwd, bks, manifest))


def topo(**kw) -> Topology:
    return Topology(**{"workers_per_host": 1, "nic_bps": RATE, "intra_bps": RATE, **kw})


# ----- closed forms -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16])
def test_ring_moves_2_n_minus_1_over_n_times_s_per_rank_and_takes_that_over_the_link(n):
    cal = synth(params=64, numel=16 * 3 * 5 * 7)  # element count divisible by every n here
    size = cal.compute.param_bytes
    res = simulate(cal, topo(), parse_regime("ring://?transport=torch"), n)
    assert res.bytes["sent_per_worker"] == 2 * (n - 1) / n * size == ring_bytes_per_rank(size, n)
    assert res.step_s == pytest.approx(2 * (n - 1) / n * size / RATE, rel=1e-12)


@pytest.mark.parametrize("n,numel", [(2, 0), (2, 1), (3, 7), (4, 1001), (5, 5)])
def test_ring_bytes_by_rank_follow_the_ring_schedule(n, numel):
    """The per-rank tally is the ring's own schedule, also for sizes that do not divide by N."""
    bounds = segment_bounds(numel, n)
    expected = [sum((bounds[ring_schedule(r, n, t)[0] + 1] - bounds[ring_schedule(r, n, t)[0]]) * 4
                    for t in range(2 * (n - 1))) for r in range(n)]
    assert ring_bytes_by_rank(numel * 4, n).tolist() == expected


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (4, 2), (8, 4), (5, 8)])
def test_ps_with_k_shards_puts_2_n_s_over_k_on_each_shard_link(n, k):
    cal = synth(params=64)
    size = cal.compute.param_bytes
    res = simulate(cal, topo(), parse_regime(f"ps://?shards={k}&mode=sync"), n)
    for into, out in zip(res.bytes["shard_link_in"], res.bytes["shard_link_out"]):
        assert into + out == 2 * n * size / k
    assert shard_bytes(cal, k).sum() == size
    # and the time is BytePS's max(S/B, N S/(K B)), plus the last piece's trip back
    piece = size / 64
    assert ps_time(size, n, k, RATE) <= res.step_s <= ps_time(size, n, k, RATE) + 3 * n * piece / RATE


@pytest.mark.parametrize("regime", ["ring://", "allreduce://?backend=gloo", "ps://?shards=2&mode=sync"])
@pytest.mark.parametrize("d", [0.001, 0.25])
def test_a_synchronous_step_with_one_worker_slowed_by_d_takes_d_longer(regime, d):
    cal = synth(params=64, buckets=4, fwd=0.02, bwd=0.05, alpha=20e-6, beta=0.0, add=1e-11, opt=1e-11)
    r, t = parse_regime(regime), topo(nic_bps=1e10)
    if r.kind == "ps":  # where no link is the limit (see the next test)
        t = topo(nic_bps=1e18)
    base = simulate(cal, t, r, 6).step_s
    slow = simulate(cal, t, r, 6, straggler=Straggler(slow_workers=1, slow_delay_s=d)).step_s
    assert slow - base == pytest.approx(d, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("d", [0.001, 0.25])
def test_a_shard_link_uses_the_delay_of_a_slowed_worker(d):
    """Where a shard's link is the limit, the other workers' pushes cross it during the delay: the step
    grows by less than d, and by no less than d minus the time the others' bytes take on that link."""
    cal = synth(params=64, buckets=4, fwd=0.02, bwd=0.05, alpha=20e-6, beta=1e-10, add=1e-11, opt=1e-11)
    r, n = parse_regime("ps://?shards=2&mode=sync"), 6
    base = simulate(cal, topo(), r, n).step_s
    grew = simulate(cal, topo(), r, n, straggler=Straggler(slow_workers=1, slow_delay_s=d)).step_s - base
    assert d - (n - 1) * cal.compute.param_bytes / 2 / RATE <= grew < d


# ----- the field's qualitative results ----------------------------------------------------------------
@pytest.mark.parametrize("n", [4, 8])
def test_dedicated_shards_overtake_the_ring_where_byteps_says_and_colocated_ones_do_not(n):
    cal = synth(params=640, numel=4096)
    ring = simulate(cal, topo(), parse_regime("ring://"), n).step_s
    need = shards_to_beat_ring(n)
    assert max(1, n / need) < 2 * (n - 1) / n <= max(1, n / (need - 1))
    for k in range(1, 2 * n + 1):
        ps = simulate(cal, topo(), parse_regime(f"ps://?shards={k}&mode=sync"), n).step_s
        assert (ps < ring) == (k >= need), f"K={k}: ps {ps} ring {ring}"
    for k in range(1, n + 1):
        colo = simulate(cal, topo(), parse_regime(f"ps://?shards={k}&mode=sync&placement=colocated"), n).step_s
        assert colo >= ring * (1 - 1e-9), f"co-located K={k}: {colo} < ring {ring}"


def test_colocated_shards_need_as_many_hosts():
    with pytest.raises(ConfigError, match="co-located shards need as many worker hosts"):
        simulate(synth(), topo(workers_per_host=4), parse_regime("ps://?shards=2&placement=colocated"), 4)


def test_ssp_gains_nothing_over_sync_with_identical_workers_and_more_as_variance_grows():
    cal = synth(params=64, buckets=2, fwd=0.02, bwd=0.05, alpha=20e-6, beta=1e-10)
    t = topo(nic_bps=100e9)
    gains = []
    for sigma in (0.0, 0.2, 0.5):
        s = Straggler(sigma=sigma)
        sync = simulate(cal, t, parse_regime("ps://?shards=4&mode=sync"), 8, straggler=s, steps=60).step_s
        ssp = simulate(cal, t, parse_regime("ps://?shards=4&mode=ssp&staleness=2"), 8, straggler=s, steps=60).step_s
        gains.append(sync / ssp)
    assert gains[0] <= 1.0
    assert gains[0] < gains[1] < gains[2] and gains[2] > 1.1


def test_async_throughput_rises_with_n_while_its_staleness_grows():
    cal = synth(params=64, fwd=0.02, bwd=0.05, alpha=20e-6, beta=1e-10)
    runs = [simulate(cal, topo(nic_bps=100e9), parse_regime("ps://?shards=4&mode=async"), n, steps=30)
            for n in (1, 2, 4, 8, 16)]
    assert all(a.throughput < b.throughput for a, b in zip(runs, runs[1:]))
    assert all(a.staleness_mean < b.staleness_mean for a, b in zip(runs, runs[1:]))
    assert runs[0].staleness == {0: 30 * 4}  # one worker: nothing lands in between, on each of 4 shards


def test_ssp_bound_one_is_lockstep_and_a_slow_worker_holds_the_others():
    cal = synth(params=64, fwd=0.01, bwd=0.02, beta=1e-10)
    s = Straggler(slow_workers=1, slow_factor=4.0)
    free = simulate(cal, topo(nic_bps=100e9), parse_regime("ps://?mode=async"), 4, straggler=s, steps=20)
    held = simulate(cal, topo(nic_bps=100e9), parse_regime("ps://?mode=ssp&staleness=1"), 4, straggler=s, steps=20)
    assert held.throughput < free.throughput
    assert max(held.staleness) <= 3 * (2 * 1 + 1)  # (N-1)(2S+1), commlab.transport.psproto.ssp_staleness_bound


# ----- calibration ------------------------------------------------------------------------------------
def test_fit_line_recovers_latency_and_per_byte_cost():
    sizes = [4096, 2**20, 16 * 2**20, 64 * 2**20]
    a, b = C.fit_line(sizes, [50e-6 + s * 1e-9 for s in sizes])
    assert a == pytest.approx(50e-6, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)


def test_transports_from_bench_records_invert_each_regimes_formula():
    n, alpha, beta = 3, 40e-6, 0.5e-9
    recs = []
    for size in (65536, 2**20, 8 * 2**20):
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta
        ps = 2 * alpha + 2 * max(1, n / 2) * size * beta
        recs += [{"kind": "regime", "regime": "ring-tcp", "workers": n, "size_bytes": size, "time_us": ring * 1e6,
                  "wrong": 0},
                 {"kind": "regime", "regime": "ps-2", "workers": n, "size_bytes": size, "time_us": ps * 1e6, "wrong": 0},
                 {"kind": "ceiling", "regime": "memcpy", "workers": n, "size_bytes": size, "time_us": 1.0, "wrong": 0}]
    got = C.transports_from_records(recs)
    assert set(got) == {"ring", "ps"}
    for t in got.values():
        assert t.alpha_s == pytest.approx(alpha, rel=1e-6) and t.beta_s == pytest.approx(beta, rel=1e-6)


def test_transports_from_a_folder_without_bandwidth_json_say_so(tmp_path):
    with pytest.raises(ConfigError, match="has no bandwidth.json"):
        C.transports_from_run(tmp_path)


def test_compute_timeline_comes_from_the_models_hooks_in_backward_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    c = C.measure_compute(model, (64,), batch=8, reps=2, bucket_mb=0.5)
    assert [[p[0] for p in b.params] for b in c.buckets] == [["4.bias", "4.weight", "2.bias", "2.weight"],
                                                              ["0.bias", "0.weight"]]
    assert sum(b.nbytes for b in c.buckets) == 4 * sum(p.numel() for p in model.parameters())
    fracs = [b.ready_frac for b in c.buckets]
    assert all(0 <= f <= 1 for f in fracs) and fracs == sorted(fracs)
    assert c.fwd_s_per_sample > 0 and c.bwd_s_per_sample > 0


def test_calibration_round_trips_through_json(tmp_path):
    cal = synth(buckets=2, fwd=0.01, bwd=0.02, alpha=1e-5, beta=1e-9, add=1e-10, opt=2e-10)
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal


def test_a_user_model_needs_its_input_shape():
    with pytest.raises(ConfigError, match="shape of one input sample"):
        C.load_model("torch.nn:Identity")
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        C.load_model("nope")


@pytest.mark.parametrize("text,match", [("foo://", "scheme must be one of"), ("ps://?shards=0", "shards must be"),
                                        ("ps://?mode=eventual", "mode must be"), ("ring://?chunk_mb=4", "unknown option")])
def test_bad_regimes_are_refused_by_name(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_regime(text)


def test_straggler_specs():
    assert Straggler.parse("lognormal:0.2+slow:0.05:2") == Straggler(0.2, 2, 0.05, 1.0)
    with pytest.raises(ConfigError, match="expected none, lognormal"):
        Straggler.parse("gamma:2")


# ----- the command ------------------------------------------------------------------------------------
def test_commlab_plan_writes_a_table_plots_and_a_recommendation_up_to_4096_workers(tmp_path):
    cal = synth(params=64, numel=65536, buckets=2, fwd=2e-4, bwd=4e-4, alpha=30e-6, beta=0.5e-9, add=1e-10,
                opt=1e-10)
    cal.save(tmp_path / "cal.json")
    out = tmp_path / "plan"
    argv = [sys.executable, "-m", "commlab.tools.cli", "plan", "--calibration", str(tmp_path / "cal.json"), "--workers",
            "8,4096", "--link", "10gbit", "--batch-size", "32", "--out", str(out), "--max-shards", "16",
            "--straggler", "lognormal:0.05", "--compress", "none"]  # compression: tests/test_plan_compress.py
    res = run_group(argv, 180, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    text = (out / "plan.md").read_text()
    assert "### Recommendation" in text and "**N = 4096:" in text and "### Crossovers" in text
    data = json.loads((out / "plan.json").read_text())
    at_4096 = [r for r in data["results"] if r["workers"] == 4096 and "error" not in r]
    assert {r["regime"] for r in at_4096} >= {"ring", "ps-sync-K8", "ps-async-K8"}
    assert all(math.isfinite(r["step_s"]) and r["step_s"] > 0 for r in at_4096)
    assert (out / "plan.png").stat().st_size > 0


def test_the_bench_reports_at_scale_section_comes_from_its_bandwidth_records():
    from commlab.plan.recommend import at_scale_from_bench
    recs = [{"kind": "regime", "regime": name, "workers": 2, "size_bytes": size, "time_us": (a + size * b) * 1e6,
             "wrong": 0}
            for size in (65536, 2**20, 8 * 2**20)
            for name, a, b in (("gloo", 100e-6, 0.8e-9), ("ring-tcp", 60e-6, 0.5e-9), ("ps-1", 150e-6, 1.2e-9))]
    text = "\n".join(at_scale_from_bench(recs, "tiny", 8))
    assert "## At scale (simulated)" in text and "| 4096 | ring |" in text and "**N = 512:" in text
    assert "Not available for this run: no bandwidth record" in "\n".join(at_scale_from_bench([], "tiny", 8))


# ----- the validation driver's arithmetic (bench/plan_validate.py; the runs themselves need root) ---------
def test_validation_ranks_only_pairs_whose_measured_difference_is_outside_its_interval():
    from bench.plan_validate import iqr_rank_check, rank_check
    pt = lambda regime, steps, pred: {"ok": True, "rate": "1gbit", "workers": 2, "regime": regime, "steps_s": steps,
                                      "median": sorted(steps)[len(steps) // 2], "p25": min(steps), "p75": max(steps),
                                      "predicted": pred}
    points = [pt("ring", [0.9, 1.0, 1.1, 1.0, 0.95], 0.8), pt("gloo", [1.0, 1.05, 1.15, 0.92, 1.1], 0.7),  # not ranked
              pt("ps-1", [3.0, 2.9, 3.1, 3.05, 2.95], 2.9), pt("ps-2", [1.5, 1.4, 1.6, 1.45, 1.55], 3.5)]  # ps-2 wrong
    checked, agree, misses = rank_check(points)
    assert (checked, agree) == (5, 4) and misses == ["1gbit N=2: ps-1 vs ps-2"]
    assert iqr_rank_check(points) == (5, 4)
    # 8% apart in every step: clear from the steps alone, not once each point carries a launch's spread
    close = [pt("ring", [1.0, 1.01, 0.99, 1.0, 1.0], 1.0), pt("gloo", [1.08, 1.09, 1.07, 1.08, 1.08], 0.9)]
    assert rank_check(close, launch_sigma=0.0) == (1, 0, ["1gbit N=2: ring vs gloo"])
    assert rank_check(close) == (0, 0, [])


def test_validation_table_replaces_only_what_lies_between_the_markers():
    from bench.plan_validate import BEGIN, END, between_markers
    text = f"intro\n{BEGIN}\nold\n{END}\nafter\n"
    assert between_markers(text, ["| a |", "| b |"]) == f"intro\n{BEGIN}\n| a |\n| b |\n{END}\nafter\n"
    with pytest.raises(ValueError, match="no <!-- plan-validate:begin -->"):
        between_markers("no markers", [])
