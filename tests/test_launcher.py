"""The launcher leaves nothing behind when it is told to stop: SIGTERM (kill, a scheduler's cancel)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import child_env, kill_group

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.multiproc
@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="needs /proc/PID/task/PID/children to find the launcher's processes")
def test_sigterm_stops_every_server_and_rank_and_says_so():
    # one parameter server and two ranks, training far longer than the test waits
    argv = [sys.executable, "-m", "commlab.cli", "train", "--no-progress", "--exchanger", "ps://?shards=1",
            "--workers", "2", "--model", "tiny", "--steps", "1000000"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 3:
            assert proc.poll() is None, f"the launcher exited early: {proc.stderr.read()}"
            assert time.monotonic() < deadline, f"the launcher started {_children(proc.pid)}, not 3 processes"
            time.sleep(0.1)
        started = _children(proc.pid)
        time.sleep(1.0)  # let them get into their work (the servers listening, the ranks connecting)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "terminated (SIGTERM); stopped every process" in err, err
        deadline = time.monotonic() + 10  # they were reaped by the launcher: gone, not zombies
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if _alive(p)], f"left running after SIGTERM: {started}"
    finally:
        kill_group(proc)
