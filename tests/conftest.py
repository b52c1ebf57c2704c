"""Fixtures shared by the test groups.

``run_ranks`` is the multi-process harness: it writes a rank program to a file,
starts N real processes through the launcher's primitives (:func:`commlab.launch.launcher.start_group`)
with torchrun's environment and a rendezvous store this process hosts on a port
the kernel picked (:func:`commlab.transport.store.host`), waits with a deadline, kills every
sibling when one fails, and hands back each rank's exit code and output so a
failing child's traceback shows in the test.

Test modules import helpers by their bare names (``from conftest import ...``,
``from faultkit import ...``): tests/ has no ``__init__.py``, so pytest puts
tests/ itself on ``sys.path``, under ``pytest`` and ``python -m pytest`` alike.
A ``tests.`` prefix resolves only where the repository root is on ``sys.path``
too (``python -m``), and would load conftest a second time under another name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import zygote
from commlab.transport import auth, rendezvous, store
from commlab.launch import launcher

ROOT = Path(__file__).resolve().parents[1]
# The test session is one "job": every server, rank and raw client a test starts proves this secret, as a
# launcher's processes prove theirs (commlab.transport.auth). A test that wants a stranger or an unauthenticated run
# removes it from that process's environment.
os.environ.setdefault(auth.SECRET_ENV, os.urandom(24).hex())


@pytest.fixture(autouse=True)
def _each_test_a_fresh_process():
    """What a process keeps across exchangers (:data:`commlab.transport.rendezvous.PROCESS`: the key spaces it
    counted on each set of servers, the round agreed through each store) is forgotten after every test, as
    if each test were a process of its own. The kernel hands the same port to a later test's servers or
    store, and the counts, keyed by address, carried over: CI failed once so, rank 0 (a thread) counting its
    exchanger the second on servers at a recycled port while rank 1 counted its first."""
    yield
    rendezvous.PROCESS.forget()


@dataclass
class RankResult:
    rank: int
    code: int | None
    out: str
    err: str

    def json(self):
        """The last line of stdout, parsed as JSON (rank programs print their result there)."""
        lines = [l for l in self.out.splitlines() if l.strip()]
        assert lines, f"rank {self.rank} printed nothing; stderr:\n{self.err}"
        return json.loads(lines[-1])


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclass
class Ranks:
    """Rank processes and the store they meet in (served by this process while it is referenced)."""

    procs: list[subprocess.Popen]
    store: object


def start_ranks(program: str, n: int, tmp_path: Path, extra_env: dict | None = None, timeout: float = 300) -> Ranks:
    """Start ``program`` as ``n`` ranks, each a process group of its own; every rank, rank 0 too, is a
    client of a store hosted here (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun)."""
    path = tmp_path / f"rank_program_{time.monotonic_ns()}.py"
    text = textwrap.dedent(program)
    lines = text.splitlines(keepends=True)
    first = 1 if lines and lines[0].startswith("from __future__") else 0  # it must stay the first statement
    path.write_text("".join(lines[:first]) + STACKS_ON_SIGNAL + "".join(lines[first:]))
    hosted = store.host("127.0.0.1", timeout)
    procs = []
    for r in range(n):
        env = child_env(RANK=r, WORLD_SIZE=n, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1", MASTER_PORT=hosted.port,
                        **{launcher.AGENT_STORE: "True"}, **(extra_env or {}))
        procs.append(launcher.start_group([sys.executable, str(path)], env, starter=zygote.start,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return Ranks(procs, hosted)


# a rank still running at collect()'s deadline prints every thread's stack (SIGUSR1) before it is killed, so a
# hang says where it hung
STACKS_ON_SIGNAL = "import faulthandler as _fh, signal as _sig; _fh.register(_sig.SIGUSR1, all_threads=True)\n"


def collect(ranks: Ranks, timeout: float, check: bool = True) -> list[RankResult]:
    """Wait for every rank (deadline shared); on the first failure or the deadline, kill the rest (at the
    deadline, a rank still running first prints its threads' stacks to its stderr)."""
    procs = ranks.procs
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if check and any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.02)
    hung = [p for p in procs if p.poll() is None] if time.monotonic() >= deadline else []
    for p in hung:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if hung:
        time.sleep(1.0)  # the dump is written from a C signal handler at once; a second is plenty
    launcher.kill_groups(procs, grace=0)  # what an exited rank started goes too
    results = []
    for r, p in enumerate(procs):
        out, err = p.communicate()
        results.append(RankResult(r, p.returncode, out, err))
    if check:
        bad = [x for x in results if x.code != 0]
        if bad:
            msg = "\n".join(f"--- rank {x.rank} exit {x.code}\n{x.err[-8000:]}" for x in bad)
            pytest.fail(f"rank(s) failed:\n{msg}")
    return results


