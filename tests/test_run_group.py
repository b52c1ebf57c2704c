"""conftest.run_group: a deadline (or an exception) stops a command and everything it started.

The command is a small parent that starts a sleeping child of its own and writes that
grandchild's pid to a file. ``subprocess.run(..., timeout=...)`` would kill the parent only and
leave the grandchild sleeping; run_group must leave nothing.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import GroupTimeout, run_group

PARENT = """
import os, subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(str(kid.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # the reader never sees half a pid
time.sleep(600)
"""


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether ``pid`` stops existing within ``within`` seconds (a zombie counts as gone: it is dead,
    only not yet reaped by whichever process inherited it)."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def read_pid(path: Path) -> int:
    assert path.exists(), "the parent never wrote its child's pid (it did not start in time)"
    return int(path.read_text())


def test_a_deadline_kills_the_grandchild_too(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(GroupTimeout, match=r"^the sleeping parent did not finish within 5s; its process group"):
        run_group([sys.executable, "-c", PARENT, str(pidfile)], 5, "the sleeping parent", capture_output=True,
                  text=True)
    pid = read_pid(pidfile)
    assert gone(pid), f"grandchild {pid} still runs after the timeout"


class Interrupted(Exception):
    pass


def test_an_exception_while_waiting_kills_the_grandchild_too(tmp_path):
    """Anything raised inside the wait (here from a signal handler, as Ctrl-C or pytest-timeout would) kills
    the group on its way out. The signal is sent once the grandchild exists, so no deadline is involved."""
    pidfile = tmp_path / "grandchild.pid"

    def interrupt(signum, frame):
        raise Interrupted

    def signal_when_started():
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # to the main thread itself, so its wait is interrupted and the handler runs inside run_group
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=signal_when_started, daemon=True)
    try:
        sender.start()
        with pytest.raises(Interrupted):
            run_group([sys.executable, "-c", PARENT, str(pidfile)], 120, capture_output=True)
    finally:
        sender.join(70)
        signal.signal(signal.SIGUSR1, old)
    pid = read_pid(pidfile)
    assert gone(pid), f"grandchild {pid} still runs after the exception"


def test_a_command_that_finishes_keeps_its_output_and_exit_code(tmp_path):
    done = run_group([sys.executable, "-c", "import os, sys; print(os.getcwd()); print(os.environ['X'], "
                                            "file=sys.stderr); sys.exit(3)"],
                     60, cwd=tmp_path, env=dict(os.environ, X="seen"), capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (3, str(tmp_path), "seen")
    assert isinstance(done, subprocess.CompletedProcess)
