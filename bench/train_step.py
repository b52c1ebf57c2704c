"""Training-step time of commlab regimes against DistributedDataParallel, side by side in one run.

    python -m bench.train_step --model mlp-25m --workers 2 --batch-size 64 \
        --regimes 'allreduce://?backend=gloo' 'ring://' 'ps://?shards=1&mode=sync' --json step.json

Every entry trains the same model on the same data with the same per-rank batch, 1 torch thread
per rank. Entries run in interleaved rounds (DDP, regime A, regime B, DDP, ...) so drift of the
machine hits them alike; each entry's median is over all its post-warm-up steps, with min-max.
Also measured: one process with no exchange at all (``local://``), for scale, and DDP a second
time with the heap setting commlab's exchangers make (``ddp+heap``, see :mod:`commlab.heap`). In
the run in bench/results/train_step-mlp25m.json the setting alone took DDP's step from 250 to 206 ms (mlp-25m), so the ratio to
``ddp+heap`` shows what the exchange itself gains over DDP's, and the ratio to plain ``ddp`` what a
user gains by switching.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.jobs import stop_groups, wait_all
from commlab.launcher import free_port


def run_entry(entry: str, a, workdir: Path, tag: str) -> list[float]:
    metrics = workdir / f"{tag}.jsonl"
    common = ["--model", a.model, "--steps", str(a.steps + a.warmup), "--batch-size", str(a.batch_size),
              "--metrics", str(metrics)]
    # every process below leads a process group of its own, so that a deadline or Ctrl-C stops it
    # with all it started (wait_all): main() goes on to the next entry, and nothing stays behind
    if entry in ("ddp", "ddp+heap"):
        import os
        port = free_port()
        heap = ["--heap", "keep"] if entry == "ddp+heap" else []
        procs: list[subprocess.Popen] = []
        try:
            for r in range(a.workers):
                procs.append(subprocess.Popen([sys.executable, "-m", "bench.ddp_worker", *common, *heap],
                                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.workers),
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                                              start_new_session=True))
        except BaseException:  # a rank that did not start: the ones started would wait for it
            stop_groups(procs)
            raise
        codes = wait_all(procs, a.timeout, f"{entry} ({a.workers} ranks)")
    else:
        workers = 1 if entry == "local://" else a.workers
        job = subprocess.Popen([sys.executable, "-m", "commlab.cli", "train", "--no-progress", "--exchanger", entry,
                                "--workers", str(workers), "--lr", "0.01", *common], start_new_session=True)
        codes = wait_all([job], a.timeout, f"commlab train --exchanger {entry}")
    if any(codes):
        raise RuntimeError(f"{entry} failed with exit codes {codes}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step_s"] for r in rows[a.warmup:]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp-25m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--regimes", nargs="+", default=["allreduce://?backend=gloo"])
    p.add_argument("--json", help="write the records here")
    a = p.parse_args(argv)
    entries = ["local://", "ddp", "ddp+heap", *a.regimes]
    times: dict[str, list[float]] = {e: [] for e in entries}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for i, e in enumerate(entries):
                if e in errors:
                    continue
                print(f"[round {rnd + 1}/{a.rounds}] {e}", file=sys.stderr, flush=True)
                try:
                    times[e] += run_entry(e, a, Path(tmp), f"r{rnd}e{i}")
                except Exception as exc:  # one failing regime must not sink the comparison
                    errors[e] = str(exc)
    ddp = statistics.median(times["ddp"]) if times["ddp"] else float("nan")
    ddp_heap = statistics.median(times["ddp+heap"]) if times["ddp+heap"] else float("nan")
    records = []
    print(f"\n{a.model}, {a.workers} ranks x batch {a.batch_size}, 1 thread each, "
          f"{a.rounds} rounds x {a.steps} steps (after {a.warmup} warm-up)\n")
    print("| entry | median step ms | min-max ms | / DDP | / DDP+heap |\n|---|---|---|---|---|")
    for e in entries:
        if e in errors:
            print(f"| {e} | failed: {errors[e]} | | |")
            records.append({"entry": e, "error": errors[e]})
            continue
        t = times[e]
        med = statistics.median(t)
        label = "local:// (1 process, batch %d, no exchange)" % a.batch_size if e == "local://" else e
        print(f"| {label} | {med * 1e3:.1f} | {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} | {med / ddp:.2f}x "
              f"| {med / ddp_heap:.2f}x |")
        records.append({"entry": e, "model": a.model, "workers": 1 if e == "local://" else a.workers,
                        "batch_size": a.batch_size, "median_step_s": med, "min_step_s": min(t),
                        "max_step_s": max(t), "steps": len(t), "ratio_to_ddp": med / ddp,
                        "ratio_to_ddp_heap": med / ddp_heap})
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