@pytest.fixture
def run_ranks(tmp_path):
    """``run_ranks(program, n, timeout=60, check=True, env=None) -> [RankResult]``."""

    def run(program: str, n: int, timeout: float = 60, check: bool = True, env: dict | None = None):
        return collect(start_ranks(program, n, tmp_path, env), timeout, check)

    return run


class GroupTimeout(subprocess.TimeoutExpired):
    """A command run by :func:`run_group` passed its deadline; its whole process group was killed."""

    def __init__(self, what: str, cmd, timeout: float, output, stderr):
        super().__init__(cmd, timeout, output, stderr)
        self.what = what

    def __str__(self) -> str:
        tail = self.stderr.decode(errors="replace") if isinstance(self.stderr, bytes) else (self.stderr or "")
        return (f"{self.what} did not finish within {self.timeout:g}s; its process group was killed"
                + (f"; last stderr:\n{tail[-2000:]}" if tail.strip() else ""))


def run_group(argv: list[str], timeout: float, what: str | None = None, *, grace: float = 0.0,
              capture_output: bool = False, **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, timeout=timeout, ...)`` for a command that starts processes of its own.

    On a timeout ``subprocess.run`` kills only ``argv``'s own process: a launcher's ranks, its
    parameter servers or a benchmark's jobs would run on with nobody waiting for them. Here
    ``argv`` starts a new session (:func:`commlab.launch.launcher.start_group`), so it and all it starts
    share one process group, and when the deadline passes, or anything is raised while waiting
    (Ctrl-C, pytest-timeout), the whole group is killed (:func:`commlab.launch.launcher.kill_groups`, with
    ``grace`` for a command that cleans up on SIGTERM). The timeout is re-raised as :class:`GroupTimeout`, naming ``what`` (default: the command line).
    A command that finishes in time is left alone: whatever it left running is still there for a
    test to find. Blocks at most ``timeout`` + ``grace`` seconds, plus reaping.
    """
    if capture_output:
        popen_kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with launcher.start_group(argv, popen_kw.pop("env", None), starter=zygote.start, **popen_kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            launcher.kill_groups([proc], grace)
            try:  # the rest of the output; the pipes close once the group is gone
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # someone outside the group holds them
                out, err = exc.output, exc.stderr
            raise GroupTimeout(what or " ".join(map(str, argv)), argv, timeout, out, err) from None
        except BaseException:
            launcher.kill_groups([proc], grace)
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def commlab_train(args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``commlab train ARGS`` as a user runs it, in a subprocess with a deadline (ranks and servers included)."""
    return run_group([sys.executable, "-m", "commlab.tools.cli", "train", "--no-progress", *args], timeout,
                     "commlab train " + " ".join(args), env=child_env(**(env or {})), capture_output=True, text=True)


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of max|a-b| / max|b| (state_dicts with equal keys)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


@pytest.fixture
def procs(tmp_path):
    """A :class:`faultkit.Procs` whose processes (servers, ranks) are killed at the end of the test."""
    from faultkit import Procs

    p = Procs(tmp_path)
    yield p
    p.close()


# The default run covers every path once; these further points of the matrices run under
# `make test-full` (marker "full"): shm beside tcp on every PS user-loop case, and the repeats of a
# case at a second N or optimizer that the user-loop tests already cover.
FULL_ONLY = {
    # the user's loop: each regime at N=2, and N=3 once (ring over tcp)
    "test_user_loop.py::test_users_loop_equals_one_process_on_the_combined_batch":
        lambda p: p["n"] == 3 and p["regime"] != "ring-tcp",
    # BN, AMP skips and resume are exchanger-level: allreduce and the ring over tcp cover them
    "test_user_loop.py::test_batchnorm_buffers_equal_on_every_rank_and_rank0_equals_ddp":
        lambda p: p["regime"] == "ring-torch",
    "test_user_loop.py::test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank":
        lambda p: p["regime"] == "ring-torch",
    "test_user_loop.py::test_stop_and_resume_equals_the_uninterrupted_run":  # state before setup: allreduce
        lambda p: p["regime"] == "ring-torch" or (p["load"] == "before" and p["regime"] != "allreduce"),
    # PS: both placements with one and several shards over tcp, and once over shm (K=3, N=2, server)
    "test_ps_update.py::test_users_loop_equals_one_process_on_the_combined_batch":
        lambda p: (p["transport"], p["update"], p["k"], p["n"]) not in {
            ("tcp", "worker", 1, 2), ("tcp", "worker", 3, 3), ("tcp", "server", 1, 3), ("tcp", "server", 3, 2),
            ("shm", "server", 3, 2)},
    "test_ps_update.py::test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank":
        lambda p: p["transport"] == "shm",
    "test_ps_update.py::test_stop_and_resume_on_fresh_servers_equals_the_uninterrupted_run":  # before: the shards'
        lambda p: p["transport"] == "shm" or (p["load"] == "before" and p["update"] == "worker"),
    "test_ps_update.py::test_batchnorm_buffers_are_equal_on_every_rank_after_every_step":
        lambda p: p["transport"] == "shm" or (p["update"], p["how"]) == ("worker", "broadcast"),
    "test_allreduce.py::test_reproduces_single_process_large_batch":
        lambda p: (p["n"] == 2) == (p["optim"][1] == "sgd"),  # sgd at N=3 and adam at N=2 stay
    "test_faults.py::test_killed_sync_shard_resumes_and_the_run_ends_as_if_never_interrupted":
        lambda p: p["transport"] == "shm",
    "test_ps.py::test_ssp_keeps_staleness_within_its_bound_and_async_does_not":
        lambda p: p["transport"] == "shm",
    "test_ps.py::test_sync_matches_one_process_on_the_combined_batch":  # shm: test_ps_update's user loop
        lambda p: p["sync_runs"] == "shm",
}


