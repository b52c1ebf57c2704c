"""tests/zygote.py, the suite's fork server: a forked child runs its program as a fresh interpreter would (argv, environment,
folder, sys.path, streams, exit status, signals, RNGs), leads a group of its own, and dies with the
process that asked for it; it serves its own user only. The suite's own zygote serves these (conftest),
or one of this module's when the run has none (COMMLAB_ZYGOTE=off)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import zygote
from commlab.launch import launcher

from conftest import child_env


@pytest.fixture(scope="module")
def zygote_env(tmp_path_factory):
    """An environment whose start_group calls go to a zygote (``starter=zygote.start`` here, and
    ``$COMMLAB_STARTER`` in a process started with it); os.environ names it during the module."""
    before = {k: os.environ.get(k) for k in (zygote.ENV, launcher.STARTER_ENV)}
    own = None
    if zygote.socket_path() is None:
        path = str(tmp_path_factory.mktemp("zygote") / "private" / "socket")
        own = launcher.start_group([sys.executable, "-m", zygote.MODULE, path], child_env(),
                                   starter=launcher.plain_start)
        os.environ.update({zygote.ENV: path, launcher.STARTER_ENV: zygote.MODULE})
    yield child_env()
    if own is not None:
        launcher.kill_groups([own], grace=5)
        for k, v in before.items():
            os.environ[k] = v if v is not None else ""


def _start(argv_tail: list[str], env: dict, **kw) -> subprocess.Popen:
    p = launcher.start_group([sys.executable, *argv_tail], env, starter=zygote.start, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, **kw)
    assert isinstance(p, zygote.Popen)
    return p


REPORT = """
import json, os, random, sys
import numpy, torch
print(sys.stdin.read() == "", file=sys.stderr)
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("ZYGOTE_X"), "path0": sys.path[0],
                  "pythonpath": [p for p in sys.path if p.endswith("extra-entry")], "name": __name__,
                  "leader": os.getpgid(0) == os.getpid() == os.getsid(0), "torch": torch.initial_seed(),
                  "numpy": float(numpy.random.random()), "random": random.random()}))
sys.exit(3)
"""


def test_a_child_gets_its_argv_environment_folder_streams_and_exit_code(zygote_env, tmp_path):
    env = dict(zygote_env, ZYGOTE_X="x", PYTHONPATH=os.pathsep.join([str(tmp_path / "extra-entry"),
                                                                     zygote_env["PYTHONPATH"]]))
    reports = []
    for _ in range(2):
        p = _start(["-c", REPORT, "a", "b"], env, cwd=tmp_path)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 3 and err == "True\n", err
        reports.append(json.loads(out))
    first, second = reports
    assert first["argv"] == ["-c", "a", "b"] and first["cwd"] == str(tmp_path) and first["x"] == "x"
    assert first["path0"] == "" and first["pythonpath"] == [str(tmp_path / "extra-entry")]
    assert first["name"] == "__main__" and first["leader"]
    for rng in ("torch", "numpy", "random"):  # reseeded in every child, as fresh interpreters would be
        assert first[rng] != second[rng], rng


def test_a_script_and_a_module_run_as_main_with_their_folder_first(zygote_env, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    body = "import sys, json; print(json.dumps([__name__, sys.argv, sys.path[0]]))\n"
    (tmp_path / "pkg" / "tool.py").write_text(body)
    script = _start([str(tmp_path / "pkg" / "tool.py"), "s"], zygote_env)
    out, err = script.communicate(timeout=120)
    assert script.returncode == 0, err
    assert json.loads(out) == ["__main__", [str(tmp_path / "pkg" / "tool.py"), "s"], str(tmp_path / "pkg")]
    module = _start(["-m", "pkg.tool", "m"], zygote_env, cwd=tmp_path)
    out, err = module.communicate(timeout=120)
    assert module.returncode == 0, err
    assert json.loads(out) == ["__main__", [str(tmp_path / "pkg" / "tool.py"), "m"], str(tmp_path)]
    # a module the zygote preloaded runs as __main__ as in a fresh interpreter: runpy has no warning for it
    preloaded = _start(["-m", "commlab.tools.cli", "--help"], zygote_env)
    out, err = preloaded.communicate(timeout=120)
    assert preloaded.returncode == 0 and "usage: commlab" in out and err == "", err


def test_exceptions_and_signals_end_a_child_as_they_end_an_interpreter(zygote_env):
    failed = _start(["-c", "raise ValueError('boom')"], zygote_env)
    _, err = failed.communicate(timeout=120)
    assert failed.returncode == 1 and err.startswith("Traceback") and "ValueError: boom" in err
    assert "zygote" not in err  # the zygote's own frames are not shown
    said = _start(["-c", "import sys; sys.exit('a message')"], zygote_env)
    assert said.communicate(timeout=120)[1] == "a message\n" and said.returncode == 1
    # SIGINT raises KeyboardInterrupt (Python's default handler); uncaught, the child dies of SIGINT
    sleeper = _start(["-c", "import time; print('up', flush=True); time.sleep(600)"], zygote_env)
    assert sleeper.stdout.readline() == "up\n"
    os.killpg(sleeper.pid, signal.SIGINT)
    _, err = sleeper.communicate(timeout=120)
    assert sleeper.returncode == -signal.SIGINT and "KeyboardInterrupt" in err
    # SIGTERM: the default disposition
    sleeper = _start(["-c", "import time; print('up', flush=True); time.sleep(600)"], zygote_env)
    assert sleeper.stdout.readline() == "up\n"
    launcher.kill_groups([sleeper], grace=5)
    assert sleeper.returncode == -signal.SIGTERM


def test_a_missing_folder_fails_the_start_as_popen_does(zygote_env, tmp_path):
    with pytest.raises(FileNotFoundError):
        launcher.start_group([sys.executable, "-c", "pass"], zygote_env, starter=zygote.start, cwd=tmp_path / "nowhere")


def test_an_exited_child_stays_a_zombie_until_waited_for_as_a_child_of_ones_own(zygote_env):
    """Its pid (and group id) is not reused before the requester has its status, and is gone once
    ``wait`` returns (what a sweep of a dead pid's leftovers relies on)."""
    p = _start(["-c", "pass"], zygote_env)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.02)
    assert p.wait(60) == 0 and not Path(f"/proc/{p.pid}").exists()


