"""Bandwidth: every regime and ceiling, every size, the nccl-tests columns (:mod:`bench.records`).

Per (regime, size, workers): the median time of one exchange of ``S`` bytes of float32 (per
iteration, the slowest rank's time), its spread, ``algbw = S / t``, ``busbw`` (algbw x the method's
bus factor, :func:`bench.records.bus_factor`: what each worker's link carries per second in each
direction, so a parameter server and a ring read on one axis) and ``wrong`` (elements that differed
from the exact reference, over all timed iterations). docs/bench.md ("What is measured") has the
definitions; :mod:`bench.bw_worker` is one rank of a job, :func:`plan` which cases share one.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import regimes as R
from bench import jobs
from commlab.launch import launcher
from bench.records import failure, record
from bench.text import human_bytes

DTYPE = "float32"


@dataclass
class Budget:
    """Seconds left for the benchmark. A job starts only if one like those before it still fits,
    and gets at most what is left; a job stopped for the budget is reported as cut, not failed."""

    deadline: float
    durations: list = field(default_factory=list)

    @classmethod
    def of(cls, seconds: float) -> "Budget":
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, floor: float = 5.0) -> bool:
        typical = statistics.median(self.durations) if self.durations else 0.0
        return self.left() > max(floor, 1.2 * typical)

    def note(self, seconds: float) -> None:
        self.durations.append(seconds)

    def outcome(self, res, stuck_s: float | None = None) -> tuple[str, str]:
        """(status, error) of a job that did not succeed: cut by the budget (``"skipped"``), stopped by its
        own deadline while it still worked (:data:`TOO_SLOW`: this machine, loaded as it is now, could
        not finish it in time; not a failure), or failed. ``stuck_s``: seconds the job had gone without a
        sign of progress when it was stopped, where the caller knows it; a job stopped by its deadline
        after :func:`stuck_after` of them is stuck, a failure."""
        if res.timed_out and self.left() <= 1.0:
            return "skipped", f"stopped after {res.seconds:.0f}s when the benchmark's time budget ran out"
        if res.timed_out and stuck_s is not None and stuck_s > stuck_after(res.seconds):
            return "failed", (f"stopped by its deadline after {res.seconds:.0f}s, with no progress in its last "
                              f"{stuck_s:.0f}s: stuck, not slow; last output: {jobs.last_error_line(res.log)}")
        if res.timed_out:
            return TOO_SLOW, (f"{TOO_SLOW}: stopped by its deadline after {res.seconds:.0f}s while it still "
                              f"progressed; last output: {jobs.last_error_line(res.log)}")
        return "failed", res.error()


TOO_SLOW = "too slow to judge here now"  # the status of a run its deadline stopped while it still progressed


def stuck_after(seconds: float) -> float:
    """Seconds without progress after which a job its deadline stopped counts as stuck, not slow: a
    quarter of its run, at least 30 (a loaded machine's pauses between steps stay far below)."""
    return max(30.0, seconds / 4)


def iters_for(size: int, repeat_bytes: int, min_iters: int, max_iters: int) -> int:
    """Timed iterations for one size: about ``repeat_bytes`` moved, clamped. Same on every rank."""
    return max(min_iters, min(max_iters, repeat_bytes // max(size, 1)))


def summarize(regime: str, url: str, kind: str, method: str, workers: int, row: dict, times: list[float],
              wrong: int, link: str, cpu: list[float] | None = None) -> dict:
    """One record (:func:`bench.records.record`: the nccl-tests columns and their spread) from
    per-iteration times (seconds), with bandwidth's own ``wrong``, ``cpu_us`` and ``job``.
    ``samples_us`` keeps every timed iteration in the order the cases took turns: sample i of two
    records from one job were taken in the same seconds (paired, see :mod:`bench.verdict`)."""
    return record("bandwidth", regime, kind=kind, method=method, workers=workers, size_bytes=row["size_bytes"],
                  times_s=times, url=url, dtype=DTYPE, warmup=row.get("warmup", 0), link=link, wrong=wrong,
                  cpu_us=statistics.median(cpu) * 1e6 if cpu else None, job=row.get("job"))


@dataclass
class JobOutcome:
    """What one bandwidth job's ranks wrote: per (case, size) the combined row, and which cases
    could not be set up or failed (the earliest failure across ranks is the culprit)."""

    rows: dict = field(default_factory=dict)  # (case, size) -> (row, slowest-rank times, rank 0 cpu, wrong)
    setup_errors: dict = field(default_factory=dict)
    failed: tuple | None = None  # (case, error)
    facts: dict = field(default_factory=dict)


def combine_ranks(out: Path, workers: int) -> JobOutcome:
    """The sizes every rank finished, per case: per-iteration slowest-rank times, wrong summed over
    ranks; the regimes' facts. Ranks write after every size, so a job cut short still has some."""
    per_rank = jobs.read_ranks(out, workers, need_step=False)
    res = JobOutcome()
    for rows in per_rank:
        for row in rows:
            if "facts" in row and not res.facts:
                res.facts = row["facts"]
            if "setup_error" in row:
                res.setup_errors.setdefault(row["case"], row["setup_error"])
    fails = sorted((row["at"], row["case"], row["failed"]) for rows in per_rank for row in rows if "failed" in row)
    if fails:
        res.failed = (fails[0][1], fails[0][2])
    keyed = [{(row["case"], row["size_bytes"]): row for row in rows if "times_s" in row} for rows in per_rank]
    for key, row in keyed[0].items():
        if all(key in k for k in keyed):
            times = [max(t) for t in zip(*(k[key]["times_s"] for k in keyed))]
            res.rows[key] = (row, times, row.get("cpu_s"), sum(k[key]["wrong"] for k in keyed))
    return res


@dataclass
class BandwidthConfig:
    regimes: list[str]
    workers: int
    sizes: list[int]
    repeat_bytes: int = 256 * 2**20
    min_iters: int = 5
    max_iters: int = 100
    warmup: int = 2
    ceilings: tuple[str, ...] = ("tcp-oneway", "tcp-duplex", "memcpy")
    job_timeout: float = 900.0  # one job holds every case and size: the budget is what bounds it
    launches: int = 3  # each job runs this many times, each time with all its iterations (bench.verdict: launches)
    corrupt: bool = False  # tests: shift one reference element, the wrong column must show it


def plan(cfg: BandwidthConfig, links=None) -> tuple[list[tuple[list[dict], list[int]]], list[dict]]:
    """The jobs: ``([case, ...], sizes)`` each, and the regimes that cannot run here.

    Everything that can share a job shares one, taking turns iteration by iteration (bench.bw_worker).
    Jobs of their own: a second ``allreduce://`` regime (one process group per process), and over
    ``--link`` a regime whose servers must be placed in namespaces, one size per job (:func:`bench.jobs.place_servers`).
    """
    together, alone, failures = [], [], []
    for name in cfg.regimes:
        e = R.bandwidth_entry(name)
        why = R.unavailable(e.url)
        if why is None and e.needs_cuda:
            import torch
            why = None if torch.cuda.is_available() else "BackendUnavailable: no CUDA device here (torch sees none)"
        if why is None and links is not None and e.loopback_only:
            why = "not run over --link: this regime's addresses are chosen on loopback (127.0.0.1)"
        if why:
            failures.append(failure("bandwidth", name, why, e.url, "unavailable"))
            continue
        case = {"name": name, "method": e.method, "url": e.url, "kind": "regime"}
        if e.one_size_per_job and links is not None:
            alone += [([dict(case, url=LAUNCHER_URL, launch=e.url)], [s]) for s in cfg.sizes]
        elif e.url.startswith("allreduce://") and any(c["url"].startswith("allreduce://") for c in together):
            alone.append(([case], cfg.sizes))
        else:
            together.append(case)
    for c in cfg.ceilings:
        if links is not None and c.startswith("zmq"):
            failures.append(failure("bandwidth", c, "not run over --link: pyzmq's ceiling binds 127.0.0.1",
                                    status="unavailable"))
            continue
        together.append({"name": c, "method": c, "url": "", "kind": "ceiling"})
    jobs = [(together, cfg.sizes)] if together else []
    return jobs + alone, failures


LAUNCHER_URL = "@launcher"  # the case's URL is the one the launcher hands the ranks (--exchanger)


def run(cfg: BandwidthConfig, run_dir: Path, budget: Budget, links=None, progress=None) -> tuple[list[dict], list[dict], dict]:
    """Measure; return (records, failures, facts per regime). Never raises for a regime's failure."""
    records, facts = [], {}
    (run_dir / "raw").mkdir(parents=True, exist_ok=True)
    jobs, failures = plan(cfg, links)
    launches = max(1, cfg.launches)
    # every launch runs the whole iteration count: a launch costs mostly its process starts (the
    # ranks, a PS's servers per size), and a median of a few iterations per launch is what made the
    # small sizes' verdicts swing (gloo's 4 KiB times are bimodal here: ~0.5 ms or 2-7 ms)
    bar = progress(total=len(jobs) * launches, desc="bandwidth", unit="job") if progress else None
    try:
        for launch in range(launches):  # launch by launch, every job in each: drift spreads over all
            for i, (cases, sizes) in enumerate(jobs):
                if launch:  # the cases that measured something in the first launch; a failure is reported once
                    ran = {r["regime"] for r in records if str(r.get("job", "")).split("-")[0] == f"bw{i}"}
                    cases = [c for c in cases if c["name"] in ran]
                    if not cases:
                        continue
                if bar:
                    bar.set_postfix_str(f"launch {launch + 1}/{launches}: " + ",".join(c["name"] for c in cases))
                seen = len(failures)
                _run_job(cfg, cases, sizes, f"bw{i}" + (f"-l{launch}" if launches > 1 else ""), run_dir, budget,
                         links, records, failures, facts)
                if launch:  # a case that fails again: one line of the first launch's is enough
                    known = {(f["regime"], f["status"]) for f in failures[:seen]}
                    failures[seen:] = [f for f in failures[seen:] if (f["regime"], f["status"]) not in known]
                bar and bar.update(1)
    except KeyboardInterrupt:
        failures.append(failure("bandwidth", "-", "interrupted (Ctrl-C or SIGTERM): the report covers the jobs that "
                                "finished", status="interrupted"))
    if bar:
        bar.close()
    return merge_launches(records), failures, facts


def merge_launches(records: list[dict]) -> list[dict]:
    """One record per (regime, size, workers) from the records of its launches (``job`` ``bwI-lL``):
    the samples of launch 0, then 1, ... in ``samples_us``, their counts in ``launch_sizes`` (what
    :mod:`bench.verdict` resamples launch by launch), ``wrong`` summed, ``job`` the job without its
    launch. Records of one launch pass through unchanged."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["regime"], r["size_bytes"], r["workers"]), []).append(r)
    out = []
    for parts in groups.values():
        if len(parts) == 1 and "-l" not in str(parts[0].get("job", "")):
            out.append(parts[0])
            continue
        first = parts[0]
        job = str(first.get("job", "")).split("-l")[0]
        times = [us * 1e-6 for p in parts for us in p["samples_us"]]
        cpus = [p["cpu_us"] for p in parts if p.get("cpu_us") is not None]
        merged = summarize(first["regime"], first["url"], first["kind"], first["method"], first["workers"],
                           {"size_bytes": first["size_bytes"], "warmup": first["warmup"], "job": job}, times,
                           sum(p["wrong"] for p in parts), first["link"])
        merged["cpu_us"] = statistics.median(cpus) if cpus else None
        merged["launch_sizes"] = [len(p["samples_us"]) for p in parts]
        merged["launch_jobs"] = [p.get("job") for p in parts]
        out.append(merged)
    return out


def paired(rs: list[dict]) -> bool:
    """Records whose samples were taken turn by turn in one job: sample i of each, the same seconds."""
    return (len({r.get("job") for r in rs}) == 1 and len({len(r.get("samples_us") or ()) for r in rs}) == 1
            and len({tuple(r.get("launch_sizes") or ()) for r in rs}) == 1)


def clusters(rs: list[dict]):
    """The launches paired records' samples came from (None: one launch, or not paired)."""
    return rs[0].get("launch_sizes") if paired(rs) else None


def launch_groups(records: list[dict]) -> list[list[list[float]]]:
    """Per record of several launches, its samples launch by launch (for :func:`bench.verdict.launch_sigma`)."""
    groups = []
    for r in records:
        sizes = r.get("launch_sizes") or []
        if len(sizes) >= 2 and not r.get("wrong") and r.get("method") != "noop":
            at, parts = 0, []
            for n in sizes:
                parts.append(r["samples_us"][at:at + n])
                at += n
            groups.append(parts)
    return groups


def _run_job(cfg, cases, sizes, tag, run_dir, budget, links, records, failures, facts) -> None:
    """One set of cases taking turns; rerun without a case that failed while running, on the sizes
    not yet measured, until every case has its sizes or a failure."""
    link = f"{links.rate} veth+tbf" if links else "loopback"
    workers = cfg.workers
    left, todo, attempt = list(cases), list(sizes), 0
    fail = lambda c, status, error, log=None: failures.append(dict(
        failure("bandwidth", c["name"], error, c.get("launch", c["url"]), status),
        **({"log": str(log.relative_to(run_dir))} if log else {})))
    while left and todo:
        if not budget.fits():
            for c in left:
                fail(c, "skipped", "the benchmark's time budget ran out before this job"
                     + (f" (sizes not measured: {', '.join(map(human_bytes, todo))})" if todo != sizes else ""))
            return
        name = f"{tag}-{attempt}" if attempt else tag
        out, log = run_dir / "raw" / f"{name}.jsonl", run_dir / "logs" / f"{name}.log"
        its = [iters_for(s, cfg.repeat_bytes, cfg.min_iters, cfg.max_iters) for s in todo]
        launch = next((c["launch"] for c in left if "launch" in c), "noop://")
        wire_cases = [{k: c[k] for k in ("name", "method", "url")} for c in left]
        args = ["--cases", json.dumps(wire_cases), "--sizes", ",".join(map(str, todo)),
                "--iters", ",".join(map(str, its)), "--warmup", str(cfg.warmup), "--out", str(out),
                "--timeout", str(min(cfg.job_timeout, 60.0)), *(["--corrupt"] if cfg.corrupt else [])]
        env = None
        if any("nccl" in c["url"] for c in left):
            from commlab.tools.doctor import NCCL_DEBUG_ENV
            env = dict(os.environ, **NCCL_DEBUG_ENV)  # NCCL's own word on GPUDirect RDMA lands in the log
        job = launcher.worker_job(launch, workers, args, module="bench.bw_worker", name=name, env=env)
        res = jobs.run(job, log, min(cfg.job_timeout, budget.left()), links)
        budget.note(res.seconds)
        try:
            got = combine_ranks(out, workers)
        except (OSError, ValueError, KeyError) as exc:
            for c in left:
                fail(c, "failed", f"its ranks' results could not be read: {type(exc).__name__}: {exc}", res.log)
            return
        for c in left:
            if c["name"] in got.facts:
                facts[c["name"]] = got.facts[c["name"]]
            if "nccl" in c["url"]:
                facts.setdefault(c["name"], {})["nccl_log"] = nccl_transport_facts(res.log)
        for s in todo:  # what finished counts, also from a job cut short
            for c in left:
                if (c["name"], s) in got.rows:
                    row, times, cpu, wrong = got.rows[(c["name"], s)]
                    records.append(summarize(c["name"], c.get("launch", c["url"]), c["kind"], c["method"], workers,
                                             dict(row, job=name), times, wrong, link, cpu))
        dropped = dict(got.setup_errors)
        if got.failed:
            dropped.setdefault(got.failed[0], got.failed[1])
        for c in [c for c in left if c["name"] in dropped]:
            fail(c, "failed", dropped[c["name"]], res.log)
        left = [c for c in left if c["name"] not in dropped]
        todo = [s for s in todo if not all((c["name"], s) in got.rows for c in left)]
        if res.ok or not left:
            return
        if got.failed is None:  # nobody named: the job as a whole failed (or ran out of time)
            status, error = budget.outcome(res)
            for c in left:
                fail(c, status, error + (f" (sizes not measured: {', '.join(map(human_bytes, todo))})"
                                         if todo != sizes else ""), res.log)
            return
        attempt += 1


def nccl_transport_facts(log: Path) -> dict:
    """What NCCL itself said about its transports (``commlab doctor``'s reading of its log): GPUDirect
    RDMA only when a channel line says GDRDMA."""
    from commlab.tools.doctor import parse_nccl_log

    return parse_nccl_log(log.read_text(errors="replace"))


def header_cost(n: int = 20000) -> dict:
    """Microseconds to build and check one header: msgpack (encode + decode) vs the ring's fixed chunk header."""
    import torch

    from commlab.transport import wire
    data = torch.zeros(1024)
    parts = wire.split("grad", data)
    t0 = time.perf_counter()
    for i in range(n):
        wire.decode(wire.encode("chunk", "rank0", i, parts), ops=("chunk",))
    t1 = time.perf_counter()
    for i in range(n):
        expected = wire.chunk_header(0, i, 1, 0, 0, 1024, torch.float32)
        wire.check_chunk_header(wire.chunk_header(0, i, 1, 0, 0, 1024, torch.float32), expected, "rank 0")
    t2 = time.perf_counter()
    return {"msgpack_us": (t1 - t0) / n * 1e6, "chunk_header_us": (t2 - t1) / n * 1e6}


if __name__ == "__main__":  # python -m bench.bandwidth: the per-message header cost alone
    print(json.dumps(header_cost()))
