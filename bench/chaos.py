"""``commlab bench chaos``: a worker killed at random (exponential intervals), and what training still gets done.

    commlab bench chaos --mtbf 20 --duration 300                       # the issue's run: 25M MLP, 4 workers
    commlab bench chaos --mtbf 20 --duration 300 --servers --exchanger 'ps://?update=server&replicas=2'
    commlab bench chaos --mtbf 30 --duration 300 --kill servers --exchanger 'ps://?update=server&replicas=2'
    commlab bench chaos --mtbf 3 --duration 8 --workers 2 --model tiny --entries free,restart-all   # a smoke run

Outside the default ``commlab bench``. One seeded kill schedule (``--seed``): kill i comes at
``sum of i+1 draws of Exp(mean --mtbf)`` seconds after training started, to a slot drawn uniformly
from the ``--workers`` (with ``--kill both``, or ``--servers``, a second schedule of the same law kills a random
server shard: ``python -m servers`` processes of the job; ``--kill servers`` kills the server shards alone,
on that second schedule). Every entry gets the same schedule, in turn:

``free``
    ``commlab run --workers N --exchanger URL``, nothing killed: the reference of the commlab entries.
``free-kg``
    the same with ``commlab``'s flags (``--replace`` or ``--spares S``), nothing killed: where a run has it, the
    reference of ``commlab`` instead (the same job but for the kills; ``free`` stays restart-all's).
``commlab``
    the same with ``--replace`` (or ``--spares S`` with ``--spares``): the survivors keep going and a
    replacement heals live. Reported missing (with why) where this checkout's ``commlab run`` has no
    such flag.
``restart-all``
    the same with ``--max-restarts`` (every rank restarted, the servers kept): torchrun's model.
``torchft-free`` / ``torchft``
    torchft's fault-tolerant DDP (``torchft-nightly``; ``pip install --no-deps torchft-nightly`` and the
    ``.[peers]`` extra): one replica group of one process per slot, gloo, a Lighthouse started by the bench
    as a process of its own (``min_replicas=1``); torchft does not restart a dead replica, so the bench
    starts a new one for the slot as soon as the old one is gone (it heals from a live peer).

Each rank is :mod:`bench.chaos_worker` (the digits, SGD; its steps logged with the wall clock). On a small
machine each worker is capped at ``--cap`` CPU (cgroup ``cpu.max``/``cfs_quota``: :mod:`bench.cpucap`),
so a death cannot speed the survivors up. The window: from the moment every slot has done a step
(``T0``) for ``--duration`` seconds; then the job is stopped.

**Accounting** (from the ranks' per-step logs; never estimated): a sample *entered an applied update*
when its rank logged the step after the exchange returned (commlab: ``ex.step()`` returned, the pull
that answers after the update; torchft: ``should_commit()`` was true and the replica took part).
**Goodput** = such samples per second in the window, over the entry's failure-free reference's
(``free`` for commlab's entries, ``torchft-free`` for torchft). Per kill: seconds from the kill to the
next step any other process logged (the survivors', or the restarted job's), seconds to *heal* (to
the victim slot's first step from a new process), *steps lost* (the step numbers done again after the
kill: the newest step done before it + 1 - the first step after it, where positive, as
``bench.probes``' restart probe counts), and *steps applied twice*: a slot logging one step number
as applied twice (must be 0), beside the servers' own count (``updates + skipped - sync step`` of
each shard's last stats line, where they wrote one). Final loss: the mean training loss of the last 20
steps in the window, beside the reference's at the same step numbers (equal steps) and at its end
(equal time). Verdicts (:func:`bench.verdict.rate_ratio`, 95% intervals): goodput over the
reference, and commlab's over restart-all's and torchft's, resampling 20 equal bins of each window
(the spread within the run; the criterion across launches is the median of three runs).

**At scale, on paper** (:mod:`commlab.plan.failures`): from the measured components (restart-all's
kill-to-next-step, the keep-going stall and heal, half a step of lost work, and the store's
rendezvous cost per rank measured here by :func:`rendezvous_per_rank`) both policies' goodput at
1,000 and 10,000 workers for a per-worker MTBF of 50 h and 5,000 h.

Writes ``chaos.md``, ``chaos.json``, ``chaos.png`` (goodput over time per entry, kills marked) and every
process's log under ``<entry>/``; ``commlab bench chaos --reread DIR`` writes the report again from them.
``commlab bench chaos --across DIR DIR DIR`` puts runs of one setting (seeds apart) side by side: each
verdict per run, the median of the runs' ratios against the issue's goal (:func:`goodput_floor`), kills and
steps applied twice, final losses beside the failure-free runs' spread.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import verdict
from bench.cpucap import Caps
from bench.jobs import ROOT
from bench.text import names, table
from commlab.launch import launcher

CASE = "chaos"
KILL_TARGETS = ("workers", "servers", "both")
ENTRIES = ("free", "free-kg", "commlab", "restart-all", "torchft-free", "torchft")
REFERENCE = {"commlab": "free", "restart-all": "free", "torchft": "torchft-free"}
KEPT_REFERENCE = {"commlab": "free-kg"}  # the reference instead, where the run has it
DEFAULT_URL = "ps://?mode=sync&update=server"
BINS = 20
TAIL_S = 60.0  # after the window, how long the job may run on for the last kills' next step and heal
LAST_STEPS = 20
KEEP_GOING_FLAGS = ("--replace", "--spares")
LIGHTHOUSE = """
import os, sys, time
from torchft._torchft import LighthouseServer
s = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(sys.argv[1]))
os.write(1, ("torchft lighthouse listening on http://127.0.0.1:" + s.address().rsplit(":", 1)[1] + "\\n").encode())
while True:
    time.sleep(3600)
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mtbf", type=float, required=True, help="mean seconds between kills (exponential intervals)")
    p.add_argument("--duration", type=float, required=True, help="seconds of training per entry, from its first step")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--exchanger", action="append", help="commlab URL(s) for free/commlab/restart-all "
                                                        f"(repeatable; default {DEFAULT_URL})")
    p.add_argument("--kill", choices=KILL_TARGETS, default="workers",
                   help="what the schedules kill: workers (default), servers (a random server shard: `python -m "
                        "servers` processes of the job), or both (a schedule of its own each)")
    p.add_argument("--servers", action="store_const", dest="kill", const="both", help="the same as --kill both")
    p.add_argument("--spares", type=int, default=0, help="commlab's entry: --spares S instead of --replace")
    p.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated, of: " + ", ".join(ENTRIES))
    p.add_argument("--model", default="mlp-25m", help="workers/models.py's name (tiny: the tests')")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--cap", type=float, default=0.45, help="CPU per worker (cgroup; 0: uncapped)")
    p.add_argument("--seed", type=int, default=0, help="the kill schedule's")
    p.add_argument("--startup-timeout", type=float, default=240.0, help="seconds from an entry's start to its "
                                                                        "first step on every slot")
    p.add_argument("--out", help="folder (default runs/chaos-<UTC time>)")
    return p