REQUESTER = """
import subprocess, sys, time
from commlab.launch import launcher
p = launcher.start_group([sys.executable, "-c", "import time; time.sleep(600)"])
print(p.pid, type(p).__module__, flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_the_process_that_asked_for_it(zygote_env):
    """The requester is SIGKILLed (no clean-up of its own): the zygote kills the child it asked for. The
    requester names no starter: it finds the zygote through ``$COMMLAB_STARTER``, as a launcher a test runs."""
    requester = subprocess.Popen([sys.executable, "-c", REQUESTER], env=zygote_env, stdout=subprocess.PIPE,
                                 text=True, start_new_session=True)
    try:
        pid, kind = requester.stdout.readline().split()
        assert kind == zygote.MODULE
        os.kill(int(pid), 0)  # running
        requester.kill()
        requester.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"pid {pid} outlived its requester by 30 s")
    finally:
        launcher.kill_groups([requester], grace=0)


def test_only_this_interpreter_with_a_program_is_served():
    assert zygote.serves([sys.executable, "-m", "workers"]) and zygote.serves([sys.executable, "x.py", "-v"])
    assert zygote.serves([sys.executable, "-c", "pass"])
    assert not zygote.serves([sys.executable, "-u", "x.py"]) and not zygote.serves([sys.executable, "-m"])
    assert not zygote.serves(["/usr/bin/env", "python3", "x.py"]) and not zygote.serves(["env", "-i", sys.executable])
    assert zygote.split(["env", "A=1", "B=x=y", sys.executable, "x.py"]) == (None, {"A": "1", "B": "x=y"},
                                                                              [sys.executable, "x.py"])
    assert zygote.serves(["ip", "netns", "exec", "ns", sys.executable, "x.py"]) == (os.geteuid() == 0)


NETNS = "import os; print(os.stat('/proc/self/ns/net').st_ino, os.environ['ZYGOTE_X'])"


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0,
                    reason="needs root and iproute2")
def test_a_child_joins_the_network_namespace_ip_netns_exec_names(zygote_env):
    name = f"zygote-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        real = subprocess.run(["ip", "netns", "exec", name, "stat", "-L", "-c", "%i", "/proc/self/ns/net"],
                              capture_output=True, text=True, check=True, timeout=30).stdout.split()
        p = launcher.start_group(["ip", "netns", "exec", name, "env", "ZYGOTE_X=in", sys.executable, "-c", NETNS],
                                 zygote_env, starter=zygote.start, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        assert isinstance(p, zygote.Popen)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.split() == [real[0], "in"] and real[0] != str(os.stat("/proc/self/ns/net").st_ino)
    finally:
        subprocess.run(["ip", "netns", "delete", name], timeout=30)


STRANGER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    sock.connect(sys.argv[1])
except PermissionError:
    print("no entry")
    sys.exit()
try:
    socket.send_fds(sock, [bytes.fromhex(sys.argv[2])], [0, 1, 2])
    sock.settimeout(60)
    reply = sock.recv(1 << 20)
    if reply:  # the child's pid; stay until its exit status comes (closing first would kill it)
        reply = sock.recv(1 << 20)
except OSError:
    reply = b""
print("served" if reply else "closed")
"""


