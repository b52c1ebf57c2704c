"""The timeline (docs/trace.md): ``commlab train --trace DIR`` over ring:// and ps:// (compressed), checked as
the Chrome trace-event format, against the step reports the same run wrote, and against interval arithmetic
done here; torch.profiler's trace of plain DDP over gloo through the same summary."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from commlab.base import trace
from commlab.tools import tracesum
from conftest import child_env, run_group

ROOT = Path(__file__).resolve().parents[1]
SKEWS = {"rank1": 7_000_000, "shard0": -4_000_000}  # ns added to these processes' trace clocks (the test hook)


def _train(tmp_path: Path, url: str, steps: int = 6) -> tuple[dict, dict[int, list[dict]]]:
    """One traced job of the built-in worker: the merged trace, and each rank's step reports (metrics lines)."""
    folder, metrics = tmp_path / "trace", tmp_path / "m.jsonl"
    skew = ",".join(f"{k}={v}" for k, v in SKEWS.items())
    r = run_group([sys.executable, "-m", "commlab.tools.cli", "train", "--exchanger", url, "--workers", "2",
                   "--model", "tiny", "--steps", str(steps), "--batch-size", "16", "--trace", str(folder),
                   "--metrics", str(metrics), "--eval-every", "0"], 120, cwd=ROOT,
                  env=child_env(**{trace.SKEW_ENV: skew}), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"timeline in {folder / 'trace.json'}" in r.stderr, r.stderr
    reports = {rank: [json.loads(line) for line in Path(f"{metrics}{'.rank1' if rank else ''}").read_text().splitlines()]
               for rank in (0, 1)}
    return json.loads((folder / "trace.json").read_text()), reports


def check_chrome(doc: dict) -> None:
    """Chrome's trace-event format (JSON object form): the fields each phase needs, of the right types."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for ev in doc["traceEvents"]:
        ph = ev["ph"]
        assert ph in ("X", "i", "C", "s", "f", "M"), ev
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        if ph == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name") and "args" in ev, ev
            continue
        assert isinstance(ev["ts"], (int, float)) and isinstance(ev.get("cat", ""), str), ev
        if ph == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, ev
        if ph in ("s", "f"):
            assert isinstance(ev["id"], int) and 0 <= ev["id"] < 2**53, ev
        if ph == "f":
            assert ev["bp"] == "e", ev
        if ph == "C":
            assert all(isinstance(v, (int, float)) for v in ev["args"].values()), ev
    json.loads(json.dumps(doc))


def check_nesting(doc: dict) -> None:
    """On every thread's track, spans nest or follow one another (never overlap in part)."""
    tracks = defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X":
            tracks[(ev["pid"], ev["tid"])].append(ev)
    eps = 1e-3  # us: ns stamps written as floats
    for track, spans in tracks.items():
        stack: list[dict] = []
        for ev in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and ev["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - eps:
                stack.pop()
            if stack:
                top = stack[-1]
                assert ev["ts"] + ev["dur"] <= top["ts"] + top["dur"] + eps, \
                    f"{track}: {ev['name']} at {ev['ts']} overlaps {top['name']} at {top['ts']} in part"
            stack.append(ev)


def check_flows(doc: dict) -> int:
    """Every flow has exactly one start and one end, and (clocks aligned) its end is not before its start."""
    ends = defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] in ("s", "f"):
            ends[ev["id"]].append(ev)
    worst = max((c.get("uncertainty_ns") or 0) for c in doc["otherData"]["commlab"]["clocks"].values()) / 1e3
    for fid, evs in ends.items():
        assert sorted(e["ph"] for e in evs) == ["f", "s"], evs
        s, f = sorted(evs, key=lambda e: e["ph"], reverse=True)
        assert f["ts"] >= s["ts"] - 2 * worst, (s, f)
    return len(ends)


def processes(doc: dict) -> set[str]:
    return {ev["args"]["name"] for ev in doc["traceEvents"] if ev["ph"] == "M" and ev["name"] == "process_name"}


def sweep(covers: list[list[tuple[float, float]]], keep) -> float:
    """The length of the time where ``keep(flags)`` holds, ``flags[i]`` being whether some interval of
    ``covers[i]`` covers it: a sweep over every boundary (this test's own interval arithmetic)."""
    points = sorted({x for group in covers for a, b in group for x in (a, b)})
    total = 0.0
    for a, b in zip(points, points[1:]):
        mid = (a + b) / 2
        if keep([any(lo <= mid < hi for lo, hi in group) for group in covers]):
            total += b - a
    return total


def check_against_reports(doc: dict, reports: dict[int, list[dict]]) -> None:
    """Per rank and step: the summary's exposed communication is the report's blocked time (within 5%), the
    bytes on the step's sends are the report's bytes_sent exactly, and its overlap is this test's sweep."""
    summary = tracesum.summarize(doc)
    spans = [ev for ev in doc["traceEvents"] if ev["ph"] == "X"]
    for rank in (0, 1):
        mine = [ev for ev in spans if ev["pid"] == rank]
        steps = {ev["args"]["step"]: ev for ev in mine if ev["name"] == "step"}
        assert sorted(steps) == [r["step"] for r in reports[rank]]
        assert any(r["bytes_sent"] for r in reports[rank])
        for rep in reports[rank]:
            st = steps[rep["step"]]
            lo, hi = st["ts"], st["ts"] + st["dur"]
            row = next(r for r in summary["steps"] if r["step"] == rep["step"])["per_rank"][f"rank {rank}"]
            blocked_ms = rep["comm_s"] * 1e3
            assert abs(row["exposed_ms"] - blocked_ms) <= 0.05 * blocked_ms + 0.005, (rank, rep, row)
            sent = sum(ev["args"]["bytes"] for ev in mine if ev["name"] == "send" and lo <= ev["ts"] <= hi)
            assert sent == rep["bytes_sent"], (rank, rep["step"], sent, rep["bytes_sent"])
            comm = [(max(lo, ev["ts"]), min(hi, ev["ts"] + ev["dur"])) for ev in mine
                    if ev.get("cat") == "comm" and ev["ts"] < hi and ev["ts"] + ev["dur"] > lo]
            backward = [(ev["ts"], ev["ts"] + ev["dur"]) for ev in mine
                        if ev["name"] == "backward" and lo <= ev["ts"] <= hi]
            total = sweep([comm], lambda f: f[0])
            hidden = sweep([comm, backward], lambda f: f[0] and f[1])
            assert row["overlap"] == (pytest.approx(hidden / total, abs=1e-6) if total else None), (rank, rep["step"])


def check_clocks(doc: dict, names: list[str]) -> None:
    """The injected skews are taken back out within 1 ms (every process here shares one clock)."""
    clocks = doc["otherData"]["commlab"]["clocks"]
    measured = {p: m.get("clocks") for p, m in doc["otherData"]["commlab"]["processes"].items()}
    for name in names:
        assert abs(clocks[name]["shift_ns"] + SKEWS.get(name, 0)) < 1_000_000, (name, clocks, measured)
        assert clocks[name]["uncertainty_ns"] < 1_000_000, (name, clocks[name])


@pytest.mark.multiproc
def test_a_ring_job_s_timeline_is_chrome_s_format_nested_aligned_and_agrees_with_its_reports(tmp_path):
    doc, reports = _train(tmp_path, "ring://")
    check_chrome(doc)
    check_nesting(doc)
    check_flows(doc)
    assert {"rank 0", "rank 1"} <= processes(doc)
    check_against_reports(doc, reports)
    check_clocks(doc, ["rank1"])
    names = {ev["name"] for ev in doc["traceEvents"]}
    assert {"forward", "backward", "blocked", "optimizer", "step", "start bucket", "ready", "collective", "send",
            "recv+reduce"} <= names, names


@pytest.mark.multiproc
def test_a_compressed_ps_job_s_timeline_has_every_shard_flows_with_both_ends_and_agrees_with_its_reports(tmp_path):
    doc, reports = _train(tmp_path, "ps://?shards=2&compress=fp16")
    check_chrome(doc)
    check_nesting(doc)
    assert check_flows(doc) > 0
    assert {"rank 0", "rank 1", "shard 0", "shard 1"} <= processes(doc)
    check_against_reports(doc, reports)
    check_clocks(doc, ["rank1", "shard0", "shard1"])
    names = {ev["name"] for ev in doc["traceEvents"]}
    assert {"receive", "apply", "reply", "push", "pull", "queue depth"} <= names, names
    shard_args = [ev["args"] for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["name"] == "push"]
    assert {a["rank"] for a in shard_args} == {"rank0", "rank1"} and all("space" in a and "step" in a
                                                                         for a in shard_args)


DDP = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3)) as prof:
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        prof.step()
if dist.get_rank() == 0:
    prof.export_chrome_trace(PATH)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_the_summary_reads_torch_profiler_s_trace_of_ddp_over_gloo(run_ranks, tmp_path):
    path = tmp_path / "ddp.json"
    run_ranks(DDP.replace("PATH", repr(str(path))), 2, timeout=120)
    doc = tracesum.load(str(path))
    summary = tracesum.summarize(doc)
    assert summary["source"] == "torch.profiler" and len(summary["steps"]) == 3
    spans = [ev for ev in doc["traceEvents"] if ev.get("ph") == "X"]
    for row in summary["steps"]:
        st = next(ev for ev in spans if ev["name"] == f"ProfilerStep#{row['step']}")
        lo, hi = st["ts"], st["ts"] + st["dur"]
        inside = [ev for ev in spans if lo <= ev["ts"] < hi and ev is not st]
        is_comm = lambda ev: ev["name"].startswith(("gloo:", "c10d::"))  # noqa: E731
        main = [ev for ev in inside if ev["tid"] == st["tid"]]
        top = [ev for ev in main if not any(o is not ev and o["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= o["ts"] + o["dur"]
                                            and (o["dur"], -o["ts"]) > (ev["dur"], -ev["ts"]) for o in main)]
        comm = [(ev["ts"], min(hi, ev["ts"] + ev["dur"])) for ev in inside if is_comm(ev)]
        computing = [(ev["ts"], ev["ts"] + ev["dur"]) for ev in top if not is_comm(ev)]
        launching = [(ev["ts"], ev["ts"] + ev["dur"]) for ev in main if is_comm(ev)]
        exposed = sweep([comm, computing, launching], lambda f: f[0] and not (f[1] and not f[2]))
        assert any("gloo:" in ev["name"] for ev in inside)
        assert exposed > 0
        assert row["exposed_ms"] * 1e3 == pytest.approx(exposed, abs=1e-3), row


def test_a_trace_folder_that_cannot_be_written_is_one_line_naming_it_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "commlab.tools.cli", "run", "--trace", str(blocker / "sub"),
                        "--workers", "2", "examples/charlm.py"], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"commlab run: --trace: cannot write traces to {blocker / 'sub'}"), \
        r.stderr


