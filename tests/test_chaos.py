"""``commlab bench chaos``: its options, its schedule, its accounting (from a real run's logs), and the
at-scale model's closed forms (commlab/plan/failures.py) against a Monte Carlo of the same rules.

No time is asserted: the smoke run checks counts (kills delivered, steps applied twice, the servers'
own count) and that nothing is left behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import chaos, verdict
from commlab.plan import failures as F

from conftest import child_env, run_group

ROOT = Path(__file__).resolve().parent.parent


# ----- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, option", [
    (["--mtbf", "0", "--duration", "5"], "--mtbf"),
    (["--mtbf", "-2", "--duration", "5"], "--mtbf"),
    (["--mtbf", "nan", "--duration", "5"], "--mtbf"),
    (["--mtbf", "3", "--duration", "0"], "--duration"),
    (["--mtbf", "3", "--duration", "inf"], "--duration"),
    (["--mtbf", "3", "--duration", "5", "--workers", "1"], "--workers"),
    (["--mtbf", "3", "--duration", "5", "--entries", "free,nope"], "--entries"),
    (["--mtbf", "3", "--duration", "5", "--entries", "free,commlab,free"], "--entries"),
])
def test_bad_options_exit_2_with_one_line_naming_the_option(argv, option, tmp_path, capsys):
    assert chaos.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0] and err[0].startswith("commlab bench chaos:")
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_the_chaos_case_is_reached_through_commlab_bench_and_not_in_the_default_run():
    from bench import __main__ as bench_main
    assert bench_main.CASES["chaos"] == "bench.chaos"
    assert "chaos" not in bench_main.parser().parse_args([]).what


# ----- the schedule -------------------------------------------------------------------------------
def test_the_schedule_is_seeded_exponential_and_every_entry_gets_the_same():
    a = chaos.schedule(20.0, 20_000.0, 4, seed=3, shards=2)
    assert a == chaos.schedule(20.0, 20_000.0, 4, seed=3, shards=2)
    assert a != chaos.schedule(20.0, 20_000.0, 4, seed=4, shards=2)
    workers = [k for k in a if k.target == "worker"]
    gaps = [y.at - x.at for x, y in zip([chaos.Kill(0.0, "worker", 0)] + workers, workers)]
    mean = sum(gaps) / len(gaps)  # ~1,000 draws of Exp(mean 20): the mean within 4 standard errors
    assert abs(mean - 20.0) < 4 * 20.0 / math.sqrt(len(gaps))
    assert {k.index for k in workers} == {0, 1, 2, 3}
    assert {k.index for k in a if k.target == "server"} == {0, 1}
    assert all(0 < k.at < 20_000.0 for k in a) and [k.at for k in a] == sorted(k.at for k in a)



def test_kill_servers_plans_the_server_shards_schedule_alone_and_servers_means_both():
    both = chaos.schedule(30.0, 3_000.0, 4, seed=1, shards=2)
    alone = chaos.schedule(30.0, 3_000.0, 0, seed=1, shards=2)
    assert alone and alone == [k for k in both if k.target == "server"]  # the same shard kills, the workers' gone
    assert chaos.killed(alone) == f"{len(alone)} of server shards"
    p = chaos.parser()
    assert p.parse_args(["--mtbf", "1", "--duration", "1"]).kill == "workers"
    assert p.parse_args(["--mtbf", "1", "--duration", "1", "--servers"]).kill == "both"
    assert p.parse_args(["--mtbf", "1", "--duration", "1", "--kill", "servers"]).kill == "servers"
    with pytest.raises(SystemExit):
        p.parse_args(["--mtbf", "1", "--duration", "1", "--kill", "shards"])
    assert chaos.main(["--reread", "/nonexistent/chaos-run"]) == 2  # one line naming the option, no traceback
    base = ["--mtbf", "1", "--duration", "1", "--kill", "servers"]
    with pytest.raises(ValueError, match="--kill servers needs every --exchanger on ps:// with replicas=2"):
        chaos.check(p.parse_args(base))  # the default URL: one server per shard
    with pytest.raises(ValueError, match="torchft entries have no servers"):
        chaos.check(p.parse_args([*base, "--exchanger", "ps://?replicas=2", "--entries", "free,torchft"]))
    assert chaos.check(p.parse_args([*base, "--exchanger", "ps://?mode=sync&replicas=2", "--entries", "free-kg,commlab"])) \
        == ["free-kg", "commlab"]
    assert chaos.goodput_floor({"exchanger": None, "kill": "servers", "mtbf": 30.0}) == 0.90
    assert chaos.goodput_floor({"exchanger": None, "kill": "workers", "mtbf": 20.0}) == 0.93

# ----- the at-scale model -------------------------------------------------------------------------
@pytest.mark.parametrize("n, rate, restart_s, lost_s", [(20, 1 / 400, 8.0, 0.5), (50, 1 / 2000, 30.0, 2.0)])
def test_restart_all_goodput_is_its_closed_form(n, rate, restart_s, lost_s):
    closed = F.goodput_restart_all(n, rate, restart_s, lost_s)
    assert closed == pytest.approx(math.exp(-n * rate * (restart_s + lost_s)))
    mc = F.simulate("restart-all", n, rate, horizon_s=2e6, restart_s=restart_s, lost_s=lost_s, seed=1)
    assert mc == pytest.approx(closed, abs=0.01)


@pytest.mark.parametrize("n, rate, stall_s, heal_s, lost_s", [(20, 1 / 400, 2.0, 15.0, 0.5),
                                                               (50, 1 / 2000, 0.5, 60.0, 2.0)])
def test_keep_going_goodput_is_its_closed_form(n, rate, stall_s, heal_s, lost_s):
    closed = F.goodput_keep_going(n, rate, stall_s, heal_s, lost_s)
    assert closed == pytest.approx(math.exp(-n * rate * stall_s) / (1 + rate * (heal_s + lost_s)))
    mc = F.simulate("keep-going", n, rate, horizon_s=5e5, stall_s=stall_s, heal_s=heal_s, lost_s=lost_s, seed=2)
    assert mc == pytest.approx(closed, abs=0.01)


def test_at_scale_restart_all_falls_behind_and_nothing_fails_means_full_goodput():
    c = F.Components(restart_s=20.0, measured_workers=4, rendezvous_per_rank_s=0.004, stall_s=0.5, heal_s=10.0,
                     lost_s=0.3)
    assert c.restart_at(4) == 20.0 and c.restart_at(10_004) == pytest.approx(60.0)
    rows = F.table(c, workers=(1000, 10000), mtbf_hours=(50.0,))
    assert [r["workers"] for r in rows] == [1000, 10000]
    for r in rows:
        assert r["keep_going"] > r["restart_all"]
    assert rows[1]["restart_all"] < rows[0]["restart_all"]
    assert F.goodput_restart_all(10_000, 0.0, 100.0, 1.0) == 1.0 == F.goodput_keep_going(10_000, 0.0, 1, 1, 1)
    assert len(F.lines(c, rows)) == 2 + 2 + len(rows)


# ----- verdicts on rates --------------------------------------------------------------------------
def test_rate_ratios_are_ratios_of_sums_with_an_interval():
    even = verdict.rate_ratio("a", [10] * 20, [1.0] * 20, "b", [10] * 20, [1.0] * 20)
    assert even.ratio == 1.0 and even.lo <= 1.0 <= even.hi and even.winner is None
    stalled = [10] * 18 + [0, 0]  # two bins of nothing (kills): 90% of the rate
    v = verdict.rate_ratio("chaos", stalled, [1.0] * 20, "free", [10] * 20, [1.0] * 20)
    assert v.ratio == pytest.approx(0.9) and v.lo < 0.9 < v.hi <= 1.0
    with pytest.raises(ValueError):
        verdict.rate_ratio("a", [1], [1.0], "b", [0], [1.0])


def _run_json(folder: Path, seed: int, ratio: float, lo: float, hi: float, loss: float, twice: int = 0,
              exchanger=None) -> Path:
    folder.mkdir()
    v = lambda label, a, b, r, l, h: {"label": label, "a": a, "b": b, "ratio": r, "lo": l, "hi": h}
    (folder / "chaos.json").write_text(json.dumps({
        "argv": ["--mtbf", "20", "--seed", str(seed)],
        "config": {"mtbf": 20.0, "duration": 300.0, "exchanger": exchanger, "servers": False, "seed": seed,
                   "out": str(folder)},
        "verdicts": [v("goodput, commlab over free", "commlab", "free", ratio, lo, hi),
                     v("goodput share, commlab over restart-all", "commlab", "restart-all", 1 + ratio, 1.5, 2.5)],
        "entries": {"free": {"final_loss": 0.04 + seed / 100, "kills": []},
                    "commlab": {"final_loss": loss, "kills": [{}] * 10, "applied_twice": [1] * twice,
                                "servers_applied_twice": [0]}}}))
    return folder


def test_across_runs_takes_the_median_ratio_against_the_goal_and_sums_what_was_applied_twice(tmp_path, capsys):
    runs = [_run_json(tmp_path / "a", 0, 0.95, 0.90, 1.0, 0.05),   # final losses of free: 0.04, 0.05, 0.06
            _run_json(tmp_path / "b", 1, 0.91, 0.85, 0.97, 0.07, twice=1),
            _run_json(tmp_path / "c", 2, 0.99, 0.93, 1.05, 0.03)]
    assert chaos.main(["--across", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| goodput, commlab over free"))
    assert "| 0.950 | met (goal >= 0.93) |" in row  # the median of 0.95, 0.91, 0.99
    share = next(line for line in out.splitlines() if line.startswith("| goodput share"))
    assert "| 1.950 | median > 1; intervals above 1 in 3 of 3 |" in share
    commlab = next(line for line in out.splitlines() if line.startswith("| commlab "))
    assert "| 10 / 10 / 10 | 1 |" in commlab and "0.0400 to 0.0600" in commlab and "2 of 3 at or below" in commlab
    _run_json(tmp_path / "d", 3, 0.80, 0.7, 0.9, 0.05, exchanger=["ring://?min_workers=1"])
    assert chaos.main(["--across", str(runs[0]), str(tmp_path / "d")]) == 2  # runs of other settings
    assert "differ in more than --seed" in capsys.readouterr().err
    assert chaos.goodput_floor({"mtbf": 20, "exchanger": ["ring://"]}) == 0.88
    assert chaos.goodput_floor({"mtbf": 10, "exchanger": None}) == 0.88
    assert chaos.goodput_floor({"mtbf": 30, "servers": True}) == 0.90


# ----- the accounting, from a real run ------------------------------------------------------------
def smoke(out: Path, entries: str, seed: int = 2) -> dict:
    """A tiny run: 2 workers, a 2 s window, one kill (seed 2: at 1.1 s, slot 1), no cap (the tests' cores)."""
    argv = [sys.executable, "-m", "bench", "chaos", "--mtbf", "2", "--duration", "2", "--workers", "2", "--model",
            "tiny", "--cap", "0", "--entries", entries, "--seed", str(seed), "--out", str(out)]
    done = run_group(argv, timeout=240, grace=15, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "chaos.json").read_text())


