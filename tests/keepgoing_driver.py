"""A worker for tests/test_keepgoing.py whose gradients are known constants, and that dies at an exact point.

``python tests/keepgoing_driver.py URL --rank R --workers N --steps T [--kill-step K --kill-at WHERE]``

The model is four flat parameters of 6, 5, 4 and 3 zeros (with two shards: 6 and 3 on shard 0, 5 and 4 on
shard 1; with ``bucket_mb`` tiny each is a bucket of its own, so each shard gets two push messages per step);
rank r's gradient is ``10 ** r`` everywhere, assigned by hand. SGD with ``--lr``: every applied step moves a
parameter by ``-lr`` times the mean of the gradients that step counted, so the end tells exactly which
ranks each step counted on each shard.

``--kill-at`` (at step K, this rank SIGKILLs itself; the point is forced, not timed):
``before``: before pushing anything of step K. ``between`` (two shards): once shard 0 holds its whole step K,
before anything reaches shard 1 (the others' pushes of step K may or may not be in there yet); ``between-done``:
the same once shard 0 has completed step K (the others' pushes are in). ``partial``: once shard 0 acknowledged its first push message of step K
(the second never leaves; shard 1 gets nothing). ``setup``: in setup, after hello, before the start pull. ``--stop-at K``: SIGSTOP at the top of step K.
``--hold-at S --hold-file PATH``: wait at the top of step S until PATH exists (the test releases it). Prints one JSON line at the end: rank, pid, parameters, the
servers' stats.

A replacement (issue 38; the test starts it for the dead rank): ``--momentum M`` (SGD's state), ``--buffer`` (a
buffer ``seen`` that each rank adds ``rank + 1`` to before each step: the exchanger then holds rank 0's),
``--wait-entry W`` (at the top of step W, wait until every shard counts a replacement that entered: it enters
at step W + 1), ``--record`` (the final line also holds the model's bits, parameters, buffer and momentum, at
the top of each step this process ran, at its entry, and at the end), ``--die-donating`` (SIGKILL as it is about
to send shard 1 its state for a replacement).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn

import commlab
from commlab.regimes import ps
from commlab.regimes.ps import server_stats
from commlab.transport.rendezvous import RankInfo

SIZES = (6, 5, 4, 3)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(step: int, where: str, rank: int, async_mode: bool) -> None:
    """Patch the client's send so that this rank dies at ``where`` of ``step``."""
    post = ps._Shard.post
    first: dict = {}

    def whole_on(endpoint: str) -> bool:
        st = server_stats(endpoint)
        if async_mode:
            return st["last_step"].get(str(rank), -1) >= step
        if where == "between-done":  # (update=server: gathered, every rank's push in, its commits still to come)
            return st["sync_step"] > step or st["sync_step"] == step and len(st["whole"]) == st["world"]
        return st["sync_step"] > step or st["sync_step"] == step and rank in st["whole"]  # (update=worker: done)

    def patched(self, op, t, *args, **kw):
        if op != "push" or t != step:
            return post(self, op, t, *args, **kw)
        if where in ("between", "between-done"):
            if self.index == 0:
                return post(self, op, t, *args, **kw)
            deadline = time.monotonic() + 60
            while not whole_on(self.peers[0]):
                if time.monotonic() > deadline:
                    raise TimeoutError("shard 0 never held this rank's whole step")
                time.sleep(0.01)
            die()
        if where == "partial":
            if self.index != 0:
                threading.Event().wait(60)  # shard 1 gets nothing of this step
                raise TimeoutError("not killed")
            if not first:
                first["req"] = post(self, op, t, *args, **kw)
                return first["req"]
            self.answer(first["req"])  # shard 0 acknowledged (folded) the first message
            die()
        return post(self, op, t, *args, **kw)

    ps._Shard.post = patched


