"""The benchmark harness: its wrong-count catches a wrong result, a failing regime is reported
while the rest run, and a tiny end-to-end run writes every section of the report.

Each job is real processes on loopback (the launcher, ranks, sockets); the tests assert
counts and contents, never a time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import bandwidth, bw_worker, records, verdict
from bench import netns as links
from bench import regimes as R
from bench.report import SECTIONS

from conftest import run_group, zygote_children

ROOT = Path(__file__).resolve().parent.parent


def tiny_bw(regimes, **kw) -> bandwidth.BandwidthConfig:
    return bandwidth.BandwidthConfig(regimes, workers=2, sizes=[4096, 12], repeat_bytes=0, min_iters=3, max_iters=3,
                                     warmup=1, ceilings=(), job_timeout=60, **{"launches": 1, **kw})


# ----- one process: the check's arithmetic --------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 13, 1000])
def test_allreduce_reference_is_the_float64_sum_of_the_inputs(world, count):
    inputs = []
    for r in range(world):
        t = torch.empty(count)
        bw_worker.fill_input(t, r)
        inputs.append(t.double())
    expected = torch.stack(inputs).sum(0) if count else torch.empty(0, dtype=torch.float64)
    assert torch.equal(bw_worker.allreduce_reference(count, world).double(), expected)
    assert torch.equal(bw_worker.mean_input(count, world).double(), expected / world)


def test_count_wrong_counts_elements_and_nan():
    ref = bw_worker.allreduce_reference(100, 2)
    got = ref.clone()
    assert bw_worker.count_wrong(got, ref) == 0
    got[3] += 1e-3
    got[50] = float("nan")
    assert bw_worker.count_wrong(got, ref) == 2
    assert bw_worker.count_wrong(ref, bw_worker.corrupt(ref)) == 1


def test_busbw_factors_and_iterations():
    assert records.bus_factor("allreduce", 2) == 1.0
    assert records.bus_factor("allreduce", 4) == 1.5
    assert records.bus_factor("pushpull", 4) == 1.0
    assert records.bus_factor("noop", 4) == 0.0
    assert bandwidth.iters_for(2**20, 2**24, 5, 100) == 16
    assert bandwidth.iters_for(4, 2**24, 5, 100) == 100
    assert bandwidth.iters_for(2**30, 2**24, 5, 100) == 5


def test_ranks_results_combine_over_the_sizes_every_rank_finished(tmp_path):
    out = tmp_path / "bw.json"
    row = lambda case, size, times, wrong: {"case": case, "size_bytes": size, "count": size // 4, "times_s": times,
                                            "cpu_s": times, "wrong": wrong}
    write = lambda path, rows: path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # metrics lines
    write(out, [row("a", 4, [1.0, 5.0], 1), row("b", 4, [1.0, 1.0], 0), row("a", 8, [1.0], 0),
                {"case": "c", "setup_error": "ConfigError: no"},
                {"case": "b", "failed": "PeerLost: rank 1", "at": 20.0}, {"facts": {"a": {"scheme": "x"}}}])
    write(tmp_path / "bw.json.rank1", [row("a", 4, [2.0, 3.0], 2), row("b", 4, [2.0, 0.5], 0),  # cut short: no size 8
                                       {"case": "a", "failed": "CommTimeout: b broke first", "at": 10.0}])
    got = bandwidth.combine_ranks(out, 2)
    assert sorted(got.rows) == [("a", 4), ("b", 4)]
    assert got.rows[("a", 4)][1:] == ([2.0, 5.0], [1.0, 5.0], 3)  # slowest rank per iteration; rank 0's CPU
    assert got.rows[("b", 4)][1] == [2.0, 1.0]
    assert got.setup_errors == {"c": "ConfigError: no"} and got.facts == {"a": {"scheme": "x"}}
    assert got.failed == ("a", "CommTimeout: b broke first")  # the earliest failure names the culprit


def test_cases_share_one_job_and_take_turns_in_the_same_order_on_every_rank(monkeypatch):
    cfg = bandwidth.BandwidthConfig(["gloo", "ring-tcp", "ps-1", "noop"], 2, [4096], ceilings=("tcp-duplex", "memcpy"))
    jobs, failures = bandwidth.plan(cfg)
    assert failures == [] and len(jobs) == 1
    assert [c["name"] for c in jobs[0][0]] == ["gloo", "ring-tcp", "ps-1", "noop", "tcp-duplex", "memcpy"]
    names = ["a", "b", "c"]
    assert [bw_worker.turns(names, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                             ["a", "b", "c"]]
    # a second allreduce:// regime needs a process group of its own: a job of its own
    monkeypatch.setitem(R.BANDWIDTH, "gloo-2", R.BandwidthEntry("allreduce://?backend=gloo&timeout=30", "allreduce"))
    jobs, _ = bandwidth.plan(bandwidth.BandwidthConfig(["gloo", "noop", "gloo-2"], 2, [4096], ceilings=()))
    assert [[c["name"] for c in cases] for cases, _ in jobs] == [["gloo", "noop"], ["gloo-2"]]


def test_a_bandwidth_regime_given_as_a_url_is_driven_by_its_scheme():
    e = R.bandwidth_entry("ring://?transport=shm&chunk_mb=1")
    assert (e.url, e.method, e.loopback_only, e.one_size_per_job) == ("ring://?transport=shm&chunk_mb=1", "allreduce",
                                                                      True, False)
    assert not R.bandwidth_entry("ring://?transport=tcp&host=auto&insecure=1").loopback_only
    assert not R.bandwidth_entry("ring://?transport=torch").loopback_only
    ps = R.bandwidth_entry("ps://?shards=2&mode=sync")
    assert (ps.method, ps.one_size_per_job) == ("pushpull", True)
    assert R.bandwidth_entry("allreduce://?backend=nccl").needs_cuda
    assert R.bandwidth_entry("noop://").method == "noop"
    assert R.pick(R.BANDWIDTH, ["gloo", "ring://?chunk_mb=2"], "bandwidth") == ["gloo", "ring://?chunk_mb=2"]
    with pytest.raises(ValueError, match=r"unknown bandwidth regime\(s\) \['ring-fast'\].*or a regime URL"):
        R.pick(R.BANDWIDTH, ["gloo", "ring-fast"], "bandwidth")
    _, failures = bandwidth.plan(bandwidth.BandwidthConfig(["nosuch://"], 2, [4096], ceilings=()))
    assert [(f["regime"], f["status"]) for f in failures] == [("nosuch://", "unavailable")]
    # planned like the table's own: a URL that shares the job with gloo, a ps:// URL over --link alone per size
    jobs, failures = bandwidth.plan(bandwidth.BandwidthConfig(["gloo", "ring://?transport=ipc&chunk_mb=1"], 2, [4096],
                                                              ceilings=()))
    assert failures == [] and [c["url"] for c in jobs[0][0]] == ["allreduce://?backend=gloo",
                                                                  "ring://?transport=ipc&chunk_mb=1"]


def test_the_start_line_holds_every_rank_and_names_the_one_that_never_came():
    import threading
    from datetime import timedelta
    import torch.distributed as dist
    import commlab
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    passed = []

    def rank(r):
        client = dist.TCPStore("127.0.0.1", store.port, 3, False, timeout=timedelta(seconds=10)) if r else store
        bw_worker.start_line(client, r, 2, 1, 10.0, "case x")
        passed.append(r)

    t = threading.Thread(target=rank, args=(1,))
    t.start()
    t.join(0.3)
    assert passed == []  # rank 1 waits for rank 0
    rank(0)
    t.join(10)
    assert sorted(passed) == [0, 1]
    with pytest.raises(commlab.CommTimeout, match=r"rank 0: rank\(s\) \[1, 2\] did not reach the start of case y"):
        bw_worker.start_line(store, 0, 3, 2, 0.3, "case y")


def test_servers_planned_on_loopback_move_to_their_namespaces():
    from bench.jobs import place_servers
    ls = links.Links(2, "1gbit", tag="clplan")  # not entered: nothing is created
    url = "ps://?mode=sync&endpoints=tcp://127.0.0.1:4001,tcp://127.0.0.1:4002"
    argvs = [["--bind", "tcp://127.0.0.1:4001", "--shard", "0/2"], ["--bind", "tcp://127.0.0.1:4002", "--shard", "1/2"]]
    url2, argvs2 = place_servers(url, argvs, ls, first_host=2)
    assert url2 == "ps://?mode=sync&endpoints=tcp://10.77.0.3:4001,tcp://10.77.0.4:4002"
    assert argvs2[1] == ["--bind", "tcp://10.77.0.4:4002", "--shard", "1/2", "--insecure"]
    with pytest.raises(ValueError, match="cannot place it"):
        place_servers(url, [["--bind", "ipc:///tmp/x"]], ls, first_host=2)
    # as planned: every server on port 0, told apart by their order in the URL
    url = "ps://?mode=sync&endpoints=tcp://127.0.0.1:0,tcp://127.0.0.1:0"
    argvs = [["--bind", "tcp://127.0.0.1:0", "--shard", f"{i}/2"] for i in range(2)]
    url2, argvs2 = place_servers(url, argvs, ls, first_host=2)
    assert url2 == "ps://?mode=sync&endpoints=tcp://10.77.0.3:0,tcp://10.77.0.4:0"
    assert [a[1] for a in argvs2] == ["tcp://10.77.0.3:0", "tcp://10.77.0.4:0"]


def test_rates_parse_in_tc_units():
    assert links.parse_rate("1gbit") == 125e6
    assert links.parse_rate("100mbps") == 100e6
    with pytest.raises(ValueError, match="expected a tc rate"):
        links.parse_rate("fast")


# ----- one process: verdicts from samples ------------------------------------------------------------
@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_a_clear_difference_names_the_winner(seed, paired):
    rng = np.random.default_rng(100 + seed)
    fast = 1.0 + 0.1 * rng.random(60)
    slow = 2.0 + 0.2 * rng.random(60)
    v = verdict.compare("ring", fast, "gloo", slow, paired=paired, seed=seed)
    assert v.winner == "ring" and v.lo > 1.0 and v.lo <= v.ratio <= v.hi
    assert 1.8 < v.ratio < 2.3
    assert v.text().startswith("ring faster than gloo, ")
    back = verdict.compare("gloo", slow, "ring", fast, paired=paired, seed=seed)
    assert back.winner == "ring" and back.hi < 1.0
    assert back.text().startswith("ring faster than gloo, ")  # told with the winner first either way
    assert back.oriented().ratio == pytest.approx(v.ratio)


@pytest.mark.parametrize("seed", range(6))
def test_overlapping_samples_are_indistinguishable(seed):
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 0.5, 40)
    other = base * rng.lognormal(0.02, 0.5, 40)  # 2% apart in the median, spread 50%
    v = verdict.compare("a", base, "b", other, paired=False, seed=seed)
    assert v.winner is None and v.lo < 1.0 < v.hi, v
    assert "indistinguishable on this machine" in v.text()


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_equal_samples_never_name_a_winner(seed, paired):
    rng = np.random.default_rng(seed)
    x = rng.lognormal(0.0, 1.0, int(rng.integers(3, 80)))
    for stat in ("median", "mean"):
        v = verdict.compare("a", x, "b", x.copy(), paired=paired, seed=seed, stat=stat)
        assert v.winner is None and v.ratio == 1.0, v
        if paired:  # the same iterations drawn for both: every resample's ratio is exactly 1
            assert v.lo == v.hi == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_launches_widen_the_interval_only_when_they_disagree(seed):
    """Two regimes 10% apart in every iteration of launches 0 and 2, while in launch 1 a's median is
    1.5x its usual: iid over iterations names a; resampled launch by launch, the launch that
    disagrees makes it indistinguishable. Launches that agree keep the winner; equal samples never
    name one; the launch spread is ~0 for launches that agree and near the truth otherwise."""
    rng = np.random.default_rng(seed)
    noise = lambda n: 1 + 0.05 * rng.random(n)
    b = np.concatenate([1.1 * noise(20) for _ in range(3)])
    a_agree = np.concatenate([noise(20) for _ in range(3)])
    a_off = np.concatenate([noise(20), 1.5 * noise(20), noise(20)])
    sizes = [20, 20, 20]
    assert verdict.compare("a", a_off, "b", b, paired=True, seed=seed).winner == "a"
    v = verdict.compare("a", a_off, "b", b, paired=True, seed=seed, clusters=sizes)
    assert v.winner is None and v.lo < 1.0 < v.hi, v
    assert verdict.compare("a", a_agree, "b", b, paired=True, seed=seed, clusters=sizes).winner == "a"
    v = verdict.compare("a", a_off, "b", a_off.copy(), paired=True, seed=seed, clusters=sizes)
    assert v.winner is None and v.lo == v.hi == 1.0
    with pytest.raises(ValueError, match="add up"):
        verdict.compare("a", a_off, "b", b, paired=True, clusters=[20, 20])
    with pytest.raises(ValueError, match="paired"):
        verdict.compare("a", a_off, "b", b, paired=False, clusters=sizes)
    agree = [[noise(40) for _ in range(3)] for _ in range(6)]
    assert verdict.launch_sigma(agree) < 0.01
    shifted = [[np.exp(m) * noise(40) for m in rng.normal(0, 0.2, 3)] for _ in range(30)]
    assert 0.12 < verdict.launch_sigma(shifted) < 0.3
    # one launch each side: the launch effect widens the interval around the same ratio
    x, y = noise(60), 1.1 * noise(60)
    plain = verdict.compare("x", x, "y", y, paired=False, seed=seed)
    wide = verdict.compare("x", x, "y", y, paired=False, seed=seed, launch_sigma=0.2)
    assert plain.winner == "x" and wide.winner is None and wide.ratio == plain.ratio
    assert wide.lo < plain.lo and wide.hi > plain.hi


def test_every_pair_in_the_listed_order_and_the_launch_spread_floor():
    rng = np.random.default_rng(7)
    noise = lambda n: 1 + 0.05 * rng.random(n)
    samples = {"gloo": 2.0 * noise(40), "ring": noise(40), "ps": 2.0 * noise(40)}
    vs = verdict.pairs(samples, paired=False)
    assert [(v.a, v.b) for v in vs] == [("gloo", "ring"), ("gloo", "ps"), ("ring", "ps")]
    assert [v.winner for v in vs] == ["ring", None, "ring"]  # gloo and ps: the same law, never a winner
    assert verdict.pairs({"only": [1.0]}, paired=True) == []
    # a one-launch comparison never carries less than the machine's pooled spread
    assert verdict.spread(0.02) == verdict.LAUNCH_SIGMA_FLOOR and verdict.spread(0.3) == 0.3
    x, y = noise(60), 1.15 * noise(60)
    assert verdict.compare("x", x, "y", y, paired=False, launch_sigma=verdict.spread(0.0)).winner is None
    assert verdict.compare("x", x, "y", 2 * y, paired=False, launch_sigma=verdict.spread(0.0)).winner == "x"


def test_time_to_target_of_an_async_regime_carries_the_spread_of_its_steps():
    from bench.report import steps_sigmas
    rng = np.random.default_rng(3)
    step = lambda n: 0.1 * (1 + 0.05 * rng.random(n))
    a, b = step(60), step(60)
    # the same step time; the async regime took 50 steps where the sync one took 70 (one draw of 30-70)
    plain = verdict.compare("sync", a, "async", b, paired=False, stat="mean", scale_a=70, scale_b=50)
    assert plain.winner == "async"  # step times alone: 1.4x, confidently
    s = steps_sigmas([{"regime": "sync", "kind": "sync"}, {"regime": "async", "kind": "async"},
                      {"regime": "local", "kind": "reference"}])
    assert s == {"sync": 0.0, "async": verdict.STEPS_SIGMA_ASYNC, "local": 0.0}
    with_steps = verdict.compare("sync", a, "async", b, paired=False, stat="mean", scale_a=70, scale_b=50,
                                 steps_sigma_a=s["sync"], steps_sigma_b=s["async"])
    assert with_steps.ratio == pytest.approx(plain.ratio) and with_steps.winner is None
    assert with_steps.lo < plain.lo and with_steps.hi > plain.hi
    # a difference far beyond that spread still names its winner; two sync regimes keep their narrow interval
    assert verdict.compare("sync", a, "async", b, paired=False, stat="mean", scale_a=70, scale_b=10,
                           steps_sigma_b=s["async"]).winner == "async"
    assert verdict.compare("x", a, "y", b, paired=False, stat="mean", scale_a=70, scale_b=70,
                           steps_sigma_a=0.0, steps_sigma_b=0.0) == verdict.compare("x", a, "y", b, paired=False,
                                                                                    stat="mean", scale_a=70, scale_b=70)


def test_merged_launches_keep_every_sample_in_launch_order():
    def rec(job, times, wrong=0):
        return bandwidth.summarize("gloo", "allreduce://?backend=gloo", "regime", "allreduce", 2,
                                   {"size_bytes": 4096, "warmup": 2, "job": job}, times, wrong, "loopback", [1e-6])
    parts = [rec("bw0-l0", [1e-3, 2e-3]), rec("bw0-l1-1", [3e-3, 4e-3, 5e-3], wrong=1), rec("bw0-l2", [6e-3])]
    single = rec("bw1", [7e-3])
    merged = bandwidth.merge_launches(parts + [dict(single, regime="ring-tcp")])
    m = next(r for r in merged if r["regime"] == "gloo")
    assert m["samples_us"] == [1000.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0] and m["launch_sizes"] == [2, 3, 1]
    assert m["job"] == "bw0" and m["wrong"] == 1 and m["iters"] == 6 and m["time_us"] == pytest.approx(3500.0)
    assert m["launch_jobs"] == ["bw0-l0", "bw0-l1-1", "bw0-l2"]
    assert next(r for r in merged if r["regime"] == "ring-tcp")["samples_us"] == [7000.0]
    assert bandwidth.launch_groups(merged) == []  # a wrong result's times do not count
    assert [[list(p) for p in g] for g in bandwidth.launch_groups([dict(m, wrong=0)])] == [[[1000.0, 2000.0],
                                                                             [3000.0, 4000.0, 5000.0], [6000.0]]]


def test_launches_that_disagree_are_shown_launch_by_launch_and_only_for_indistinguishable_lines():
    """Two launches: in one ring is 5x faster than gloo, in the other they tie. The run's interval, which
    resamples launches, reaches across 1 (≈); the note gives each launch's own verdict. Lines the run
    settles, and launches that agree, get no note."""
    from bench.report import launch_notes, size_verdicts
    rng = np.random.default_rng(3)
    noise = lambda n: 1 + 0.05 * rng.random(n)

    def records(gloo, ring, sizes=(30, 30)):
        def rec(regime, times):
            merged = bandwidth.merge_launches([
                bandwidth.summarize(regime, "x://", "regime", "allreduce", 2, {"size_bytes": 4096, "warmup": 2,
                                    "job": f"bw0-l{i}"}, list(part), 0, "loopback", [1e-6])
                for i, part in enumerate(np.split(np.asarray(times), np.cumsum(sizes)[:-1]))])
            return merged[0]
        return [rec("gloo", gloo), rec("ring", ring)]

    ring = 1e-4 * noise(60)
    gloo = np.concatenate([1e-4 * noise(30), 5e-4 * noise(30)])  # launch 1: a tie; launch 2: ring 5x faster
    recs = records(gloo, ring)
    (v,) = size_verdicts(recs, 4096, each_pair=True)
    assert v.winner is None, v  # two launches this far apart: the run cannot say
    (note,) = launch_notes(recs)
    assert note.startswith("- bandwidth 4 KiB, gloo vs ring: launch 1 "), note
    assert re.search(r"launch 1 (ring [=≈] gloo|gloo [=≈] ring) ", note), note  # a tie: equivalent or indistinguishable
    assert 4.5 < float(re.search(r"launch 2 ring > gloo ([0-9.]+)x", note).group(1)) < 5.5, note
    # both launches 5x: the run names ring, and there is nothing to explain
    assert size_verdicts(records(5e-4 * noise(60), ring), 4096, each_pair=True)[0].winner == "ring"
    assert launch_notes(records(5e-4 * noise(60), ring)) == []
    # the same law on both sides: no launch names a winner, so no note
    assert launch_notes(records(1e-4 * noise(60), ring)) == []
    with pytest.raises(ValueError, match="launches"):
        verdict.per_launch("a", [1.0, 2.0], "b", [1.0, 2.0], [1, 2])


def test_verdicts_against_the_best_and_their_arguments():
    vs = verdict.against_best({"slow": [3.0] * 5 + [3.1] * 5, "fast": [1.0] * 5 + [1.1] * 5,
                               "mid": [2.0] * 5 + [2.1] * 5}, paired=True)
    assert [(v.a, v.b, v.winner) for v in vs] == [("fast", "mid", "fast"), ("fast", "slow", "fast")]
    # time to a target: steps x mean step; fewer steps can win over faster steps
    v = verdict.compare("a", [1.0, 1.1] * 10, "b", [0.5, 0.55] * 10, paired=False, stat="mean",
                        scale_a=10, scale_b=40)
    assert v.winner == "a" and v.ratio == pytest.approx(2.0)
    assert verdict.against_best({"only": [1.0]}, paired=True) == []
    with pytest.raises(ValueError, match="equal lengths"):
        verdict.compare("a", [1.0, 2.0], "b", [1.0], paired=True)
    with pytest.raises(ValueError, match="both sides"):
        verdict.compare("a", [], "b", [1.0], paired=False)
    with pytest.raises(ValueError, match="positive"):
        verdict.compare("a", [0.0], "b", [1.0], paired=False)


# ----- several processes -----------------------------------------------------------------------------
@pytest.mark.multiproc
def test_a_corrupted_reference_counts_wrong_results(tmp_path):
    recs, failures, _ = bandwidth.run(tiny_bw(["gloo"], corrupt=True), tmp_path, bandwidth.Budget.of(120))
    assert failures == []
    assert [r["size_bytes"] for r in recs] == [4096, 12]
    # one shifted element per check, 3 timed checks per size, on each of the 2 ranks
    assert [r["wrong"] for r in recs] == [6, 6]


@pytest.mark.multiproc
def test_a_failing_regime_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    # noop:// has no allreduce_async: the ranks start, then fail on their first exchange
    monkeypatch.setitem(R.BANDWIDTH, "broken", R.BandwidthEntry("noop://", "allreduce"))
    monkeypatch.setitem(R.BANDWIDTH, "gone", R.BandwidthEntry("gone://", "allreduce"))  # a scheme nobody registered
    missing = ["gone"]
    recs, failures, _ = bandwidth.run(tiny_bw(["broken", "nccl", *missing, "noop"]), tmp_path,
                                      bandwidth.Budget.of(120))
    by_name = {f["regime"]: f for f in failures}
    for name in missing:
        assert by_name[name]["status"] == "unavailable" and "unknown exchanger scheme" in by_name[name]["error"]
    assert by_name["broken"]["status"] == "failed"
    assert "allreduce_async" in by_name["broken"]["error"]
    if not torch.cuda.is_available():
        assert by_name["nccl"]["status"] == "unavailable" and "CUDA" in by_name["nccl"]["error"]
    assert {r["regime"] for r in recs} == {"noop"}
    assert all(r["wrong"] == 0 for r in recs)


def _children_mentioning(text: str) -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{p.name}: {cmd}")
    return found


@pytest.mark.multiproc
def test_a_tiny_run_writes_every_section_and_leaves_no_process(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "commlab.tools.cli", "bench", "--out", str(out), "--sizes", "4K,64K",
            "--bw-regimes", "noop", "--conv-regimes", "local,ddp,gloo", "--ceilings", "memcpy",
            "--max-iters", "3", "--model", "tiny", "--steps", "6", "--eval-every", "3", "--target-acc", "0.05",
            "--scale-regimes", "gloo", "--scale-workers", "2,3", "--scale-steps", "5", "--no-probes", "--budget-s", "150",
            "--workloads", "charlm", "--workloads-budget-s", "0"]  # the workloads' phase, every run skipped
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    forked = zygote_children()  # none of this test's: the ones a running bench would add must be gone at the end
    # on SIGTERM the bench stops its jobs (each a session of its own, out of reach of a SIGKILL to
    # the bench's group) and deletes its namespaces: give it 5 s for that before the SIGKILL
    done = run_group(argv, 200, "commlab bench (tiny run)", grace=5, env=env, cwd=ROOT, capture_output=True,
                     text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    for what in ("N = 2 workers", "[min–max]", "p90", "Verdict: fastest exchange per size",
                 "Verdict: fastest to accuracy", "Verdict: the cost of staleness", "gloo: **coincides** with local://",
                 "ddp: **coincides** with local://"):
        assert what in report, (what, report[report.index("## Failed"):report.index("## Bandwidth")],
                                (out / "logs" / "conv-gloo.log").read_text()[-2000:])
    assert "- gloo: step at N=3 / N=2: " in report and "oversubscribed" in report
    assert "commlab bench: workload charlm gloo: skipped" in done.stderr
    for png in ("busbw.png", "convergence.png", "split.png", "scaling.png"):
        assert (out / png).stat().st_size > 10_000, png
    bw = json.loads((out / "bandwidth.json").read_text())
    noop = [r for r in bw if r["regime"] == "noop"]
    assert [r["size_bytes"] for r in noop] == [4096, 65536] and all(r["wrong"] == 0 for r in noop)
    for key in ("regime", "workers", "size_bytes", "time_us", "time_us_min", "time_us_max", "algbw_gbps",
                "busbw_gbps", "wrong"):
        assert key in noop[0]
    man = json.loads((out / "manifest.json").read_text())
    assert man["config"]["bandwidth"]["sizes"] == [4096, 65536]
    assert {"revision", "dirty"} <= set(man["git"])
    assert {"cuda", "nccl_version", "gpudirect_rdma", "link"} <= set(man["transport"])
    assert _children_mentioning(str(out)) == [] and zygote_children() <= forked


@pytest.mark.netns
@pytest.mark.skipif(links.link_unavailable_reason() is not None, reason="needs root and iproute2")
def test_capped_links_carry_tcp_and_vanish(tmp_path):
    tag = f"clt{os.getpid() % 100000}"  # unique: test runs side by side must not share namespaces

    def ours():
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [l for l in listed.splitlines() if l.split()[0] in {f"{tag}hub", f"{tag}h0", f"{tag}h1"}]
    with links.Links(2, "200mbit", tag=tag) as ls:
        assert len(ours()) == 3
        cfg = bandwidth.BandwidthConfig(["gloo"], 2, [65536], 0, 3, 3, 1, ("tcp-oneway",), 60, launches=1)
        recs, failures, _ = bandwidth.run(cfg, tmp_path, bandwidth.Budget.of(120), links=ls)
    assert ours() == []
    assert failures == []
    assert {r["regime"] for r in recs} == {"gloo", "tcp-oneway"}
    assert all(r["wrong"] == 0 and r["link"] == "200mbit veth+tbf" for r in recs)


def test_staleness_is_read_from_the_servers_last_stats_lines(tmp_path):
    log = tmp_path / "job.log"
    log.write_text('commlab server shard 0/2 mode=ssp listening on tcp://127.0.0.1:1\n'
                   'commlab server shard 0/2: {"staleness": {"0": 5}, "updates": 5}\n'
                   'commlab server shard 1/2: {"staleness": {"0": 1}}\n'
                   'commlab server shard 0/2: {"staleness": {"0": 2, "3": 1}, "updates": 3}\n')
    from bench.convergence import read_staleness
    assert sorted(read_staleness(log)) == [0, 0, 0, 3]
    assert read_staleness(tmp_path / "none.log") is None
    assert read_staleness(log, key="clock_gap") is None  # no server reported it
    log.write_text('commlab server shard 0/1: {"staleness": {"0": 2}, "clock_gap": {"0": 3, "1": 1}}\n')
    assert sorted(read_staleness(log, key="clock_gap")) == [0, 0, 0, 1]


def test_the_staleness_verdict_states_equal_samples_and_shows_the_ssp_bound():
    from bench.report import staleness_verdict
    common = {"kind": "async", "test_acc": 0.5, "test_loss": 1.5, "samples": 640,
              "step_s_samples": [0.01, 0.011, 0.012]}
    sync = dict(common, regime="ps-sync", kind="sync", url="ps://?shards=1&mode=sync", lr=0.1, test_loss=1.0)
    ssp = dict(common, regime="ps-ssp-2", url="ps://?shards=1&mode=ssp&staleness=2", lr=0.05,
               staleness=[0, 1, 3, 1], clock_gap=[0, 2, 1, 2])
    broken = dict(ssp, regime="ps-ssp-broken", clock_gap=[0, 3])
    lines = staleness_verdict([sync, ssp, broken])
    assert "at equal samples (640 samples, lr 0.1)" in lines[0]
    assert "(+0.5000 against ps-sync)" in lines[1] and "lr 0.05 per update, 4 updates" in lines[1]
    assert "SSP's bound S = 2: **max clock gap 2**." in lines[1] and "Version gap" in lines[1]
    assert "indistinguishable on this machine" in lines[1]  # the same step times
    assert "ABOVE the bound" in lines[2]


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a regime that fails here: NCCL without CUDA")
def test_a_training_run_that_fails_is_reported_and_the_reference_still_runs(tmp_path, monkeypatch):
    from bench import convergence
    monkeypatch.setitem(R.CONVERGENCE, "nccl", R.ConvergenceEntry("allreduce://?backend=nccl", "sync"))
    cfg = convergence.ConvergenceConfig(["nccl", "local"], model="tiny", steps=4, eval_every=2, job_timeout=60)
    summaries, failures, curves = convergence.run(cfg, tmp_path, bandwidth.Budget.of(120))
    assert [f["regime"] for f in failures] == ["nccl"]
    assert failures[0]["status"] == "failed" and "CUDA" in failures[0]["error"]
    assert [s["regime"] for s in summaries] == ["local"] and summaries[0]["steps"] == 4
    assert len(curves["local"]) == 4


@pytest.mark.multiproc
def test_a_run_its_deadline_stops_while_it_steps_is_too_slow_to_judge_not_failed(tmp_path):
    """A training run that cannot finish by its deadline (a million steps; 2 s on a quiet machine, stretched by
    a slowdown fixed at 1.5 for the test) is reported as too slow to judge here now, with the deadline it had,
    not as failed; the report lists it after the failures and says what it means."""
    from bench import convergence, report
    cfg = convergence.ConvergenceConfig(["local"], model="tiny", steps=10**6, eval_every=10**6, job_timeout=2,
                                        slowdown=1.5)
    summaries, failures, _ = convergence.run(cfg, tmp_path, bandwidth.Budget.of(120))
    assert summaries == [] and [(f["regime"], f["status"]) for f in failures] == [("local", bandwidth.TOO_SLOW)]
    assert failures[0]["deadline_s"] == 3.0 and failures[0]["error"].startswith(bandwidth.TOO_SLOW + ": stopped by")
    assert "deadline 3s: 2s on a quiet machine x 1.50" in failures[0]["error"]
    lines = report.failures_section(failures + [records.failure("convergence", "ring", "boom")])
    rows = [line for line in lines if line.startswith("| convergence")]
    assert "| ring |" in rows[0] and "| failed |" in rows[0] and f"| {bandwidth.TOO_SLOW} |" in rows[1]
    assert any(f"1 run(s) **{bandwidth.TOO_SLOW}**" in line and "not failures" in line for line in lines)


def test_a_run_its_deadline_stops_after_long_silence_is_stuck_which_is_a_failure(tmp_path):
    from bench.jobs import JobResult
    log = tmp_path / "job.log"
    log.write_text("$ the job\nstep 3\n")
    stopped, budget = JobResult(124, 200.0, log, True), bandwidth.Budget.of(100)
    assert bandwidth.stuck_after(200.0) == 50.0 and bandwidth.stuck_after(20.0) == 30.0
    assert budget.outcome(stopped)[0] == budget.outcome(stopped, stuck_s=49.0)[0] == bandwidth.TOO_SLOW
    status, error = budget.outcome(stopped, stuck_s=51.0)
    assert status == "failed" and "no progress in its last 51s: stuck, not slow" in error
    assert bandwidth.Budget.of(0).outcome(stopped)[0] == "skipped"  # the benchmark's budget, not the run's deadline
    assert budget.outcome(JobResult(1, 5.0, log, False)) == ("failed", "step 3")


def test_convergence_and_script_rows_state_the_same_curve_figures_under_the_same_keys():
    """One training-curve summary (bench.curves.summary) under both: closed forms from two ranks' lines."""
    from bench import convergence, curves
    from bench import script_compare as sc
    line = lambda step, sent, comm, **kw: {"step": step, "loss": 1.0 / (step + 1), "time_s": 0.5 * (step + 1),
                                            "step_s": 0.5, "compute_s": 0.3, "comm_s": comm, "bytes_sent": sent, **kw}
    ranks = [[line(0, 100, 0.1), line(1, 100, 0.2, test_loss=0.4, test_acc=0.9)],
             [line(0, 300, 0.1), line(1, 300, 0.2)]]
    common = curves.summary(ranks)
    assert {k: common[k] for k in ("steps", "wall_s", "step_s_median", "comm_s_median", "bytes_per_step",
                                   "bytes_sent_total", "test_loss", "test_acc")} == \
        {"steps": 2, "wall_s": 1.0, "step_s_median": 0.5, "comm_s_median": pytest.approx(0.15),
         "bytes_per_step": 200.0, "bytes_sent_total": 800.0, "test_loss": 0.4, "test_acc": 0.9}
    conv = convergence.summarize("x", R.ConvergenceEntry("ring://", "sync"), ranks, target=0.5)
    row = sc.summarize(sc.Outcome(sc.Regime("x", "ring://", 2, ()), "ok", ranks=ranks))
    for key, value in common.items():
        assert conv[key] == row[key] == value, key
    assert conv["steps_to_target"] == 2 and row["final_loss"] == 0.5