def check(a) -> list[str]:
    """The entries to run; ValueError (one line naming the option) for anything wrong, before anything starts."""
    if not (math.isfinite(a.mtbf) and a.mtbf > 0):
        raise ValueError(f"--mtbf must be a positive number of seconds, got {a.mtbf:g}")
    if not (math.isfinite(a.duration) and a.duration > 0):
        raise ValueError(f"--duration must be a positive number of seconds, got {a.duration:g}")
    if a.workers < 2:
        raise ValueError(f"--workers must be >= 2 (a survivor needs a peer), got {a.workers}")
    if a.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {a.spares}")
    if not 0 <= a.cap <= 64:
        raise ValueError(f"--cap must be a CPU share in [0, 64], got {a.cap:g}")
    from workers.models import MODELS
    if a.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {a.model!r}")
    if a.batch_size < 1 or a.startup_timeout <= 0:
        raise ValueError("--batch-size must be >= 1 and --startup-timeout > 0")
    wanted = names(a.entries, ENTRIES, "--entries")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"--entries names an entry twice: {a.entries}")
    if a.kill != "workers":  # a server killed ends an unreplicated job, and torchft has none to kill
        from commlab.base.config import ExchangerURL
        for u in a.exchanger or [DEFAULT_URL]:
            parsed = ExchangerURL.parse(u)
            if parsed.scheme != "ps" or dict(parsed.query).get("replicas") != "2":
                raise ValueError(f"--kill {a.kill} needs every --exchanger on ps:// with replicas=2 (a killed server "
                                 f"of an unreplicated shard ends the job), got {u}")
        if any(n.startswith("torchft") for n in wanted):
            raise ValueError(f"--kill {a.kill}: the torchft entries have no servers to kill; leave them out of --entries")
    return wanted


# ----- the schedule -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kill:
    at: float  # seconds after T0
    target: str  # "worker" or "server"
    index: int  # slot, or shard


def schedule(mtbf: float, duration: float, workers: int, seed: int, shards: int = 0) -> list[Kill]:
    """The kills of one run, in time order: exponential intervals of mean ``mtbf`` within ``duration``, a
    uniform victim each; with ``shards``, a second stream of the same law for the servers (``workers=0``: the
    servers' stream alone, the same kills as beside the workers')."""
    out = []
    for target, count, stream in (("worker", workers, 0), ("server", shards, 1)):
        if not count:
            continue
        rng, t = random.Random(seed * 1_000_003 + stream), 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf)
            if t >= duration:
                break
            out.append(Kill(t, target, rng.randrange(count)))
    return sorted(out, key=lambda k: k.at)


# ----- reading what the ranks logged --------------------------------------------------------------

