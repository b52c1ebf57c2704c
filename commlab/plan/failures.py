"""Goodput under failures at scale, on paper: keep-going beside restart-all, from measured components.

Failures are independent across workers, each worker failing at ``rate`` per second (a Poisson
process; per-worker MTBF = 1 / rate), so a job of ``n`` workers sees failures at ``L = n * rate``.
Goodput is the share of the failure-free job's samples per second that still enter applied
updates.

**Restart-all** (``commlab run --max-restarts``, torchrun): every failure stops every rank; the
job is back after ``C(n)`` seconds (detection, process start, rendezvous of ``n`` ranks, the
first step) and the work in flight, ``w`` seconds of it, is lost. A failure during a restart
starts the restart again (it is the same kind of event). A productive stretch lasts X ~ Exp(L)
and yields max(0, X - w); a restart of length C under failures at rate L takes
(e^{LC} - 1) / L on average. One cycle's expected work over its expected length gives::

    G_restart(n) = exp(-L (C(n) + w))

**Keep-going** (survivors train on, a replacement heals live): a failure stalls every survivor
for ``k`` seconds (the dead process is noticed, the step in flight completes over the live
ranks); the dead worker is missing for ``h`` seconds (start, heal) plus its lost in-flight work
``w``. The share of wall time outside every failure's stall is P(no failure in the last k
seconds) = e^{-Lk}; each worker is present a share 1 / (1 + rate (h + w)) of the time (up
Exp(rate), down h + w). Taking the two as independent (they are, up to O(1/n))::

    G_keep(n) = exp(-L k) / (1 + rate (h + w))

``C(n)`` grows with the job: ``C(n) = C(n0) + r (n - n0)`` from one measured restart at ``n0``
ranks and the rendezvous cost per rank ``r`` (:class:`Components`); ``k`` and ``h`` do not grow
with ``n`` (the survivors' servers or ring notice one connection; the replacement joins at a step
boundary without a job-wide rendezvous). :func:`simulate` checks both forms by Monte Carlo
(tests/test_chaos.py). Pure Python: no torch.

    python -m commlab.plan.failures --chaos runs/chaos-X/chaos.json     # the components a chaos run measured
    python -m commlab.plan.failures --restart-s 12 --workers-measured 4 --rendezvous-per-rank-s 1e-4 \
        --stall-s 0.3 --heal-s 6 --lost-s 0.5 --workers 1000,10000 --mtbf-hours 50,5000
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass

HOUR = 3600.0


@dataclass(frozen=True)
class Components:
    """What one measured run says a failure costs (seconds)."""

    restart_s: float  # restart-all: from the kill to the first step after it, at measured_workers
    measured_workers: int
    rendezvous_per_rank_s: float  # how much longer the rendezvous takes per added rank
    stall_s: float  # keep-going: the survivors' lost time per failure (kill to their next step, less a step)
    heal_s: float  # keep-going: kill to the replacement's first step
    lost_s: float  # work in flight a failure throws away (about half a step)

    def restart_at(self, n: int) -> float:
        return self.restart_s + self.rendezvous_per_rank_s * max(0, n - self.measured_workers)


def goodput_restart_all(n: int, rate: float, restart_s: float, lost_s: float) -> float:
    """exp(-n rate (C + w)): the module's closed form."""
    return math.exp(-n * rate * (restart_s + lost_s))


def goodput_keep_going(n: int, rate: float, stall_s: float, heal_s: float, lost_s: float) -> float:
    """exp(-n rate k) / (1 + rate (h + w)): the module's closed form."""
    return math.exp(-n * rate * stall_s) / (1.0 + rate * (heal_s + lost_s))


def table(c: Components, workers=(1000, 10000), mtbf_hours=(50.0, 5000.0)) -> list[dict]:
    """Both policies' goodput per (per-worker MTBF, n)."""
    rows = []
    for m in mtbf_hours:
        rate = 1.0 / (m * HOUR)
        for n in workers:
            c_n = c.restart_at(n)
            rows.append({"workers": n, "mtbf_hours_per_worker": m, "job_failures_per_hour": n * rate * HOUR,
                         "restart_s": c_n, "restart_all": goodput_restart_all(n, rate, c_n, c.lost_s),
                         "keep_going": goodput_keep_going(n, rate, c.stall_s, c.heal_s, c.lost_s)})
    return rows


