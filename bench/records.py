"""The one record shape of every benchmark case: the nccl-tests columns, per case and regime.

``commlab bench`` (bandwidth) and its cases ``train-step``, ``ps-rounds`` and ``gpu-sweep`` all
write lists of these records (JSON objects), one per (case, regime, size), so one reader, one
table and one verdict serve them all. :func:`record` builds one from the timed iterations:

    case          which benchmark: "bandwidth", "train-step", "ps-rounds", "gpu-sweep"
    regime        the entry's name: a regime name ("ring-tcp"), a URL, or a peer's ("ddp", "rpc-default")
    kind          "regime" (a commlab exchanger), "peer" (not commlab: DDP, torch.distributed.rpc),
                  "ceiling" (raw TCP, pyzmq, memcpy), "reference" (one process, nothing exchanged)
    url           the exchanger URL ("" for peers and ceilings)
    method        how the bytes move, which sets busbw: "allreduce" | "pushpull" | "noop" | a ceiling's name
    workers       N ranks; link: "loopback" or the capped link
    size_bytes    bytes exchanged per iteration (the tensor; a training step's gradients); count; dtype
    iters         timed iterations; warmup: iterations before them, not timed
    time_us       median time of one iteration (an exchange, a training step, a push + pull round),
                  with time_us_min, time_us_p90, time_us_max
    algbw_gbps    size / time (GB/s), with _min (at the slowest iteration) and _max (at the fastest)
    busbw_gbps    algbw x the method's bus factor (bandwidth.py's table), with _min and _max
    samples_us    every timed iteration in the order taken: what the verdicts bootstrap over

and whatever the case adds (``wrong``, ``cpu_us`` and ``job`` for bandwidth; ``step_ms``,
``comm_ms``, ``model`` for train-step; ``rounds_per_s`` for ps-rounds; ``device`` for gpu-sweep).
A training step's algbw is gradient bytes per second of training, compute included. Also here what
the cases share besides the record: running a job of ranks (:func:`run_ranks`), taking turns
(:func:`take_turns`), wording a ratio (:func:`ratio_line`), writing a case's document (:func:`write`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from bench import jobs, manifest, text
from commlab.launch import launcher, scratch
from bench.text import fmt_us, human_bytes
from bench.verdict import Verdict, quantile

KINDS = ("regime", "peer", "ceiling", "reference")
T = TypeVar("T")
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
FIELDS = ("case", "regime", "kind", "url", "method", "workers", "link", "size_bytes", "count", "dtype", "iters",
          "warmup", "time_us", "time_us_min", "time_us_p90", "time_us_max", "algbw_gbps", "algbw_gbps_min",
          "algbw_gbps_max", "busbw_gbps", "busbw_gbps_min", "busbw_gbps_max", "samples_us")


def bus_factor(method: str, workers: int) -> float:
    """busbw / algbw: bytes each worker's link carries per direction, per byte of result (nccl-tests)."""
    if method == "allreduce":
        return 2 * (workers - 1) / workers
    if method == "noop":
        return 0.0
    return 1.0


def method_of(url: str) -> str:
    """How a regime URL moves bytes: all-reduce regimes, parameter servers, or nothing."""
    scheme = url.split("://", 1)[0]
    return {"allreduce": "allreduce", "ring": "allreduce", "ps": "pushpull"}.get(scheme, "noop")


