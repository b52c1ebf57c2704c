"""The peer: torch DistributedDataParallel (gloo) training what ``python -m workers`` trains: the same flags
(:func:`workers.loop.add_training_args`), model, data order, optimizer and evaluation, and the same JSON line
per step (loss, acc, compute_s, step_s, bytes_sent, time_s; test_loss/test_acc on rank 0 at eval steps).
Run through the launcher with torchrun's environment (its hosted store: ``env://`` connects as a client) by
``commlab bench train-step`` (:mod:`bench.train_step`) and by the convergence comparison's ``ddp`` entry.

DDP overlaps its all-reduces with backward and ``optimizer.step()`` does not wait for anything, so there is
no exposed-communication time to report apart from compute: ``compute_s`` is forward + backward (which
includes DDP's exchange), ``comm_s`` is None. ``bytes_sent`` is a ring all-reduce's count for the gradients,
2(N-1)/N of their bytes, as commlab's allreduce:// counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from commlab.core import metrics
from workers.data import load_digits
from workers.loop import add_training_args, config_from_args, evaluate
from workers.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ddp_worker")
    add_training_args(p)
    p.set_defaults(model="mlp-25m", steps=30, batch_size=64, lr=0.01)
    p.add_argument("--heap", choices=("system", "keep"), default="system",
                   help="keep: the same glibc heap setting commlab's exchangers make (commlab.core.heap)")
    a = p.parse_args()
    cfg = config_from_args(a)
    torch.set_num_threads(cfg.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    model, side = build_model(cfg.model, cfg.seed)
    if a.heap == "keep":
        from commlab.core.heap import keep_freed_gradients
        keep_freed_gradients(model.parameters())
    ddp = DistributedDataParallel(model)
    opt = cfg.optim.build(ddp.parameters())
    data = load_digits(side, cfg.seed)
    sent = 2 * (world - 1) * sum(p.numel() * p.element_size() for p in model.parameters()) // world
    path = cfg.metrics or os.environ.get(metrics.ENV)
    if cfg.metrics:
        metrics.metrics_path(cfg.metrics, rank).unlink(missing_ok=True)
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        x, y = data.batch(step, rank, world, cfg.batch_size)
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = ddp(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        line = dict(loss=loss.item(), acc=(logits.argmax(1) == y).float().mean().item(), compute_s=t1 - t0,
                    comm_s=None, step_s=t2 - t0, bytes_sent=sent, time_s=t2 - t_start)
        if rank == 0 and (step == cfg.steps - 1 or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
            line["test_loss"], line["test_acc"] = evaluate(model, data.test_x, data.test_y)
        if path:
            metrics.report(step, path=path, rank=rank, **line)
    leave()


def leave() -> NoReturn:
    """End a rank of a DDP job (collective: every rank calls it): meet the others, destroy the default group,
    then exit without the interpreter's teardown. About one DDP job in ten here died of std::terminate
    ("terminate called without an active exception", SIGABRT) at exit, whether rank 0 hosted the store or
    the launcher did, and deleting the DDP module first did not stop it. Call it once everything the rank
    had to say is written (:func:`commlab.core.metrics.report` closes its file on every line)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
