"""The embedded default: N workers (and any servers their regime needs) on loopback.

Workers are started as processes by module name (``python -m workers``) with
torchrun's environment variables, so a worker cannot tell this launcher from
torchrun. The launcher watches them: the first process to fail is named, the
rest are stopped, and nothing is left behind, also on Ctrl-C or SIGTERM (what
``kill``, a job scheduler's cancel or a test's timeout sends).

A regime whose workers need servers (``ps://``) exposes
``plan_local(url, workers, scratch) -> (url_for_workers, [server argv, ...])``;
the launcher starts those first and stops them last. Every caller of a plan
(this launcher, the benchmarks) goes through :func:`planned_servers`, which
owns the plan's scratch folder (ipc sockets) and removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from commlab.config import ExchangerURL
from commlab.exchanger import PlansServers
from commlab.registry import regime_class


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def planned_servers(url: str, workers: int) -> Iterator[tuple[str, list[list[str]]]]:
    """The servers ``url``'s regime wants started for a job of ``workers`` on this host.

    Yields ``(url for the workers, [server argv for ``python -m servers``, ...])``: the URL
    unchanged and no servers when the regime has no ``plan_local`` or the URL names its servers.
    A plan that needs files (ipc sockets) calls ``scratch()`` for a folder
    ``$TMPDIR/commlab-SCHEME-*``; it is removed when the block exits, also on errors, so stop
    the servers inside it. Does not start anything.
    """
    parsed = ExchangerURL.parse(url)
    cls = regime_class(parsed.scheme)
    if not issubclass(cls, PlansServers):
        yield url, []
        return
    made: list[str] = []

    def scratch() -> str:
        # made on first use: a tcp plan makes nothing that a killed launcher could leave behind
        if not made:
            made.append(tempfile.mkdtemp(prefix=f"commlab-{parsed.scheme}-"))
        return made[0]

    try:
        yield cls.plan_local(parsed, workers, scratch)
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


class Terminated(Exception):
    """SIGTERM reached the launcher (raised by its handler, so the ``finally`` that stops the job runs)."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated()


@dataclass
class Proc:
    name: str  # "rank 1", "server shard 0/2"
    popen: subprocess.Popen


def stop_all(procs: list[Proc], grace: float = 5.0) -> None:
    """SIGTERM everything still running, then SIGKILL what did not stop within ``grace``."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def launch(url: str, workers: int, worker_args: list[str], *, env: dict | None = None,
           poll_s: float = 0.05, quiet_ranks: bool = True, module: str = "workers",
           master_addr: str = "127.0.0.1", rank_prefix: Callable[[int], list[str]] | None = None) -> int:
    """Run the job; return 0, or non-zero after naming the process that failed first.

    ``module`` is what each rank runs (``python -m MODULE``; benchmarks run their own
    per-rank module). ``rank_prefix(r)`` is put before rank r's command line and
    ``master_addr`` is where rank 0's store listens: together they place ranks in other
    network namespaces (``ip netns exec NS ...``) for runs over capped links.
    """
    if workers < 1:
        print("commlab train: --workers must be >= 1", file=sys.stderr)
        return 2
    # SIGTERM's default action ends the launcher at once and orphans every server and rank;
    # turned into an exception it unwinds like Ctrl-C. (Signal handlers live in the main thread only.)
    installed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if installed else None
    try:
        return _launch(url, workers, worker_args, env, poll_s, quiet_ranks, module, master_addr, rank_prefix)
    except KeyboardInterrupt:
        print("commlab train: interrupted; stopped every process", file=sys.stderr)
        return 130
    except Terminated:
        print("commlab train: terminated (SIGTERM); stopped every process", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if installed:  # None: a handler set outside Python, which Python cannot put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _launch(url, workers, worker_args, env, poll_s, quiet_ranks, module, master_addr, rank_prefix) -> int:
    with planned_servers(url, workers) as (url, server_argvs):
        base = dict(os.environ if env is None else env)
        base.update(MASTER_ADDR=master_addr, MASTER_PORT=str(free_port()), WORLD_SIZE=str(workers),
                    LOCAL_WORLD_SIZE=str(workers), PYTHONUNBUFFERED="1")
        procs: list[Proc] = []
        try:
            for i, argv in enumerate(server_argvs):
                procs.append(Proc(f"server {i}", subprocess.Popen([sys.executable, "-m", "servers", *argv], env=base)))
            for r in range(workers):
                env_r = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                prefix = rank_prefix(r) if rank_prefix else []
                args = [*prefix, sys.executable, "-m", module, "--exchanger", url, *worker_args]
                if r > 0 and quiet_ranks:
                    args.append("--no-progress")
                procs.append(Proc(f"rank {r}", subprocess.Popen(args, env=env_r)))
            ranks = [p for p in procs if p.name.startswith("rank")]
            while True:
                for p in procs:
                    code = p.popen.poll()
                    if code not in (None, 0) or (code == 0 and not p.name.startswith("rank")):
                        others = [q for q in procs if q is not p]
                        stop_all(others)
                        how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
                        print(f"commlab train: {p.name} failed first ({how}); stopped the others", file=sys.stderr)
                        return code if code > 0 else 1
                if all(p.popen.poll() == 0 for p in ranks):
                    return 0
                time.sleep(poll_s)
        finally:
            stop_all(procs)
