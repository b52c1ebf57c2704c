"""One rank of a keep-going job (``ring://?min_workers=M``, ``allreduce://?min_workers=M``) in tests/test_ring_keepgoing.py.

``ring_keepgoing_script.py OUT STEPS``; rank and job from torchrun's environment, the exchanger from $COMMLAB_EXCHANGER.
Each rank trains STEPS steps of a small MLP with Adam on data that depends only on (step, rank), from
``ex.start_step`` (a replacement enters later), and writes ``OUT/rank<r>.<pid>.pt``: the members of every step
it took part in, its parameters, buffers and optimizer state after each step, and its pid.

Faults, by environment (``RANK:STEP``, one rank at one step):

- ``KG_KILL=R:S:exchange``: rank R SIGKILLs itself inside step S's exchange (in the hook of the last gradient of
  its backward, once every earlier bucket's collective has started);
- ``KG_KILL=R:S:vote``: after its exchange of step S completed, before its vote (the survivors hold sums that
  include its gradient: they must discard them);
- ``KG_KILL=R:S:stop``: SIGSTOP instead of SIGKILL, inside the exchange (the test continues it later);
- ``KG_KILL=R:S:reform``: rank R SIGKILLs itself as its ring re-forms in step S (after another rank's death);
- ``KG_KILL=R:S:heal``: rank R (not the donor) SIGKILLs itself as the heal of a replacement admitted at S begins;
- ``KG_AWAIT_JOIN=R:S``: the other ranks wait, before step S, until a replacement of rank R asked to join (so
  that step S's commit admits it: it enters at S + 1); the replacement (``KG_ASK_AT=S``) asks only once rank
  ``KG_WATCH`` (0) has begun step S (``OUT/at.rank<r>``), so no earlier commit admits it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import commlab


def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + r)
    x = torch.randn(8, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
        self.register_buffer("calls", torch.zeros(1))  # a buffer a replacement must take (0 on a fresh process)

    def forward(self, x):
        self.calls += 1
        return self.body(x)


def build():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def snapshot(model, opt, ex=None) -> dict:
    comp = getattr(ex, "compressor", None)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "optim": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                      for i, st in opt.state_dict()["state"].items()},
            **({"compress": comp.state_dict()} if comp is not None else {})}


def fault(name: str):
    spec = os.environ.get(name, "")
    return tuple(int(x) if x.isdigit() else x for x in spec.split(":")) if spec else None


def main() -> int:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    model, opt = build()
    ask_at, watched = int(os.environ.get("KG_ASK_AT", "-1")), out / f"at.rank{os.environ.get('KG_WATCH', '0')}"
    deadline = time.monotonic() + 120
    while ask_at >= 0 and not (watched.exists() and int(watched.read_text()) >= ask_at):
        assert time.monotonic() < deadline, f"{watched.name} never reached step {ask_at}"
        time.sleep(0.02)
    ex = commlab.connect()
    ex.setup(model, opt)
    record = {"pid": os.getpid(), "start_step": ex.start_step, "members": {}, "states": {},
              "entered": snapshot(model, opt, ex) if ex.start_step else None}
    kill, join = fault(f"KG_KILL{rank}") or fault("KG_KILL"), fault("KG_AWAIT_JOIN")
    step_now = [ex.start_step]
    step_s = float(os.environ.get("KG_STEP_S", "0"))
    if kill and kill[0] == rank and kill[2] in ("exchange", "stop"):
        sig = signal.SIGKILL if kill[2] == "exchange" else signal.SIGSTOP

        def inside(p):
            if step_now[0] == kill[1]:
                (out / f"fault.rank{rank}").write_text(repr(time.time()))
                os.kill(os.getpid(), sig)

        model.body[0].weight.register_post_accumulate_grad_hook(inside)  # after commlab's: its bucket is started
    if kill and kill[0] == rank and kill[2] == "reform":  # a member that dies as the ring re-forms
        reform = ex._reform_links

        def reforming():
            if step_now[0] == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return reform()

        ex._reform_links = reforming
    if kill and kill[0] == rank and kill[2] == "heal":  # a member that dies while a replacement is healed
        transfer = ex._transfer

        def heal(donor, pending):
            if step_now[0] == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return transfer(donor, pending)

        ex._transfer = heal
    if kill and kill[0] == rank and kill[2] == "vote":
        decide = ex.quorum.decide

        def vote(step, failure):
            if step_now[0] == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return decide(step, failure)

        ex.quorum.decide = vote
    for step in range(ex.start_step, steps):
        step_now[0] = step
        (out / f"at.tmp{rank}").write_text(str(step))
        os.replace(out / f"at.tmp{rank}", out / f"at.rank{rank}")
        if join and rank != join[0] and step == join[1]:
            deadline = time.monotonic() + 120
            while not ex.quorum.store.check([f"join/{join[0]}"]):
                assert time.monotonic() < deadline, "the replacement never asked to join"
                time.sleep(0.02)
        time.sleep(step_s)  # KG_STEP_S: a step's compute, for runs under a launcher (a replacement has time to start)
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        record["members"][step] = list(ex.quorum.members)  # the step's, decided at the end of backward
        opt.step()
        record["states"][step] = snapshot(model, opt, ex)
        record.setdefault("done_at", {})[step] = time.time()  # wall clock: for figures, never asserted
    record["facts"] = ex.facts()["keep_going"]
    ex.close()
    torch.save(record, out / f"rank{rank}.{os.getpid()}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
