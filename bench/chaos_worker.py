"""One rank of ``commlab bench chaos``: the same loop under commlab (``commlab run``) and under torchft.

    python -m bench.chaos_worker --log DIR [--model mlp-25m] [--batch-size B] [--lr LR]
    python -m bench.chaos_worker --log DIR --torchft http://HOST:PORT --slot R --replicas N

It trains until it is killed (the bench stops the job at the end of its window). Before torch is
imported it joins its CPU cap (:mod:`bench.cpucap`, ``$BENCH_CPU_CAP``) and writes
``DIR/pids/slot<r>.<pid>`` so the bench can find the process that holds a slot now. Per process it
appends JSON lines to ``DIR/steps/slot<r>.<pid>.jsonl``:

- ``{"ev": "ready", "t": ..., "start": s}`` once connected, set up and about to take its first step, step
  ``s`` (the servers' next step, a live peer's, or a checkpoint's: a restarted ``ring://`` job without
  keep-going resumes from the checkpoint rank 0 writes every ``--checkpoint-every`` steps);
- per step, after the exchange returned: ``{"ev": "step", "step": s, "t": wall clock, "samples": n,
  "loss": ..., "applied": bool}``. Under commlab the step's update is applied with this rank's
  gradient in it once ``ex.step()`` returned (sync ``ps://``: the pull answers after the update), so
  ``samples`` is the batch and ``applied`` true. Under torchft ``applied`` is what ``should_commit``
  said (the optimizer stepped), ``samples`` the batch if this replica took part in the quorum and
  committed, else 0; ``step`` is torchft's ``current_step()`` before the commit;
- with ``--signal-at S`` (``python -m bench.probes keepgoing``; commlab only): the process of slot
  ``--signal-slot`` reaching step S, at its top (before the forward: nothing of step S pushed), writes
  ``{"ev": "signal", "t": ..., "step": S, "signal": "kill" | "stop"}`` and sends itself SIGKILL or SIGSTOP,
  once per job (a marker file in DIR: a replacement runs with the same arguments).

Data: the digits of :mod:`workers.data`, sample order fixed by the seed; rank r of N takes slice r of
step s's global batch (a replacement takes the slot's rank, so the same samples).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench import cpucap

KEEP_GOING = "COMMLAB_KEEP_GOING"  # what `commlab run --replace/--spares` sets (commlab.transport.rendezvous)
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos_worker")
    p.add_argument("--log", required=True)
    p.add_argument("--model", default="mlp-25m")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torchft", help="the Lighthouse's address: train as a torchft replica group of one")
    p.add_argument("--slot", type=int, help="torchft: this replica's slot (commlab: $RANK)")
    p.add_argument("--replicas", type=int, default=2, help="torchft: how many replica groups the job has")
    p.add_argument("--timeout", type=float, default=30.0, help="torchft's quorum and operation timeouts")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="where the job keeps no state (ring://, allreduce://) and does not keep going: rank 0 "
                        "writes model and optimizer every K steps, and a restarted job resumes there")
    p.add_argument("--signal-at", type=int, help="at the top of this step the process of --signal-slot sends "
                                                 "itself --signal, once per job (module text)")
    p.add_argument("--signal-slot", type=int, default=1)
    p.add_argument("--signal", choices=tuple(SIGNALS), default="kill")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds slept in each step before its exchange (compute stood in for: a tiny model's steps "
                        "outrun a replacement's entry)")
    return p


class Log:
    def __init__(self, folder: str, slot: int):
        self.pid = os.getpid()
        steps = Path(folder, "steps")
        steps.mkdir(parents=True, exist_ok=True)
        self.fh = (steps / f"slot{slot}.{self.pid}.jsonl").open("a", buffering=1)
        self.slot = slot

    def write(self, **rec) -> None:
        self.fh.write(json.dumps({"slot": self.slot, "pid": self.pid, **rec}) + "\n")


def signal_self(a, log: Log, step: int) -> None:
    """The planned fault: log it, then SIGKILL or SIGSTOP this process; once per job (``DIR/signalled``)."""
    try:
        Path(a.log, "signalled").open("x").close()
    except FileExistsError:  # done already: this process replaces the victim, or the victim is back
        return
    log.write(ev="signal", t=time.time(), step=step, signal=a.signal)
    os.kill(os.getpid(), SIGNALS[a.signal])


def build(model_name: str, seed: int):
    from workers.models import build_model

    return build_model(model_name, seed)


def commlab_loop(a, slot: int, log: Log) -> int:
    import torch
    import torch.nn.functional as F

    import commlab
    from workers.data import load_digits

    model, side = build(a.model, a.seed)
    data = load_digits(side, a.seed)
    ex = commlab.connect()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    ex.setup(model, opt)
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # restart-all without state on servers: a checkpoint, as a torchrun user keeps one (the probe's pattern)
    ckpt = Path(a.log, "ckpt.pt") if not ex.keeps_state and not os.environ.get(KEEP_GOING) else None
    step = ex.start_step
    if ckpt is not None and attempt > 0 and ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = state["step"]
    log.write(ev="ready", t=time.time(), start=step, attempt=attempt)
    while True:
        if step == a.signal_at and slot == a.signal_slot:
            signal_self(a, log, step)
        x, y = data.batch(step, slot, world, a.batch_size)
        ex.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        ex.step()
        log.write(ev="step", step=step, t=time.time(), samples=a.batch_size, loss=loss.item(), applied=True)
        step += 1
        if ckpt is not None and slot == 0 and step % a.checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, f"{ckpt}.tmp")
            os.replace(f"{ckpt}.tmp", ckpt)


def torchft_loop(a, slot: int, log: Log) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    from workers.data import load_digits

    model, side = build(a.model, a.seed)
    data = load_digits(side, a.seed)
    inner = torch.optim.SGD(model.parameters(), lr=a.lr)
    # a replica group of one: its own store (torchft's groups rendezvous there), hosted here on port 0
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    t = timedelta(seconds=a.timeout)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(s):
        model.load_state_dict(s["model"])
        inner.load_state_dict(s["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=1, use_async_quorum=False, replica_id=f"chaos{slot}", store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=a.torchft, hostname="127.0.0.1",
                      port=0, timeout=t, quorum_timeout=t, connect_timeout=t)
    ddp = DistributedDataParallel(manager, model)
    log.write(ev="ready", t=time.time(), attempt=0)  # its step is the quorum's, known once healed: no "start"
    while True:
        # torchft's OptimizerWrapper, spelled out to see what should_commit said: the quorum first
        # (synchronous: use_async_quorum=False), which heals a new replica from a peer
        manager.start_quorum()
        inner.zero_grad()
        step = manager.current_step()
        x, y = data.batch(step, slot, a.replicas, a.batch_size)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # the gradients averaged over the quorum's participants
        participating = manager.is_participating()
        committed = manager.should_commit()
        if committed:
            inner.step()
        log.write(ev="step", step=step, t=time.time(), samples=a.batch_size if committed and participating else 0,
                  loss=loss.item(), applied=bool(committed), participants=manager.num_participants())


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    slot = a.slot if a.slot is not None else int(os.environ.get("RANK", "0"))
    cpucap.join_from_env(slot)  # before torch: its import and threads run capped
    Path(a.log, "pids").mkdir(parents=True, exist_ok=True)
    Path(a.log, "pids", f"slot{slot}.{os.getpid()}").touch()
    log = Log(a.log, slot)
    import torch

    torch.set_num_threads(1)
    return torchft_loop(a, slot, log) if a.torchft else commlab_loop(a, slot, log)


if __name__ == "__main__":
    sys.exit(main())