@pytest.mark.multiproc
def test_a_tiny_chaos_run_counts_from_the_logs_and_a_replayed_step_is_applied_twice(tmp_path):
    doc = smoke(tmp_path / "run", "restart-all")
    assert [k["at"] for k in doc["schedule"]] == pytest.approx([1.1178], abs=1e-3)
    ra = doc["entries"]["restart-all"]
    assert len(ra["kills"]) == 1 and ra["kills"][0]["slot"] == 1
    for e in (ra,):
        assert e["applied_twice"] == [] and e["samples"] > 0 and e["servers_applied_twice"] == [0]
        # the samples counted are the logged steps', each once: batch 32 per slot and step
        assert e["samples"] == 32 * sum(1 for _ in logged_in_window(tmp_path / "run" / e["entry"], e))
    assert "commlab" in doc["missing"] or "commlab" not in doc["entries"]
    assert (tmp_path / "run" / "chaos.md").read_text().count("| restart-all |") == 1
    assert ra["kills"][0]["heal_s"] is not None  # the job ran on past the window until the slot healed
    # a step replayed by a new process of the same slot (as a restart that resumed a step early would)
    folder = tmp_path / "copy"
    shutil.copytree(tmp_path / "run" / "restart-all", folder)
    recs = chaos.read_steps(folder)
    step = next(r for r in recs if r.get("ev") == "step" and r["slot"] == 0)
    (folder / "steps" / "slot0.999999.jsonl").write_text(json.dumps(dict(step, pid=999999, t=step["t"] + 0.5)) + "\n")
    again = chaos.account(chaos.read_steps(folder), [], ra["t0"], 2.0)
    assert again["applied_twice"] == [{"slot": 0, "step": step["step"], "pids": [step["pid"], 999999]}]
    assert again["samples"] == ra["samples"]  # the replay's samples are not counted twice
    assert not list(Path("/sys/fs/cgroup/cpu").glob("commlab-chaos-*")) if Path("/sys/fs/cgroup/cpu").exists() else True