def record(case: str, regime: str, *, kind: str, method: str, workers: int, size_bytes: int, times_s: Sequence[float],
           url: str = "", dtype: str = "float32", warmup: int = 0, link: str = "loopback", **extra) -> dict:
    """One record (module docstring) from the timed iterations ``times_s`` (seconds), plus ``extra``.

    Raises ValueError for no samples or an unknown kind or dtype. A case's extra field may not
    shadow a common one.
    """
    if not times_s:
        raise ValueError(f"{case} {regime}: no timed iterations")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(ITEMSIZE)}, got {dtype!r}")
    clash = sorted(set(extra) & set(FIELDS))
    if clash:
        raise ValueError(f"extra fields {clash} would replace common ones")
    ts = sorted(times_s)
    med = statistics.median(ts)
    p90 = quantile(ts, 0.9)
    f = bus_factor(method, workers)
    gb = lambda t: size_bytes / t / 1e9 if t > 0 else float("inf")
    return {"case": case, "regime": regime, "kind": kind, "url": url, "method": method, "workers": workers,
            "link": link, "size_bytes": size_bytes, "count": size_bytes // ITEMSIZE[dtype], "dtype": dtype,
            "iters": len(ts), "warmup": warmup,
            "time_us": med * 1e6, "time_us_min": ts[0] * 1e6, "time_us_p90": p90 * 1e6, "time_us_max": ts[-1] * 1e6,
            "algbw_gbps": gb(med), "algbw_gbps_min": gb(ts[-1]), "algbw_gbps_max": gb(ts[0]),
            "busbw_gbps": gb(med) * f, "busbw_gbps_min": gb(ts[-1]) * f, "busbw_gbps_max": gb(ts[0]) * f,
            "samples_us": [round(t * 1e6, 1) for t in times_s], **extra}


def failure(case: str, regime: str, error: str, url: str = "", status: str = "failed") -> dict:
    """An entry that produced no record, in the shape ``commlab bench``'s manifest lists failures."""
    return {"phase": case, "regime": regime, "url": url, "status": status, "error": error}


def ratio_line(label: str, v: Verdict) -> str:
    """``"LABEL: 0.78x [0.74, 0.83], ddp faster"``: ``v.ratio`` as computed (``stat(b) / stat(a)``, not
    turned round), its 95% interval, and the verdict (:meth:`bench.verdict.Verdict.said`: a winner only
    where the interval lies beyond the verdict's band; "equivalent within ±5%" where it lies inside;
    else "indistinguishable on this machine")."""
    return f"{label}: {v.ratio:.2f}x [{v.lo:.2f}, {v.hi:.2f}], {v.said()}"


def meets(v: Verdict, goal: float) -> str:
    """``meets`` where ``v.ratio >= goal`` holds over the whole interval, ``misses`` where it fails over it,
    else ``the interval straddles it``."""
    return "meets" if v.lo >= goal else "misses" if v.hi < goal else "the interval straddles it"


def goal_text(v: Verdict, goal: float) -> str:
    """``goal >= GOALx: meets`` (:func:`meets`)."""
    return f"goal >= {goal:g}x: {meets(v, goal)}"


def table(records: list[dict], extra: Sequence[tuple[str, str]] = ()) -> list[str]:
    """Markdown lines: the common columns and the ``(header, key)`` extras, one row per record."""
    head = ["regime", "kind", "N", "size", "time (median [min–max])", "algbw GB/s", "busbw GB/s", *(h for h, _ in extra)]
    return text.table(head, [[r["regime"], r["kind"], str(r["workers"]), human_bytes(r["size_bytes"]),
                              f"{fmt_us(r['time_us'])} [{fmt_us(r['time_us_min'])}–{fmt_us(r['time_us_max'])}]",
                              f"{r['algbw_gbps']:.3g}", "—" if r["method"] == "noop" else f"{r['busbw_gbps']:.3g}",
                              *(text.fmt(r.get(key), 4) for _, key in extra)] for r in records])


def write(path: str | os.PathLike, case: str, config: dict, records: list[dict], verdicts: list[tuple[str, Verdict]],
          failures: list[dict], **extra) -> None:
    """A case's document: what ran (config, git, environment), its records, its labelled verdicts, its
    failures, and the case's ``extra`` top-level facts."""
    doc = {"case": case, "config": config, "git": manifest.git_facts(), "environment": manifest.environment(),
           "records": records, "verdicts": [dict(label=label, **v.as_dict()) for label, v in verdicts],
           "failures": failures, **extra}
    Path(path).write_text(json.dumps(doc, indent=1))