def read_steps(folder: Path) -> list[dict]:
    """Every JSON line of ``folder/steps/*.jsonl`` (a line cut short by a kill skipped), sorted by time."""
    recs = []
    for path in sorted(Path(folder, "steps").glob("slot*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "t" in rec:
                recs.append(rec)
    return sorted(recs, key=lambda r: r["t"])


def training_start(recs: list[dict], slots: int) -> float | None:
    """T0: the wall-clock time by which every slot had logged a step (None: not yet)."""
    first: dict[int, float] = {}
    for r in recs:
        if r.get("ev") == "step" and r["slot"] not in first:
            first[r["slot"]] = r["t"]
    return max(first.values()) if len(first) >= slots else None


def server_stats(job_logs: Path) -> list[dict]:
    """Each server's last stats line (``commlab server shard i/K: {...}``) in its log, in server order."""
    out = []
    for path in sorted(job_logs.glob("server*.log")):
        last = None
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("commlab server shard") and ": {" in line:
                try:
                    last = json.loads(line.split(": ", 1)[1])
                except ValueError:
                    pass
        if last is not None:
            out.append({k: last.get(k) for k in ("shard", "mode", "updates", "skipped", "sync_step", "pushes",
                                                 "duplicates", "replaced", "world", "attempt", "version")})
    return out


def held_up(r: dict, k: dict) -> bool:
    """Whether step record ``r`` is one kill ``k`` could hold up: later than the kill, of another process, and
    (where the kill names the step its victim was at, ``k["step"]``: ``bench.probes keepgoing``) of that step
    or a later one, so not a step whose every push was in before the kill."""
    return r["t"] > k["t"] and r["pid"] != k.get("pid") and r["step"] >= k.get("step", r["step"])


def settled(recs: list[dict], kills: list[dict]) -> bool:
    """Whether every kill has, in ``recs``, a later step of another process (:func:`held_up`) and, where the
    kill names its slot, of a new process of that slot."""
    for k in kills:
        later = [r for r in recs if r.get("ev") == "step" and held_up(r, k) and r.get("samples", 0) > 0]
        if not later or ("slot" in k and not any(r["slot"] == k["slot"] for r in later)):
            return False
    return True


def account(recs: list[dict], kills: list[dict], t0: float, duration: float, bins: int = BINS, *,
            rollbacks: bool = True) -> dict:
    """What the window [t0, t0 + duration) got done (module text), from the ranks' records and the kills
    delivered (``{"t", "slot" or "shard", "pid"}``, and ``"step"`` where the victim's step is known: the next
    step is then the first :func:`held_up` counts). ``rollbacks``: a process's ``start`` says where it
    resumed its slot's state (False for torchft, whose new replica takes a live peer's step)."""
    end = t0 + duration
    steps = [r for r in recs if r.get("ev") == "step"]
    # a process that resumed slot s at step c (a checkpoint) rolled back what earlier processes of the slot
    # logged from step c on: those updates are lost (thrown away), not applied twice
    resumed = [(r["t"], r["slot"], r["start"]) for r in recs
               if rollbacks and r.get("ev") == "ready" and r.get("start") is not None]
    rolled = lambda r: any(t > r["t"] and slot == r["slot"] and start <= r["step"] for t, slot, start in resumed)
    applied = [r for r in steps if r.get("applied", True) and not rolled(r)]
    rolled_back = sorted({r["step"] for r in steps if r.get("applied", True) and rolled(r)})
    seen: dict[tuple[int, int], dict] = {}
    twice = []
    for r in applied:
        key = (r["slot"], r["step"])
        if key in seen:
            twice.append({"slot": r["slot"], "step": r["step"], "pids": [seen[key]["pid"], r["pid"]]})
        else:
            seen[key] = r
    inside = [r for r in seen.values() if t0 <= r["t"] < end]
    width = duration / bins
    counts = [0] * bins
    for r in inside:
        counts[min(bins - 1, int((r["t"] - t0) / width))] += r.get("samples", 0)
    samples = sum(counts)
    per_kill = []
    for k in kills:
        tk = k["t"]
        after = [r for r in seen.values() if r["t"] > tk and r["pid"] != k.get("pid")]
        row = dict(k, at=tk - t0)
        nxt = [r["t"] for r in after if held_up(r, k)]
        row["next_step_s"] = min(nxt) - tk if nxt else None
        if "slot" in k:
            healed = [r["t"] for r in after if r["slot"] == k["slot"] and r.get("samples", 0) > 0]
            row["heal_s"] = min(healed) - tk if healed else None
        lost = []  # per slot: its newest step before the kill (rolled back ones too) + 1 - its first after
        for slot in {r["slot"] for r in after}:
            before = [r["step"] for r in steps if r["slot"] == slot and r.get("applied", True) and r["t"] <= tk]
            if before:
                lost.append(max(before) + 1 - min(r["step"] for r in after if r["slot"] == slot))
        if lost:
            row["steps_lost"] = max(0, max(lost))
        per_kill.append(row)
    # the loss per global step: the mean over the slots that logged it
    by_step: dict[int, list[float]] = {}
    for r in inside:
        by_step.setdefault(r["step"], []).append(r["loss"])
    loss = {s: statistics.fmean(v) for s, v in sorted(by_step.items())}
    last = list(loss)[-LAST_STEPS:]
    discarded = sorted({r["step"] for r in steps if not r.get("applied", True)})
    step_times = sorted({r["step"]: r["t"] for r in inside}.values())
    return {"t0": t0, "duration_s": duration, "samples": samples, "goodput": samples / duration,
            "bins": counts, "bin_s": width, "kills": per_kill, "applied_twice": twice,
            "discarded_steps": discarded, "rolled_back_steps": rolled_back, "steps": len(loss), "last_step": max(loss, default=None),
            "final_loss": statistics.fmean(loss[s] for s in last) if last else None,
            "loss_by_step": {str(s): v for s, v in loss.items()},
            "median_step_s": statistics.median(b - a for a, b in zip(step_times, step_times[1:]))
            if len(step_times) > 2 else None}


# ----- running an entry ---------------------------------------------------------------------------

def keep_going_flag() -> str | None:
    """Why ``commlab run`` cannot keep going in this checkout (None: it can)."""
    from commlab.tools import cli
    p = argparse.ArgumentParser(add_help=False)
    cli.add_job_args(p, 1)
    have = set(p._option_string_actions) | {f for f in KEEP_GOING_FLAGS if f'"{f}"' in inspect.getsource(cli)}
    missing = [f for f in KEEP_GOING_FLAGS if f not in have]
    return None if not missing else (f"this checkout's `commlab run` has no {' or '.join(missing)} (survivors keep "
                                     "going: issue 38 items 1-2, not merged here)")


@dataclass
class Entry:
    name: str
    url: str  # commlab's URL, or "torchft"
    kills: bool
    folder: Path
    procs: list = field(default_factory=list)  # Popen: the launcher, or the lighthouse and the replicas
    slots: dict = field(default_factory=dict)  # torchft: slot -> its current Popen
    lighthouse: str = ""  # torchft: the Lighthouse's address


def env_of(caps: Caps | None) -> dict:
    env = dict(os.environ, **(caps.env() if caps else {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def worker_args(a, log: Path) -> list[str]:
    return ["--log", str(log), "--model", a.model, "--batch-size", str(a.batch_size), "--lr", str(a.lr)]


def start_commlab(e: Entry, a, caps: Caps | None, kills: int, extra: list[str] | tuple = ()) -> None:
    """``commlab run`` of :mod:`bench.chaos_worker` for entry ``e`` (``extra``: more worker arguments), a
    process group of its own in ``e.procs``; its output in ``launcher.log``. Does not block."""
    flags = []
    if kind(e.name) == "restart-all":
        flags = ["--max-restarts", str(kills + 100)]
    elif kind(e.name) in ("commlab", "free-kg"):
        flags = ["--spares", str(a.spares)] if a.spares else ["--replace"]
    argv = [sys.executable, "-m", "commlab.tools.cli", "run", "--workers", str(a.workers), "--exchanger", e.url,
            "--log-dir", str(e.folder / "job"), *flags, "-m", "bench.chaos_worker", "--", *worker_args(a, e.folder),
            *extra]
    out = (e.folder / "launcher.log").open("a")
    e.procs.append(launcher.start_group(argv, env_of(caps), stdout=out, stderr=subprocess.STDOUT))
    out.close()


def start_torchft(e: Entry, a, caps: Caps) -> None:
    lh = launcher.spawn("lighthouse", [sys.executable, "-c", LIGHTHOUSE, "1000"], env_of(None),
                        e.folder / "lighthouse.log", report_endpoint=True)
    e.procs.append(lh.popen)
    e.lighthouse = launcher.await_endpoints([lh], 60)[0]
    for slot in range(a.workers):
        start_replica(e, a, caps, slot)


def start_replica(e: Entry, a, caps: Caps, slot: int) -> None:
    argv = [sys.executable, "-m", "bench.chaos_worker", *worker_args(a, e.folder), "--torchft", e.lighthouse,
            "--slot", str(slot), "--replicas", str(a.workers)]
    out = (e.folder / f"replica{slot}.log").open("a")
    p = launcher.start_group(argv, env_of(caps), stdout=out, stderr=subprocess.STDOUT)
    out.close()
    e.slots[slot] = p
    e.procs.append(p)


def last_line(e: Entry) -> str:
    """The telling line of the entry's logs (an error, else the last line)."""
    from bench.jobs import last_error_line
    logs = [e.folder / "launcher.log", *sorted(e.folder.glob("replica*.log")), *sorted((e.folder / "job").glob("*.log"))]
    for log in logs:
        line = last_error_line(log) if log.exists() else ""
        if "Error" in line or "error" in line:
            return line
    return next((last_error_line(l) for l in logs if l.exists()), "")


def live_pid(folder: Path, slot: int) -> int | None:
    """The newest live process of ``slot`` (its pid file, ``chaos_worker``), or None."""
    best = None
    for f in Path(folder, "pids").glob(f"slot{slot}.*"):
        pid = int(f.name.split(".")[1])
        if alive(pid) and (best is None or f.stat().st_mtime > best[0]):
            best = (f.stat().st_mtime, pid)
    return best[1] if best else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def server_pids(root: int) -> list[int]:
    """The ``python -m servers`` processes started under the launcher ``root`` (by their shard order)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            todo.append(c)
            try:
                argv = Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"servers" in argv and b"-m" in argv and alive(c):
                out.append((argv, c))
    return [c for _, c in sorted(out)]


def run_entry(e: Entry, a, caps: Caps, plan: list[Kill], progress) -> dict:
    e.folder.mkdir(parents=True, exist_ok=True)
    for mine in ("steps", "pids", "job"):  # an --out used before: its logs are not this run's
        shutil.rmtree(e.folder / mine, ignore_errors=True)
    (e.folder / "ckpt.pt").unlink(missing_ok=True)
    started = time.monotonic()
    delivered: list[dict] = []
    out: dict = {"entry": e.name, "url": e.url}
    try:
        if e.url == "torchft":
            start_torchft(e, a, caps)
        else:
            start_commlab(e, a, caps, sum(k.target == "worker" for k in plan))
        t0 = None
        while t0 is None:  # every slot's first step
            t0 = training_start(read_steps(e.folder), a.workers)
            if t0 is None:
                if time.monotonic() - started > a.startup_timeout:
                    raise RuntimeError(f"not every slot took a step within --startup-timeout {a.startup_timeout:g}s")
                dead = [p for p in e.procs if p.poll() is not None]
                log = e.folder / "launcher.log"
                if not dead and log.exists() and "restarting every rank" in log.read_text(errors="replace"):
                    raise RuntimeError(f"a rank failed before every slot took a step: {last_line(e)}")
                if dead:
                    raise RuntimeError(f"{'the job' if e.url != 'torchft' else 'a process'} ended (exit "
                                       f"{dead[0].returncode}) before every slot took a step: {last_line(e)}")
                time.sleep(0.1)
        out["startup_s"] = time.monotonic() - started
        progress(f"commlab bench chaos: {e.name}: training ({'kills: ' + str(len(plan)) if e.kills else 'no kills'}, "
                 f"{a.duration:g} s)")
        todo = list(plan) if e.kills else []
        while time.time() < t0 + a.duration:
            now = time.time()
            if e.url == "torchft":  # torchft does not restart a dead replica: the bench does, at once
                for slot, p in list(e.slots.items()):
                    if p.poll() is not None:
                        start_replica(e, a, caps, slot)
            elif e.procs[0].poll() is not None:
                out["ended_early"] = f"the job ended (exit {e.procs[0].returncode}) {now - t0:.1f} s into the window"
                break
            if todo and now >= t0 + todo[0].at:
                k = todo[0]
                if k.target == "worker":
                    pid = live_pid(e.folder, k.index)
                else:
                    pids = server_pids(e.procs[0].pid) if e.url != "torchft" else []
                    pid = pids[k.index % len(pids)] if pids else None
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    delivered.append({"t": time.time(), "planned": k.at, ("slot" if k.target == "worker" else "shard"):
                                      k.index, "pid": pid})
                    todo.pop(0)
                    continue
            time.sleep(0.01)  # a victim slot with no live process (restarting): its kill waits for one
        out["undelivered"] = len(todo)
        # the window is over: no more kills; the job runs on until every kill delivered has its next step
        # and its heal in the logs (their times, not the goodput), at most TAIL_S
        until = time.time() + (TAIL_S if delivered else 0)
        while time.time() < until and e.procs[0].poll() is None and not settled(read_steps(e.folder), delivered):
            if e.url == "torchft":
                for slot, p in list(e.slots.items()):
                    if p.poll() is not None:
                        start_replica(e, a, caps, slot)
            time.sleep(0.25)
    except (RuntimeError, launcher.JobFailed) as exc:
        out["error"] = str(exc)
    finally:
        launcher.kill_groups(e.procs, grace=10)
        tail = (e.folder / "launcher.log")
        if tail.exists():
            out["launcher_tail"] = tail.read_text(errors="replace").splitlines()[-5:]
    recs = read_steps(e.folder)
    t0 = training_start(recs, a.workers)
    if t0 is not None:
        out.update(account(recs, delivered, t0, a.duration, rollbacks=e.url != "torchft"))
    out["servers"] = server_stats(e.folder / "job")
    out["servers_applied_twice"] = [s["updates"] + (s["skipped"] or 0) - s["sync_step"] for s in out["servers"]
                                    if s.get("mode") == "sync" and s.get("sync_step") is not None]
    return out


# ----- the rendezvous per rank (for the at-scale model) -------------------------------------------

def rendezvous_per_rank(ns=(8, 32, 128)) -> dict:
    """:func:`meet_times` in a process of its own (torch's store warns per client thread unless told
    before it loads: ``TORCH_CPP_LOG_LEVEL``)."""
    code = f"import json; from bench.chaos import meet_times; print(json.dumps(meet_times({tuple(ns)!r})))"
    env = dict(env_of(None), TORCH_CPP_LOG_LEVEL="ERROR")
    p = launcher.start_group([sys.executable, "-c", code], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        got, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        launcher.kill_groups([p], grace=0)
        return {"error": "the store meetings did not finish within 120 s", "seconds": {}, "per_rank_s": None}
    if p.returncode != 0:
        return {"error": err.decode(errors="replace").strip().splitlines()[-1:], "seconds": {}, "per_rank_s": None}
    return json.loads(got.decode().strip().splitlines()[-1])


def meet_times(ns) -> dict:
    """Seconds for ``n`` clients of one TCPStore (threads here) to meet (each adds itself, all wait for
    the count), per n, and the least-squares slope: the store's own cost per rank."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    times = {}
    for n in ns:
        master = dist.TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        go = threading.Barrier(n + 1)
        done = []

        def client(i):
            s = dist.TCPStore("127.0.0.1", master.port, n + 1, is_master=False, timeout=timedelta(seconds=60))
            go.wait()
            if s.add("arrived", 1) == n:
                s.set("all", "1")
            s.wait(["all"])
            done.append(time.perf_counter())

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(60)
        times[n] = max(done) - t0
        del master
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"seconds": {str(k): v for k, v in times.items()}, "per_rank_s": max(0.0, slope)}


def at_scale(results: dict, a, rdv: dict) -> dict | None:
    """:mod:`commlab.plan.failures`' table from this run's components (None without restart-all and a
    keep-going entry)."""
    from commlab.plan import failures as F

    med = lambda xs: statistics.median(xs) if xs else None
    ra_label = next((n for n in results if kind(n) == "restart-all" and results[n].get("kills")), None)
    if ra_label is None:
        return None
    url = ra_label[len("restart-all"):]
    ra, ref = results[ra_label], results.get("free" + url) or {}
    keep = next((results[n] for n in ("commlab" + url, "torchft") if results.get(n, {}).get("kills")), None)
    if rdv.get("per_rank_s") is None:
        return None
    restart = med([k["next_step_s"] for k in ra.get("kills", []) if k.get("next_step_s") is not None])
    if restart is None or keep is None:
        return None
    step = ref.get("median_step_s") or keep.get("median_step_s") or 0.0
    stall = med([k["next_step_s"] for k in keep["kills"] if k.get("next_step_s") is not None])
    heal = med([k["heal_s"] for k in keep["kills"] if k.get("heal_s") is not None])
    if stall is None or heal is None:
        return None
    c = F.Components(restart_s=restart, measured_workers=a.workers, rendezvous_per_rank_s=rdv["per_rank_s"],
                     stall_s=max(0.0, stall - step), heal_s=heal, lost_s=step / 2)
    return {"keep_going_from": keep["entry"], "components": F.as_dict(c), "rows": F.table(c),
            "lines": F.lines(c, F.table(c))}


# ----- the report ---------------------------------------------------------------------------------

def kind(label: str) -> str:
    """An entry label's kind: ``commlab`` of ``commlab ring://...`` (one label per URL with several)."""
    return label.split(" ", 1)[0]


def reference_of(label: str, results: dict | None = None) -> str | None:
    """The failure-free entry an entry's goodput is measured against: its URL's ``free`` (``free-kg`` for
    ``commlab`` where ``results`` has it: the same job, keep-going flags and all), or ``torchft-free``."""
    k = kind(label)
    ref = REFERENCE.get(k)
    if ref is None:
        return None
    kept = KEPT_REFERENCE.get(k, "") + label[len(k):]
    return kept if results is not None and k in KEPT_REFERENCE and kept in results else \
        ref + ("" if k == "torchft" else label[len(k):])


def verdicts(results: dict) -> list[tuple[str, verdict.Verdict]]:
    out = []
    have = lambda n: n in results and results[n].get("bins") and results[n].get("goodput") is not None
    seconds = lambda n: [results[n]["bin_s"]] * len(results[n]["bins"])
    for n in results:
        ref = reference_of(n, results)
        if ref and have(n) and have(ref) and results[ref]["goodput"] > 0:
            out.append((f"goodput, {n} over {ref}", verdict.rate_ratio(
                n, results[n]["bins"], seconds(n), ref, results[ref]["bins"], seconds(ref))))
    for n in [n for n in results if kind(n) == "commlab"]:
        for other in ("restart-all" + n[len("commlab"):], "torchft"):
            refs = [reference_of(n, results), reference_of(other, results)]
            if have(n) and have(other) and all(have(r) and results[r]["goodput"] > 0 for r in refs):
                # each over its own reference, then against each other
                out.append((f"goodput share, {n} over {other}", verdict.rate_ratio(
                    n, scaled(results, n), seconds(n), other, scaled(results, other), seconds(other))))
    return out


def scaled(results: dict, n: str) -> list[float]:
    """An entry's samples per bin over its reference's goodput: its bins in units of the reference."""
    return [c / results[reference_of(n, results)]["goodput"] for c in results[n]["bins"]]


def steps_lost(r: dict) -> str:
    """The table's steps lost: distinct step numbers rolled back (done again after a restart from a checkpoint),
    or, where nothing rolls back, the kills' count (the probe's); torchft's uncommitted steps beside."""
    rolled = r.get("rolled_back_steps") or []
    said = f"{len(rolled)} rolled back" if rolled else str(sum(k.get("steps_lost", 0) for k in r["kills"]))
    return said + (f" (+{len(r['discarded_steps'])} discarded)" if r["discarded_steps"] else "")


def fmt(x, spec=".2f") -> str:
    return "—" if x is None else format(x, spec)


def med_max(xs) -> str:
    """``median (max)`` of the kills' figures; a kill whose figure never came (the job stopped first) is
    counted apart."""
    got = [x for x in xs if x is not None]
    never = len(xs) - len(got)
    said = f"{statistics.median(got):.2f} ({max(got):.2f})" if got else "—"
    return said + (f"; {never} never" if never else "")


def plot(results: dict, kills: list[Kill], path: Path) -> Path | None:
    from bench.plots import plt, save

    have = [r for r in results.values() if r.get("bins")]
    if not have:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in have:
        ref = results.get(reference_of(r["entry"], results) or r["entry"], r)
        rate = ref.get("goodput") or r["goodput"]
        xs = [(i + 0.5) * r["bin_s"] for i in range(len(r["bins"]))]
        ax.plot(xs, [c / r["bin_s"] / rate if rate else 0 for c in r["bins"]], marker=".", label=r["entry"])
        for k in r.get("kills", []):
            ax.axvline(k["at"], color=ax.lines[-1].get_color(), alpha=0.25, lw=1)
    ax.set_xlabel("seconds since every slot's first step (kills: vertical lines)")
    ax.set_ylabel("goodput / the reference's mean")
    ax.set_title("samples entering applied updates, per bin")
    ax.legend(fontsize=8)
    return save(fig, path)


def killed(plan: list[Kill]) -> str:
    """What a plan kills, counted: ``9 of workers, 9 of server shards``."""
    n = {t: sum(k.target == t for k in plan) for t in ("worker", "server")}
    return ", ".join(f"{c} of {'workers' if t == 'worker' else 'server shards'}" for t, c in n.items() if c) or "none"


def write(out: Path, results: dict, a, plan: list[Kill], caps_said: str, missing: dict, scale: dict | None,
          rdv: dict | None, seconds: float, argv: list[str]) -> Path:
    vs = verdicts(results)
    targets = {k.target for k in plan}
    what = "workers and server shards" if len(targets) == 2 else "server shards" if targets == {"server"} else "workers"
    md = [f"# Chaos: {what} killed at random, and the training still done", "",
          f"- `commlab bench chaos {' '.join(argv)}`: {a.workers} workers, model {a.model}, batch {a.batch_size} per "
          f"worker; {len(plan)} kills planned ({killed(plan)}; mean {a.mtbf:g} s apart per schedule, seed {a.seed}) in "
          f"{a.duration:g} s windows; "
          f"{caps_said}. This case ran {seconds:.0f} s; load average at the end "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}. The machine may be shared.",
          "- Goodput: samples that entered an applied update per second of the window, over the reference's "
          "(commlab: `free-kg` where the run has it, else `free`; restart-all: `free`; torchft: `torchft-free`). "
          "Per kill: seconds to the next step of any other process, seconds to heal (the slot's first step from a new process; a killed server shard's heal, its new "
          "backup, is in the launcher's log, not timed here); median (max).", ""]
    rows = []
    for name, r in results.items():
        if "goodput" not in r:
            rows.append([name, r.get("url", ""), "—", "—", "—", "—", "—", "—", "—", "—", r.get("error", "no steps")])
            continue
        ref = results.get(reference_of(name, results) or "", {})
        equal_steps = None
        if ref.get("loss_by_step") and r.get("loss_by_step"):
            mine = list(r["loss_by_step"])[-LAST_STEPS:]
            theirs = [ref["loss_by_step"][s] for s in mine if s in ref["loss_by_step"]]
            equal_steps = statistics.fmean(theirs) if len(theirs) == len(mine) and theirs else None
        twice = len(r["applied_twice"])
        servers = r.get("servers_applied_twice") or []
        rows.append([name, r["url"], str(len(r["kills"])), f"{r['goodput']:.1f}",
                     fmt(r["goodput"] / ref["goodput"], ".3f") if ref.get("goodput") else "(reference)",
                     med_max([k.get("next_step_s") for k in r["kills"]]), med_max([k.get("heal_s") for k in r["kills"] if "slot" in k]),
                     steps_lost(r),
                     f"{twice}" + (f" (servers: {sum(servers)})" if servers else ""),
                     f"{fmt(r['final_loss'], '.4f')} / {fmt(equal_steps, '.4f')} / {fmt(ref.get('final_loss'), '.4f')}",
                     r.get("ended_early", "") + (f"; {r['undelivered']} kills undelivered" if r.get("undelivered") else "")])
    for name, why in missing.items():
        rows.append([name, "", "—", "—", "—", "—", "—", "—", "—", "—", f"not run: {why}"])
    md += table(["entry", "url", "kills", "goodput samples/s", "over reference", "kill → next step s", "heal s",
                 "steps lost", "applied twice", "final loss / reference at equal steps / at equal time", "note"], rows)
    md += ["", "Verdicts (95% intervals from 20 bins of each window; the spread within this run, not between "
               f"launches; {verdict.rule(named='an entry is named ahead')}):", ""]
    md += [f"- {label}: {v.ratio:.3f} [{v.lo:.3f}, {v.hi:.3f}]" + (f" ({v.winner} ahead)" if v.winner else
                                                                    f" ({v.said()})")
           for label, v in vs] + [""]
    png = plot(results, plan, out / "chaos.png")
    if png:
        md += [f"![goodput over time]({png.name})", ""]
    md += ["## At scale, on paper", ""]
    if scale:
        md += [f"Keep-going figures from `{scale['keep_going_from']}`; rendezvous per rank from "
               f"{len(rdv['seconds'])} store meetings ({', '.join(f'{k} ranks {v * 1e3:.0f} ms' for k, v in rdv['seconds'].items())}).", ""]
        md += scale["lines"] + [""]
    else:
        md += ["Not computed: it needs restart-all's and a keep-going entry's (commlab or torchft) kills measured.", ""]
    (out / "chaos.md").write_text("\n".join(md))
    doc = {"case": CASE, "argv": argv, "config": {k: v for k, v in vars(a).items()}, "cpu_cap": caps_said,
           "schedule": [vars(k) for k in plan], "entries": results, "missing": missing,
           "verdicts": [dict(label=label, **v.as_dict()) for label, v in vs], "at_scale": scale,
           "rendezvous": rdv, "seconds": seconds}
    (out / "chaos.json").write_text(json.dumps(doc, indent=1, default=str))
    return out / "chaos.md"


def folder_of(label: str) -> str:
    return label.replace("/", "_").replace(" ", "_").replace("?", "_")


def reread(folder: Path) -> Path:
    """A run's report again from its logs (this checkout's accounting): ``commlab bench chaos --reread DIR``."""
    doc = json.loads((folder / "chaos.json").read_text())
    a = argparse.Namespace(**doc["config"])
    results = {}
    for label, e in doc["entries"].items():
        recs = read_steps(folder / folder_of(label))
        t0 = training_start(recs, a.workers)
        kills = [{k: v for k, v in kill.items() if k in ("t", "planned", "slot", "shard", "pid")}
                 for kill in e.get("kills", [])]
        results[label] = dict(e, **account(recs, kills, t0, a.duration, rollbacks=e.get("url") != "torchft")) \
            if t0 is not None else e
    rdv = doc.get("rendezvous")
    scale = at_scale(results, a, rdv) if rdv else None
    return write(folder, results, a, [Kill(**k) for k in doc["schedule"]], doc["cpu_cap"], doc["missing"], scale,
                 rdv, doc["seconds"], doc["argv"])


def run(a, wanted: list[str], out: Path, progress=print) -> tuple[dict, dict, str, list[Kill]]:
    urls = a.exchanger or [DEFAULT_URL]
    from commlab.base.config import ExchangerURL
    shards = max(int(dict(ExchangerURL.parse(u).query).get("shards", 1)) for u in urls) \
        if a.kill in ("servers", "both") else 0
    plan = schedule(a.mtbf, a.duration, a.workers if a.kill in ("workers", "both") else 0, a.seed, shards)
    missing: dict[str, str] = {}
    why = keep_going_flag()
    if "commlab" in wanted and why:
        missing["commlab"] = why
    if any(n.startswith("torchft") for n in wanted):
        try:
            import torchft  # noqa: F401
        except ImportError as exc:
            for n in wanted:
                if n.startswith("torchft"):
                    missing[n] = f"torchft cannot be imported ({exc}): pip install --no-deps torchft-nightly, then .[peers]"
    caps = Caps(a.cap) if a.cap > 0 else Caps.none("--cap 0")
    results: dict[str, dict] = {}
    try:
        for name in wanted:
            if name in missing:
                continue
            for url in (urls if not name.startswith("torchft") else ["torchft"]):
                label = name if len(urls) == 1 or url == "torchft" else f"{name} {url}"
                progress(f"commlab bench chaos: {label}: starting")
                e = Entry(label, url, name in ("commlab", "restart-all", "torchft"), out / folder_of(label))
                results[label] = run_entry(e, a, caps, plan, progress)
    finally:
        caps.close()
    return results, missing, caps.describe(), plan


def goodput_floor(config: dict) -> float:
    """Issue 38's goodput goal (over the failure-free reference) for a run's configuration: 0.90 with
    server shards killed (``--kill servers`` or ``both``), 0.88 for the collectives or a kill every 10 s or less,
    else 0.93 (``ps://``, a kill every 20 s)."""
    url = config.get("exchanger") or [DEFAULT_URL]
    if config.get("servers") or config.get("kill", "workers") != "workers":
        return 0.90
    if any(not u.startswith("ps:") for u in url) or config["mtbf"] <= 10:
        return 0.88
    return 0.93


def across(folders: list[Path]) -> str:
    """The criterion across launches: each run's verdicts side by side, the median of the runs' ratios
    against the goal (:func:`goodput_floor` for goodput over the reference, above 1 for a share), the kills
    and steps applied twice summed, and every entry's final loss beside the failure-free runs' spread."""
    runs = [json.loads((f / "chaos.json").read_text()) for f in folders]
    configs = {json.dumps({k: v for k, v in r["config"].items() if k not in ("seed", "out")}, sort_keys=True)
               for r in runs}
    if len(configs) > 1:
        raise ValueError(f"--across: the runs differ in more than --seed/--out: {sorted(configs)}")
    floor = goodput_floor(runs[0]["config"])
    labels = list(dict.fromkeys(v["label"] for r in runs for v in r["verdicts"]))
    lines = [f"# Chaos across {len(runs)} runs", "",
             "- " + "; ".join(f"`commlab bench chaos {' '.join(r['argv'])}`" for r in runs), ""]
    rows = []
    for label in labels:
        vs = [next((v for v in r["verdicts"] if v["label"] == label), None) for r in runs]
        got = [v for v in vs if v]
        med = statistics.median(v["ratio"] for v in got)
        share = label.startswith("goodput share")
        a, b = kind(got[0]["a"]), kind(got[0]["b"])
        goal = 1.0 if share else (floor if a in ("commlab", "torchft") and b in ("free", "free-kg", "torchft-free")
                                  else None)
        if goal is None:
            met = "(stated)"
        elif share:
            met = (f"median {'>' if med > goal else '<='} 1; intervals above 1 in "
                   f"{sum(v['lo'] > 1 for v in got)} of {len(got)}")
        else:
            met = f"{'met' if med >= goal else 'NOT met'} (goal >= {goal:.2f})"
        rows.append([label] + [f"{v['ratio']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]" if v else "—" for v in vs]
                    + [f"{med:.3f}", met])
    lines += table(["verdict"] + [f"run {i + 1} (seed {r['config']['seed']})" for i, r in enumerate(runs)]
                   + ["median", "goal"], rows)
    frees = {n: [r["entries"][n]["final_loss"] for r in runs if n in r["entries"]]
             for n in dict.fromkeys(n for r in runs for n in r["entries"] if kind(n) in ("free", "free-kg",
                                                                                         "torchft-free"))}
    rows = []
    for name in dict.fromkeys(n for r in runs for n in r["entries"]):
        es = [r["entries"].get(name) for r in runs]
        ref = frees.get(reference_of(name, runs[0]["entries"]) or name) or []
        losses = [e["final_loss"] for e in es if e]
        where = ("—" if not ref or name in frees else
                 f"{sum(x <= max(ref) for x in losses)} of {len(losses)} at or below the reference's worst")
        twice = [len(e.get("applied_twice") or []) + sum(e.get("servers_applied_twice") or []) for e in es if e]
        rows.append([name, " / ".join(str(len(e.get("kills") or [])) if e else "—" for e in es), str(sum(twice)),
                     " / ".join(f"{x:.4f}" for x in losses),
                     f"{min(ref):.4f} to {max(ref):.4f}" if ref else "—", where])
    lines += ["", *table(["entry", "kills per run", "applied twice (logs + servers, all runs)", "final loss per run",
                          "reference's final loss, spread", "final loss"], rows)]
    return "\n".join(lines) + "\n"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--reread"] and len(argv) == 2:  # a run's report again, from its logs
        try:
            print(reread(Path(argv[1])).read_text())
        except (OSError, ValueError, KeyError) as exc:
            print(f"commlab bench chaos: --reread: {exc}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["--across"] and len(argv) > 2:  # the median of several runs' ratios, against the goals
        try:
            print(across([Path(f) for f in argv[1:]]))
        except (OSError, ValueError, KeyError) as exc:
            print(f"commlab bench chaos: --across: {exc}", file=sys.stderr)
            return 2
        return 0
    a = parser().parse_args(argv)
    try:
        wanted = check(a)
    except ValueError as exc:
        print(f"commlab bench chaos: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out or Path("runs") / time.strftime("chaos-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    progress = lambda what: print(what, file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # like Ctrl-C: every job stopped, the cgroups removed
        signal.signal(sig, _interrupt)
    try:
        results, missing, caps_said, plan = run(a, wanted, out, progress)
    except KeyboardInterrupt:
        print("commlab bench chaos: interrupted; every job was stopped", file=sys.stderr)
        return 130
    keeps = any(r.get("kills") for n, r in results.items() if kind(n) in ("commlab", "torchft"))
    restarts = any(r.get("kills") for n, r in results.items() if kind(n) == "restart-all")
    rdv = rendezvous_per_rank() if restarts and keeps else None
    scale = at_scale(results, a, rdv) if rdv else None
    path = write(out, results, a, plan, caps_said, missing, scale, rdv, time.monotonic() - t0, argv)
    print(path.read_text())
    print(f"commlab bench chaos: {path} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
