"""One rank of ``commlab bench compress``: the same loop under a commlab exchanger or under DDP with a torch hook.

    python -m bench.compress_worker --exchanger local:// --model mlp-25m --steps 6 --metrics F \
        --entries '[{"url": "ring://"}, {"url": "ring://?compress=powersgd:4,start_iter=2"}, {"peer": "ddp"}]'

Started by the launcher (:func:`bench.jobs.run`, job URL ``local://``: torchrun's environment, nothing else).
One job runs a whole cell: every entry in turn (``--rounds`` times), each from a fresh model, so the only
difference between two entries is how the gradients travel, and a process start is paid once, not per
entry. An entry is a commlab URL (``commlab.connect(url)``, ``ex.setup``, ``ex.step()``, ``ex.close()``) or
a peer, DistributedDataParallel over the default gloo group: ``ddp`` (plain), ``ddp+fp16`` (torch's
``fp16_compress_hook``), ``ddp+powersgd`` (torch's ``powerSGD_hook`` with ``matrix_approximation_rank=--rank-r``
and ``start_powerSGD_iter=--start-iter``, in one bucket: see :func:`ddp_wrap`), each on a gloo group of its own, or
one of ``commlab bench lowcomm``'s local-steps peers (``alone``, ``postlocal``, ``torchft``:
:mod:`bench.lowcomm_peers`). An entry ``{"url": "job"}`` connects to the job's own URL (a ``ps://`` job: the
launcher started its servers); ``"slow_rank": R`` makes rank R sleep its own step time after each step. An
entry that raises leaves an ``.error`` file and the next runs.

Models (:class:`Task`): ``mlp-25m`` (the ``commlab train`` model and data, SGD) and ``charlm``
(examples/charlm.py's model, AdamW in its parameter groups, warm-up and cosine, bf16 autocast, clipping);
``tiny`` and ``charlm-tiny`` are the same at test size. Every rank writes one line per step through
:func:`commlab.report` (entry i, round r: ``BASE.<i>.<r>``): ``loss, step_s, comm_s, time_s, bytes_sent,
bytes_uncompressed``, and on rank 0 at the end (and every ``--eval-every`` steps) ``test_loss`` (the held-out
loss of rank 0's model; its time is left out of ``time_s``). Under DDP ``comm_s`` is None (its wait is
inside backward) and the bytes are a closed form (:func:`ddp_bytes`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

import commlab
from bench.ddp_worker import leave
from bench.lowcomm_peers import PEERS as LOCAL_STEP_PEERS

ROOT = Path(__file__).resolve().parent.parent
DDP_PEERS = ("ddp", "ddp+fp16", "ddp+powersgd")
PEERS = (*DDP_PEERS, *LOCAL_STEP_PEERS)  # the latter: bench/lowcomm_peers.py's (commlab bench lowcomm)
ONE_BUCKET_MB = 4096  # DDP+PowerSGD's bucket cap: every model here in one bucket (see ddp_wrap)
# charlm's shape (d_model, layers, heads, context) per name; the MLPs are workers/models.py's
LMS = {"charlm": (96, 3, 4, 64), "charlm-tiny": (16, 1, 2, 16)}
MODELS = ("mlp-25m", "tiny", *LMS)


class Task:
    """A model, its optimizer and schedule, its data and its loss: built alike on every rank and for every entry."""

    def __init__(self, name: str, seed: int, batch: int, lr: float | None, steps: int):
        self.name, self.batch = name, batch
        if name in LMS:
            d, layers, heads, self.context = LMS[name]
            sys.path.insert(0, str(ROOT / "examples"))
            import charlm

            self.lm = charlm
            text = charlm.corpus()
            chars = sorted(set(text))
            data = torch.tensor(_encode(text, chars), dtype=torch.long)
            split = int(len(data) * 0.9)
            self.train, self.held_out, self.seed = data[:split], data[split:], seed
            torch.manual_seed(seed)
            self.model = charlm.CharLM(len(chars), self.context, d, layers, heads)
            self.opt = torch.optim.AdamW(charlm.param_groups(self.model, 0.1), lr=lr or 3e-3, betas=(0.9, 0.95))
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, charlm.warmup_cosine(min(20, steps // 5 + 1),
                                                                                          steps))
        else:
            from workers.data import load_digits
            from workers.models import build_model

            self.model, side = build_model(name, seed)
            self.digits = load_digits(side, seed)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=lr or 0.05)
            self.sched = None

    def batch_of(self, step: int, rank: int, world: int):
        if self.name not in LMS:
            return self.digits.batch(step, rank, world, self.batch)
        size = len(self.train) // world
        return self.lm.windows(self.train[rank * size:(rank + 1) * size], self.batch, self.context, self.seed,
                               rank, step, 0)

    def loss(self, forward, x, y) -> torch.Tensor:
        if self.name not in LMS:
            return F.cross_entropy(forward(x), y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = forward(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def after_backward(self) -> None:
        if self.name in LMS:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    @torch.no_grad()
    def test_loss(self) -> float:
        self.model.eval()
        if self.name not in LMS:
            out = F.cross_entropy(self.model(self.digits.test_x), self.digits.test_y).item()
        else:
            xs = [self.lm.windows(self.held_out, self.batch, self.context, 1234, i) for i in range(8)]
            out = sum(self.loss(self.model, x, y).item() for x, y in xs) / len(xs)
        self.model.train()
        return out


def _encode(text: str, chars: list[str]) -> list[int]:
    lookup = {c: i for i, c in enumerate(chars)}
    return [lookup[c] for c in text]


def ddp_bytes(model, peer: str, step: int, world: int, rank_r: int, start_iter: int) -> tuple[int, int]:
    """(bytes one rank sends in this step under the DDP peer, the uncompressed all-reduce's), counted as a
    ring all-reduce counts: 2(N-1)/N of each all-reduced tensor. PowerSGD: torch's rule for which tensors
    are compressed is commlab's (``min_compression_rate=2``), so its layout gives the P and Q sizes."""
    from commlab.compress.powersgd import layout

    ring = lambda nbytes: 2 * (world - 1) * nbytes // world
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plain = ring(4 * numel)
    if peer == "ddp+fp16":
        return ring(2 * numel), plain
    if peer == "ddp+powersgd" and step >= start_iter:
        lay = layout(shapes, rank_r, 2.0)
        p = sum(n * r for _, n, _, r in lay.matrices)
        q = sum(m * r for _, _, m, r in lay.matrices)
        return ring(4 * (lay.plain_numel + p)) + ring(4 * q), plain
    return plain, plain


def ddp_wrap(task: Task, peer: str, rank_r: int, start_iter: int, group):
    """DistributedDataParallel over ``group`` (gloo, this entry's own) around ``task.model``, with the peer's
    torch comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    # torch's PowerSGD hook over gloo with several buckets: the all-reduce of Q that each bucket's callback issues
    # went out in different orders on the two ranks (the 25M MLP: gloo "24576 vs 4096 bytes, a collective
    # mismatch" at the first compressed step, every time); one bucket for it, as its communication is small
    one = {"bucket_cap_mb": ONE_BUCKET_MB} if peer == "ddp+powersgd" else {}
    ddp = DistributedDataParallel(task.model, process_group=group, **one)
    if peer == "ddp+fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif peer == "ddp+powersgd":
        state = powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=rank_r, start_powerSGD_iter=start_iter,
                                            min_compression_rate=2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compress_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--exchanger", default="local://", help="the job's URL, as the launcher passes it: must be "
                                                            "local:// (each entry names its own)")
    p.add_argument("--entries", required=True, help='JSON list of {"url": URL} or {"peer": PEER}, run in this order; '
                                                    '{"url": "job"}: the job\'s own URL (--exchanger: a ps:// job\'s '
                                                    'servers); "slow_rank": R: rank R sleeps its own step time after '
                                                    'each step; a local-steps peer\'s settings: "H", "P", "T", "alpha"')
    p.add_argument("--rounds", type=int, default=1, help="run the entries this many times, taking turns")
    p.add_argument("--model", choices=MODELS, default="mlp-25m")
    p.add_argument("--rank-r", type=int, default=4, help="ddp+powersgd: matrix_approximation_rank")
    p.add_argument("--start-iter", type=int, default=2, help="ddp+powersgd: start_powerSGD_iter")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=0, help="rank 0's held-out loss every this many steps (0: at "
                   "the end only), its time left out of time_s")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, help="default: 0.05 (SGD, MLPs), 3e-3 (AdamW, charlm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", required=True, help="entry i of round r writes BASE.<i>.<r> (rank k > 0: .rank<k>), "
                                                    "and BASE.<i>.<r>.error.rank<k> if it failed")
    p.add_argument("--no-progress", action="store_true", help="accepted from the launcher; this worker prints none")
    return p


def train_entry(entry: dict, a, rank: int, world: int, path: str) -> None:
    """One entry's run from a fresh model: ``a.steps`` steps, one line per step to ``path``."""
    task = Task(a.model, a.seed, a.batch_size, a.lr, a.steps)
    peer, ex, local = entry.get("peer"), None, None
    if peer in LOCAL_STEP_PEERS:
        local = LOCAL_STEP_PEERS[peer](task.model, task.opt, entry, world)
        forward = local.forward
    elif peer:  # a group of its own: nothing an earlier entry left on a group can meet this one's collectives
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
        forward = ddp_wrap(task, peer, a.rank_r, a.start_iter, group)
    else:
        ex = commlab.connect(a.exchanger if entry["url"] == "job" else entry["url"])
        forward = task.model
        ex.setup(task.model, task.opt)
    slow = entry.get("slow_rank") == rank
    t_start = time.perf_counter()
    try:
        for step in range(a.steps):
            x, y = task.batch_of(step, rank, world)
            t0 = time.perf_counter()
            task.opt.zero_grad()
            loss = task.loss(forward, x, y)
            loss.backward()  # under DDP the hook's all-reduces end inside backward
            task.after_backward()
            if local is not None:
                local.step()
                sent, raw = local.after_step(step)
                line = {"comm_s": None, "bytes_sent": sent, "bytes_uncompressed": raw}
            elif ex is None:
                task.opt.step()
                sent, raw = ddp_bytes(task.model, peer, step, world, a.rank_r, a.start_iter)
                line = {"comm_s": None, "bytes_sent": sent, "bytes_uncompressed": raw}
            else:
                rep = ex.step()  # optimizer.step() after the exchange
                line = {"comm_s": rep.wait_s, "bytes_sent": rep.bytes_sent,
                        "bytes_uncompressed": rep.bytes_uncompressed or rep.bytes_sent}
            if task.sched is not None:
                task.sched.step()
            now = time.perf_counter()
            if slow:  # the slow worker: twice its own step time
                time.sleep(now - t0)
                now = time.perf_counter()
            line["time_s"] = now - t_start
            if step == 0:
                line["numel"] = sum(q.numel() for q in task.model.parameters())
            if rank == 0 and (step == a.steps - 1 or (a.eval_every and (step + 1) % a.eval_every == 0)):
                line["test_loss"] = task.test_loss()
                t_start += time.perf_counter() - now  # the wall clock leaves the evaluation out
            commlab.report(step, path=path, rank=rank, loss=loss.item(), step_s=now - t0, **line)
    finally:
        if local is not None:
            local.close()
        if ex is not None:
            ex.close()  # (an entry's DDP group lives to the end: destroying it under its DDP aborted a rank)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    entries = json.loads(a.entries)
    bad = [e for e in entries if not (e.get("url") or e.get("peer") in PEERS)]
    if (a.exchanger != "local://" and not any(e.get("url") == "job" for e in entries)) or bad:
        print(f"bench.compress_worker: the job's URL must be local:// (got {a.exchanger}) unless an entry is "
              f"{{\"url\": \"job\"}}, and every entry a url or one of {PEERS} (got {bad})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    import torch.distributed as dist

    # the default group serves DDP's entries (an allreduce:// entry borrows it too); commlab's own rendezvous
    # gives every exchanger of this process a namespace of its own in the job's store
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    for rnd in range(a.rounds):
        for i, entry in enumerate(entries):
            path = f"{a.metrics}.{i}.{rnd}"
            dist.barrier()  # every rank starts each entry together (rank 0 evaluated the last one alone)
            try:
                train_entry(entry, a, rank, world, path)
            except Exception as exc:  # this entry failed here: say so and go on with the next (they all time out)
                Path(f"{path}.error.rank{rank}").write_text(f"{type(exc).__name__}: {exc}"[:2000])
                print(f"bench.compress_worker rank {rank}: {entry}: {type(exc).__name__}: {exc}", file=sys.stderr)
    leave()


if __name__ == "__main__":
    sys.exit(main())
