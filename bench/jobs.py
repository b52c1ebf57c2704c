"""The one way a benchmark case runs a job: :func:`run`, the launcher in the bench's own process.

A job is a :class:`commlab.launch.launcher.Job` (what each rank runs, how many, under which exchanger URL)
run by :func:`commlab.launch.launcher.run_job` here, without a second Python process in between: its ranks
and servers each lead a process group of their own, and when the job ends, fails, passes its
deadline, or the benchmark is interrupted, the launcher stops every group
(:func:`commlab.launch.launcher.kill_groups`: SIGTERM, then SIGKILL): nothing a job started outlives it.
What ``commlab run`` would show on a terminal (rank 0's output, the servers', the launcher's own
lines: ``Job.console``) goes to the job's log instead, and every process's output to its own log in
the folder beside it (``LOG`` without ``.log``: ``rank<r>.log``, ``server<i>.log``). When a job
fails, the telling line of its log (:func:`last_error_line`) becomes the error the report shows.
With a :class:`bench.netns.Links` topology, rank r runs in host r's namespace, the rendezvous store
beside rank 0, and the servers a regime plans on loopback in hosts N, N+1, ... (:func:`place_servers`).

:mod:`bench.probes`' killed-rank probe starts its ranks itself, for the reason its docstring gives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from bench.netns import Links
from commlab.launch import launcher
from commlab.core.metrics import metrics_path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: `python -m bench.X`, `-m workers` resolve from it
LOOPBACK_TCP = re.compile(r"^tcp://127\.0\.0\.1:(\d+)$")
TIMED_OUT, INTERRUPTED = 124, (130, 143)  # the launcher's exit codes: the deadline; Ctrl-C, SIGTERM


@dataclass(frozen=True)
class JobResult:
    returncode: int
    seconds: float
    log: Path  # what a terminal would have shown; the per-process logs are in log.with_suffix("")
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def error(self) -> str:
        """Why the job failed, in one line (empty if it did not)."""
        if self.ok:
            return ""
        if self.timed_out:
            return f"ran past its deadline ({self.seconds:.0f}s) and was stopped; last output: {last_error_line(self.log)}"
        return last_error_line(self.log) or f"exit code {self.returncode}"


def last_error_line(log: Path) -> str:
    """The most telling line of a failed job's log: a commlab error, else the last exception, else the last line."""
    try:
        # the first line is the job :func:`run` wrote: not the job's own word
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip() and not l.startswith("$ ")]
    except OSError:
        return ""
    for key in ("commlab worker rank", "Error:", "Error", "error:"):
        hits = [l for l in lines if key in l and "Traceback" not in l]
        if hits:
            return hits[0][:400] if key == "commlab worker rank" else hits[-1][:400]
    return lines[-1][:400] if lines else ""


def run(job: launcher.Job, log: Path, timeout: float, links: Links | None = None) -> JobResult:
    """Run ``job`` through the launcher in this process; leave nothing running. Blocks for the job's
    deadline, ``timeout`` seconds from its start (checked once its ranks run; the start of its servers
    gets at most as long again), plus the stop.

    ``job``'s environment gets the checkout on ``PYTHONPATH``; its log goes to ``log`` and its
    processes' logs to the folder ``log`` names without ``.log`` (module docstring). With ``links``
    its ranks, store and servers are placed in the namespaces (the caller owns them). A failed job
    is a result (``ok`` False, ``error()``); Ctrl-C or SIGTERM while it runs raises
    KeyboardInterrupt once every process is stopped.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if job.env is None else job.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    place = {}
    if links is not None:
        n = job.workers
        place = dict(master_addr=links.addr(0), rank_prefix=links.prefix, server_prefix=lambda i: links.prefix(n + i),
                     place_servers=lambda url, argvs: place_servers(url, argvs, links, first_host=n))
    started = time.monotonic()
    with log.open("w", buffering=1) as console:
        console.write(f"$ {job.workers} x python {json.dumps([*job.command, *job.args])} under {job.exchanger}\n")
        code = launcher.run_job(dataclasses.replace(job, env=env, deadline_s=max(0.1, timeout),
                                                    start_timeout_s=min(job.start_timeout_s, max(1.0, timeout)),
                                                    log_dir=str(log.with_suffix("")), console=console, summary=False,
                                                    **place))
    if code in INTERRUPTED:
        raise KeyboardInterrupt(f"{job.name}: stopped (exit {code})")
    return JobResult(code, time.monotonic() - started, log, code == TIMED_OUT)


def place_servers(url: str, server_argvs: list[list[str]], links: Links, first_host: int) -> tuple[str, list[list[str]]]:
    """Move the loopback endpoints of a ``plan_local`` plan onto hosts ``first_host``, ``first_host + 1``, ...

    Server i's ``--bind tcp://127.0.0.1:P`` (P is 0 in a plan: the server reports what it bound)
    becomes ``tcp://<address of host first_host + i>:P`` in its argv and in the workers' URL
    template, in server order (:func:`commlab.launch.launcher.with_endpoints`), with ``--insecure`` (the
    address exists only inside namespaces this benchmark created). A plan whose servers are not on
    loopback tcp cannot be placed.
    """
    binds, placed, out = [], [], []
    for i, argv in enumerate(server_argvs):
        bind = launcher.bind_of(argv)
        m = LOOPBACK_TCP.match(bind)
        if m is None:
            raise ValueError(f"server {i}'s plan {argv} does not bind one loopback tcp endpoint: cannot place it "
                             f"in a namespace")
        binds.append(bind)
        placed.append(f"tcp://{links.addr(first_host + i)}:{m.group(1)}")
        out.append([placed[-1] if a == bind else a for a in argv] + ["--insecure"])
    return launcher.with_endpoints(url, binds, placed), out


def read_ranks(base: Path, workers: int, *, need_step: bool = True) -> list[list[dict]]:
    """What each of a job's ranks wrote with :func:`commlab.core.metrics.report` (rank r > 0 writes
    ``base.rank<r>``, :func:`commlab.core.metrics.metrics_path`): its JSON objects in order, a line cut short
    (a rank killed mid-write) skipped; with ``need_step``, only those with an integer ``step``. A rank
    that wrote nothing has ``[]``."""
    out = []
    for r in range(workers):
        lines, p = [], metrics_path(base, r)
        for line in p.read_text(errors="replace").splitlines() if p.exists() else ():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and (not need_step or isinstance(rec.get("step"), int)):
                lines.append(rec)
        out.append(lines)
    return out
