"""A rank of a job that shrinks and grows (tests/test_elastic.py; not a test itself), with torchrun's
environment and the exchanger from $COMMLAB_EXCHANGER (ps://...?mode=sync&update=server).

``elastic_script.py OUT STEPS``: one parameter ``w`` (3 numbers) whose loss on rank r is ``(w * (r + 1)).sum()``:
rank r of N holds shard r of the data, whose gradient is r + 1, so a sync step of N ranks moves ``w`` by
``lr * mean(1..N)``. On a new world size the loop rescales the learning rate to ``BASE_LR * N``, as
Horovod's reset callbacks do (the data's re-sharding is the rank's own: its shard is its new rank's).
Writes ``OUT/start.<attempt>.<rank>.json`` once set up (the attempt id ``ex.attempt_id``, the world
size, ``ex.start_step``) and ``OUT/end.<attempt>.<rank>.json`` with the parameters and the servers' stats.

``HOLD=N:T[,N:T...]``: in an attempt of N ranks the rank stops before step T until the file ``OUT/go.N.T``
exists (a slow worker; at most 120 s), or until it is killed, as its agent does when the group restarts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import commlab

BASE_LR = 0.01


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    ex = commlab.connect()
    ex.setup(model, opt)
    for group in opt.param_groups:  # the reset callback: this attempt's N, which commits carry to the servers
        group["lr"] = BASE_LR * ex.world_size
    attempt, rank = ex.attempt_id, ex.rank
    (out / f"start.{attempt}.{rank}.json").write_text(json.dumps(
        {"attempt": attempt, "world": ex.world_size, "start_step": ex.start_step, "pid": os.getpid(), "agent": os.getppid(),
         "params": model.weight.detach().view(-1).tolist()}))
    holds = [tuple(map(int, spec.split(":"))) for spec in os.environ.get("HOLD", "").split(",") if spec]
    for step in range(ex.start_step, steps):
        if (ex.world_size, step) in holds:
            deadline = time.monotonic() + 120
            while not (out / f"go.{ex.world_size}.{step}").exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"rank {rank} held before step {step} was neither released nor stopped")
                time.sleep(0.02)
        ex.zero_grad()
        (model.weight * (rank + 1)).sum().backward()
        opt.step()
    record = {"params": model.weight.detach().view(-1).tolist(), "servers": ex.server_stats()}
    ex.close()
    (out / f"end.{attempt}.{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
