"""The character LM of charlm.py in one process, in float32, on the batch every pipeline replica draws.

``examples/pipeline_lm.py`` is this script cut into pipeline stages, each replicated for data
parallelism, with commlab exchanging each stage's gradients within its replica group; it takes
this script's options, data and optimizer from here, and its ``main`` differs from this one by the
lines ``diff -u examples/plain/pipeline_lm.py examples/pipeline_lm.py`` shows.
With ``--data-shards D`` and D x the batch this process sees the windows of D replicas together,
split into the same micro-batches: the run a synchronous regime must reproduce.

    python examples/plain/pipeline_lm.py --steps 100
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from charlm import CharLM, corpus, param_groups, warmup_cosine, windows


def options(description: str) -> argparse.ArgumentParser:
    """The model's, the data's and the optimizer's options (examples/pipeline_lm.py takes them too)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (per replica)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="sgd: with momentum 0.9; its step is proportional to the gradient, so two runs compare to "
                        "float32 rounding, while AdamW's normalised step turns rounding noise on a gradient that is "
                        "zero in exact arithmetic (attention's key bias) into a step of size lr")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradient to this global L2 norm (0: off)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p


def parse_args(argv=None):
    p = options(__doc__.splitlines()[0])
    p.add_argument("--data-shards", type=int, default=1, help="cut the text into this many slices, one window "
                                                               "stream each")
    p.add_argument("--save", help="write the model's state_dict here at the end")
    return p.parse_args(argv)


def text_data() -> tuple[list[str], torch.Tensor]:
    """(the characters, the training text as their indices): the first 90% of charlm.py's corpus."""
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    return chars, data[:int(len(data) * 0.9)]


def batches(train: torch.Tensor, shards: int, mine: range, args) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``next_batch(step)``: ``args.batch_size`` windows, an equal part from each of ``mine``, slices of the text
    cut into ``shards``; each slice's windows are a function of (seed, slice, step) alone, so D replicas
    together draw what one process drawing from all D slices draws."""
    size, per = len(train) // shards, args.batch_size // len(mine)

    def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [windows(train[s * size:(s + 1) * size], per, args.context, args.seed, s, step) for s in mine]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    return next_batch


def make_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    return torch.optim.SGD(groups, lr=args.lr, momentum=0.9)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def micro_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, count: int,
                around: Callable[[int], ContextManager] = lambda m: contextlib.nullcontext()) -> torch.Tensor:
    """Forward and backward over ``count`` micro-batches of (x, y), each inside ``around(m)`` (an exchanger's
    ``no_sync()`` for all but the last); gradients add up to the mean loss's. Returns the mean loss."""
    losses = []
    for m, (xm, ym) in enumerate(zip(x.chunk(count), y.chunk(count))):
        with around(m):
            loss = loss_fn(model(xm), ym)
            (loss / count).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def end_step(step: int, loss: torch.Tensor, optimizer, scheduler, args, t0: float, report=None,
             show: bool = True) -> None:
    """The optimizer's and the schedule's step, then every ``--log-every`` steps ``report(step, fields)``
    (a metrics line) and, where ``show``, a line on stdout."""
    optimizer.step()
    scheduler.step()
    if step % args.log_every == 0 or step == args.steps - 1:
        now = time.perf_counter()
        if report is not None:
            report(step, {"loss": loss.item(), "lr": scheduler.get_last_lr()[0], "time_s": now - t0})
        if show:
            print(f"step {step:5d}  loss {loss.item():.4f}  {now - t0:.1f}s", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    chars, train = text_data()
    next_batch = batches(train, args.data_shards, range(args.data_shards), args)

    torch.manual_seed(args.seed)
    model = CharLM(len(chars), args.context, args.d_model, args.layers, args.heads)
    optimizer = make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))

    t0 = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = next_batch(step)
        loss = micro_steps(model, x, y, args.microbatches)  # what a pipeline schedule does
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        end_step(step, loss, optimizer, scheduler, args, t0)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