def test_one_human_bytes_in_binary_units_for_bench_and_commlab():
    import commlab.core.metrics
    from bench import text
    assert text.human_bytes is commlab.core.metrics.human_bytes
    assert [text.human_bytes(n) for n in (None, 0, 1000, 1024, 1536, 4 * 2**20, 1.5 * 2**30, -2048)] == \
        ["—", "0 B", "1000 B", "1 KiB", "1.5 KiB", "4 MiB", "1.5 GiB", "-2 KiB"]


@pytest.mark.multiproc
def test_regimes_and_ceilings_take_turns_and_every_sum_is_exact(tmp_path):
    """Three ranks: gloo, two rings, a parameter server and the ceilings in one job, taking turns on each
    size (every rank must pick the same order, or a collective would pair with the wrong one and hang or
    sum wrong); sample i of every record comes from the same turn. Two launches of the job, two
    iterations each: every record has both, launch by launch."""
    cfg = bandwidth.BandwidthConfig(["gloo", "ring-tcp", "ring-ipc", "ps-1"], 3, [4096, 3 << 20], repeat_bytes=0,
                                    min_iters=2, max_iters=2, warmup=1, launches=2,
                                    ceilings=("tcp-oneway", "tcp-duplex", "zmq-tcp", "zmq-ipc", "memcpy"))
    recs, failures, facts = bandwidth.run(cfg, tmp_path, bandwidth.Budget.of(240))
    assert failures == []
    names = ["gloo", "ring-tcp", "ring-ipc", "ps-1", "tcp-oneway", "tcp-duplex", "zmq-tcp", "zmq-ipc", "memcpy"]
    assert sorted((r["regime"], r["size_bytes"]) for r in recs) == sorted((n, s) for n in names for s in cfg.sizes)
    assert [r["regime"] for r in recs if (r["wrong"], r["iters"], len(r["samples_us"]), r["workers"]) != (0, 4, 4, 3)] \
        == [], [(r["regime"], r["size_bytes"], r["wrong"], r["iters"]) for r in recs]
    assert {r["job"] for r in recs} == {"bw0"}  # one job, one set of processes per launch
    assert all(r["launch_sizes"] == [2, 2] and r["launch_jobs"] == ["bw0-l0", "bw0-l1"] for r in recs), recs[0]
    assert all(r["time_us_min"] <= r["time_us"] <= r["time_us_max"] for r in recs)
    assert {"ring-tcp", "gloo"} <= set(facts)


