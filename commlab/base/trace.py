"""The timeline: one small recorder per process, written as Chrome trace-event JSON (docs/trace.md).

Off unless ``$COMMLAB_TRACE`` names a folder (``commlab run --trace DIR`` sets it for every rank and
server). Off, a seam pays one attribute check: the exchanger, the ring, the ps:// client and the server
each hold ``_trace`` (a :class:`Recorder` or None) and record only when it is set; nothing here is
called, nothing is allocated. On, each process keeps its events in memory and writes
``DIR/rank<r>.json`` (or ``DIR/shard<k>.json``) when its exchanger or server closes, and at exit.

The recorder knows four things, Chrome's names for them in brackets:

- a **span** [``X``, a complete event]: a name, a category, a start and an end on the calling thread
  (every thread is a track of its own, so spans on one track nest or follow one another because the
  code that records them does);
- an **instant** [``i``]: a point on the calling thread's track;
- a **flow** [``s`` then ``f``]: an arrow from a point inside a span of one process to a span of
  another (a push to the shard that applies it; a shard's reply to the receive that takes it); both
  ends compute the same id from what both know (:func:`flow_id`);
- a **counter** [``C``]: values over time (bytes in flight on a link, staleness, queue depth).

Clocks: each process stamps with its own monotonic clock, shifted to the wall clock once at start (so a
torch.profiler trace, stamped from Kineto's wall-clock ``baseTimeNanoseconds``, lands in the same
place). Hosts' clocks differ; so do the namespaces of a test given a skew (``$COMMLAB_TRACE_SKEW_NS``,
a test hook added to this clock). Each process therefore measures the others it meets NTP-style: it
asks for the peer's clock and takes the answer's midpoint between its own send and receive; the best
of several round trips has the smallest window, and half that window bounds the error. Those
measurements (:meth:`Recorder.peer_clock`) go in the file's metadata, and :func:`merge` puts every
process on the clock of rank 0 through the chain of measurements with the least uncertainty, which it
states in the merged file.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from commlab.base.errors import CommTimeout, ConfigError

ENV = "COMMLAB_TRACE"  # the folder every process writes its file to
SKEW_ENV = "COMMLAB_TRACE_SKEW_NS"  # test hook: added to the trace clock ("NS", or "rank1=NS,shard0=NS")
TORCH_ENV = "COMMLAB_TRACE_TORCH"  # steps whose torch.profiler operator trace goes in the file ("3" or "3-5")
FORMAT = 1  # of the files' otherData.commlab block
SHARD_PID = 1000  # process id of shard k in the merged trace (rank r is r)
TORCH_TID = 1 << 30  # torch.profiler's tracks in a process's file: ids from here up
CLOCK_ROUNDS = 12  # round trips per clock measurement: the narrowest one wins


def folder_problem(folder: str) -> str | None:
    """None if ``folder`` is (or can be made) a writable folder, else one line saying why not."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".commlab-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return f"cannot write traces to {folder}: {exc.strerror or exc}"
    return None