def test_the_merge_puts_each_process_on_rank_0_s_clock_through_the_least_uncertain_chain():
    metas = {"rank0": {"clocks": {"shard0": {"offset_ns": -300, "uncertainty_ns": 10}}},
             "rank1": {"clocks": {"shard0": {"offset_ns": 200, "uncertainty_ns": 5},
                                  "rank0": {"offset_ns": 900, "uncertainty_ns": 100}}},
             "shard0": {"clocks": {}}}
    got = trace.offsets(metas, "rank0")
    # shard0 = rank0 - 300; rank1 = shard0 - 200 = rank0 - 500 (15 ns) beats the direct 900 (100 ns)
    assert got["rank0"] == (0, 0)
    assert got["shard0"] == (300, 10)
    assert got["rank1"] == (500, 15)


@pytest.mark.full  # once (of ten runs, at load 14) its job did not end within 120 s; not reproduced since
@pytest.mark.multiproc
def test_trace_torch_puts_the_profiler_s_operators_inside_the_steps_it_chose_on_the_same_clock(tmp_path):
    folder = tmp_path / "trace"
    r = run_group([sys.executable, "-m", "commlab.tools.cli", "train", "--exchanger", "ring://", "--workers", "2",
                   "--model", "tiny", "--steps", "5", "--batch-size", "16", "--trace", str(folder),
                   "--trace-torch", "2-3", "--eval-every", "0"], 120, cwd=ROOT,
                  env=child_env(**{trace.SKEW_ENV: "rank1=7000000"}), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads((folder / "trace.json").read_text())
    check_chrome(doc)
    check_nesting(doc)
    for rank in (0, 1):
        spans = [ev for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["pid"] == rank]
        steps = {ev["args"]["step"]: ev for ev in spans if ev["name"] == "step"}
        forwards = [ev for ev in spans if ev["name"] == "forward"]
        ops = [ev for ev in spans if ev.get("cat") == "torch" and ev["name"] == "aten::linear"]
        assert ops, f"rank {rank}: no operator of torch.profiler in the timeline"
        lo, hi = steps[2]["ts"], steps[3]["ts"] + steps[3]["dur"]
        slack = 50.0  # us: the profiler's stamps and ours are read at slightly different moments
        for op in ops:  # every linear layer ran inside one of our forward spans of the chosen steps
            assert lo - slack <= op["ts"] <= hi + slack, (rank, op["ts"], lo, hi)
            assert any(f["ts"] - slack <= op["ts"] and op["ts"] + op["dur"] <= f["ts"] + f["dur"] + slack
                       for f in forwards), (rank, op)


def test_bench_train_step_words_what_tracing_costs_beside_the_same_regime_untraced():
    from bench import records, train_step

    def rec(name, times):
        return records.record("train-step", name, kind="peer" if name == "ddp" else "regime", method="allreduce",
                              workers=2, size_bytes=40, times_s=times)

    steps = [rec("ddp", [0.2] * 4), rec("ring://", [0.1] * 4), rec("ring:// +trace", [0.102] * 4),
             rec("ps://", [0.3] * 4), rec("ps:// +trace", [0.3] * 4)]
    got = {label: v.ratio for label, v in train_step.verdicts(steps, ["ring://", "ps://"])}
    assert got == pytest.approx({"ring:// +trace / ring:// step time": 1.02, "ps:// +trace / ps:// step time": 1.0,
                                 "ring:// / ddp step time": 0.5, "ps:// / ddp step time": 1.5,
                                 "ps:// / ring:// step time": 3.0})
    # tracing's lines are judged by its goal's 3% (bench/verdict.py's band), the others by the default 5%
    said = {label: (v.band, v.said()) for label, v in train_step.verdicts(steps, ["ring://", "ps://"])}
    assert said["ring:// +trace / ring:// step time"] == (train_step.TRACE_COST_BAND, "equivalent within ±3%")
    assert said["ps:// / ring:// step time"] == (0.05, "ring:// faster")
    assert train_step.url_of("ps://?shards=2 +trace") == "ps://?shards=2"


def test_an_unwritable_commlab_trace_stops_the_exchanger_before_it_connects(tmp_path, monkeypatch):
    import commlab
    from commlab.base.errors import ConfigError
    from commlab.transport.rendezvous import RankInfo

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(trace.ENV, str(blocker / "sub"))
    with pytest.raises(ConfigError, match=f"COMMLAB_TRACE: cannot write traces to {blocker / 'sub'}"):
        commlab.connect("ring://", RankInfo(0, 1, 0, "127.0.0.1", 0, "flags"))


@pytest.mark.full
@pytest.mark.multiproc
@pytest.mark.parametrize("url", ["ring://?compress=fp16", "ps://?shards=2", "ps://?shards=1&update=server",
                                 "ring://?transport=shm&sync_every=2"])
def test_more_regimes_timelines_agree_with_their_reports(tmp_path, url):
    doc, reports = _train(tmp_path, url)
    check_chrome(doc)
    check_nesting(doc)
    check_flows(doc)
    check_against_reports(doc, reports)
    check_clocks(doc, ["rank1"])
