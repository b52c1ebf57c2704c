"""The training loop: the same code under every regime, talking only to the Exchanger."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import commlab
import commlab.core.metrics  # used as commlab.core.metrics below: commlab imports its entry points on first use
from commlab.transport import rendezvous
from commlab.core.optim import OPTIMIZERS, OptimizerSpec
from commlab.core.staging import resolve_device
from workers.data import load_digits
from workers.models import MODELS, build_model


@dataclass(frozen=True)
class WorkerConfig:
    exchanger: str
    model: str
    steps: int
    batch_size: int
    optim: OptimizerSpec
    seed: int
    threads: int
    eval_every: int
    save_params: str | None
    metrics: str | None
    progress: bool
    device: str = "cpu"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers", description="One data-parallel training worker.")
    add_training_args(p)
    p.add_argument("--rank", type=int, help="this worker's rank, if no launcher environment sets it")
    p.add_argument("--workers", type=int, help="world size, if no launcher environment sets it")
    p.add_argument("--master-addr", help="rendezvous host, if no launcher environment sets MASTER_ADDR")
    p.add_argument("--master-port", type=int, help="rendezvous port, if no launcher environment sets MASTER_PORT")
    return p


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The flags ``commlab train`` and a bare worker share."""
    p.add_argument("--exchanger", default=os.environ.get("COMMLAB_EXCHANGER", "local://"),
                   help="regime URL, e.g. allreduce://?backend=gloo (default: $COMMLAB_EXCHANGER, else local://)")
    p.add_argument("--model", default="mlp", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    p.add_argument("--eval-every", type=int, default=0, help="test-set accuracy every K steps on rank 0 (0: end only)")
    p.add_argument("--save-params", help="rank 0 writes the final state_dict here (torch.save)")
    p.add_argument("--metrics", help="JSON lines per step; rank r > 0 writes PATH.rank<r> "
                                     "(default: $COMMLAB_METRICS, which commlab train and run set)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, cuda (GPU LOCAL_RANK %% count) or cuda:K")


def config_from_args(a: argparse.Namespace) -> WorkerConfig:
    for name in ("steps", "batch_size", "threads"):
        if getattr(a, name) < 1:
            raise commlab.ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    optim = OptimizerSpec(a.optimizer, lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay)
    return WorkerConfig(a.exchanger, a.model, a.steps, a.batch_size, optim, a.seed, a.threads, a.eval_every,
                        a.save_params, a.metrics, not a.no_progress, a.device)


@torch.no_grad()
def evaluate(model, x, y) -> tuple[float, float]:
    out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


def train(cfg: WorkerConfig, rank_info: rendezvous.RankInfo) -> dict:
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device, rank_info.local_rank)
    model, side = build_model(cfg.model, cfg.seed)
    model.to(device)
    data = load_digits(side, cfg.seed)
    rank, world = rank_info.rank, rank_info.world_size
    ex = commlab.connect(cfg.exchanger, rank_info)
    metrics = cfg.metrics or os.environ.get(commlab.core.metrics.ENV)
    if cfg.metrics:  # a file named on the command line holds this run only (the launcher clears its own)
        commlab.core.metrics.metrics_path(cfg.metrics, rank).unlink(missing_ok=True)
    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc=f"{ex.scheme}:// x{world}", unit="step", disable=None)
    try:
        optimizer = cfg.optim.build(model.parameters())  # a torch optimizer, as a user's script has
        ex.setup(model, optimizer)
        t_start = time.perf_counter()
        record: dict = {}
        for step in range(ex.start_step, cfg.steps):  # a restarted job under ps:// update=server goes on
            x, y = (t.to(device) for t in data.batch(step, rank, world, cfg.batch_size))
            t0, c0 = time.perf_counter(), time.thread_time()
            ex.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            t1 = time.perf_counter()
            report = ex.step()  # optimizer.step(), and what this step's exchange moved and waited
            t2 = time.perf_counter()
            record = {"step": step, "rank": rank, "loss": loss.item(),
                      "acc": (logits.argmax(1) == y).float().mean().item(),
                      "compute_s": t1 - t0, "comm_s": report.wait_s, "step_s": t2 - t0,
                      "cpu_s": time.thread_time() - c0,  # this thread's CPU in the step (not the exchange's threads)
                      "bytes_sent": report.bytes_sent, "bytes_received": report.bytes_received,
                      "time_s": t2 - t_start}
            if report.bytes_uncompressed:  # compress=: what the step would have sent without it
                record["bytes_uncompressed"] = report.bytes_uncompressed
            last = step == cfg.steps - 1
            if rank == 0 and (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
                record["test_loss"], record["test_acc"] = evaluate(model, data.test_x.to(device), data.test_y.to(device))
            if metrics:
                commlab.report(path=metrics, **record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
                bar.update(1)
        if rank == 0 and cfg.save_params:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, cfg.save_params)
        return record
    finally:
        if bar is not None:
            bar.close()
        ex.close()


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        cfg = config_from_args(a)
        info = rendezvous.from_env(rank=a.rank, world_size=a.workers, master_addr=a.master_addr,
                                   master_port=a.master_port)
        train(cfg, info)
    except (commlab.CommError, commlab.ConfigError) as exc:
        rank = os.environ.get("RANK", a.rank if a.rank is not None else "?")
        print(f"commlab worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0