# ----- the cases: one record shape, ratios with their intervals ---------------------------------------
RATIO_LINE = r"{}: \d+\.\d\dx \[\d+\.\d\d, \d+\.\d\d\], (indistinguishable on this machine|\S+ faster)"


def test_a_record_holds_the_nccl_tests_columns_of_its_samples():
    r = records.record("train-step", "ring://", kind="regime", method="allreduce", workers=4, size_bytes=8000,
                       times_s=[0.003, 0.001, 0.002, 0.004], url="ring://", warmup=2, step_ms=2.5)
    assert set(records.FIELDS) <= set(r) and r["step_ms"] == 2.5
    assert (r["case"], r["count"], r["iters"], r["warmup"]) == ("train-step", 2000, 4, 2)
    assert r["samples_us"] == [3000.0, 1000.0, 2000.0, 4000.0]  # in the order taken
    assert (r["time_us"], r["time_us_min"], r["time_us_max"]) == pytest.approx((2500.0, 1000.0, 4000.0))
    assert r["time_us_p90"] == pytest.approx(4000.0)
    assert r["algbw_gbps"] == pytest.approx(8000 / 0.0025 / 1e9)
    assert (r["algbw_gbps_min"], r["algbw_gbps_max"]) == pytest.approx((8000 / 0.004 / 1e9, 8000 / 0.001 / 1e9))
    assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 1.5)  # 2(N-1)/N at N = 4
    assert records.record("x", "noop", kind="reference", method="noop", workers=2, size_bytes=4,
                          times_s=[1.0])["busbw_gbps"] == 0.0
    with pytest.raises(ValueError, match="no timed iterations"):
        records.record("x", "a", kind="regime", method="allreduce", workers=2, size_bytes=4, times_s=[])
    with pytest.raises(ValueError, match="kind must be one of"):
        records.record("x", "a", kind="other", method="allreduce", workers=2, size_bytes=4, times_s=[1.0])
    with pytest.raises(ValueError, match="would replace common ones"):
        records.record("x", "a", kind="peer", method="allreduce", workers=2, size_bytes=4, times_s=[1.0], iters=3)
    assert [records.method_of(u) for u in ("ring://", "allreduce://?backend=gloo", "ps://?shards=2", "local://")] \
        == ["allreduce", "allreduce", "pushpull", "noop"]