def _ask_as(uid: int | None, path: Path, request: bytes) -> str:
    """What a client running as ``uid`` (None: this process's) gets from the zygote at ``path``."""
    who = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", STRANGER, str(path), request.hex()], capture_output=True,
                          text=True, timeout=60, **who)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


SYSTEM_PYTHON = "/usr/bin/python3"  # another user cannot enter the folders of this venv's interpreter


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root (to be another user)")
def test_only_the_zygotes_own_user_reaches_it_or_is_served(tmp_path):
    """The socket is 0600 in a 0700 folder; a client of another uid (nobody) cannot pass the folder, and
    where it can reach the socket (the modes loosened here, as a careless umask or folder would), the
    zygote closes its connection unread (SO_PEERCRED), counts it and says so; its own user is served."""
    import msgpack

    base = Path(tempfile.mkdtemp(prefix="commlab-zgtest-"))
    try:
        base.chmod(0o711)  # the test's own folder may be entered: only the zygote's keeps a stranger out
        folder, path, ran = base / "private", base / "private" / "socket", base / "ran"
        own = launcher.start_group([sys.executable, "-m", zygote.MODULE, "--bare", str(path)], child_env(),
                                   starter=launcher.plain_start, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not path.exists():
                assert own.poll() is None and time.monotonic() < deadline, "the zygote did not bind its socket"
                time.sleep(0.05)
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_ISSOCK(path.stat().st_mode) and [p.name for p in folder.iterdir()] == ["socket"]
            request = msgpack.packb({"argv": [sys.executable, "-c", f"open({str(ran)!r}, 'w').close()"],
                                     "netns": None, "env": child_env(), "cwd": str(base)})
            assert _ask_as(NOBODY, path, request) == "no entry"
            folder.chmod(0o711)
            path.chmod(0o666)
            assert _ask_as(NOBODY, path, request) == "closed"
            assert not ran.exists()  # nothing ran
            assert _ask_as(None, path, request) == "served" and ran.exists()  # the same request, from its own user
        finally:
            launcher.kill_groups([own], grace=5)
        log = own.stderr.read()
        assert f"refused a connection from uid {NOBODY}" in log and "1 refused so far" in log, log
    finally:
        shutil.rmtree(base, ignore_errors=True)


NOBODY = 65534


def test_the_zygote_refuses_a_folder_others_may_enter(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", zygote.MODULE, "--bare", str(folder / "socket")], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "must be a folder of uid" in done.stderr and not (folder / "socket").exists()


PARENT = """
import os
with open(os.path.join(os.environ["OUT"], os.environ["RANK"]), "w") as fh:
    fh.write(f"{os.getppid()} {open(f'/proc/{os.getppid()}/cmdline').read().split(chr(0))[:3]}")
"""


def test_the_ranks_of_a_launcher_a_test_starts_are_forked_from_the_zygote_too(zygote_env, tmp_path):
    """``commlab run`` started by a test (the zygote's child) starts its ranks through ``$COMMLAB_STARTER``:
    their parent is the zygote, not that launcher."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    cli = _start(["-m", "commlab.tools.cli", "run", "--workers", "2", str(script)], dict(zygote_env, OUT=str(tmp_path)))
    out, err = cli.communicate(timeout=170)
    assert cli.returncode == 0, err
    parents = [(tmp_path / r).read_text().split(" ", 1) for r in ("0", "1")]
    assert all(int(pid) != cli.pid and zygote.MODULE in cmd for pid, cmd in parents), (cli.pid, parents)


def test_a_new_run_sweeps_only_the_fork_server_folders_of_runs_that_are_gone():
    """Suites run side by side (other checkouts, pytest-xdist's workers): a run's start removes the folder of
    a run whose pid is gone, and keeps a live run's, this run's own among them."""
    import conftest

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that was a run's and is gone
    gone = Path(tempfile.mkdtemp(prefix=f"commlab-zygote-{dead.pid}-"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = Path(tempfile.mkdtemp(prefix=f"commlab-zygote-{other.pid}-"))  # another suite's, without a socket yet
        conftest._remove_dead_zygote_folders()
        assert not gone.exists() and live.is_dir()
        ours = Path(os.environ[zygote.ENV]).parent
        assert ours.is_dir() and Path(f"/proc/{ours.name.split('-')[2]}").exists()  # this run (or xdist's controller)
    finally:
        other.kill()
        other.wait()
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(gone, ignore_errors=True)
