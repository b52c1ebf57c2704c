"""commlab.launch.scratch: folders named by their owner; the sweep removes those whose owner is gone, only those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from commlab.launch import launcher, scratch
from commlab.transport import shm
from conftest import child_env

OWNER = """
import sys, time
from commlab.launch import scratch
path = scratch.mkdtemp("ring", sys.argv[1])
open(path + "/r0", "w").close()
print(path, flush=True)
time.sleep(600)
"""


def _owner(directory: Path) -> tuple[subprocess.Popen, str]:
    p = launcher.start_group([sys.executable, "-c", OWNER, str(directory)], child_env(), stdout=subprocess.PIPE,
                             text=True)
    line = p.stdout.readline().strip()
    assert line, "the owner printed no folder"
    return p, line


def test_a_killed_owners_folder_is_swept_and_a_live_ones_stays(tmp_path):
    dead, dead_path = _owner(tmp_path)
    live, live_path = _owner(tmp_path)
    stranger = tmp_path / "commlab-not-ours"
    stranger.mkdir()
    try:
        assert Path(dead_path).name.startswith(f"commlab-ring-{dead.pid}.{shm.start_time(dead.pid)}-")
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert os.path.exists(dead_path + "/r0")  # SIGKILL runs no clean-up
        assert scratch.sweep_stale(str(tmp_path)) == [dead_path]
        assert not os.path.exists(dead_path) and os.path.exists(live_path + "/r0") and stranger.is_dir()
    finally:
        live.kill()
        live.wait(10)
    assert scratch.sweep_stale(str(tmp_path)) == [live_path]


def test_a_reused_pid_is_not_the_owner(tmp_path):
    folder = tmp_path / f"commlab-job-{os.getpid()}.{shm.start_time(os.getpid()) + 1}-abc_123x"
    folder.mkdir()
    mine = scratch.mkdtemp("job", str(tmp_path))
    assert scratch.sweep_stale(str(tmp_path)) == [str(folder)] and os.path.isdir(mine)


def test_the_folder_block_removes_its_folder_also_on_errors(tmp_path):
    with pytest.raises(RuntimeError):
        with scratch.folder("case", str(tmp_path)) as path:
            Path(path, "x").write_text("y")
            raise RuntimeError("boom")
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="lower-case"):
        scratch.mkdtemp("Bad-Kind", str(tmp_path))
