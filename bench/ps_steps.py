"""Training step cost: ``ps://?shards=1&mode=sync`` beside ``allreduce://?backend=gloo``, same run.

For each model, runs ``commlab train --workers 2 --batch-size 64`` under both
regimes, alternating (so drift on a shared machine hits both alike), and
reports the median per-step time of rank 0 (warm-up steps dropped), the
median time ``step()`` blocked, and ps / allreduce. The goal: at most 1.3 x.

    python -m bench.ps_steps [--models mlp mlp-25m] [--steps 30] [--repeats 1] [--json ps_steps.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.jobs import run_job

REGIMES = {"ps": "ps://?shards=1&mode=sync", "allreduce": "allreduce://?backend=gloo"}


def run(exchanger: str, model: str, steps: int, warmup: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        # a job of its own process group (bench.jobs): on the deadline the launcher goes with its ranks and servers
        res = run_job([sys.executable, "-m", "commlab.cli", "train", "--exchanger", exchanger, "--workers", "2",
                       "--model", model, "--batch-size", "64", "--steps", str(steps), "--metrics", str(metrics),
                       "--no-progress"], Path(tmp) / "train.log", timeout)
        if not res.ok:
            raise RuntimeError(f"commlab train --exchanger {exchanger} --model {model}: {res.error()}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()][warmup:]
    return {"step_s": [r["step_s"] for r in rows], "comm_s": [r["comm_s"] for r in rows]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ps_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "mlp-25m"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default="ps_steps.json")
    a = p.parse_args(argv)
    results: dict = {}
    for model in a.models:
        samples = {name: {"step_s": [], "comm_s": []} for name in REGIMES}
        for _ in range(a.repeats):
            for name, url in REGIMES.items():
                got = run(url, model, a.steps, a.warmup, a.timeout)
                for k in got:
                    samples[name][k] += got[k]
        results[model] = {name: {"median_step_s": statistics.median(v["step_s"]),
                                 "median_comm_s": statistics.median(v["comm_s"]), "steps": len(v["step_s"])}
                          for name, v in samples.items()}
        results[model]["ratio"] = results[model]["ps"]["median_step_s"] / results[model]["allreduce"]["median_step_s"]
    print(f"\nmedian step, 2 workers, batch 64 each: {REGIMES['ps']} vs {REGIMES['allreduce']}")
    print(f"{'model':10} {'ps step':>9} {'(blocked)':>10} {'allreduce':>10} {'(blocked)':>10} {'ps/ar':>7}")
    for model, r in results.items():
        ps, ar = r["ps"], r["allreduce"]
        print(f"{model:10} {ps['median_step_s'] * 1e3:7.1f}ms {ps['median_comm_s'] * 1e3:8.1f}ms "
              f"{ar['median_step_s'] * 1e3:8.1f}ms {ar['median_comm_s'] * 1e3:8.1f}ms {r['ratio']:6.2f}x"
              f"  (goal <= 1.3x: {'meets' if r['ratio'] <= 1.3 else 'misses'})")
    Path(a.json).write_text(json.dumps({"regimes": REGIMES, "results": results, "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
