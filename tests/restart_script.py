"""A user's script run by ``commlab run --max-restarts R`` in tests/test_restart.py (not a test itself).

``restart_script.py OUT STEPS MODEL``, the exchanger from $COMMLAB_EXCHANGER. Each rank trains STEPS
steps from ``ex.start_step`` and writes ``OUT/rank<r>.attempt<a>.json``: where it started, what it got
back (``ex.restored_state``), its final parameters and optimizer state, and the servers' stats.

MODEL ``mlp``: a small regression model on data that depends only on (step, rank), SGD with momentum and
a StepLR, whose state the loop commits after every step (``ex.commit_state``). ``const``: one parameter
whose loss is ``(w * (rank + 1)).sum()``, so every applied push moves it by ``lr * (rank + 1)`` (async,
ssp: a closed form from the number of pushes applied).

Faults, attempt 0 only: ``KILL_RANK``/``KILL_STEP``: that rank SIGKILLs itself when it reaches that step;
with ``KILL_AFTER_PUSH_OF=R`` it first waits until every shard holds rank R's push of that step and
waits for its own (the step is in flight), so the race "one rank pushed, the other died" is forced.
``KILL_BETWEEN_COMMITS_OF=T`` (K = 2): rank 1 dies between its commits of step T to shard 0 and shard 1,
once shard 0 applied the step (a hook on the client's send, here in the user's process).
``KILL_BEFORE_COMMIT_STATE=T``: rank 1 dies after its step T was applied (and its scheduler stepped), before
``ex.commit_state``, once rank 0 pushed step T + 1 (so rank 0 committed its state of T): its kept state belongs
to step T, the servers' to T + 1 (the window of issue 38).

Keep-going (``commlab run --replace``): ``REPLACE_KILL_STEP=K``: rank 1's (``REPLACE_KILL_RANK``'s) first process
dies at the top of step K; its replacement (``$COMMLAB_REPLACEMENT``) writes ``OUT/rank<r>.replacement.json`` with what it holds when it
enters (parameters, momentum, ``ex.healed``); every rank records its parameters and momentum after each step
from K on (``after``), the pid it ran as, and the end.

A second death, forced (keep-going): each replacement of the victim numbers itself as it starts (``OUT/rank<r>.replacement<n>.started``,
made exclusively, before it says hello; the second one's files are ``rank<r>.replacement2.json``).
``REPLACE_HOLD=N``: replacement N waits there (before its hello) until it is stopped. ``REPLACE_DIE=N``: replacement N
SIGKILLs itself at the top of the step it entered at (after its replay), before it pushes. ``WAIT_AT=S:N[,S:N]``: every original rank but the
victim waits at the top of step S until every shard let N replacements enter (their stats' ``replaced``).
``DIE_AT=S:N``: rank 0's original process waits at the top of step S until the victim's replacement N started, then
SIGKILLs itself (every rank is then a replacement that has not entered).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

import commlab
from commlab.regimes.ps import server_stats

out, steps, kind = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def batch(step: int, r: int, attempt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's batch of ``step``; each attempt draws other data, so a step's result tells which attempt's
    pushes it was made of."""
    g = torch.Generator().manual_seed(1000 * step + r + 100_000 * attempt)
    x = torch.randn(8, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def build(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model = nn.Linear(3, 1, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), None


def loss_of(model, step: int, r: int) -> torch.Tensor:
    if kind == "mlp":
        x, y = batch(step, r, attempt)
        return nn.functional.mse_loss(model(x), y)
    return (model.weight * (r + 1)).sum()


def wait_in_flight(ex, step: int, pusher: int, timeout: float = 60.0) -> None:
    """Until every shard has ``pusher``'s push of ``step`` and waits for this rank's."""
    deadline = time.monotonic() + timeout
    for endpoint in ex.facts()["servers"]:
        while True:
            st = server_stats(endpoint)
            if st["sync_step"] == step and rank in st["waiting_for"] and pusher not in st["waiting_for"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {pusher}'s push of step {step} never reached {endpoint}: {st}")
            time.sleep(0.02)


def die_between_commits(step: int) -> None:
    """Rank 1's commit of ``step`` reaches shard 0 only: its commit to shard 1 waits until shard 0 applied the
    step (rank 0 committed to both), then the rank dies. Shard 0 is then a step ahead of shard 1, which holds
    the step gathered with rank 0's commit alone."""
    from commlab.regimes import ps

    post = ps._Shard.post

    def patched(self, op, t, *args, **kw):
        if op == "commit" and t == step and self.index == 1:
            deadline = time.monotonic() + 60
            while server_stats(self.count_endpoints[0])["sync_step"] != step + 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard 0 never applied step {step}")
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        return post(self, op, t, *args, **kw)

    ps._Shard.post = patched


def numbered(r: int) -> int:
    """This replacement's number among rank ``r``'s (1 for the first), taken by creating its file exclusively."""
    n = 1
    while True:
        try:
            os.close(os.open(out / f"rank{r}.replacement{n}.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1


def wait_for(what: str, cond, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {what} within {timeout:g}s")
        time.sleep(0.01)


def forced_at(ex, step: int, victim: int) -> None:
    """``WAIT_AT`` and ``DIE_AT`` (see the module's docstring), at the top of ``step``."""
    for item in filter(None, os.environ.get("WAIT_AT", "").split(",")):
        s, n = (int(x) for x in item.split(":"))
        if s == step and rank != victim:
            wait_for(f"{n} replacement(s) entered every shard",
                     lambda: all(server_stats(e)["members"]["replaced"] >= n for e in ex.facts()["servers"]))
    if rank == 0 and os.environ.get("DIE_AT"):
        s, n = (int(x) for x in os.environ["DIE_AT"].split(":"))
        if s == step:
            wait_for(f"rank {victim}'s replacement {n} started",
                     lambda: (out / f"rank{victim}.replacement{n}.started").exists())
            os.kill(os.getpid(), signal.SIGKILL)


def momentum_of(opt) -> dict:
    return {str(i): st["momentum_buffer"].tolist() for i, st in opt.state_dict()["state"].items()
            if st.get("momentum_buffer") is not None}


def main() -> None:
    model, opt, sched = build(kind)
    replacement = "COMMLAB_REPLACEMENT" in os.environ
    # (the victim's replacements only: REPLACE_HOLD and REPLACE_DIE name one of them)
    number = numbered(rank) if replacement and rank == int(os.environ.get("REPLACE_KILL_RANK", "1")) else 0
    if number and number == int(os.environ.get("REPLACE_HOLD", "0")):
        threading.Event().wait(120)  # until the launcher stops it (it never says hello)
        raise TimeoutError(f"rank {rank}'s replacement {number} was held 120 s and never stopped")
    ex = commlab.connect()
    ex.setup(model, opt)
    if attempt == 0 and rank == 1 and "KILL_BETWEEN_COMMITS_OF" in os.environ:
        for shard in ex.shards:
            shard.count_endpoints = [s.endpoint for s in ex.shards]
        die_between_commits(int(os.environ["KILL_BETWEEN_COMMITS_OF"]))
    restored = ex.restored_state
    if restored is not None and sched is not None:
        sched.load_state_dict(restored["sched"])
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):
            group["lr"] = lr  # a scheduler's state does not set the groups' lr: the loop does, as after a load
    suffix = "" if number <= 1 else str(number)  # (the first keeps the name the other tests read)
    if replacement:
        (out / f"rank{rank}.replacement{suffix}.json").write_text(json.dumps({
            "pid": os.getpid(), "healed": ex.healed, "start_step": ex.start_step, "restored_step": ex.restored_step,
            "params": {k: v.tolist() for k, v in model.state_dict().items()}, "momentum": momentum_of(opt)}))
    after = {}
    record = {"rank": rank, "attempt": attempt, "start_step": ex.start_step, "pid": os.getpid(), "after": after,
              "restored": None if restored is None else {"step": restored["step"]},
              "restored_step": ex.restored_step}
    ran = 0
    for step in range(ex.start_step, steps):
        victim = int(os.environ.get("REPLACE_KILL_RANK", "1"))
        if rank == victim and not replacement and step == int(os.environ.get("REPLACE_KILL_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        if number and number == int(os.environ.get("REPLACE_DIE", "0")) and step == ex.healed["step"]:
            os.kill(os.getpid(), signal.SIGKILL)  # after it entered (and replayed): the shards count it from here on
        if not replacement:
            forced_at(ex, step, victim)
        if attempt == 0 and rank == int(os.environ.get("KILL_RANK", "-1")) and step == int(os.environ["KILL_STEP"]):
            if "KILL_AFTER_PUSH_OF" in os.environ:
                wait_in_flight(ex, step, int(os.environ["KILL_AFTER_PUSH_OF"]))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))  # keep-going: survivors still train when a replacement comes
        ex.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
        ran += 1
        if sched is not None:
            sched.step()
            if attempt == 0 and rank == 1 and step == int(os.environ.get("KILL_BEFORE_COMMIT_STATE", "-1")):
                wait_in_flight(ex, step + 1, 0)
                os.kill(os.getpid(), signal.SIGKILL)
            ex.commit_state({"sched": sched.state_dict(), "step": step + 1})
        if step >= int(os.environ.get("REPLACE_KILL_STEP", "1000000")):
            after[step] = {"params": {k: v.tolist() for k, v in model.state_dict().items()}, "momentum": momentum_of(opt)}
    if kind == "const":  # async, ssp: the others may still push; the result is every push applied
        deadline = time.monotonic() + 60
        while sum(s["updates"] for s in ex.server_stats()) < world * steps * len(ex.shards):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the servers applied {ex.server_stats()} pushes")
            time.sleep(0.05)
        ex.pull_latest()
    record.update(ran=ran, params={k: v.tolist() for k, v in model.state_dict().items()}, momentum=momentum_of(opt),
                  lr=[g["lr"] for g in opt.param_groups],
                  servers=[{**{k: s[k] for k in ("updates", "replaced", "duplicates", "attempt")},
                            "entered": s["members"]["replaced"]} for s in ex.server_stats()])
    ex.close()
    name = f"rank{rank}.replacement.end.json" if replacement else f"rank{rank}.attempt{attempt}.json"
    (out / name).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
