"""Every benchmark job is a process group of its own, with a deadline, a log, and no survivors.

A job (``commlab train ...`` or one bandwidth run) starts in a new session, through the
launcher's :func:`commlab.launcher.start_group`, and dies with the benchmark. When the job
ends, fails, runs past its deadline, or the benchmark is interrupted, the whole group is
stopped by the launcher's one kill (:func:`commlab.launcher.kill_groups`: SIGTERM, then
SIGKILL after a grace period): nothing a job started outlives it. Its stdout and stderr go
to a log file; when a job fails, the last meaningful line of that log becomes the error the
report shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from commlab import launcher
from commlab.metrics import metrics_path


@dataclass(frozen=True)
class JobResult:
    returncode: int
    seconds: float
    log: Path
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
        # the first line is the command run_job wrote: not the job's own word
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip() and not l.startswith("$ ")]
    except OSError:
        return ""
    for key in ("commlab worker rank", "Error:", "Error", "error:"):
        hits = [l for l in lines if key in l and "Traceback" not in l]
        if hits:
            return hits[0][:400] if key == "commlab worker rank" else hits[-1][:400]
    return lines[-1][:400] if lines else ""


def run_job(argv: list[str], log: Path, timeout: float, env: dict | None = None) -> JobResult:
    """Run ``argv`` as a new process group (:func:`commlab.launcher.start_group`); block at most
    ``timeout`` seconds; leave nothing running (:func:`commlab.launcher.kill_groups`, SIGTERM then,
    after 3 s, SIGKILL to the whole group, also when the job ended by itself)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parent.parent)  # the checkout, so `python -m workers` resolves
    full_env["PYTHONPATH"] = root + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    started = time.monotonic()
    with log.open("w") as fh:
        fh.write("$ " + " ".join(argv) + "\n")
        fh.flush()
        proc = launcher.start_group(argv, full_env, stdout=fh, stderr=subprocess.STDOUT)
        timed_out = False
        try:
            proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on KeyboardInterrupt: the group goes with us
            launcher.kill_groups([proc], grace=3.0)
    return JobResult(proc.returncode, time.monotonic() - started, log, timed_out)


def read_ranks(base: Path, workers: int, *, need_step: bool = True) -> list[list[dict]]:
    """What each of a job's ranks wrote with :func:`commlab.metrics.report` (rank r > 0 writes
    ``base.rank<r>``, :func:`commlab.metrics.metrics_path`): its JSON objects in order, a line cut short
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


def stop_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process group each of ``procs`` leads, with whatever the process started; reap
    each (:func:`commlab.launcher.kill_groups` with no grace, which new code calls directly)."""
    launcher.kill_groups(procs, grace=0)


def wait_all(procs: list[subprocess.Popen], timeout: float, what: str) -> list[int]:
    """Exit codes of ``procs``, waited for under one deadline: blocks at most ``timeout`` s plus the kill.

    For jobs whose output goes to the terminal or a file (nobody reads a pipe here). Each process
    leads a process group of its own (``start_new_session=True``). If the deadline passes, or
    anything is raised while waiting (Ctrl-C), every one of those groups is stopped
    (:func:`stop_groups`), a launcher's ranks and servers included, before the error goes on; the
    deadline raises TimeoutError naming ``what``. Processes that finish in time are left alone.
    """
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(max(0.0, deadline - time.monotonic())) for p in procs]
    except BaseException as exc:
        stop_groups(procs)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise TimeoutError(f"{what} did not finish within {timeout:g}s; its processes were killed") from exc
        raise


def python() -> str:
    return sys.executable
