"""Helpers for the fault tests (test_fuzz, test_faults, test_multihost): real server processes,
a raw DEALER that speaks the wire protocol, the server's resident memory.

Every process started here is registered with a :class:`Procs` that kills it at the end. Each
starts a session of its own, so that a kill reaches whatever it started too (a launcher's ranks).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from commlab.transport import auth, psproto, sockets as transport, wire
from commlab.launch import launcher
from commlab.regimes.ps import server_stats

import zygote
from conftest import REAL_STARTS, GroupTimeout

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           PYTHONUNBUFFERED="1")
# for a launcher whose ranks a test finds by their parent and environment (/proc): started for real
LAUNCHER_ENV = dict(ENV, **REAL_STARTS)
DRIVER = str(REPO / "tests" / "ps_driver.py")
AGENT_ENV = {launcher.AGENT_STORE: "True"}  # a rank's store is hosted for it (Procs.store): rank 0 is a client too
START_TIMEOUT = 60.0


class Server:
    def __init__(self, proc: subprocess.Popen, endpoint: str, log: Path):
        self.proc, self.endpoint, self.log = proc, endpoint, log

    @property
    def address(self) -> str:
        return self.endpoint.removeprefix("tcp://")

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def stats(self, timeout: float = 20.0) -> dict:
        return server_stats(self.endpoint, timeout=timeout)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (the server checkpoints and says goodbye); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def rss_kib(self) -> int:
        """Resident set size of the server process (``VmRSS`` in /proc/PID/status), KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for server pid {self.proc.pid}")


class Procs:
    """Starts servers, workers and stores through the launcher's primitives (each process leads a
    group of its own and dies with the test's process); :meth:`close` stops whatever still runs,
    by process group (:func:`commlab.launch.launcher.stop_all`), never by name."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, []

    def popen(self, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """``cmd`` with the tests' environment (plus ``env``), from the repository root."""
        p = launcher.start_group(cmd, {**ENV, **(env or {})}, cwd=REPO, starter=zygote.start, **kw)
        self.procs.append(launcher.Proc(f"process {len(self.procs)}", p))
        return p

    def server(self, *args: str, bind: str = "tcp://127.0.0.1:0", prefix: tuple[str, ...] = (),
               env: dict | None = None) -> Server:
        """``python -m servers`` (its output in a log; ``env`` added to its environment), once it reported the
        endpoint it bound."""
        log = self.tmp / f"server{len(self.procs)}.log"
        p = launcher.spawn(f"server {len(self.procs)}", [*prefix, sys.executable, "-m", "servers", "--bind", bind,
                                                           "--log-every", "0", *args], {**ENV, **(env or {})}, log,
                           report_endpoint=True, starter=zygote.start)
        self.procs.append(p)
        endpoint = launcher.await_endpoints([p], START_TIMEOUT)[0]
        return Server(p.popen, endpoint, log)

    def store(self, addr: str, prefix: tuple[str, ...] = ()) -> int:
        """A rendezvous store in a process of its own (:func:`commlab.launch.launcher.start_store`) at
        ``addr``, started with ``prefix`` (a namespace); its port. Ranks that use it need
        ``TORCHELASTIC_USE_AGENT_STORE=True`` (:data:`AGENT_ENV`)."""
        return launcher.start_store(addr, prefix, ENV, self.tmp / f"store{len(self.procs)}.log", START_TIMEOUT,
                                    self.procs, starter=zygote.start)

    def worker(self, url: str, rank: int, workers: int, steps: int, *extra: str,
               prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        cmd = [*prefix, sys.executable, DRIVER, url, "--rank", str(rank), "--workers", str(workers),
               "--steps", str(steps), *extra]
        return self.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def close(self) -> None:
        launcher.stop_all(self.procs, grace=0)


def wait_until(cond, timeout: float, what: str, every: float = 0.05):
    """``cond()``'s first true value, polled every ``every`` s; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} within {timeout}s")


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for processes under one deadline; ``(returncode, stdout, stderr)`` each; kill what hangs,
    with its process group where it leads one (a launcher's ranks)."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            launcher.kill_groups([p], grace=0)
            o, e = p.communicate()
            e += f"\n[killed after {timeout}s]"
        out.append((p.returncode, o, e))
    return out


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


class Raw:
    """A bare DEALER speaking the wire protocol, to send what a correct client never would."""

    def __init__(self, endpoint: str, sender: str = "rank0", curve: transport.CurveKeys | None = None,
                 secret: auth.JobSecret | None | bool = True):
        """``secret``: True proves the test session's secret (as the job's processes do), None or a
        JobSecret of another job makes a stranger."""
        self.tp = transport.Transport(curve=curve)
        self.sock = self.tp.connect(zmq.DEALER, endpoint)
        secret = auth.load() if secret is True else secret
        if secret is not None:
            transport.handshake(self.sock, secret, sender, "server", 10.0)
        self.sender, self.id = sender, 1000
        self.link = None  # a commlab.transport.psshm.Link, once the caller mapped what a hello with shm_host offered

    def send(self, frames) -> None:
        transport.send(self.sock, frames, timeout=10, who="server")

    def reply(self, timeout: float = 20.0) -> wire.Header:
        msg = transport.recv(self.sock, timeout, "server")
        region = self.link.outbound.size if self.link is not None else None
        return wire.decode(msg, ops=psproto.REPLIES, max_bytes=2**24, region=region), msg[1:]

    def request(self, op: str, step: int = -1, parts=(), **meta) -> wire.Header:
        self.id += 1
        self.send(wire.encode(op, self.sender, step, parts, dict(meta, id=self.id)))
        return self.reply()[0]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.tp.close()


def setup_beside_raw(ex, model, optim, raw: Raw, timeout: float = 30.0, **extra) -> wire.Header:
    """``ex.setup(model, optim)`` on a thread while ``raw`` plays the job's other rank: it says hello with
    ``ex``'s own hello (its rank, and ``extra``, replaced) and makes its start pull, as a real worker's
    setup does (a shard answers start pulls once every rank made one). Returns ``raw``'s hello reply."""
    with cf.ThreadPoolExecutor(1) as pool:
        done = pool.submit(ex.setup, model, optim)
        deadline = time.monotonic() + timeout
        while not (ex.shards and ex.shards[0].hello_meta):
            if done.done() or time.monotonic() > deadline:
                done.result(0)
                raise GroupTimeout(f"rank 0 sent no hello within {timeout:g}s")
            time.sleep(0.005)
        rank = int(raw.sender.removeprefix("rank"))
        hello = raw.request("hello", **dict(ex.shards[0].hello_meta, rank=rank, **extra))
        assert hello.op == "ok", hello.meta
        start = raw.request("pull", -1, after_step=-1, start=True)
        assert start.op == "params", start.meta
        done.result(timeout)
    return hello


