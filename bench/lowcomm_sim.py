"""Local steps simulated in one process, with no exchanger: the reference the lowcomm case's curves are checked
against, and the way to try an outer step or a data split on the char LM in minutes instead of a cell's hour.

    python -m bench.lowcomm_sim --sync-every 48 --outer plain                # the bench's h48 entry (1,920 steps)
    python -m bench.lowcomm_sim --sync-every 48 --outer nesterov --iid       # every replica samples the whole text

K model copies of :class:`bench.compress_worker.Task` (the bench's model, AdamW in its groups, warm-up and cosine,
bf16 autocast, clipping; the same seed, so the same initial model), replica k drawing the batches the bench's rank
k draws (``--iid``: windows of the whole training text instead of the k-th contiguous slice). Every
``--sync-every`` steps the anchor's outer optimizer (``plain``: ``SGD(lr=1)``, plain averaging; ``nesterov``:
``SGD(lr=0.7, momentum=0.9, nesterov=True)``, commlab's default) steps with the mean of (anchor - replica), and
every replica takes the anchor; each keeps its own inner optimizer state. No warm-up, no fragments, fp32: the
arithmetic of ``ring://?sync_every=H&outer=...`` written out as a textbook would. Prints replica 0's held-out loss
(the bench's :meth:`Task.test_loss`) every ``--eval-every`` steps; ``--json`` writes the curve.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.compress_worker import LMS, Task

OUTERS = {"plain": dict(lr=1.0), "nesterov": dict(lr=0.7, momentum=0.9, nesterov=True)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lowcomm_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="charlm", choices=tuple(LMS))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=48)
    p.add_argument("--outer", default="plain", choices=tuple(OUTERS))
    p.add_argument("--steps", type=int, default=1920)
    p.add_argument("--batch-size", type=int, default=16, help="per replica (the bench's char LM: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iid", action="store_true", help="every replica samples the whole training text")
    p.add_argument("--eval-every", type=int, default=192)
    p.add_argument("--json", help="write the held-out curve here")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    for name in ("replicas", "sync_every", "steps", "batch_size", "eval_every"):
        if getattr(a, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    K = a.replicas
    tasks = [Task(a.model, a.seed, a.batch_size, None, a.steps) for _ in range(K)]
    models = [list(t.model.parameters()) for t in tasks]
    anchor = [p.detach().clone() for p in models[0]]
    outer = torch.optim.SGD(anchor, **OUTERS[a.outer])
    curve, t0 = [], time.perf_counter()
    for step in range(a.steps):
        for k, t in enumerate(tasks):
            x, y = (t.lm.windows(t.train, t.batch, t.context, t.seed, k, step, 0) if a.iid
                    else t.batch_of(step, k, K))
            t.opt.zero_grad()
            t.loss(t.model, x, y).backward()
            t.after_backward()
            t.opt.step()
            t.sched.step()
        if (step + 1) % a.sync_every == 0:
            with torch.no_grad():
                for i, x in enumerate(anchor):
                    x.grad = sum(x - m[i] for m in models) / K
                outer.step()
                for m in models:
                    for p, x in zip(m, anchor):
                        p.copy_(x)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            loss = tasks[0].test_loss()
            curve.append({"step": step, "test_loss": loss})
            print(f"step {step + 1:5d}  held-out {loss:.4f}  {time.perf_counter() - t0:6.1f}s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "curve": curve}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
