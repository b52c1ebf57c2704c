"""A rank of tests/test_localsteps.py, and the pieces its single-process reference shares with it (the model,
the data, the inner optimizer): ``LS_CFG`` (JSON) says the URL, steps, model and optimizer; ``LS_OUT`` is
where the rank saves its parameters, buffers, inner optimizer state, exchanger state and per-step bytes.

``ahead``: rank 1 starts that step's fragment exchange only once rank 0 has computed its next step's
gradients (through the rendezvous store): rank 0 can get there only if its own start of the exchange did not
wait for rank 1. ``kill_at``: the rank saves a checkpoint at every sync (``ckpt``) and, at that inner step, dies by SIGKILL
(rank 0 only) after its optimizer step; ``resume``: it starts from the checkpoint, redoes the lost steps and
counts them (``redone``). ``lengths``: rank r runs lengths[r] steps inside ``ex.join()``. ``order`` (with ``every`` = H): the ranks' syncs reach the shards in this order
(a list of ranks; each rank runs H x its syncs steps), forced through files. ``slow``: rank 1 sleeps that many seconds before each optimizer step.
``pause`` = [rank, step, seconds]: that rank sleeps after that step (which of two requests reaches a shard first). ``kill_server_at``: rank 0 kills the PS shard ``server_pid`` by SIGKILL after that step, once rank 1 took
it too (so no reply of the last sync is still on its way).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import torch
from torch import nn

DIM, CLASSES, BATCH = 6, 3, 8


def make_model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    # no bias before BatchNorm (it cancels): its gradient is zero up to rounding, which AdamW would scale up
    # to lr-sized steps, so 1-ulp differences in BatchNorm's reductions between processes (their summation
    # order) would move the parameters by lr per step and no reference could match
    layers: list[nn.Module] = [nn.Linear(DIM, 12, bias=not bn)]
    if bn:
        layers.append(nn.BatchNorm1d(12))
    layers += [nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, CLASSES)]
    return nn.Sequential(*layers)


def make_inner(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, (x[:, 0] > x[:, 1]).long() + (x[:, 2] > 0.5).long()


def wait_for(path: str, what: str, timeout: float = 30.0) -> None:
    """Until the file ``path`` exists (ps:// has no store to wait on); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never happened ({path})")
        time.sleep(0.005)


def main() -> None:
    import commlab

    cfg = json.loads(os.environ["LS_CFG"])
    out = os.environ["LS_OUT"]
    model = make_model(cfg.get("bn", False))
    opt = make_inner(model, cfg.get("inner", "adamw"))
    stepped: list[torch.Tensor] = []  # the parameters right after the inner step, before any sync

    def note(*_):
        stepped[:] = [torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])]

    opt.register_step_post_hook(note)  # runs before the exchanger's, which setup registers after it
    ex = commlab.connect(cfg["url"])
    ex.setup(model, opt)
    rank, start, redone = ex.rank, 0, 0
    ckpt = f"{out}.ckpt{rank}"
    if cfg.get("resume"):
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        ex.load_state_dict(saved["ex"])
        start = saved["step"]
        redone = cfg["kill_at"] + 1 - start  # the steps the killed run took past its last checkpoint
    sent, received, pushed = [], [], []
    ahead = cfg.get("ahead")  # a fragment's step: rank 1 syncs it only once rank 0 is one step past it
    order, every = cfg.get("order"), cfg.get("every", 1)  # async: the order in which the syncs reach the shards
    mine = [i for i, r in enumerate(order or []) if r == rank]  # this rank's syncs' places in that order
    steps = len(mine) * every if order is not None else cfg["steps"]
    lengths = cfg.get("lengths")  # uneven inputs: rank r runs lengths[r] steps, inside ex.join()
    if lengths is not None:
        steps = lengths[rank]
    with ex.join(enable=lengths is not None):
        for step in range(start, steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            store = getattr(ex, "store", None)  # ps:// has none: a file
            if ahead is not None and rank == 0 and step == ahead + 1:
                store.set("test/ahead", "1") if store is not None else open(f"{out}.ahead", "w").close()
            if ahead is not None and rank == 1 and step == ahead:
                store.wait(["test/ahead"], timedelta(seconds=20)) if store is not None else wait_for(f"{out}.ahead", "rank 0 ahead")
            if rank == 1 and cfg.get("slow"):  # the slow worker (async): as if its step took that much longer
                time.sleep(cfg["slow"])
            outer = getattr(ex.talk, "outer", None)
            whole = outer is not None and len(outer.anchors()) == 1  # one fragment: the anchor is the whole model
            anchor = outer.anchors()[0].clone() if whole else None
            event = mine[(step + 1) // every - 1] if order is not None and (step + 1) % every == 0 else None
            if event:  # a sync: only once the one before it in the order has been applied (pushed and pulled back)
                wait_for(f"{out}.event{event - 1}", f"sync {event - 1} of the order")
            opt.step()
            if event is not None:
                open(f"{out}.event{event}", "w").close()
            sent.append(ex.last_report.bytes_sent if ex.last_report is not None else 0)
            received.append(ex.last_report.bytes_received if ex.last_report is not None else 0)
            if sent[-1] and anchor is not None:  # a sync: the pseudo-gradient this rank sent
                pushed.append(anchor - stepped[0])
            if "kill_at" in cfg and sent[-1]:  # a sync happened: commit the state of this step
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "ex": ex.state_dict(),
                            "step": step + 1}, ckpt)
            if cfg.get("kill_at") == step and not cfg.get("resume") and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg.get("pause") and cfg["pause"][:2] == [rank, step]:
                time.sleep(cfg["pause"][2])
            if cfg.get("kill_server_at") == step:  # a PS shard dies between two syncs, once both ranks got there
                flag = f"{out}.past_sync"  # ps:// has no store: a file says rank 1 got there
                if rank == 1:
                    open(flag, "w").close()
                else:
                    wait_for(flag, f"rank 1 at step {step}")
                    os.kill(cfg["server_pid"], signal.SIGKILL)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "buffers": {n: b.clone() for n, b in model.named_buffers()},
                "opt": opt.state_dict(), "ex": ex.state_dict(), "sent": sent, "received": received, "redone": redone,
                "pushed": pushed}, f"{out}.{rank}")
    ex.close()
    print(json.dumps({"rank": rank, "redone": redone}))


if __name__ == "__main__":
    main()