# in a child's environment (or os.environ, monkeypatched): what that child starts starts the ordinary way
REAL_STARTS = {zygote.ENV: "off", launcher.STARTER_ENV: ""}
_ZYGOTE: dict = {}


def _start_zygote() -> None:
    """One fork server for the whole run (``tests/zygote.py``): every Python process the tests start
    (ranks, servers, launchers, and what those start) is forked from it with torch and torch._dynamo
    already imported, instead of importing them again (3-4 s of CPU each). It imports while pytest
    collects. The tests' helpers pass its starter to the launcher (``starter=zygote.start``); the
    processes they start inherit ``$COMMLAB_STARTER`` naming it, for the launchers they run.
    ``COMMLAB_ZYGOTE=off make test`` runs the suite with real starts throughout; the launcher's own
    tests always start for real."""
    if os.environ.get(zygote.ENV):  # "off", or a zygote of the caller's
        return
    _remove_dead_zygote_folders()
    # mode 0700: the zygote's socket is reachable by us alone; the name carries this run's pid (the sweep's key)
    folder = tempfile.mkdtemp(prefix=f"commlab-zygote-{os.getpid()}-")
    path = os.path.join(folder, "socket")
    _ZYGOTE.update(proc=launcher.start_group([sys.executable, "-m", zygote.MODULE, path], child_env(),
                                             starter=launcher.plain_start), folder=folder)
    os.environ[zygote.ENV] = path
    os.environ[launcher.STARTER_ENV] = zygote.MODULE


def _remove_dead_zygote_folders() -> None:
    """The folders of earlier runs that were killed before pytest_unconfigure (a timeout's SIGKILL): a folder
    whose run (the pid in its name) is gone. Other suites running now (other checkouts, pytest-xdist's
    workers) keep theirs: their pids live. A folder without a pid in its name is judged by its socket: one
    that no zygote answers (connected as the zygote listens, SOCK_SEQPACKET) is gone."""
    import socket as sockets
    for folder in Path(tempfile.gettempdir()).glob("commlab-zygote-*"):
        if not folder.is_dir() or folder.stat().st_uid != os.getuid():  # another user's run: not ours to judge
            continue
        pid = folder.name.split("-")[2]
        if pid.isdigit():
            if not Path(f"/proc/{pid}").exists():
                shutil.rmtree(folder, ignore_errors=True)
            continue
        probe = sockets.socket(sockets.AF_UNIX, sockets.SOCK_SEQPACKET)
        try:
            probe.settimeout(1.0)
            probe.connect(str(folder / "socket"))
        except OSError:  # no socket, or nobody listening: the run that made it is gone
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            probe.close()


def zygote_children() -> set[int]:
    """Live (not zombie) processes the run's zygote forked: a forked child's /proc cmdline and environ
    are the zygote's, so a test that looks for what it left running by those looks here too."""
    if "proc" not in _ZYGOTE:
        return set()
    kids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[1]) == _ZYGOTE["proc"].pid:
                kids.add(int(d))
    return kids


def pytest_configure(config):
    # A shell without job control starts a background command with SIGINT ignored, and children
    # inherit an ignored signal across exec: the Ctrl-C tests' programs would then never see their
    # SIGINT (a suite started with `make test &` failed exactly those). Python's own handler is reset
    # to the default on exec, so the programs the tests start get Ctrl-C as in a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _start_zygote()


def pytest_unconfigure(config):
    if _ZYGOTE:
        os.environ.pop(zygote.ENV, None)
        os.environ.pop(launcher.STARTER_ENV, None)
        launcher.kill_groups([_ZYGOTE.pop("proc")], grace=5)  # its children die with it (PR_SET_PDEATHSIG)
        shutil.rmtree(_ZYGOTE.pop("folder"), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        rule = FULL_ONLY.get(f"{item.path.name}::{item.originalname}")
        if rule is not None and hasattr(item, "callspec") and rule(item.callspec.params):
            item.add_marker(pytest.mark.full)
