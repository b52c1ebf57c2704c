"""The launcher: nothing left behind when it is told to stop (SIGTERM, a scheduler's cancel), when a
rank fails, when the deadline passes or when the launcher itself is killed; the failing rank named;
a bad URL refused in one line before anything starts; a summary line even through a pipe."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import commlab
from commlab.launch import launcher, scratch

from conftest import REAL_STARTS, child_env, run_group

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def real_starts(monkeypatch):
    """The launcher's stops, its children's death with it and its deadline are tested with real starts:
    no fork server (tests/zygote.py) for the commands these tests start, nor for what those start (the
    tests find the ranks as the launcher's children in /proc). The rest may be forked."""
    for key, value in REAL_STARTS.items():
        monkeypatch.setenv(key, value)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


NEEDS_PROC_CHILDREN = pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="needs /proc/PID/task/PID/children to find the launcher's processes")

# a rank that does nothing but wait: launcher behaviour without torch's start-up cost in the ranks
SLEEPER = """
import os, subprocess, sys, time
code = int(os.environ.get("FAIL_RANK_" + os.environ["RANK"], "-1"))
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} up", flush=True)
if os.environ.get("GRANDCHILD_PID_FILE") and os.environ["RANK"] == "0":  # a process of the rank's own
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["GRANDCHILD_PID_FILE"] + ".tmp", "w") as fh:
        fh.write(str(kid.pid))
    os.replace(os.environ["GRANDCHILD_PID_FILE"] + ".tmp", os.environ["GRANDCHILD_PID_FILE"])
if code >= 0:
    time.sleep(float(os.environ.get("FAIL_AFTER_S", "0")))
    print("this rank fails on purpose", file=sys.stderr, flush=True)
    sys.exit(code)
time.sleep(600)
"""


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "commlab.tools.cli", *args]


