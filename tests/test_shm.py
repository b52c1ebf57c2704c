"""commlab.transport.shm: a segment's file goes away on normal exit, on SIGTERM, and (found by the next start's sweep)
after SIGKILL; the sweep never touches a live owner's entries or names that are not commlab's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from commlab.launch import launcher
from commlab.transport import shm
from commlab.base.errors import ProtocolError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason=f"needs {shm.SHM_DIR}")

OWNER = """
import sys, time
from commlab.transport import shm
seg = shm.Segment.create(sys.argv[1], "t-out", 1 << 20)
seg.array()[:4] = [1, 2, 3, 4]
print(seg.path, flush=True)
if sys.argv[2] == "sleep":
    time.sleep(60)
"""


def _owner(run: str, mode: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = launcher.start_group([sys.executable, "-c", OWNER, run, mode], env, stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert path.startswith(f"{shm.SHM_DIR}/commlab-{run}-{proc.pid}."), path
    return proc, path


def test_normal_exit_unlinks():
    proc, path = _owner(shm.new_run_id(), "exit")
    assert proc.wait(30) == 0
    assert not os.path.exists(path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_unlink_and_still_terminate(sig):
    proc, path = _owner(shm.new_run_id(), "sleep")
    try:
        assert os.path.exists(path)
        proc.send_signal(sig)
        # SIGTERM: our handler removes the file, then the process dies by the signal as before; Ctrl-C:
        # KeyboardInterrupt ends the interpreter normally (exit handlers run), then Python re-raises SIGINT
        assert proc.wait(30) == -sig
        assert not os.path.exists(path)
    finally:
        proc.kill()
        proc.wait(10)


def test_sigkill_leaves_an_entry_that_the_next_sweep_removes():
    run = shm.new_run_id()
    dead, dead_path = _owner(run, "sleep")
    live, live_path = _owner(run, "sleep")
    stranger = Path(shm.SHM_DIR, f"commlab-not-ours-{run}")
    stranger.write_bytes(b"x")
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        assert os.path.exists(dead_path)  # SIGKILL runs no handler
        attached = shm.Segment.attach(live_path, 1 << 20)  # another process can map the live one
        assert list(attached.array()[:4]) == [1, 2, 3, 4]
        attached.close()
        removed = shm.sweep_stale()
        assert dead_path in removed and not os.path.exists(dead_path)
        assert os.path.exists(live_path) and stranger.exists()  # a live owner's, and a name not in the pattern
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(10)
        stranger.unlink()
    shm.sweep_stale()  # the second owner was killed too
    assert not os.path.exists(live_path)


def test_a_reused_pid_is_not_the_owner():
    """The name carries the owner's start time: the same pid with another start time is a dead owner."""
    name = f"commlab-{shm.new_run_id()}-{os.getpid()}.{shm.start_time(os.getpid()) + 1}-t-out"
    path = Path(shm.SHM_DIR, name)
    path.write_bytes(b"")
    try:
        assert str(path) in shm.sweep_stale()
    finally:
        path.unlink(missing_ok=True)


def test_attach_refuses_what_is_not_a_segment(tmp_path):
    seg = shm.Segment.create(shm.new_run_id(), "t-small", 64)
    try:
        with pytest.raises(ProtocolError, match="expected at least"):
            shm.Segment.attach(seg.path, 1 << 20)
        with pytest.raises(ProtocolError, match="not a commlab shared-memory segment name"):
            shm.Segment.attach(str(tmp_path / "x"))
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def test_sigterm_guard_is_set_only_while_something_is_tracked():
    import signal as sg
    before = sg.getsignal(sg.SIGTERM)
    seg = shm.Segment.create(shm.new_run_id(), "t-guard", 64)
    try:
        assert sg.getsignal(sg.SIGTERM) is not before  # ours, while the file exists
        seg.unlink()
        assert sg.getsignal(sg.SIGTERM) is before  # the process's own disposition again
    finally:
        seg.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (a container's small /dev/shm in miniature); needs root and mount(2)."""
    where = tmp_path / "shm"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_tmpfs_is_a_clear_error_at_create_not_a_sigbus_later(tiny_tmpfs):
    import errno
    with pytest.raises(OSError, match=r"has no room for a 4198400-byte segment \(1048576 bytes free\).*--shm-size.*"
                                      r"transport=tcp") as info:
        shm.Segment.create(shm.new_run_id(), "r0-out", 4 << 20, directory=tiny_tmpfs)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tiny_tmpfs) == []  # nothing left behind
    seg = shm.Segment.create(shm.new_run_id(), "r0-out", 512 << 10, directory=tiny_tmpfs)
    seg.array()[:] = 7  # every page is there: no SIGBUS
    seg.close()
    assert os.listdir(tiny_tmpfs) == []