def lines(c: Components, rows: list[dict]) -> list[str]:
    """A markdown table of :func:`table`'s rows, with the components it used."""
    out = [f"Components (seconds): restart-all {c.restart_s:.2f} at {c.measured_workers} ranks + "
           f"{c.rendezvous_per_rank_s * 1e3:.3f} ms of rendezvous per added rank; keep-going stall "
           f"{c.stall_s:.2f}, heal {c.heal_s:.2f}; work lost per failure {c.lost_s:.2f}. "
           "Goodput: restart-all exp(-n rate (C(n) + w)), keep-going exp(-n rate k) / (1 + rate (h + w)) "
           "(commlab/plan/failures.py).", "",
           "| workers | MTBF per worker | job failures / h | restart-all C(n) | restart-all goodput | keep-going goodput |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['workers']:,} | {r['mtbf_hours_per_worker']:g} h | {r['job_failures_per_hour']:.3g} | "
                   f"{r['restart_s']:.1f} s | {r['restart_all']:.1%} | {r['keep_going']:.1%} |")
    return out


def as_dict(c: Components) -> dict:
    return asdict(c)


def simulate(policy: str, n: int, rate: float, *, horizon_s: float, restart_s: float = 0.0, stall_s: float = 0.0,
             heal_s: float = 0.0, lost_s: float = 0.0, seed: int = 0) -> float:
    """Monte Carlo goodput of ``policy`` ("restart-all" or "keep-going") over ``horizon_s`` seconds of wall
    time: failures drawn worker by worker, the same rules as the closed forms (module text)."""
    rng = random.Random(seed)
    big = n * rate
    if policy == "restart-all":
        t = work = 0.0
        while t < horizon_s:
            x = rng.expovariate(big)  # productive until the next failure
            if t + x >= horizon_s:
                work += max(0.0, horizon_s - t - lost_s)
                break
            work += max(0.0, x - lost_s)
            t += x
            while True:  # the restart; a failure inside it starts it again
                y = rng.expovariate(big)
                if y >= restart_s:
                    t += restart_s
                    break
                t += y
        return work / horizon_s
    if policy == "keep-going":
        # every failure: (time, worker); a stall of every worker for stall_s, and that worker gone heal_s + lost_s
        events = []
        for w in range(n):
            t = rng.expovariate(rate)
            while t < horizon_s:
                events.append(t)
                t += heal_s + lost_s + rng.expovariate(rate)  # down, then up until its next failure
        down = len(events) * (heal_s + lost_s)  # worker-seconds missing (the tail past the horizon is small)
        events.sort()
        stalled, end = 0.0, 0.0
        for t in events:  # the union of [t, t + stall_s)
            start = max(t, end)
            end = max(end, t + stall_s)
            stalled += max(0.0, end - start)
        stalled = min(stalled, horizon_s)
        present = 1.0 - down / (n * horizon_s)
        return (1.0 - stalled / horizon_s) * present
    raise ValueError(f"policy must be 'restart-all' or 'keep-going', got {policy!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commlab.plan.failures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chaos", help="a `commlab bench chaos` run's chaos.json: its measured components")
    p.add_argument("--restart-s", type=float)
    p.add_argument("--workers-measured", type=int, default=4)
    p.add_argument("--rendezvous-per-rank-s", type=float, default=0.0)
    p.add_argument("--stall-s", type=float)
    p.add_argument("--heal-s", type=float)
    p.add_argument("--lost-s", type=float, default=0.0)
    p.add_argument("--workers", default="1000,10000")
    p.add_argument("--mtbf-hours", default="50,5000", help="per worker")
    a = p.parse_args(argv)
    try:
        workers = tuple(int(x) for x in a.workers.split(","))
        mtbf = tuple(float(x) for x in a.mtbf_hours.split(","))
        if min(workers) < 1 or min(mtbf) <= 0:
            raise ValueError
    except ValueError:
        print("commlab plan failures: --workers and --mtbf-hours must be comma-separated positive numbers",
              file=sys.stderr)
        return 2
    if a.chaos:
        scale = json.loads(open(a.chaos).read()).get("at_scale")
        if not scale:
            print(f"commlab plan failures: --chaos {a.chaos} has no at-scale components (it needs restart-all's and "
                  "a keep-going entry's kills)", file=sys.stderr)
            return 2
        c = Components(**scale["components"])
    else:
        given = {k: getattr(a, k) for k in ("restart_s", "stall_s", "heal_s")}
        missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None or v < 0]
        if missing:
            print(f"commlab plan failures: give {', '.join(missing)} (seconds >= 0) or --chaos FILE", file=sys.stderr)
            return 2
        c = Components(a.restart_s, a.workers_measured, a.rendezvous_per_rank_s, a.stall_s, a.heal_s, a.lost_s)
    print("\n".join(lines(c, table(c, workers, mtbf))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