def test_ratio_lines_carry_the_interval_and_say_indistinguishable_around_one():
    import re
    v = verdict.compare("ddp", [2.0] * 6, "ring://", [1.0] * 6, paired=False)
    line = records.ratio_line("ring:// / ddp step time", v)
    assert line == "ring:// / ddp step time: 0.50x [0.50, 0.50], ring:// faster"
    rng = np.random.default_rng(0)
    x = rng.lognormal(0.0, 0.5, 30)
    same = records.ratio_line("b / a", verdict.compare("a", x, "b", x * rng.lognormal(0.0, 0.5, 30), paired=False))
    assert re.fullmatch(RATIO_LINE.format("b / a"), same) and same.endswith("indistinguishable on this machine")
    assert records.goal_text(v, 0.4) == "goal >= 0.4x: meets" and records.goal_text(v, 0.6) == "goal >= 0.6x: misses"


def test_each_case_compares_against_its_peer_in_the_ratio_it_names():
    from bench import gpu_sweep, ps_rounds, train_step
    rec = lambda case, name, times, **kw: records.record(case, name, kind="peer" if name in ("ddp", "rpc-default")
                                                         else "regime", method="allreduce", workers=2, size_bytes=40,
                                                         times_s=times, **kw)
    steps = [rec("train-step", "ddp", [0.2] * 4), rec("train-step", "allreduce://", [0.1] * 4),
             rec("train-step", "ps://", [0.3] * 4)]
    got = {label: v.ratio for label, v in train_step.verdicts(steps, ["allreduce://", "ps://"])}
    assert got == pytest.approx({"allreduce:// / ddp step time": 0.5, "ps:// / ddp step time": 1.5,
                                 "ps:// / allreduce:// step time": 3.0})
    rounds = [rec("ps-rounds", "ps-shm", [0.001, 0.003]), rec("ps-rounds", "rpc-default", [0.004, 0.004])]
    (label, v, goal), = ps_rounds.verdicts(rounds)
    assert (label, goal) == ("ps-shm / rpc-default rounds/s", 2.0) and v.ratio == pytest.approx(2.0)  # of the means
    sweep = [rec("gpu-sweep", "ring://", [0.5] * 3, url="ring://", device="cuda"),
             rec("gpu-sweep", "ring://", [0.4] * 3, url="ring://", device="cpu")]
    (label, v), = gpu_sweep.verdicts(sweep)
    assert label == f"ring:// {40 / 2**20:g} MiB CUDA / CPU algbw" and v.ratio == pytest.approx(0.8)


