"""A small GPT-style character-level language model, trained on the Python documentation's topics.

``examples/plain/charlm.py`` trains it in one process with plain torch; ``examples/charlm.py`` is
the same script data-parallel over N ranks with commlab, each rank on its own slice of the text
(``diff -u examples/plain/charlm.py examples/charlm.py`` shows every line that changes). The
text is the standard library's ``pydoc_data.topics`` (about 465 KB of English and Python), so
nothing is downloaded. What it exercises: AdamW with parameter groups (no weight decay on biases
and norm weights), warm-up then cosine learning rate (LambdaLR), gradient clipping, mixed
precision (bfloat16 autocast on CPU, float16 with a GradScaler on CUDA), gradient accumulation,
and checkpoints that resume exactly where they stopped.

    python examples/plain/charlm.py --steps 300
    commlab run --workers 2 --exchanger 'allreduce://?backend=gloo' examples/charlm.py --steps 300
    COMMLAB_EXCHANGER='ring://' torchrun --nproc-per-node 2 examples/charlm.py --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import commlab


def corpus() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each around a residual."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only; none on biases and norm weights."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """LR multiplier: linear from 1/warmup to 1 over ``warmup`` steps, then cosine down to ``floor``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return f


def windows(data: torch.Tensor, batch: int, context: int, *seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target): ``batch`` random windows of ``data``, a function of ``seed`` alone (so a
    resumed run draws what the uninterrupted one would have, with no generator state to save)."""
    gen = torch.Generator().manual_seed(hash(seed) & 0xFFFF_FFFF)  # a tuple of ints hashes alike in every process
    start = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    rows = torch.stack([data[s: s + context + 1] for s in start.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model, data, args, device, amp) -> tuple[float, float]:
    """Loss and next-character accuracy on fixed windows of held-out text."""
    model.eval()
    losses, hits, n = [], 0, 0
    for i in range(args.eval_batches):
        x, y = (t.to(device) for t in windows(data, args.batch_size, args.context, 1234, i))
        with amp():
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        hits += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
    model.train()
    return sum(losses) / len(losses), hits / n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-step (per rank)")
    p.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--checkpoint", help="save here every --checkpoint-every steps and at the end")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists (a restarted "
                                                          "job does, without the flag)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="end after this many steps, checkpointed, as if preempted (the schedule still spans --steps)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--data-shards", type=int, default=0,
                   help="cut the text into this many slices, one window stream each (default: one per rank)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ex = commlab.connect()  # the regime named by $COMMLAB_EXCHANGER; rank and peers from the launcher
    rank, world, local_rank = ex.rank, ex.world_size, ex.rank_info.local_rank
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}"  # ranks share GPUs if need be
                          if torch.cuda.is_available() else "cpu")
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(len(data) * 0.9)
    train, held_out = data[:split], data[split:]
    # The text is cut into --data-shards slices (default: one per rank); a rank draws its batch from
    # its share of them, each slice's windows a function of (seed, slice, step, micro) alone. So one
    # process with --data-shards N and N x the batch sees exactly the windows N ranks see together:
    # the reference a synchronous regime must reproduce (``commlab run --exchanger local:// ...
    # --batch-size 2B --data-shards 2``), and a resumed run draws what the uninterrupted one would.
    shards = args.data_shards or world
    per = shards // world
    if shards % world or args.batch_size % per:
        raise SystemExit(f"--data-shards {shards} must be a multiple of the {world} ranks and divide "
                         f"--batch-size {args.batch_size} into equal parts")
    size = len(train) // shards
    mine = range(rank * per, (rank + 1) * per)

    def next_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [windows(train[s * size:(s + 1) * size], args.batch_size // per, args.context,
                         args.seed, s, step, micro) for s in mine]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    torch.manual_seed(args.seed)
    model = CharLM(len(chars), args.context, args.d_model, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    ex.setup(model, optimizer)  # collective: every rank starts from rank 0's parameters
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    cuda = device.type == "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)  # float16 needs it; bfloat16 does not
    amp = lambda: torch.autocast(device.type, dtype=torch.float16 if cuda else torch.bfloat16)

    def own_part(state: dict) -> dict:
        """This rank's own part of a checkpoint: rank 0's file, or the one this rank saved beside it."""
        own = f"{args.checkpoint}.rank{rank}"
        if rank == 0 or not os.path.exists(own):
            return state
        theirs = torch.load(own, map_location=device)
        if theirs["step"] != state["step"]:
            print(f"rank {rank}: {own} is from step {theirs['step']}, {args.checkpoint} from step "
                  f"{state['step']}: resuming with rank 0's exchanger state", file=sys.stderr, flush=True)
            return state
        return theirs

    start = 0
    restarted = ex.rank_info.attempt > 0  # torchrun's (or commlab run's) --max-restarts started us again
    if ex.start_step:  # the servers hold the run (ps:// update=server): parameters, AdamW state, steps applied
        scheduler.load_state_dict(ex.restored_state["scheduler"])
        scaler.load_state_dict(ex.restored_state["scaler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        start = ex.start_step
    elif (args.resume or restarted) and args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        ex.load_state_dict(own_part(state)["exchanger"])
        start = state["step"]

    def save(step: int) -> None:
        # rank 0 saves the run; every other rank its exchanger's own state (compression residuals differ by rank)
        state = {"exchanger": ex.state_dict(), "step": step}
        if rank == 0:
            state.update(model=model.state_dict(), optimizer=optimizer.state_dict(),
                         scheduler=scheduler.state_dict(), scaler=scaler.state_dict())
        path = args.checkpoint if rank == 0 else f"{args.checkpoint}.rank{rank}"
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a kill never leaves half a checkpoint

    def micro_step(x, y) -> float:
        with amp():
            loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
        scaler.scale(loss / args.accum).backward()
        return loss.item() / args.accum

    t0, loss = time.perf_counter(), float("nan")
    for step in range(start, args.steps):
        t_step = time.perf_counter()
        optimizer.zero_grad()
        loss = 0.0
        for micro in range(args.accum):
            with ex.no_sync() if micro < args.accum - 1 else contextlib.nullcontext():  # exchange once a step
                loss += micro_step(*next_batch(step, micro))
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if ex.keeps_state:  # what the servers do not hold, for a restart to find (nothing lost)
            ex.commit_state({"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()})
        if step % args.log_every == 0 or step == args.steps - 1:
            lr = scheduler.get_last_lr()[0]
            now = time.perf_counter()  # what the step cost; the exchange adds its bytes and exposed wait
            commlab.report(step, loss=loss, lr=lr, time_s=now - t0, step_s=now - t_step, exchange=ex.last_report)
            if rank == 0:
                print(f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  {time.perf_counter() - t0:.1f}s", flush=True)
        stop = step + 1 == args.stop_after
        due = (step + 1) % args.checkpoint_every == 0 or step == args.steps - 1 or stop
        if args.checkpoint and due:
            save(step + 1)
        if stop:
            break
    test_loss, test_acc = evaluate(model, held_out, args, device, amp)
    if rank == 0:
        print(f"held-out loss {test_loss:.4f}, next-character accuracy {test_acc:.3f}", flush=True)
        commlab.report(args.steps - 1, loss=loss, test_loss=test_loss, test_acc=test_acc,
                       exchange=ex.last_report)
    ex.close()


if __name__ == "__main__":
    main()