def flow_id(*parts: Any) -> int:
    """A flow's id from what both of its ends know (sender, shard, key space, request id, phase): 48 bits,
    exact in a JSON number."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


class Recorder:
    """One process's events. Thread-safe (appends to one list); every method records on the calling
    thread's track. Times are this process's trace clock in ns (:meth:`now`)."""

    def __init__(self, folder: str, kind: str, index: int, skew_ns: int = 0):
        self.folder, self.kind, self.index = folder, kind, index
        self.name = f"{kind}{index}"
        self.pid = index if kind == "rank" else SHARD_PID + index
        self.skew_ns = skew_ns
        # the monotonic clock, put on the wall clock once: spans never jump, and Kineto's stamps line up
        self._base = time.time_ns() - time.perf_counter_ns() + skew_ns
        # what ts count from (whole seconds): microseconds since the epoch would lose the sub-microsecond digits
        # in a float, as Kineto's would without its baseTimeNanoseconds
        self.origin_ns = self.now() // 10**9 * 10**9
        self.events: list[tuple] = []
        self.threads: dict[int, str] = {}
        self.clocks: dict[str, tuple[int, int]] = {}  # peer -> (its clock - ours in ns, uncertainty in ns)
        self.meta: dict[str, Any] = {}
        self.extra: list[dict] = []  # events taken whole (torch.profiler's), already on this clock
        self._lock = threading.Lock()
        self._written = False
        atexit.register(self.write)

    def now(self) -> int:
        return time.perf_counter_ns() + self._base

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        return tid

    def span(self, name: str, cat: str, t0: int, t1: int | None = None, args: dict | None = None) -> int:
        """A span from ``t0`` to ``t1`` (default: now) on this thread; returns its end."""
        t1 = self.now() if t1 is None else t1
        self.events.append(("X", name, cat, t0, t1 - t0, self._tid(), args))
        return t1

    def instant(self, name: str, cat: str, args: dict | None = None, t: int | None = None) -> None:
        self.events.append(("i", name, cat, self.now() if t is None else t, 0, self._tid(), args))

    def counter(self, name: str, values: dict, t: int | None = None) -> None:
        self.events.append(("C", name, "counter", self.now() if t is None else t, 0, 0, values))

    def flow(self, ph: str, fid: int, name: str, t: int) -> None:
        """One end of a flow (``ph``: ``s`` start, ``f`` end) at ``t``, which must lie inside a span of this
        thread recorded around it (Chrome binds the arrow to that span). A start goes where its span starts
        (before the bytes left), an end where the bytes had surely arrived: a thread preempted inside a span
        stretches it, and the arrow must still point forward in time."""
        self.events.append((ph, name, "flow", t, fid, self._tid(), None))

    def peer_clock(self, peer: str, ask: Callable[[], int | None], rounds: int = CLOCK_ROUNDS) -> None:
        """Measure ``peer``'s trace clock against ours: ``ask()`` makes one round trip and returns the peer's
        clock read in the middle of it (None: the peer does not trace). Keeps the narrowest round."""
        best: tuple[int, int] | None = None
        for _ in range(rounds):
            t1 = self.now()
            theirs = ask()
            t2 = self.now()
            if theirs is None:
                return
            half = (t2 - t1) // 2
            if best is None or half < best[1]:
                best = (int(theirs) - (t1 + half), half)
        if best is not None:
            self.clocks[peer] = best

    def take_torch_trace(self, path: str) -> int:
        """torch.profiler's Chrome trace at ``path`` (``export_chrome_trace``) into this file: its events on
        this process's tracks, shifted onto this clock through Kineto's ``baseTimeNanoseconds`` (its ``ts`` are
        microseconds after that wall-clock instant). Returns how many events were taken."""
        with open(path) as fh:
            data = json.load(fh)
        base_ns = int(data.get("baseTimeNanoseconds", 0))
        # Kineto's ts count from its base on the wall clock; ours from our origin, on the wall clock plus the skew
        shift_us = (base_ns + self.skew_ns - self.origin_ns) / 1000.0
        taken = 0
        for ev in data.get("traceEvents", []):
            if not isinstance(ev, dict) or ev.get("ph") not in ("X", "i", "C", "s", "f", "M"):
                continue
            ev = dict(ev, pid=self.pid)
            if "tid" in ev:  # a track of its own beside ours (Kineto's spans need not nest with ours)
                ev["tid"] = TORCH_TID + (abs(hash(str(ev["tid"]))) % TORCH_TID)
                if ev.get("ph") == "M":
                    ev["args"] = {"name": f"torch.profiler {ev.get('args', {}).get('name', '')}".strip()}
            if ev.get("ph") == "M":
                if ev.get("name") != "thread_name":
                    continue
            elif "ts" in ev:
                ev["ts"] = float(ev["ts"]) + shift_us
            ev["cat"] = "torch" if ev.get("ph") != "M" else ev.get("cat", "")
            if ev.get("ph") in ("s", "f"):
                ev["id"] = flow_id(self.name, "torch", ev.get("id"))
            self.extra.append(ev)
            taken += 1
        return taken

    # ----- the file ---------------------------------------------------------------------------
    def chrome(self) -> dict:
        """This process's events as a Chrome trace-event object (ts in microseconds on this clock, from
        ``origin_ns``)."""
        pid = self.pid
        out: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                            "args": {"name": f"{self.kind} {self.index}"}},
                           {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        for tid, tname in list(self.threads.items()):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
        for ph, name, cat, ts, x, tid, args in list(self.events):
            ev: dict[str, Any] = {"ph": ph, "name": name, "cat": cat, "ts": (ts - self.origin_ns) / 1000.0, "pid": pid,
                                  "tid": tid}
            if ph == "X":
                ev["dur"] = x / 1000.0
            elif ph == "i":
                ev["s"] = "t"
            elif ph in ("s", "f"):
                ev["id"] = x
                if ph == "f":
                    ev["bp"] = "e"
            if args:
                ev["args"] = args
            out.append(ev)
        out.extend(self.extra)
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"commlab": {"format": FORMAT, "process": self.name, "pid": pid, "kind": self.kind,
                                          "index": self.index, "origin_ns": self.origin_ns,
                                          "clocks": {p: {"offset_ns": o, "uncertainty_ns": u}
                                                     for p, (o, u) in self.clocks.items()},
                                          **self.meta}}}

    def path(self) -> Path:
        return Path(self.folder) / f"{self.name}.json"

    def write(self) -> Path | None:
        """Write (again: the whole file) ``DIR/<process>.json``. Never raises: a trace is not worth a crash."""
        with self._lock:
            try:
                path = self.path()
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(self.chrome()))
                os.replace(tmp, path)
                return path
            except (OSError, TypeError, ValueError) as exc:
                print(f"commlab: trace of {self.name} not written: {exc}", file=sys.stderr, flush=True)
                return None


_recorders: dict[tuple[int, str], Recorder] = {}  # (pid, process name): one recorder per process


def recorder(kind: str, index: int, environ=None) -> Recorder | None:
    """This process's recorder if ``$COMMLAB_TRACE`` is set, else None (then nothing is ever recorded). One
    per process and name: a rank with several exchangers shares one file. Read when an exchanger or a
    server starts, in the process itself (a fork server's children read their own environment)."""
    env = os.environ if environ is None else environ
    folder = env.get(ENV)
    if not folder:
        return None
    key = (os.getpid(), f"{kind}{index}")
    rec = _recorders.get(key)
    if rec is None:
        problem = folder_problem(folder)
        if problem:  # before this process exchanges anything, not when its file is due
            raise ConfigError(f"${ENV}: {problem}")
        rec = _recorders[key] = Recorder(folder, kind, index, skew_of(env.get(SKEW_ENV, ""), key[1]))
    return rec


def skew_of(spec: str, process: str) -> int:
    """The test hook's skew for ``process``: ``spec`` is ns for every process, or ``rank1=5000000,shard0=-300``."""
    if "=" not in spec:
        return int(spec or 0)
    for part in spec.split(","):
        name, _, ns = part.partition("=")
        if name.strip() == process:
            return int(ns)
    return 0


def torch_steps(environ=None) -> range | None:
    """``$COMMLAB_TRACE_TORCH``: which steps torch.profiler records (``3`` or ``3-5``), or None."""
    spec = (os.environ if environ is None else environ).get(TORCH_ENV, "")
    if not spec:
        return None
    lo, _, hi = spec.partition("-")
    return range(int(lo), int(hi or lo) + 1)


# ----- clocks through the rendezvous store ------------------------------------------------------
def sync_over_store(rec: Recorder, store, rank: int, world: int, timeout: float, ns: str = "trace/clock/") -> None:
    """Every rank but 0 measures rank 0's trace clock through the store: it writes a ping, rank 0 answers
    with its clock, NTP-style (:meth:`Recorder.peer_clock`). Collective: every rank of the job calls it (every
    rank traces or none), rank 0 answering the others in turn; each wait is bounded by ``timeout``, and a
    rank that never pings (it does not trace) is named in the :class:`CommTimeout` rank 0 raises."""
    if world < 2:
        return
    wait = timedelta(seconds=timeout)
    if rank == 0:
        for r in range(1, world):
            for k in range(CLOCK_ROUNDS):
                try:
                    store.wait([f"{ns}{r}/{k}/ping"], wait)
                except Exception as exc:  # the store's own timeout (a RuntimeError of torch's)
                    raise CommTimeout(f"rank {r} did not measure the trace clock within {timeout:g}s: every rank "
                                      f"must trace (${ENV}) or none", peer=r, op="receive") from exc
                store.set(f"{ns}{r}/{k}/pong", str(rec.now()))
        return
    best: tuple[int, int] | None = None
    for k in range(CLOCK_ROUNDS):  # the pong is read after the clock stops: wait() returns once it is there
        t1 = rec.now()
        store.set(f"{ns}{rank}/{k}/ping", "1")
        store.wait([f"{ns}{rank}/{k}/pong"], wait)
        t2 = rec.now()
        theirs = int(store.get(f"{ns}{rank}/{k}/pong"))
        half = (t2 - t1) // 2
        if best is None or half < best[1]:
            best = (theirs - (t1 + half), half)
    if best is not None:
        rec.clocks["rank0"] = best


# ----- merging ------------------------------------------------------------------------------------
def offsets(metas: dict[str, dict], reference: str) -> dict[str, tuple[float, float]]:
    """Each process's shift onto ``reference``'s clock in ns, and its uncertainty: the chain of measurements
    (either direction) with the least summed uncertainty. A process no chain reaches is left unshifted,
    with an infinite uncertainty."""
    edges: dict[str, list[tuple[str, float, float]]] = {p: [] for p in metas}
    for p, meta in metas.items():
        for q, m in meta.get("clocks", {}).items():
            o, u = float(m["offset_ns"]), float(m["uncertainty_ns"])
            # q's clock = p's + o: a time t on p is t + o on q
            edges.setdefault(p, []).append((q, o, u))
            edges.setdefault(q, []).append((p, -o, u))
    best: dict[str, tuple[float, float]] = {reference: (0.0, 0.0)}
    todo = [reference]
    while todo:  # few processes: a plain relaxation
        todo.sort(key=lambda p: best[p][1])
        p = todo.pop(0)
        shift_p, unc_p = best[p]
        for q, o, u in edges.get(p, []):
            # a time t on q is t - o on p, then + shift_p on the reference
            cand = (shift_p - o, unc_p + u)
            if q not in best or cand[1] < best[q][1]:
                best[q] = cand
                todo.append(q)
    return {p: best.get(p, (0.0, float("inf"))) for p in metas}


def merge(folder: str, out: str | None = None) -> Path | None:
    """Merge every ``DIR/*.json`` a process wrote into ``DIR/trace.json`` (or ``out``), each on rank 0's clock
    (or the first process's without a rank 0); flow ends whose other end is missing (a process killed, a
    reply after its receiver stopped tracing) are dropped and counted. None if there was nothing to merge."""
    files = sorted(p for p in Path(folder).glob("*.json") if p.name != "trace.json" and not p.name.startswith("."))
    docs = {}
    for path in files:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        meta = doc.get("otherData", {}).get("commlab")
        if isinstance(meta, dict):
            docs[meta["process"]] = doc
    if not docs:
        return None
    metas = {p: d["otherData"]["commlab"] for p, d in docs.items()}
    reference = "rank0" if "rank0" in docs else sorted(docs)[0]
    shifts = offsets(metas, reference)
    origin = min(int(m.get("origin_ns", 0)) for m in metas.values())
    events: list[dict] = []
    for p, doc in docs.items():
        shift_us = (shifts[p][0] + int(metas[p].get("origin_ns", 0)) - origin) / 1000.0
        for ev in doc.get("traceEvents", []):
            if "ts" in ev and ev.get("ph") != "M":
                ev["ts"] = ev["ts"] + shift_us
            events.append(ev)
    starts = {ev["id"] for ev in events if ev.get("ph") == "s"}
    ends = {ev["id"] for ev in events if ev.get("ph") == "f"}
    both = starts & ends
    kept = [ev for ev in events if ev.get("ph") not in ("s", "f") or ev["id"] in both]
    clock = {p: {"shift_ns": s, "uncertainty_ns": (u if u != float("inf") else None)} for p, (s, u) in shifts.items()}
    merged = {"traceEvents": kept, "displayTimeUnit": "ms",
              "otherData": {"commlab": {"format": FORMAT, "merged": True, "reference_clock": reference, "origin_ns": origin,
                                        "clocks": clock, "processes": metas,
                                        "flows_dropped": len(events) - len(kept)}}}
    target = Path(out) if out else Path(folder) / "trace.json"
    target.write_text(json.dumps(merged))
    return target


class TorchProfile:
    """``--trace-torch STEPS``: torch.profiler records the operators of ``steps`` (0-based optimizer steps),
    whose trace goes into ``rec``'s file on its clock (:meth:`Recorder.take_torch_trace`). Call
    :meth:`at_step` with the number of steps finished, when a step ends (and with 0 at setup)."""

    def __init__(self, rec: Recorder, steps: range):
        self.rec, self.steps = rec, steps
        self.prof: Any = None  # torch.profiler.profile while the steps run

    def close(self) -> None:
        """The run ended before the last chosen step: what was recorded goes in all the same."""
        if self.prof is not None:
            self.at_step(self.steps.stop)

    def at_step(self, done: int) -> None:
        if self.prof is None and done == self.steps.start:
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
        elif self.prof is not None and done >= self.steps.stop:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
            path = Path(self.rec.folder) / f".{self.rec.name}-torch.json"
            prof.export_chrome_trace(str(path))
            try:
                n = self.rec.take_torch_trace(str(path))
                self.rec.meta["torch_profile"] = {"steps": [self.steps.start, self.steps.stop - 1], "events": n}
            finally:
                path.unlink(missing_ok=True)
