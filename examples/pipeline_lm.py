"""The character LM of charlm.py cut into pipeline stages, each replicated for data parallelism.

``examples/plain/pipeline_lm.py`` trains it in one process; this is the same script (its options,
data and optimizer taken from there) with the model cut into ``--stages`` stages by
``torch.distributed.pipelining`` (a ``PipelineStage`` per rank, a GPipe or 1F1B schedule over
``--microbatches``) and the ranks that hold the same stage exchanging its gradients by commlab,
within their replica group only (docs/scripts.md shows how its ``main`` differs from the plain one)::

    4 ranks, 2 stages x 2 replicas          rank = replica x stages + stage
      replica 0:  rank 0 (stage 0) -> rank 1 (stage 1)      activations forward, gradients back:
      replica 1:  rank 2 (stage 0) -> rank 3 (stage 1)      the pipeline's group ([0, 1], [2, 3])
      commlab:    ranks 0, 2 exchange stage 0's gradients; ranks 1, 3 stage 1's (group=[0, 2], [1, 3])

    commlab run --workers 4 --exchanger 'allreduce://?backend=gloo' examples/pipeline_lm.py --steps 100
    commlab run --workers 4 --exchanger 'ps://?shards=1&mode=sync' examples/pipeline_lm.py --steps 100

The schedule runs one backward per micro-batch: it runs inside ``ex.no_sync()`` and ``ex.flush()``
exchanges once, after the last one. gloo on CPU, NCCL on GPU. Every wait is bounded: the pipeline's
groups are made with ``--timeout`` (a dead stage is an error naming it), commlab's by its URL.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import commlab
from charlm import CharLM, warmup_cosine
from plain.pipeline_lm import batches, end_step, loss_fn, make_optimizer, options, text_data  # the plain script's


class Stage(nn.Module):
    """Blocks ``[lo, hi)`` of a CharLM, after its embeddings (first stage) and before its head (last stage).
    Parameter names are the whole model's (``blocks.3.qkv.weight``), so a stage's state_dict is a part of
    the whole model's."""

    def __init__(self, lm: CharLM, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.tok, self.pos = (lm.tok, lm.pos) if first else (None, None)
        self.blocks = nn.ModuleDict({str(i): lm.blocks[i] for i in range(lo, hi)})
        self.ln, self.head = (lm.ln, lm.head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None else x


def parse_args(argv=None):
    p = options(__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (the ranks are stages x replicas)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a pipeline send or receive may wait")
    p.add_argument("--save", help="each rank writes its stage's state_dict to SAVE.stageS.replicaR at the end")
    p.add_argument("--bubble", action="store_true", help="report each step's bubble: the schedule's time less "
                                                             "this stage's compute alone, timed after it (one more "
                                                             "forward and backward per micro-batch)")
    p.add_argument("--data-shards", type=int, default=0, help="cut the text into this many slices, one window "
                                                              "stream each (default: one per replica)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    # the pipeline's own process group (env:// from the launcher), its waits bounded by --timeout
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world, stages = dist.get_rank(), dist.get_world_size(), args.stages
    if world % stages or args.layers < stages:
        raise SystemExit(f"--stages {stages} must divide the {world} ranks and be at most --layers {args.layers}")
    replicas = world // stages
    replica, stage = divmod(rank, stages)
    pipeline, _ = dist.new_subgroups_by_enumeration(  # every rank makes every replica's group, in one order
        [list(range(r * stages, (r + 1) * stages)) for r in range(replicas)], timeout=timedelta(seconds=args.timeout))
    ex = commlab.connect(group=[r * stages + stage for r in range(replicas)])  # this stage's replicas
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    chars, train = text_data()
    shards = args.data_shards or replicas  # one process with --stages 1 and all slices is the reference
    if shards % replicas or args.batch_size % (shards // replicas):
        raise SystemExit(f"--data-shards {shards} must be a multiple of the {replicas} replicas and divide "
                         f"--batch-size {args.batch_size} into equal parts")
    per = shards // replicas
    next_batch = batches(train, shards, range(replica * per, (replica + 1) * per), args)  # this replica's slices

    torch.manual_seed(args.seed)
    whole = CharLM(len(chars), args.context, args.d_model, args.layers, args.heads)
    cut = [args.layers * s // stages for s in range(stages + 1)]
    model = Stage(whole, cut[stage], cut[stage + 1], stage == 0, stage == stages - 1).to(device)
    # A micro-batch's shapes, given: else the stage infers them with a real forward and backward of its own
    # in the first step, whose gradients (on a module that is not FSDP's) would add to that step's.
    micro = args.batch_size // args.microbatches
    shapes = [(micro, args.context)] + [(micro, args.context, args.d_model)] * (stages - 1) + \
             [(micro, args.context, len(chars))]
    meta = [torch.empty(shape, dtype=torch.long, device="meta") if s == 0 else  # activations carry gradients back
            torch.empty(shape, device="meta", requires_grad=True) for s, shape in enumerate(shapes)]
    # the bytes this stage sends its neighbours per step: activations forward, their gradients back
    sent = args.microbatches * 4 * ((stage < stages - 1) + (stage > 0)) * micro * args.context * args.d_model
    optimizer = make_optimizer(model, args)
    ex.setup(model, optimizer)  # collective over this stage's replicas
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    pipe = PipelineStage(model, stage, stages, device, input_args=meta[stage], output_args=meta[stage + 1],
                         group=pipeline)
    Schedule = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = Schedule(pipe, args.microbatches, loss_fn=loss_fn)  # grads scaled by 1/microbatches
    last = replica * stages + stages - 1
    neighbours = [replica * stages + s for s in (stage - 1, stage + 1) if 0 <= s < stages]

    t0 = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = next_batch(step)
        losses = []
        started = time.perf_counter()
        try:
            with ex.no_sync():  # one backward per micro-batch inside the schedule: none exchanges
                schedule.step(*([x.to(device)] if stage == 0 else []),
                              **({"target": y.to(device), "losses": losses} if stage == stages - 1 else {}))
        except RuntimeError as exc:  # gloo's or NCCL's send/receive: a neighbour died, or stalled past --timeout
            raise SystemExit(f"rank {rank} (stage {stage} of replica {replica}): pipeline step {step} failed, "
                             f"with neighbour stage(s) on rank(s) {neighbours}: {exc}") from exc
        pipeline_s = time.perf_counter() - started  # the bubble: what of it this stage did not compute
        timing = {"pipeline_s": pipeline_s, "activation_bytes": sent}
        if args.bubble:  # the same micro-batches' compute alone, timed now, under the machine's load of now
            alone = alone_s(model, meta[stage], args.microbatches, len(chars), device, stage == stages - 1)
            timing.update(alone_s=alone, bubble_s=max(0.0, pipeline_s - alone))
        ex.flush()  # one exchange per step, after the last micro-batch: p.grad is the replicas' average
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=last, group=pipeline)  # every stage logs the loss the last one computed
        if args.clip:
            clip_across_stages(model, args.clip, pipeline)
        end_step(step, loss, optimizer, scheduler, args, t0, show=rank == 0,
                 report=lambda step, fields: commlab.report(step, exchange=ex.last_report, **timing, **fields))
    if args.save:
        torch.save(model.state_dict(), f"{args.save}.stage{stage}.replica{replica}")
    ex.close()
    dist.destroy_process_group()


def alone_s(model: nn.Module, meta: torch.Tensor, count: int, vocab: int, device, last: bool) -> float:
    """Seconds this stage's forward and backward of ``count`` micro-batches take with no pipeline around it:
    inputs of ``meta``'s shape made up here, the loss on the ``last`` stage, no communication. The backward
    is ``autograd.grad``, which leaves ``p.grad`` and the exchanger's hooks alone, so it may run between a
    step's schedule and its exchange."""
    gen = torch.Generator().manual_seed(0)  # the job's random streams are left as they were
    x = torch.randint(vocab, meta.shape, generator=gen) if meta.dtype == torch.long else \
        torch.randn(meta.shape, generator=gen).requires_grad_()
    x, y = x.to(device), torch.randint(vocab, meta.shape[:2], generator=gen).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    started = time.perf_counter()
    for _ in range(count):
        out = model(x)
        if last:
            torch.autograd.grad(loss_fn(out, y), params)
        else:
            torch.autograd.grad(out, params + ([x] if x.requires_grad else []), torch.ones_like(out))
    return time.perf_counter() - started


def clip_across_stages(model: nn.Module, max_norm: float, pipeline) -> None:
    """``clip_grad_norm_`` over the whole model: the squared norms of every stage of this replica add up."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm2 = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(norm2, group=pipeline)
    coef = (max_norm / (norm2.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)


if __name__ == "__main__":
    main()