@pytest.mark.parametrize("case", ["train-step", "ps-rounds", "gpu-sweep"])
def test_each_case_is_a_subcommand_of_commlab_bench(case, capsys):
    from bench.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main([case, "--help"])
    assert exc.value.code == 0
    assert f"usage: commlab bench {case}" in capsys.readouterr().out


def _case(tmp_path, *argv, timeout=240):
    out = tmp_path / "case.json"
    done = run_group([sys.executable, "-m", "commlab.tools.cli", "bench", *argv, "--json", str(out)], timeout, argv[0],
                     env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["case"] == argv[0] and doc["failures"] == []
    for r in doc["records"]:
        assert set(records.FIELDS) <= set(r) and r["case"] == argv[0], r
        assert r["iters"] == len(r["samples_us"]) and r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
    return doc, done.stdout


@pytest.mark.multiproc
def test_train_step_runs_a_regime_beside_ddp_and_words_the_ratio(tmp_path):
    import re
    from workers.models import build_model
    doc, stdout = _case(tmp_path, "train-step", "--model", "tiny", "--workers", "2", "--steps", "2", "--warmup", "0",
                        "--rounds", "1", "--peers", "ddp", "--regimes", "allreduce://?backend=gloo")
    by = {r["regime"]: r for r in doc["records"]}
    assert sorted(by) == ["allreduce://?backend=gloo", "ddp"]
    assert (by["ddp"]["kind"], by["ddp"]["url"], by["allreduce://?backend=gloo"]["kind"]) == ("peer", "", "regime")
    params = sum(p.numel() for p in build_model("tiny", 0)[0].parameters())
    for r in by.values():
        assert (r["workers"], r["iters"], r["size_bytes"], r["method"]) == (2, 2, 4 * params, "allreduce")
        assert r["step_ms"] == pytest.approx(r["time_us"] / 1e3)
    assert by["allreduce://?backend=gloo"]["comm_ms"] is not None and by["ddp"]["comm_ms"] is None
    (v,) = doc["verdicts"]
    assert v["label"] == "allreduce://?backend=gloo / ddp step time" and v["lo"] <= v["ratio"] <= v["hi"]
    assert re.search(RATIO_LINE.format(re.escape(v["label"])), stdout), stdout


@pytest.mark.multiproc
def test_ps_rounds_runs_ps_beside_rpc_and_words_the_goal_ratio(tmp_path):
    import re
    doc, stdout = _case(tmp_path, "ps-rounds", "--only", "ps-tcp", "rpc-uv-basic", "--rounds", "3", "--warmup", "1",
                        "--repeats", "1", "--mib", "0.01", "--workers", "2")
    by = {r["regime"]: r for r in doc["records"]}
    assert (by["ps-tcp"]["kind"], by["rpc-uv-basic"]["kind"]) == ("regime", "peer")
    for r in by.values():
        assert (r["workers"], r["iters"], r["method"], r["count"]) == (2, 6, "pushpull", int(0.01 * 2**20) // 4)
        # rounds/s = the sum over the workers of rounds / seconds; the samples are worker 0's rounds, then worker 1's
        s = r["samples_us"]
        assert r["rounds_per_s"] == pytest.approx(3e6 / sum(s[:3]) + 3e6 / sum(s[3:]), rel=1e-3)
    (v,) = doc["verdicts"]
    assert v["label"] == "ps-tcp / rpc-uv-basic rounds/s" and v["lo"] <= v["ratio"] <= v["hi"]
    assert re.search(RATIO_LINE.format(re.escape(v["label"])) + r" \(goal >= 1.5x: ", stdout), stdout


@pytest.mark.multiproc
def test_gpu_sweep_dry_runs_on_cpu_tensors_in_the_same_records(tmp_path):
    out = tmp_path / "sweep"
    done = run_group([sys.executable, "-m", "commlab.tools.cli", "bench", "gpu-sweep", "--devices", "cpu", "--regimes",
                      "ring://", "--sizes-mib", "0.01", "--steps", "2", "--warmup", "0", "--out", str(out)], 180,
                     "gpu-sweep", env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "gpu-dryrun-cpu.json").read_text())
    (r,) = doc["records"]
    assert set(records.FIELDS) <= set(r)
    assert (r["case"], r["regime"], r["device"], r["iters"], r["size_bytes"]) == \
        ("gpu-sweep", "ring://", "cpu", 2, int(0.01 * 2**20) // 4 * 4)
    assert "| ring:// | regime | 2 |" in (out / "gpu-dryrun-cpu.md").read_text()

def _run_tiny_case(case: str, args: list[str], out: Path, timeout: float) -> dict:
    """``commlab bench CASE --tiny ARGS --out OUT`` to its end (rc 0); its JSON."""
    argv = [sys.executable, "-m", "commlab.tools.cli", "bench", case, "--tiny", *args, "--out", str(out)]
    done = run_group(argv, timeout, f"commlab bench {case} (tiny)", grace=5, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                     cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / f"{case}.json").read_text())



@pytest.mark.multiproc
def test_compress_case_runs_each_entry_beside_ddp_with_closed_form_bytes_and_words_the_goal(tmp_path):
    """`commlab bench compress` on loopback at test size: the regime uncompressed, with powersgd:4, and DDP with
    torch's PowerSGD hook; bytes per step equal their closed forms; every verdict carries its interval."""
    from bench import compress
    from commlab.compress.powersgd import layout
    from workers.models import build_model
    out = tmp_path / "compress"
    forked = zygote_children()
    doc = _run_tiny_case("compress", ["--models", "mlp", "--link", "loopback", "--steps", "4", "--regime", "allreduce://",
                                      "--compressors", "powersgd:4", "--peers", "ddp+powersgd"], out, 200)
    (cell,) = doc["cells"]
    assert doc["failures"] == [] and (cell["model"], cell["link"], cell["skip"]) == ("mlp", "loopback", 3)
    rows = {r["regime"]: r for r in cell["rows"]}
    psgd = "allreduce://?compress=powersgd:4,start_iter=2"
    assert list(rows) == ["allreduce://", psgd, "ddp+powersgd:4"]
    shapes = [p.shape for p in build_model("tiny", 0)[0].parameters()]
    numel, lay = sum(s.numel() for s in shapes), layout(shapes, 4, 2.0)
    p, q = sum(n * r for _, n, _, r in lay.matrices), sum(m * r for _, _, m, r in lay.matrices)
    flags = 4 * len(shapes)  # commlab's presence flags ride with round 0 (one bucket); DDP has none
    # a ring's count, 2(N-1)/N of each all-reduced tensor, is the tensor itself at N=2
    assert rows["allreduce://"]["bytes_per_step"] == 4 * numel + flags
    assert rows[psgd]["bytes_per_step"] == 4 * (lay.plain_numel + p) + flags + 4 * q
    assert rows["ddp+powersgd:4"]["bytes_per_step"] == 4 * (lay.plain_numel + p) + 4 * q
    for label, r in rows.items():  # step times from step 1 on; PowerSGD's after its warm-up (start_iter=2)
        assert r["status"] == "ok" and r["steps"] == 4 and len(r["curve"]) == 4
        assert r["step_s_samples"] == [p["step_s"] for p in r["curve"][3 if "powersgd" in label else 1:]]
        assert r["step_s_median"] <= r["step_s_p90"] <= max(r["step_s_samples"])
    assert rows[psgd]["bytes_ratio"] == rows[psgd]["bytes_per_step"] / rows["allreduce://"]["bytes_per_step"]
    labels = [v["label"] for v in cell["verdicts"]]
    assert labels == [f"step time, allreduce:// / {psgd}", f"time to target, allreduce:// / {psgd}",
                      "step time, allreduce:// / ddp+powersgd:4", "time to target, allreduce:// / ddp+powersgd:4",
                      f"step time, ddp+powersgd:4 / {psgd}"]
    assert all(v["lo"] <= v["ratio"] <= v["hi"] for v in cell["verdicts"])
    md = (out / "compress.md").read_text()
    assert f"- on loopback no compressor pays (no goal for them against uncompressed): step {psgd} / allreduce:// " in md
    assert f"- step time ddp+powersgd:4 / {psgd}: " in md and "goal: never slower than torch's hook, the median of " \
        "three runs' ratios >= 1x (this run: " in md
    assert compress.NO_COMPRESSOR_PAYS_ON_LOOPBACK in md
    assert re.search(RATIO_LINE.format(re.escape(labels[0])), md) and "this case ran " in md
    assert (out / "compress-mlp-loopback.png").stat().st_size > 10_000
    assert compress.planner_lines(cell["rows"], "loopback", {(psgd, "loopback"): {"step_s": 0.5}}) == [
        f"- `{psgd}`: planner predicted 500.0 ms a step, measured {rows[psgd]['step_s_median'] * 1e3:.1f} ms "
        f"({rows[psgd]['step_s_median'] / 0.5:.2f}x the prediction)"]
    assert _children_mentioning(str(out)) == [] and zygote_children() <= forked


def test_compress_case_refuses_bad_options_in_one_line_before_anything_starts(capsys):
    from bench.compress import main
    for argv, said in ((["--compressors", "topk:2"], "--compressors: option 'compress': 'topk:2'"),
                       (["--models", "cnn"], "--models: unknown ['cnn']"),
                       (["--peers", "ddp+powersgd", "--start-iter", "1"], "--start-iter must be >= 2")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


@pytest.mark.multiproc
@pytest.mark.full  # 11 s: the case runs outside the default bench; its overlap rule and bytes stay in the default run
def test_lowcomm_case_writes_its_report_with_utilization_and_closed_form_bytes(tmp_path):
    """`commlab bench lowcomm` at test size on loopback: `alone` (no exchange), the synchronous ring and torch's
    post-local SGD at H = 48 in one job, and a local-steps ps:// entry (reported as it resolves: unavailable
    without the localsteps options). Post-local SGD averages at step 0 only in 12 steps: 4n bytes (a ring's
    count at N = 2), then none; utilization is steps x alone's wall clock per step / wall (steps 1 on: alone's is 1).
    The held-out loss every 4 steps (rank 0's model): the target is the ring's at step 12 (3/4 of the way is step
    9; its first evaluation from there on), which the ring reaches by then. No time is asserted."""
    out = tmp_path / "lowcomm"
    forked = zygote_children()
    doc = _run_tiny_case("lowcomm", ["--models", "lm", "--link", "loopback", "--steps", "12",
                                     "--entries", "sync,postlocal,async", "--eval-every", "4"], out, 240)
    (cell,) = doc["cells"]
    rows = {r["regime"]: r for r in cell["rows"]}
    post = "torch PostLocalSGD H=48"
    from bench.lowcomm import ASYNC_LABEL
    assert list(rows) == ["alone", "ring://", post, ASYNC_LABEL] and cell["overlap"] == 1 and cell["projected"] == []
    assert (cell["overlap_whole"], cell["overlap_f16"]) == (1, 47)  # on loopback the closed form's T is 1
    n = cell["numel"]  # what alone's worker said; the ring's own step adds its presence flags
    assert rows["ring://"]["bytes_per_step"] > 4 * n > 0
    assert [p["bytes_sent"] for p in rows[post]["curve"]] == [4 * n] + [0] * 11
    assert all(p["bytes_sent"] == 0 for p in rows["alone"]["curve"])
    for label in ("alone", "ring://", post):
        r = rows[label]
        assert r["status"] == "ok" and len(r["curve"]) == 12
        pts = r["curve"]
        assert r["utilization"] == pytest.approx(11 * cell["t_alone_s"] / (pts[-1]["time_s"] - pts[0]["time_s"]))
        assert r["loss_at_equal_wall"] is not None and r["peak_bytes_per_s"] >= 0
        assert [p["step"] for p in pts if p.get("test_loss") is not None] == [3, 7, 11], label
        assert r["held_final"] == pts[-1]["test_loss"]
    assert rows["alone"]["utilization"] == pytest.approx(1.0)
    assert cell["held_out_target"] == rows["ring://"]["curve"][-1]["test_loss"]
    assert rows["ring://"]["held_steps"] is not None and rows["ring://"]["held_steps"] <= 12
    if rows[ASYNC_LABEL]["status"] != "ok":  # before the localsteps options: said, by name, in the report
        assert "sync_every" in rows[ASYNC_LABEL]["error"]
        assert any(f["regime"].startswith(ASYNC_LABEL) for f in doc["failures"])
    md = (out / "lowcomm.md").read_text()
    assert "## lm (charlm-tiny) at loopback" in md and "| utilization |" in md and "this case ran " in md
    assert all(v["lo"] <= v["ratio"] <= v["hi"] for v in cell["verdicts"])
    for png in ("lowcomm-lm-loopback.png", "lowcomm-util-lm.png"):
        assert (out / png).stat().st_size > 10_000, png
    assert _children_mentioning(str(out)) == [] and zygote_children() <= forked


def test_lowcomm_overlap_is_the_smallest_that_hides_a_fragment_and_its_bound():
    from bench.lowcomm import exposed_bound, int8_bytes, overlap, util_bound
    # 1,048,576 parameters, P = 4: a fragment of 262,144 int8 codes and 1,024 float32 scales (266,240 bytes);
    # at 1 Mbit/s (125,000 B/s) that is 2.13 s: 43 steps of 50 ms, clamped to H/P - 1 = 11
    assert int8_bytes(262144) == 266240
    assert overlap(2**20, 125_000, 0.05) == 11 and overlap(2**20, 12_500_000, 0.05) == 1
    assert overlap(2**20, 1_250_000, 0.05) == 5  # 0.213 s / 0.05 s -> 5
    assert exposed_bound(2**20, 1_250_000, 0.05, 5) == 0.0
    assert exposed_bound(2**20, 125_000, 0.05, 11) == pytest.approx(266240 / 125_000 - 0.55)
    assert util_bound(2**20, 125_000, 0.05, 11) == pytest.approx(48 * 0.05 / (48 * 0.05 + 4 * (2.12992 - 0.55)))
    assert util_bound(2**20, None, 0.05, 1) == 1.0
    from bench.lowcomm import check, parser
    for flag, bad in (("--overlap", "12"), ("--whole-overlap", "48")):  # beyond H/P - 1 and H - 1
        with pytest.raises(ValueError, match=flag):
            check(parser().parse_args(["--models", "lm", "--link", "10mbit", flag, bad]))


def test_lowcomm_async_entries_are_jobs_of_their_own_with_the_slow_rank():
    """async, async-int8 and async-stream: each a job of its own (its servers) on its URL, the slow rank 1 set, and
    a time-to-target verdict against the slow-rank ring each (made only where both reach the target)."""
    from bench.lowcomm import ASYNC_LABEL, async_urls, entries

    urls = async_urls(3)
    assert urls["async-int8"].endswith("&compress=int8") and "fragments=4&overlap=3" in urls["async-stream"]
    chosen = entries(3, 2)
    for name, url in urls.items():
        e = chosen[name]
        assert e.url == "job" and e.label == f"{url} (rank 1 2x slower)" and dict(e.settings)["slow_rank"] == 1
    assert chosen["async"].label == ASYNC_LABEL


def test_lowcomm_whole_model_overlap_and_async_at_equal_held_out_loss():
    """async-int8-overlap's T hides the whole model's int8 push and float32 pull (closed form, clamped to H - 1);
    each async entry's time to its last held-out loss over the slow-rank ring's time to the same loss."""
    from bench.lowcomm import SLOW_SYNC_LABEL, async_urls, held_against_slow, int8_bytes, overlap_whole

    # 10^6 parameters: 1,015,628 int8 bytes (a float32 scale per 256) + 4,000,000 float32 back; at 100 Mbit/s
    # 0.40 s = 11.1 steps of 36 ms
    assert int8_bytes(10**6) == 1_015_628
    assert overlap_whole(10**6, 12_500_000, 0.036) == 12 and overlap_whole(10**6, 1_250_000, 0.036) == 47
    assert overlap_whole(10**6, None, 0.036) == 1
    urls = async_urls(3, 12)
    assert urls["async-int8-overlap"].endswith("&compress=int8&overlap=12&merge=delta")
    assert "anchor_dtype=float16&overlap=47&merge=delta" in urls["async-int8-f16"]

    def row(regime, evals):
        return {"regime": regime, "curve": [{"time_s": t, "test_loss": loss} for t, loss in evals]}

    slow = row(SLOW_SYNC_LABEL, [(10, 1.5), (20, 1.4), (30, 1.3), (40, 1.2)])
    fast = row("ps://?mode=async&x (rank 1 2x slower)", [(5, 1.45), (12, 1.35), (15, 1.36)])
    (h,) = held_against_slow([slow, fast, row("ring://", [(1, 1.0)])])
    assert (h["loss"], h["async_s"], h["slow_s"]) == (1.36, 12, 30) and h["ratio"] == pytest.approx(0.4)
    assert held_against_slow([fast]) == []  # no slow ring in the run: nothing to compare with
    # run longer (--async-steps), the async job goes below the ring's last loss: compared there, the ring's whole run
    longer = row("ps://?mode=async&y (rank 1 2x slower)", [(5, 1.45), (12, 1.35), (25, 1.19), (50, 1.1)])
    (h,) = held_against_slow([slow, longer])
    assert (h["loss"], h["async_s"], h["slow_s"]) == (1.2, 25, 40) and h["ratio"] == pytest.approx(0.625)
    from bench.lowcomm import check, entries, is_local, parser
    for flag in ("--async-steps", "--local-steps-run"):
        with pytest.raises(ValueError, match=flag):
            check(parser().parse_args(["--models", "lm", "--link", "10mbit", flag, "1"]))
    # --local-steps-run moves these to a job of their own; the synchronous entries, the peers and the slow ring stay
    assert sorted(n for n, e in entries(3, 2).items() if is_local(e)) == [
        "h10", "h10-int8", "h48", "h48-int8", "h48-int8-nesterov", "stream-fp32", "stream-int8", "stream-int8-slices"]
