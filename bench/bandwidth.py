"""Bandwidth: every regime and ceiling, every size, the nccl-tests columns.

Per (regime, size, workers): the median time of one exchange of ``S`` bytes of
float32 (per iteration, the slowest rank's time), its min, p90 and max, and:

- ``algbw = S / t``: how fast the application gets its ``S``-byte result, the same
  definition for every regime;
- ``busbw``: bytes each worker's link carries per second *in each direction*, so
  figures from different algorithms read on one axis and against the link:

  ====================  ======================  =====================================
  regime                per worker, each way    busbw
  ====================  ======================  =====================================
  all-reduce (ring)     2(N-1)/N x S            algbw x 2(N-1)/N  (as nccl-tests)
  parameter server      pushes S, pulls S       algbw x 1
  raw TCP ceilings      S                       algbw x 1
  memcpy                S read, S written       algbw x 1
  noop                  0                       0
  ====================  ======================  =====================================

  A PS and a ring reaching the same busbw use their links equally well; the ring
  needs fewer bytes per worker (2(N-1)/N against 2), so at equal busbw its algbw
  is higher by N/(2(N-1)) -- and a PS's servers carry N x S / K each way per shard.
- ``wrong``: elements that differed from the exact reference, over all timed iterations.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import regimes as R
from bench.jobs import python, run_job
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

    def outcome(self, res) -> tuple[str, str]:
        """(status, error) of a job that did not succeed: cut by the budget, or failed."""
        if res.timed_out and self.left() <= 1.0:
            return "skipped", f"stopped after {res.seconds:.0f}s when the benchmark's time budget ran out"
        return "failed", res.error()


def iters_for(size: int, repeat_bytes: int, min_iters: int, max_iters: int) -> int:
    """Timed iterations for one size: about ``repeat_bytes`` moved, clamped. Same on every rank."""
    return max(min_iters, min(max_iters, repeat_bytes // max(size, 1)))


def bus_factor(method: str, workers: int) -> float:
    if method == "allreduce":
        return 2 * (workers - 1) / workers
    if method == "noop":
        return 0.0
    return 1.0


def summarize(regime: str, url: str, kind: str, method: str, workers: int, row: dict, times: list[float],
              wrong: int, link: str) -> dict:
    """One JSON record from per-iteration times (seconds)."""
    s = row["size_bytes"]
    ts = sorted(times)
    med = statistics.median(ts)
    p90 = ts[min(len(ts) - 1, int(round(0.9 * (len(ts) - 1))))]
    f = bus_factor(method, workers)
    gb = lambda t: s / t / 1e9 if t > 0 else float("inf")
    return {"regime": regime, "url": url, "kind": kind, "method": method, "workers": workers, "link": link,
            "size_bytes": s, "count": row["count"], "dtype": DTYPE, "iters": len(ts), "warmup": row.get("warmup", 0),
            "time_us": med * 1e6, "time_us_min": ts[0] * 1e6, "time_us_p90": p90 * 1e6, "time_us_max": ts[-1] * 1e6,
            "algbw_gbps": gb(med), "algbw_gbps_min": gb(ts[-1]), "algbw_gbps_max": gb(ts[0]),
            "busbw_gbps": gb(med) * f, "busbw_gbps_min": gb(ts[-1]) * f, "busbw_gbps_max": gb(ts[0]) * f,
            "wrong": wrong}


def combine_ranks(out: Path, workers: int) -> tuple[list[dict], list[list[float]], list[int], dict]:
    """Sizes every rank finished: rank 0's rows, per-iteration slowest-rank times, wrong summed over
    ranks; and the regime's facts. Ranks write after every size, so a job cut short still has some."""
    per_rank = []
    for r in range(workers):
        p = out if r == 0 else Path(f"{out}.rank{r}")
        per_rank.append(json.loads(p.read_text())["rows"] if p.exists() else [])
    facts = next((row["facts"] for row in per_rank[0] if "facts" in row), {})
    sized = [[row for row in rows if "size_bytes" in row] for rows in per_rank]
    done = min(len(rows) for rows in sized)
    times = [[max(t) for t in zip(*(rows[i]["times_s"] for rows in sized))] for i in range(done)]
    wrong = [sum(rows[i]["wrong"] for rows in sized) for i in range(done)]
    return sized[0][:done], times, wrong, facts