def logged_in_window(folder: Path, e: dict):
    seen = set()
    for r in chaos.read_steps(folder):
        if r.get("ev") == "step" and e["t0"] <= r["t"] < e["t0"] + e["duration_s"] and (r["slot"], r["step"]) not in seen:
            seen.add((r["slot"], r["step"]))
            yield r


@pytest.mark.full
@pytest.mark.multiproc
def test_every_entry_of_a_tiny_chaos_run_reports_its_kills_and_applies_nothing_twice(tmp_path):
    pytest.importorskip("torchft", reason="the torchft peer needs torchft-nightly (.[peers])")
    doc = smoke(tmp_path / "run", ",".join(chaos.ENTRIES))
    for name, e in doc["entries"].items():
        assert e.get("error") is None, (name, e.get("error"))
        assert e["applied_twice"] == [] and e["samples"] > 0, name
        assert len(e["kills"]) == (1 if name in chaos.REFERENCE else 0), name
        assert all(k["heal_s"] is not None for k in e["kills"]), name
    assert {v["a"] for v in doc["verdicts"]} >= {"restart-all", "torchft"}
    # commlab against the same job with its flags and no kills; restart-all against the plain job
    assert {v["label"] for v in doc["verdicts"]} >= {"goodput, commlab over free-kg", "goodput, restart-all over free"}