def _stat_fields(pid: str) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (read from /proc)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(_stat_fields(d)[1]) == pid:
                    kids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) pids in process group ``pgid`` (read from /proc)."""
    members = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = _stat_fields(d)
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return members


def wait_for_rank_process(parent: int, rank: int, timeout: float) -> int:
    """Pid of the child of ``parent`` whose environment says ``RANK=rank``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for kid in children_of(parent):
            try:
                with open(f"/proc/{kid}/environ", "rb") as fh:
                    if f"RANK={rank}".encode() in fh.read().split(b"\0"):
                        return kid
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} process of launcher {parent} never appeared")


def kill_rank_under_launcher(url: str, model: str, rank: int, settle_s: float) -> tuple[int, str, list[int]]:
    """``commlab train --exchanger URL --workers 3`` until killed: SIGKILL rank ``rank`` once training
    has run ``settle_s`` seconds. Returns the launcher's exit code, its stderr and the pids it left
    running (its ranks and servers share its process group). Blocks at most ~START_TIMEOUT + 60 s;
    nothing it started outlives the call."""
    cli = launcher.start_group([sys.executable, "-m", "commlab.tools.cli", "train", "--no-progress", "--exchanger", url,
                                "--workers", "3", "--model", model, "--steps", "100000"], LAUNCHER_ENV, cwd=REPO,
                               starter=zygote.start, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = wait_for_rank_process(cli.pid, rank=rank, timeout=START_TIMEOUT)
        time.sleep(settle_s)  # let training start
        os.kill(victim, signal.SIGKILL)
        try:
            _, err = cli.communicate(timeout=60)
        except subprocess.TimeoutExpired as exc:  # the group is killed below, on the way out
            raise GroupTimeout(f"the launcher of {url} after rank {rank} was killed", exc.cmd, exc.timeout,
                               exc.output, exc.stderr) from None
        # the launcher has exited: by now its children were reparented, so look for them by group
        left = group_members(cli.pid)
    finally:
        launcher.kill_groups([cli], grace=0)  # what it left behind is reported above, and goes now
    return cli.returncode, err, left