def _wait_children(proc: subprocess.Popen, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(_children(proc.pid)) < n:
        assert proc.poll() is None, f"the launcher exited early: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"the launcher started {_children(proc.pid)}, not {n} processes"
        time.sleep(0.1)
    return _children(proc.pid)


def _gone(pids: list[int], within: float = 10) -> list[int]:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


LONG_JOBS = {
    # one parameter server and two ranks, training far longer than the test waits
    "train": ["train", "--no-progress", "--exchanger", "ps://?shards=1", "--workers", "2", "--model", "tiny",
              "--steps", "1000000"],
    # the same shape for a user's script (ranks that only wait: the launcher is what is tested)
    "run": ["run", "--exchanger", "ps://?shards=1&mode=sync", "--workers", "2", "SCRIPT"],
}


@pytest.mark.multiproc
@NEEDS_PROC_CHILDREN
@pytest.mark.parametrize("command", sorted(LONG_JOBS))
@pytest.mark.usefixtures("real_starts")
def test_sigterm_stops_every_server_and_rank_and_says_so(command, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    args = [str(script) if a == "SCRIPT" else a for a in LONG_JOBS[command]]
    proc = subprocess.Popen(_cli(args), cwd=ROOT, env=child_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        started = _wait_children(proc, 3)
        time.sleep(1.0)  # let them get into their work (the servers listening, the ranks connecting)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert f"commlab {command}: terminated (SIGTERM); stopped every process" in err, err
        assert not _gone(started), f"left running after SIGTERM: {started}"
    finally:
        launcher.kill_groups([proc], grace=0)


@pytest.mark.multiproc
@NEEDS_PROC_CHILDREN
@pytest.mark.usefixtures("real_starts")
def test_ctrl_c_stops_every_rank_and_says_so(tmp_path):
    """The ranks lead process groups of their own, so a terminal's Ctrl-C reaches the launcher only:
    the launcher must stop them."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(_cli(["run", "--workers", "2", "--exchanger", "noop://", str(script)]), cwd=ROOT,
                            env=child_env(), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        started = _wait_children(proc, 2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "commlab run: interrupted; stopped every process" in err, err
        assert not _gone(started), f"left running after Ctrl-C: {started}"
    finally:
        launcher.kill_groups([proc], grace=0)


@pytest.mark.multiproc
@NEEDS_PROC_CHILDREN
@pytest.mark.usefixtures("real_starts")
def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: its ranks, each in a process group of its
    own, must still go (the parent-death signal set by commlab/launch/childexec.py), and the scratch folder
    it leaves is removed by the next start's sweep (commlab.launch.scratch)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(_cli(["run", "--workers", "2", "--exchanger", "noop://", str(script)]), cwd=ROOT,
                            env=child_env(TMPDIR=tmp), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        started = _wait_children(proc, 2)
        proc.kill()
        proc.wait(30)
        assert not _gone(started), f"outlived their launcher: {started}"
        left = sorted(str(p) for p in tmp.iterdir())
        assert len(left) == 1 and Path(left[0]).name.startswith(f"commlab-job-{proc.pid}."), left
        assert scratch.sweep_stale(str(tmp)) == left and not any(tmp.iterdir())
    finally:
        launcher.kill_groups([proc], grace=0)
        for pid in started:  # in their own process groups: not reached by kill_groups
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.multiproc
@NEEDS_PROC_CHILDREN
@pytest.mark.usefixtures("real_starts")
def test_the_failing_rank_is_named_with_its_log_and_the_others_stopped_with_what_they_started(tmp_path):
    script, grandchild = tmp_path / "sleeper.py", tmp_path / "grandchild.pid"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(_cli(["run", "--workers", "3", "--exchanger", "noop://", str(script)]), cwd=ROOT,
                            env=child_env(FAIL_RANK_1=3, FAIL_AFTER_S=3, GRANDCHILD_PID_FILE=grandchild),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = _wait_children(proc, 3)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 3, err
        assert "commlab run: rank 1 failed first (exit code 3); stopped the others" in err, err
        assert "this rank fails on purpose" in err, err  # the tail of rank 1's log
        started.append(int(grandchild.read_text()))  # rank 0's own child, in rank 0's process group
        assert not _gone(started), f"left running after rank 1 failed: {started}"
    finally:
        launcher.kill_groups([proc], grace=0)


@pytest.mark.multiproc
@pytest.mark.usefixtures("real_starts")
def test_deadline_stops_the_job(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    r = run_group(_cli(["run", "--workers", "2", "--deadline", "3", "--exchanger", "noop://", "--log-dir",
                        str(tmp_path / "logs"), str(script)]), 120, cwd=ROOT, env=child_env(),
                  capture_output=True, text=True)
    assert r.returncode == 124, r.stderr
    assert "passed its deadline of 3s with rank 0, rank 1 still running" in r.stderr, r.stderr
    assert "rank 1 of 2 up" in (tmp_path / "logs" / "rank1.log").read_text()


@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("url, complaint", [
    ("ps://?mode=bogus", "option 'mode': 'bogus' is not one of"),
    ("ring://?chunk=3", "ring:// does not know option 'chunk'"),
    ("nope://", "unknown exchanger scheme 'nope://'"),
])
def test_a_bad_url_is_one_line_naming_the_option_and_starts_nothing(command, url, complaint):
    args = [command, "--exchanger", url] + (["examples/charlm.py"] if command == "run" else [])
    r = run_group(_cli(args), 60, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"commlab {command}: --exchanger {url!r}: "), r.stderr
    assert complaint in lines[0], lines[0]


@pytest.mark.multiproc
def test_train_ends_with_a_summary_through_a_pipe(tmp_path):
    r = run_group(_cli(["train", "--exchanger", "ps://?shards=2&mode=sync", "--workers", "2", "--model", "tiny",
                        "--steps", "3"]), 120, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("commlab train: 2 ranks of workers, ps://?shards=2&mode=sync: 3 steps in "), r.stdout
    assert "final loss" in line and "test accuracy" in line and "sent" in line, line


def test_reported_endpoints_replace_the_planned_ones_in_server_order():
    from commlab.launch.launcher import with_endpoints

    url = "ps://?mode=sync&endpoints=tcp://127.0.0.1:0,tcp://127.0.0.1:0,tcp://127.0.0.1:0"
    got = with_endpoints(url, ["tcp://127.0.0.1:0"] * 3,
                         ["tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002", "tcp://127.0.0.1:4003"])
    assert got == "ps://?mode=sync&endpoints=tcp://127.0.0.1:4001,tcp://127.0.0.1:4002,tcp://127.0.0.1:4003"
    ipc = "ps://?endpoints=ipc:///tmp/x/shard0,ipc:///tmp/x/shard1"
    assert with_endpoints(ipc, ["ipc:///tmp/x/shard0", "ipc:///tmp/x/shard1"],
                          ["ipc:///tmp/x/shard0", "ipc:///tmp/x/shard1"]) == ipc
    with pytest.raises(commlab.ConfigError, match="does not name server endpoint 'tcp://127.0.0.1:0'"):
        with_endpoints("ps://?endpoints=ipc:///a", ["tcp://127.0.0.1:0"], ["tcp://127.0.0.1:1"])


def test_a_dead_servers_endpoint_is_swapped_only_where_it_stands_whole():
    """commlab run's URL for a replacement (ReplicaSets.current): the exited server's endpoint, not a longer one it
    begins (a port that begins another, a socket path that begins another)."""
    from commlab.launch.launcher import swap_endpoint

    assert swap_endpoint("ps://127.0.0.1:5555,127.0.0.1:55556?mode=sync", "127.0.0.1:5555", "127.0.0.1:7") == \
        "ps://127.0.0.1:7,127.0.0.1:55556?mode=sync"
    assert swap_endpoint("ps://?endpoints=tcp://h:55556,tcp://h:5555&x=1", "tcp://h:5555", "tcp://g:1") == \
        "ps://?endpoints=tcp://h:55556,tcp://g:1&x=1"
    assert swap_endpoint("ps://?endpoints=ipc:///t/s01,ipc:///t/s0/x,ipc:///t/s0", "ipc:///t/s0", "ipc:///t/n") == \
        "ps://?endpoints=ipc:///t/s01,ipc:///t/s0/x,ipc:///t/n"


def test_a_plan_binds_port_0_and_start_servers_hands_the_workers_what_each_server_bound(tmp_path):
    from commlab.launch.launcher import bind_of, server_plan, start_servers, stop_all

    procs = []
    with server_plan("ps://?shards=2&mode=sync", 2) as (template, argvs):
        assert [bind_of(a) for a in argvs] == ["tcp://127.0.0.1:0"] * 2
        assert "endpoints=tcp://127.0.0.1:0,tcp://127.0.0.1:0" in template
        try:  # a prefix per server (ip netns exec NS for a namespace; here a harmless one)
            url = start_servers(template, argvs, child_env(), tmp_path, 60, procs, prefix=lambda i: ["env", f"S={i}"])
        finally:
            stop_all(procs)
    ports = [int(e.rsplit(":", 1)[1]) for e in url.split("endpoints=")[1].split("&")[0].split(",")]
    assert all(p > 0 for p in ports) and len(set(ports)) == 2, url
    assert [p.name for p in procs] == ["server 0", "server 1"]
    assert "listening on" in (tmp_path / "server1.log").read_text()


def test_a_store_in_a_process_of_its_own_reports_its_port(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    from commlab.launch.launcher import start_store, stop_all

    procs = []
    try:
        port = start_store("127.0.0.1", ["env"], child_env(), tmp_path / "store.log", 60, procs)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                               wait_for_workers=False, use_libuv=True)
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        stop_all(procs)
    assert procs[0].popen.returncode != 0  # served until stopped


def test_report_writes_one_json_line_per_call_to_the_rank_s_own_file(tmp_path, monkeypatch):
    from commlab.core.metrics import last_record, metrics_path, summary

    base = tmp_path / "m.jsonl"
    monkeypatch.delenv("COMMLAB_METRICS", raising=False)
    assert commlab.report(0, loss=1.0) is None  # no launcher asked: nothing written
    monkeypatch.setenv("COMMLAB_METRICS", str(base))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    step = commlab.StepReport(step=4, wait_s=0.5, bytes_sent=2_000_000, bytes_received=1_000)
    commlab.report(4, loss=0.25, exchange=step)
    assert metrics_path(base, 1) == tmp_path / "m.jsonl.rank1" and not base.exists()
    rec = last_record(metrics_path(base, 1))
    assert isinstance(rec.pop("unix_s"), float)  # report stamps when the line was written
    assert rec == {"step": 4, "rank": 1, "bytes_sent": 2_000_000, "bytes_received": 1_000, "comm_s": 0.5,
                   "exchanges": 1, "loss": 0.25}
    commlab.report(9, path=base, rank=0, loss=0.125, test_acc=0.875, bytes_sent=1500)
    assert summary(last_record(base), 3.0) == ("10 steps in 3.0 s, final loss 0.125, test accuracy 87.5%, "
                                               "1.5 KiB sent per step by rank 0")
    commlab.report(10, path=base, rank=0, exchange=dataclasses.replace(step, exchanges=2))
    assert summary(last_record(base), 3.0).endswith("1.9 MiB sent, 1000 B received in 2 exchanges per step by rank 0")
    assert "no metrics reported" in summary(None, 1.0)


def test_how_a_process_starts_is_the_callers_and_the_environment_names_only_a_module(tmp_path):
    """start_group and a Job start through the starter they are given; without one, through the module
    $COMMLAB_STARTER names (how a harness reaches the launchers its commands run), else the ordinary way."""
    import zygote
    from commlab.base.errors import ConfigError

    asked: list[list[str]] = []

    def recording(argv, env, **popen_kw):
        asked.append(list(argv))
        return launcher.plain_start(argv, env, **popen_kw)

    p = launcher.start_group([sys.executable, "-c", "print('hi')"], child_env(), starter=recording,
                             stdout=subprocess.PIPE, text=True)
    assert p.communicate(timeout=120)[0] == "hi\n" and p.returncode == 0
    code = launcher.run_job(launcher.Job(("-c", "pass"), workers=2, env=child_env(), starter=recording,
                                         summary=False, log_dir=str(tmp_path)))
    assert code == 0 and asked[0][-1] == "print('hi')" and len(asked) == 3  # the command, then the job's 2 ranks
    assert launcher.starter_from_env({}) is launcher.plain_start
    assert launcher.starter_from_env({launcher.STARTER_ENV: "zygote"}) is zygote.start
    with pytest.raises(ConfigError, match=r"\$COMMLAB_STARTER='no_such_starter' names no importable module"):
        launcher.starter_from_env({launcher.STARTER_ENV: "no_such_starter"})
