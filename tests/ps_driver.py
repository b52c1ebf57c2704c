"""A worker for tests/test_ps.py whose gradients are known constants.

``python tests/ps_driver.py URL --rank R --workers N --steps T --grad G [--sleep S] [--size n] [...]``

The model is one flat parameter of ``n`` zeros; every step the gradient is
``G`` everywhere, assigned to ``p.grad`` by hand (no backward), then ``exchanger.step()`` pushes it
and pulls. Prints one JSON line: the final parameter values this worker holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

import commlab
from commlab.transport.rendezvous import RankInfo


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise commlab.CommTimeout(f"{what} within {timeout:g}s")
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--grad", type=float, default=0.25)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--optimizer", default="sgd", help="a commlab.OptimizerSpec name (adam: state to replicate)")
    p.add_argument("--size", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' per step (a slow worker)")
    p.add_argument("--barrier", action="store_true", help="start stepping once every worker is attached")
    p.add_argument("--lag-until-version", type=int, default=0,
                   help="a slow worker: before pushing its first step, wait until the servers applied this many "
                        "more updates (or --lag-timeout passed, as when the mode blocks the others)")
    p.add_argument("--lag-timeout", type=float, default=2.0)
    p.add_argument("--final-version", type=int, default=0,
                   help="after the steps, wait until every shard applied this many updates, then pull the newest "
                        "parameters and print those (async: what the job ended with)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = nn.ParameterList([nn.Parameter(torch.zeros(a.size))])
    info = RankInfo(a.rank, a.workers, a.rank, "127.0.0.1", 0, "flags")
    with commlab.connect(a.url, info) as ex:
        ex.setup(model, commlab.OptimizerSpec(a.optimizer, lr=a.lr))
        if a.barrier:
            wait_for(lambda: all(len(s["workers"]) >= a.workers for s in ex.server_stats()),
                     f"rank {a.rank}: not every worker attached")
        for step in range(a.steps):
            ex.zero_grad()
            if a.sleep:
                time.sleep(a.sleep)
            lag_until = time.monotonic() + a.lag_timeout
            pulled = min(shard.version for shard in ex.shards)  # the version this gradient is computed on
            while step == 0 and a.lag_until_version and time.monotonic() < lag_until:
                if min(s["version"] for s in ex.server_stats()) >= pulled + a.lag_until_version:
                    break
                time.sleep(0.01)
            model[0].grad = torch.full_like(model[0], a.grad)  # a gradient of our own (no backward)
            ex.step()
        if a.final_version:
            wait_for(lambda: min(s["version"] for s in ex.server_stats()) >= a.final_version,
                     f"rank {a.rank}: the shards did not reach version {a.final_version}")
            ex.pull_latest()
        print(json.dumps({"rank": a.rank, "param": model[0].detach().tolist()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
