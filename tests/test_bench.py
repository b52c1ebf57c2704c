"""The benchmark harness: its wrong-count catches a wrong result, a failing regime is reported
while the rest run, and a tiny end-to-end run writes every section of the report.

Each job is real processes on loopback (the launcher, ranks, sockets); the tests assert
counts and contents, never a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bandwidth, bw_worker
from commlab import netns as links
from bench import regimes as R
from bench.report import SECTIONS

from conftest import run_group

ROOT = Path(__file__).resolve().parent.parent


def tiny_bw(regimes, **kw) -> bandwidth.BandwidthConfig:
    return bandwidth.BandwidthConfig(regimes, workers=2, sizes=[4096, 12], repeat_bytes=0, min_iters=3, max_iters=3,
                                     warmup=1, ceilings=(), job_timeout=60, **kw)


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
    assert bandwidth.bus_factor("allreduce", 2) == 1.0
    assert bandwidth.bus_factor("allreduce", 4) == 1.5
    assert bandwidth.bus_factor("pushpull", 4) == 1.0
    assert bandwidth.bus_factor("noop", 4) == 0.0
    assert bandwidth.iters_for(2**20, 2**24, 5, 100) == 16
    assert bandwidth.iters_for(4, 2**24, 5, 100) == 100
    assert bandwidth.iters_for(2**30, 2**24, 5, 100) == 5


def test_ranks_results_combine_over_the_sizes_every_rank_finished(tmp_path):
    out = tmp_path / "bw.json"
    row = lambda size, times, wrong: {"size_bytes": size, "count": size // 4, "times_s": times, "wrong": wrong}
    out.write_text(json.dumps({"rows": [row(4, [1.0, 5.0], 1), row(8, [1.0], 0), {"facts": {"scheme": "x"}}]}))
    (tmp_path / "bw.json.rank1").write_text(json.dumps({"rows": [row(4, [2.0, 3.0], 2)]}))  # cut short
    rows, times, wrong, facts = bandwidth.combine_ranks(out, 2)
    assert [r["size_bytes"] for r in rows] == [4] and times == [[2.0, 5.0]] and wrong == [3]
    assert facts == {"scheme": "x"}


def test_servers_planned_on_loopback_move_to_their_namespaces():
    from bench.launch_job import place_servers
    ls = links.Links(2, "1gbit", tag="clplan")  # not entered: nothing is created
    url = "ps://?mode=sync&endpoints=tcp://127.0.0.1:4001,tcp://127.0.0.1:4002"
    argvs = [["--bind", "tcp://127.0.0.1:4001", "--shard", "0/2"], ["--bind", "tcp://127.0.0.1:4002", "--shard", "1/2"]]
    url2, argvs2 = place_servers(url, argvs, ls, first_host=2)
    assert url2 == "ps://?mode=sync&endpoints=tcp://10.77.0.3:4001,tcp://10.77.0.4:4002"
    assert argvs2[1] == ["--bind", "tcp://10.77.0.4:4002", "--shard", "1/2", "--insecure"]
    with pytest.raises(ValueError, match="cannot place it"):
        place_servers(url, [["--bind", "ipc:///tmp/x"]], ls, first_host=2)


def test_rates_parse_in_tc_units():
    assert links.parse_rate("1gbit") == 125e6
    assert links.parse_rate("100mbps") == 100e6
    with pytest.raises(ValueError, match="expected a tc rate"):
        links.parse_rate("fast")


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
    argv = [sys.executable, "-m", "commlab.cli", "bench", "--out", str(out), "--sizes", "4K,64K",
            "--bw-regimes", "noop", "--conv-regimes", "local,gloo", "--ceilings", "memcpy",
            "--max-iters", "3", "--model", "tiny", "--steps", "6", "--eval-every", "3", "--target-acc", "0.05",
            "--budget-s", "150", "--workloads", "none"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # on SIGTERM the bench stops its jobs (each a session of its own, out of reach of a SIGKILL to
    # the bench's group) and deletes its namespaces: give it 5 s for that before the SIGKILL
    done = run_group(argv, 170, "commlab bench (tiny run)", grace=5, env=env, cwd=ROOT, capture_output=True,
                     text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    for what in ("N = 2 workers", "[min–max]", "p90", "Verdict: fastest exchange per size",
                 "Verdict: fastest to accuracy", "Verdict: the cost of staleness", "gloo: **coincides** with local://"):
        assert what in report, (what, report[report.index("## Failed"):report.index("## Bandwidth")],
                                (out / "logs" / "conv-gloo.log").read_text()[-2000:])
    for png in ("busbw.png", "convergence.png", "split.png"):
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
    assert _children_mentioning(str(out)) == []


@pytest.mark.netns
@pytest.mark.skipif(links.link_unavailable_reason() is not None, reason="needs root and iproute2")
def test_capped_links_carry_tcp_and_vanish(tmp_path):
    tag = f"clt{os.getpid() % 100000}"  # unique: test runs side by side must not share namespaces

    def ours():
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [l for l in listed.splitlines() if l.split()[0] in {f"{tag}hub", f"{tag}h0", f"{tag}h1"}]
    with links.Links(2, "200mbit", tag=tag) as ls:
        assert len(ours()) == 3
        cfg = bandwidth.BandwidthConfig(["gloo"], 2, [65536], 0, 3, 3, 1, ("tcp-oneway",), 60)
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
    assert sorted(read_staleness(tmp_path / "none", [], log)) == [0, 0, 0, 3]
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "s.json").write_text('{"staleness": [1, 2]}')
    assert read_staleness(tmp_path / "stats", [], log) == [1, 2]
    assert read_staleness(tmp_path / "none", [[{"step": 0}]]) is None


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


def test_ring_sweep_takes_turns_and_every_sum_is_exact():
    """bench/ring_bandwidth: three ranks, gloo and two rings taking turns on each size (every rank
    must pick the same order, or a collective would pair with the wrong one and hang or sum wrong)."""
    from bench import ring_bandwidth as rb

    cases = [("gloo", 4096), ("ring-tcp", 4096), ("ring-ipc", 4096), ("gloo", 3 << 20), ("ring-tcp", 3 << 20)]
    records = rb.run_cases(cases, 3, quick=True, timeout=120, timed=4)
    assert sorted((r["regime"], r["size_bytes"]) for r in records) == sorted(cases)
    assert [(r["wrong"], r["iterations"], r["workers"]) for r in records] == [(0, 4, 3)] * len(cases)
    assert all(r["cpu_us"] > 0 and r["time_min_us"] <= r["time_us"] <= r["time_max_us"] for r in records)
