"""The character LM of charlm.py with tensor-parallel MLPs, data-parallel over a 2-D mesh (dp x tp).

``examples/plain/pipeline_lm.py`` trains the whole model in one process; this is the same loop (its
options, data and optimizer taken from there) with every block's MLP split over the mesh's ``tp``
dimension by ``torch.distributed.tensor.parallel`` (the first Linear by columns, the second by rows,
so the hidden activations never leave their rank) and commlab exchanging gradients over ``dp``::

    4 ranks, mesh [[0, 1], [2, 3]] with dimensions ("dp", "tp")
      tp: ranks 0, 1 (and 2, 3) hold halves of each MLP and see the same batch
      dp: ranks 0, 2 (and 1, 3) hold the same shards and exchange their gradients:
          commlab.connect(group=mesh["dp"]); a DTensor's gradient moves as its local shard

    commlab run --workers 4 --exchanger 'allreduce://?backend=gloo' examples/tp_lm.py --steps 100
    commlab run --workers 4 --exchanger 'ring://' examples/tp_lm.py --steps 100

gloo on CPU. Every wait is bounded: the mesh's groups are made with ``--timeout``, commlab's by its URL.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import commlab
from charlm import CharLM, warmup_cosine
from plain.pipeline_lm import batches, end_step, make_optimizer, micro_steps, options, text_data  # the plain script's


def parse_args(argv=None):
    p = options(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per replica (the ranks are dp x tp)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a tensor-parallel collective may wait")
    p.add_argument("--save", help="rank 0 writes the whole model's state_dict here at the end")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)  # env:// from the launcher
    rank, world, tp = dist.get_rank(), dist.get_world_size(), args.tp
    if world % tp or (4 * args.d_model) % tp:
        raise SystemExit(f"--tp {tp} must divide the {world} ranks and the MLP's {4 * args.d_model} hidden units")
    dp = world // tp
    layout = torch.arange(world).view(dp, tp)  # rank = replica x tp + shard
    tp_group, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout)  # every rank makes every
    dp_group, _ = dist.new_subgroups_by_enumeration(layout.t().tolist(), timeout=timeout)  # group, in one order
    mesh = DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh=layout, mesh_dim_names=("dp", "tp"))
    ex = commlab.connect(group=mesh["dp"])  # the replicas of this rank's shards
    replica = rank // tp
    chars, train = text_data()
    next_batch = batches(train, dp, range(replica, replica + 1), args)  # the tp ranks of a replica: one batch

    torch.manual_seed(args.seed)
    model = CharLM(len(chars), args.context, args.d_model, args.layers, args.heads)
    for block in model.blocks:  # mlp = Linear(d, 4d), GELU, Linear(4d, d)
        parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = make_optimizer(model, args)
    ex.setup(model, optimizer)  # collective over this rank's dp group
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))

    t0 = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = next_batch(step)
        last = args.microbatches - 1  # exchange once a step, in the last micro-batch's backward
        loss = micro_steps(model, x, y, args.microbatches,
                           around=lambda m: ex.no_sync() if m < last else contextlib.nullcontext())
        if args.clip:
            clip_whole_model(model, args.clip, tp_group)
        end_step(step, loss, optimizer, scheduler, args, t0, show=rank == 0,
                 report=lambda step, fields: commlab.report(step, exchange=ex.last_report, **fields))
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}  # collective
    if args.save and rank == 0:
        torch.save(whole, args.save)
    if args.save:  # every shard, to compare the replicas
        torch.save({k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()},
                   f"{args.save}.rank{rank}")
    ex.close()
    dist.destroy_process_group()


def clip_whole_model(model: torch.nn.Module, max_norm: float, tp_group) -> None:
    """``clip_grad_norm_`` over the whole model (torch's refuses a mix of DTensors and tensors): the squared
    norm of a sharded DTensor adds up its shards over the tp ranks; a replicated one, or a plain tensor, is
    whole on every rank."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements)]
    whole = [g.to_local() if isinstance(g, DTensor) else g for g in grads
             if not (isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements))]
    shards2 = torch.stack([g.pow(2).sum() for g in sharded]).sum() if sharded else torch.zeros(())
    dist.all_reduce(shards2, group=tp_group)
    norm2 = shards2 + (torch.stack([g.pow(2).sum() for g in whole]).sum() if whole else 0.0)
    coef = (max_norm / (norm2.sqrt() + 1e-6)).clamp(max=1.0)
    for g in sharded + whole:
        g.mul_(coef)


if __name__ == "__main__":
    main()