def conclude(case: str, title: str, records: list[dict], columns: Sequence[tuple[str, str]], verdicts: list[tuple],
             failures: dict[str, str], url_of: Callable[[str], str], json_path: str | None, config: dict) -> int:
    """The end of a case: print ``title``, the records' :func:`table` (with ``columns``), each verdict
    ``(label, v)`` or ``(label, v, goal)`` as its :func:`ratio_line` (and :func:`goal_text`), and each
    entry that failed; write the case's document (:func:`write`) to ``json_path`` where given. Returns the
    exit status: 1 if an entry failed, else 0."""
    print(f"\n{title}\n")
    print("\n".join(table(records, columns)) + "\n")
    for label, v, *goal in verdicts:
        print(ratio_line(label, v) + "".join(f" ({goal_text(v, g)})" for g in goal))
    for name, err in failures.items():
        print(f"{name}: failed: {err}")
    if json_path:
        write(json_path, case, config, records, [(label, v) for label, v, *_ in verdicts],
              [failure(case, name, err, url_of(name)) for name, err in failures.items()])
        print(f"wrote {json_path}")
    return 1 if failures else 0


class CaseFailed(RuntimeError):
    """A job of a case failed; the message names the first process's error (its log's telling line)."""


def run_ranks(name: str, command: Sequence[str], args: Sequence[str] = (), *, workers: int, deadline_s: float,
              exchanger: str = "local://", url_flag: str | None = None, trace: str | None = None) -> list[list[dict]]:
    """Run ``python COMMAND ARGS`` as ``workers`` ranks (:func:`bench.jobs.run`); each rank's metrics lines.

    The launcher starts the servers ``exchanger``'s regime plans (they bind port 0 and report), hosts
    the rendezvous TCPStore on port 0 (``MASTER_PORT``, with ``TORCHELASTIC_USE_AGENT_STORE=True``, so
    torch's ``env://`` init of a process group or of torch.distributed.rpc connects as a client), and
    stops everything when a process fails or ``deadline_s`` passes. Ranks write with
    :func:`commlab.core.metrics.report` (``$COMMLAB_METRICS``). Blocks until the job ends. Raises CaseFailed
    for a failed job (naming its log's telling line), KeyboardInterrupt when it was stopped by Ctrl-C or
    SIGTERM.
    """
    with scratch.folder("case") as tmp:
        base = Path(tmp) / "metrics.jsonl"
        job = launcher.Job(tuple(command), tuple(args), workers, exchanger, url_flag=url_flag, metrics=str(base),
                           name=name, trace=trace)
        res = jobs.run(job, Path(tmp) / "job.log", deadline_s)
        if not res.ok:
            raise CaseFailed(f"{name}: {res.error()}")
        return jobs.read_ranks(base, workers, need_step=False)


def take_turns(case: str, names: Sequence[str], rounds: int, run_one: Callable[[str], T],
               said: Callable[[int, str, T], None]) -> tuple[dict[str, list[T]], dict[str, str]]:
    """``run_one(name)`` for each of ``names`` in turn, ``rounds`` times (drift on a shared machine hits
    every entry alike); ``said(round, name, result)`` after each. Returns each name's results in round
    order and the error of each that failed (CaseFailed: one failing entry must not sink the comparison;
    it is left out of later rounds). Ctrl-C or SIGTERM ends the rounds: what finished is returned."""
    got: dict[str, list[T]] = {n: [] for n in names}
    failures: dict[str, str] = {}
    try:
        for rnd in range(rounds):
            for name in names:
                if name in failures:
                    continue
                try:
                    got[name].append(run_one(name))
                except CaseFailed as exc:
                    failures[name] = str(exc)
                    continue
                said(rnd, name, got[name][-1])
    except KeyboardInterrupt:
        print(f"commlab bench {case}: interrupted; reporting what finished", file=sys.stderr)
    return got, failures