def bits(model: nn.Module, optimizer) -> dict:
    """The model's parameters, buffers and SGD momentum, each as the hex of its bytes (equal: bitwise)."""
    hexed = lambda t: None if t is None else t.detach().contiguous().numpy().tobytes().hex()
    return {"params": [hexed(q) for q in model.parameters()], "buffers": [hexed(b) for b in model.buffers()],
            "momentum": [hexed(optimizer.state.get(q, {}).get("momentum_buffer")) for q in model.parameters()]}


def wait_entered(endpoints: list[str]) -> None:
    """Until every shard counts a replacement that entered (bounded)."""
    deadline = time.monotonic() + 60
    while not all(server_stats(e)["members"]["replaced"] >= 1 for e in endpoints):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no replacement entered: {[server_stats(e)['members'] for e in endpoints]}")
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-at", choices=("before", "between", "between-done", "partial", "setup"), default="before")
    p.add_argument("--stop-at", type=int, default=-1, help="SIGSTOP itself at the top of this step (frozen)")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--buffer", action="store_true")
    p.add_argument("--wait-entry", type=int, default=-1)
    p.add_argument("--record", action="store_true")
    p.add_argument("--die-donating", action="store_true",
                   help="SIGKILL itself as it is about to send shard 1 its state for a replacement")
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--hold-file", default="")
    p.add_argument("--final-updates", type=int, default=0,
                   help="async: after the steps, wait until every shard applied this many updates, then pull")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in SIZES])
    if a.buffer:
        model.register_buffer("seen", torch.zeros(3))
    info = RankInfo(a.rank, a.workers, a.rank, "127.0.0.1", 0, "flags")
    pid = os.getpid()
    if a.die_donating:
        post = ps._Shard.post
        ps._Shard.post = lambda self, op, *args, **kw: die() if op == "donate" and self.index == 1 else \
            post(self, op, *args, **kw)
    if a.kill_at == "setup" and a.kill_step >= 0:  # after hello, before the start pull: the others' start waits
        ps._Shard.start = lambda self, *args, **kw: die()
    with commlab.connect(a.url, info) as ex:
        ex.setup(model, commlab.OptimizerSpec("sgd", lr=a.lr, momentum=a.momentum))
        record = {"start_step": ex.start_step, "entry": bits(model, ex.optimizer), "at": {}}
        for s in ex.shards:
            s.peers = [x.endpoint for x in ex.shards]
        if a.kill_step >= 0 and a.kill_at != "before":
            arm(a.kill_step, a.kill_at, a.rank, ex.mode != "sync")
        for step in range(ex.start_step, a.steps):
            if step == a.kill_step and a.kill_at == "before":
                die()
            if step == a.stop_at:
                os.kill(os.getpid(), signal.SIGSTOP)  # until the test sends SIGCONT
            if step == a.wait_entry:
                wait_entered([s.endpoint for s in ex.shards])
            record["at"][step] = bits(model, ex.optimizer)
            if a.buffer:
                model.seen.add_(a.rank + 1)
            if step == a.hold_at:
                deadline = time.monotonic() + 120
                while not os.path.exists(a.hold_file):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {a.rank}: {a.hold_file} never appeared (held at step {step})")
                    time.sleep(0.01)
            ex.zero_grad()
            if a.sleep:
                time.sleep(a.sleep)
            for param in model:
                param.grad = torch.full_like(param, 10.0 ** a.rank)
            ex.step()
        deadline = time.monotonic() + 60
        while a.final_updates and min(s["updates"] for s in ex.server_stats()) < a.final_updates:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the shards applied {[s['updates'] for s in ex.server_stats()]} updates")
            time.sleep(0.01)
        if a.final_updates:
            ex.pull_latest()
        stats = ex.server_stats()
        record["end"] = bits(model, ex.optimizer)
        print(json.dumps({"rank": a.rank, "pid": pid, "start_step": ex.start_step, "params": [q.detach().tolist() for q in model],
                          "buffers": [b.tolist() for b in model.buffers()],
                          "servers": stats, **(record if a.record else {})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
