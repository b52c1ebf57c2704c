"""The peer: torch DistributedDataParallel (gloo) running the same model, data, batch and optimizer
as ``python -m workers``. Run by ``commlab bench train-step`` (:mod:`bench.train_step`) through the
launcher, with torchrun's environment (its hosted store: ``env://`` connects as a client); rank 0
writes one JSON line per step (step_s) to ``$COMMLAB_METRICS``, like a commlab worker does."""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from commlab import metrics
from workers.data import load_digits
from workers.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp-25m")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heap", choices=("system", "keep"), default="system",
                   help="keep: the same glibc heap setting commlab's exchangers make (commlab.heap)")
    a = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    model, side = build_model(a.model, a.seed)
    if a.heap == "keep":
        from commlab.heap import keep_freed_gradients
        keep_freed_gradients(model.parameters())
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    data = load_digits(side, a.seed)
    for step in range(a.steps):
        x, y = data.batch(step, rank, world, a.batch_size)
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if rank == 0:
            metrics.report(step, rank=rank, step_s=time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    # Then leave without the interpreter's teardown: about one DDP job in ten here died of std::terminate
    # ("terminate called without an active exception", SIGABRT) after this point, at exit, whether rank 0
    # hosted the store or the launcher did, and deleting the DDP module first did not stop it. Everything
    # this rank had to say is written (metrics.report closes its file on every line).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