def memcpy_records(sizes: list[int], iters: list[int], warmup: int, link: str) -> list[dict]:
    out = []
    for size, n in zip(sizes, iters):
        src = np.arange(size, dtype=np.uint8)
        dst = np.empty_like(src)
        times = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        wrong = int((dst != src).sum())
        row = {"size_bytes": size, "count": size // 4, "warmup": warmup}
        out.append(summarize("memcpy", "", "ceiling", "memcpy", 1, row, times, wrong, link))
    return out


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
    job_timeout: float = 90.0
    corrupt: bool = False  # tests: shift one reference element, the wrong column must show it


def run(cfg: BandwidthConfig, run_dir: Path, budget: Budget, links=None, progress=None) -> tuple[list[dict], list[dict], dict]:
    """Measure; return (records, failures, facts per regime). Never raises for a regime's failure."""
    records, failures, facts = [], [], {}
    (run_dir / "raw").mkdir(parents=True, exist_ok=True)
    link = f"{links.rate} veth+tbf" if links else "loopback"
    iters = [iters_for(s, cfg.repeat_bytes, cfg.min_iters, cfg.max_iters) for s in cfg.sizes]
    jobs, late = [], []  # (name, url, kind, method, sizes)
    for name in cfg.regimes:
        e = R.BANDWIDTH[name]
        why = R.unavailable(e.url)
        if why is None and e.needs_cuda:
            import torch
            why = None if torch.cuda.is_available() else "BackendUnavailable: no CUDA device here (torch sees none)"
        if why is None and links is not None and e.loopback_only:
            why = "not run over --link: this regime's addresses are chosen on loopback (127.0.0.1)"
        if why:
            failures.append({"phase": "bandwidth", "regime": name, "url": e.url, "status": "unavailable", "error": why})
            continue
        # one_size_per_job: on loopback the job's rank 0 restarts the servers per size (bench.bw_worker);
        # over --link, where servers must be placed in namespaces, each size is a job of its own
        groups = [[s] for s in cfg.sizes] if e.one_size_per_job and links is not None else [cfg.sizes]
        (late if e.one_size_per_job else jobs).extend((name, e.url, "regime", e.method, g) for g in groups)
    # cheap jobs first (one each), then the ceilings, then regimes that need a job per size:
    # if the time budget runs out, it is the last of those that are skipped
    jobs += [(c, "noop://", "ceiling", c, cfg.sizes) for c in cfg.ceilings if c.startswith("tcp")] + late
    bar = progress(total=len(jobs) + ("memcpy" in cfg.ceilings), desc="bandwidth", unit="job") if progress else None
    failed_names: set[str] = set()
    try:
        _run_jobs(cfg, jobs, iters, run_dir, budget, links, link, bar, records, failures, facts, failed_names)
    except KeyboardInterrupt:
        failures.append({"phase": "bandwidth", "regime": "-", "url": "", "status": "interrupted",
                         "error": "interrupted (Ctrl-C or SIGTERM): the report covers the jobs that finished"})
        if bar:
            bar.close()
        return records, failures, facts
    if "memcpy" in cfg.ceilings:
        records += memcpy_records(cfg.sizes, iters, cfg.warmup, "memory")
        bar and bar.update(1)
    if bar:
        bar.close()
    return records, failures, facts


def _run_jobs(cfg, jobs, iters, run_dir, budget, links, link, bar, records, failures, facts, failed_names) -> None:
    for name, url, kind, method, sizes in jobs:
        if bar:
            bar.set_postfix_str(name)
        if name in failed_names:
            bar and bar.update(1)
            continue
        if not budget.fits():
            failures.append({"phase": "bandwidth", "regime": name, "url": url, "status": "skipped",
                             "error": "the benchmark's time budget ran out before this job"})
            failed_names.add(name)
            bar and bar.update(1)
            continue
        its = [iters[cfg.sizes.index(s)] for s in sizes]
        tag = f"{name}-{sizes[0]}" if len(sizes) == 1 and len(cfg.sizes) > 1 else name
        out = run_dir / "raw" / f"bw-{tag}.json"
        workers = cfg.workers if not method.startswith("tcp") else 2
        servers_in_job = R.BANDWIDTH[name].one_size_per_job if kind == "regime" and links is None else False
        argv = [python(), "-m", "bench.launch_job", "--url", "noop://" if servers_in_job else url,
                "--workers", str(workers), "--module", "bench.bw_worker"]
        if links is not None:
            argv += ["--link", links.rate, "--link-tag", links.tag]
        argv += ["--", "--method", method, "--sizes", ",".join(map(str, sizes)), "--iters", ",".join(map(str, its)),
                 "--warmup", str(cfg.warmup), "--out", str(out), "--timeout", str(min(cfg.job_timeout, 60.0))]
        if servers_in_job:
            argv += ["--regime-url", url]
        if cfg.corrupt:
            argv.append("--corrupt")
        env = None
        if "nccl" in url:
            from commlab.doctor import NCCL_DEBUG_ENV
            env = dict(os.environ, **NCCL_DEBUG_ENV)  # NCCL's own word on GPUDirect RDMA lands in the log
        res = run_job(argv, run_dir / "logs" / f"bw-{tag}.log", min(cfg.job_timeout, budget.left()), env=env)
        budget.note(res.seconds)
        try:
            rows, times, wrong, f = combine_ranks(out, workers)
        except (OSError, ValueError, KeyError) as exc:
            rows, times, wrong, f = [], [], [], {}
            res = dataclasses.replace(res, returncode=res.returncode or 1)
            failures.append({"phase": "bandwidth", "regime": name, "url": url, "status": "failed",
                             "error": f"its ranks' results could not be read: {type(exc).__name__}: {exc}",
                             "log": str(res.log.relative_to(run_dir))})
            failed_names.add(name)
        if f:
            facts[name] = f
        if "nccl" in url:
            facts.setdefault(name, {})["nccl_log"] = nccl_transport_facts(res.log)
        for row, t, w in zip(rows, times, wrong):  # what finished counts, also from a job cut short
            records.append(summarize(name, url, kind, method, workers, row, t, w, link))
        if not res.ok and name not in failed_names:
            status, error = budget.outcome(res)
            missing = [s for s in sizes if s not in {row["size_bytes"] for row in rows}]
            failures.append({"phase": "bandwidth", "regime": name, "url": url, "status": status,
                             "error": error + (f" (sizes not measured: {', '.join(map(human_bytes, missing))})"
                                               if rows and missing else ""),
                             "log": str(res.log.relative_to(run_dir))})
            failed_names.add(name)
        bar and bar.update(1)


def nccl_transport_facts(log: Path) -> dict:
    """What NCCL itself said about its transports (``commlab doctor``'s reading of its log): GPUDirect
    RDMA only when a channel line says GDRDMA."""
    from commlab.doctor import parse_nccl_log

    return parse_nccl_log(log.read_text(errors="replace"))