def test_the_at_scale_table_from_given_components_or_a_chaos_run(tmp_path, capsys):
    assert F.main(["--restart-s", "12", "--stall-s", "0.3", "--heal-s", "6", "--lost-s", "0.5",
                   "--rendezvous-per-rank-s", "1e-4", "--workers", "1000,10000", "--mtbf-hours", "50"]) == 0
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 1")]
    c = F.Components(12.0, 4, 1e-4, 0.3, 6.0, 0.5)
    want = F.table(c, (1000, 10000), (50.0,))
    assert [r.split("|")[5].strip() for r in rows] == [f"{w['restart_all']:.1%}" for w in want]
    assert F.main(["--stall-s", "1"]) == 2 and "--restart-s" in capsys.readouterr().err
    (tmp_path / "chaos.json").write_text(json.dumps({"at_scale": {"components": F.as_dict(c)}}))
    assert F.main(["--chaos", str(tmp_path / "chaos.json"), "--mtbf-hours", "50"]) == 0
    assert [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 1")] == rows


# ----- the keep-going probe (python -m bench.probes keepgoing): issue 38's figures from a real job ---------------
@pytest.mark.multiproc
@pytest.mark.parametrize("sig, heal, at", [("kill", "replace", 3),
                                           pytest.param("stop", "spares", 25, marks=pytest.mark.full)])
def test_the_keepgoing_probe_times_the_survivors_next_step_and_the_heal_from_the_logs(tmp_path, sig, heal, at):
    """One run, the tiny model, rank 1 signalled at the top of step ``at``: the survivors' first step after the
    signal is that step itself (sync: it waited for rank 1's loss); after a kill the replacement, a new process of
    slot 1, enters at a later step and logs its first step after the survivors' step; the plain start is
    timed. Orders and counts only, never a time. SIGSTOP comes at step 25 (0.5 s of steps in): a worker frozen
    before its heartbeat connection's first zmq PING (heartbeat_s / 4 after it connects) is never dropped,
    since the shard learns the TTL from that PING (a limit of the product, found by this probe)."""
    from test_restart import _leftovers
    shm_before = set(os.listdir("/dev/shm"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "kg.json"
    argv = [sys.executable, "-m", "bench.probes", "keepgoing", "--signal", sig, "--heal", heal, "--runs", "1",
            "--model", "tiny", "--kill-at", str(at), "--step-sleep", "0.02", "--deadline", "120", "--out", str(out)]
    done = run_group(argv, timeout=180, grace=15, env=child_env(TMPDIR=tmp_path / "tmp"), capture_output=True,
                     text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _leftovers(tmp_path, shm_before)  # its scratch folder, the job's segments
    doc = json.loads(out.read_text())
    assert (doc["signal"], doc["heal"], doc["kill_at"], doc["model"]) == (sig, heal, at, "tiny")
    assert doc["next_step_goal_s"] == (0.5 if sig == "kill" else 1.5)
    assert ("heartbeat_s=1" in doc["url"]) == (sig == "stop")
    (run,) = doc["runs"]
    assert "error" not in run, run
    assert run["signal_step"] == at and run["next_step"] == at and run["next_step_slot"] in (0, 2), run
    assert run["next_step_s"] > 0 and run["step_s_before"] > 0 and run["process_start_s"] > 0, run
    if sig == "kill":
        assert run["entered_at"] > at and run["replacement_pid"] != run["victim_pid"], run
        assert run["heal_s"] > run["next_step_s"], run  # its first step follows the survivors' step 3
    else:
        assert "heal_s" not in run
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 1 |"))
    assert row.startswith(f"| 1 | {at} | {run['next_step_s']:.3g} | {at} |"), row
    assert chaos.held_up({"t": 2.0, "pid": 7, "step": 4}, {"t": 1.0, "pid": 8, "step": 4})
    assert not chaos.held_up({"t": 2.0, "pid": 7, "step": 3}, {"t": 1.0, "pid": 8, "step": 4})  # its pushes were in
    assert chaos.held_up({"t": 2.0, "pid": 7, "step": 3}, {"t": 1.0, "pid": 8})  # the chaos bench's kills name no step


def test_the_keepgoing_probe_refuses_bad_options_in_one_line(capsys):
    from bench import probes
    for argv, option in [(["--runs", "0"], "--runs"), (["--kill-at", "0"], "--kill-at"), (["--model", "big"], "--model"),
                         (["--signal", "stop", "--heartbeat-s", "0.01"], "--heartbeat-s")]:
        assert probes.main(["keepgoing", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and option in err[0] and err[0].startswith("python -m bench.probes keepgoing:"), err
