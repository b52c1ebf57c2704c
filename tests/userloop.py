"""A user's own training loop, as a DDP user writes it, ported to commlab with the contract's few lines.

Run per rank (``python tests/userloop.py '<json config>'``, under torchrun's environment) it trains
through ``commlab.connect(url)`` and prints one JSON line: every parameter, buffer and optimizer
state tensor, plus what the loop saw (pre-clip norms, learning rates, GradScaler scales). Imported,
:func:`reference` runs the same loop in one process on the combined batch (every rank's every
micro-step), which is what a synchronous regime must reproduce.

The loop: AdamW in two param groups (weight decay on weights only), warm-up + cosine schedule
(LambdaLR), GradScaler (unscale before clipping), ``clip_grad_norm_`` with a threshold the norms
are above (so it really clips), two micro-steps of accumulation (the first under ``no_sync``).
Variants: ``mlp`` (a LayerNorm MLP), ``ckpt`` / ``ckpt-reentrant`` (its middle block under
``torch.utils.checkpoint``), ``bn`` (a BatchNorm model, plain SGD: compared with DDP), ``amp``
(bf16 autocast; one rank's gradient made inf at one step).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from commlab.launch.exiting import exit_now
from commlab.core.metrics import metrics_path

FEATURES, HIDDEN, OUT, BATCH, MICRO = 6, 8, 3, 4, 2
CLIP = 0.05  # below every pre-clip norm of this loop: clipping always acts
INF_STEP, INF_RANK = 4, 1  # amp variant: this rank's gradient is inf at this step


class Net(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        # no bias before BatchNorm (as in ResNets): its gradient would be zero in exact arithmetic, rounding noise here
        self.inp = nn.Linear(FEATURES, HIDDEN, bias=variant != "bn")
        if variant == "bn":
            self.mid = nn.Sequential(nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
        else:
            self.mid = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = self.inp(x)
        if self.variant.startswith("ckpt"):
            h = checkpoint(self.mid, h, use_reentrant=self.variant == "ckpt-reentrant")
        else:
            h = self.mid(h)
        return self.out(h)


def build(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Net(variant)
    if variant == "bn":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]  # biases, norm weights
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=0.01, betas=(0.9, 0.99))
    return model, opt


def schedule(opt, steps: int):
    warm = 3

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def data(step: int, world: int):
    """Every rank's micro-batches of one step: [rank][micro] -> (x, y)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world, MICRO, BATCH, FEATURES, generator=g)
    y = torch.randn(world, MICRO, BATCH, OUT, generator=g)
    return x, y


def snapshot(model, opt) -> dict:
    """Parameters, buffers and optimizer state as lists. The state is read through ``opt.state_dict()``
    (under ps:// update=server it lives on the servers, which that call gathers)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    state = {}
    for index, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            state[f"{order[int(index)]}.{k}"] = torch.as_tensor(v).double().reshape(-1).tolist()
    return {"params": {n: p.detach().double().reshape(-1).tolist() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().double().reshape(-1).tolist() for n, b in model.named_buffers()},
            "state": state}


def finish_step(model, opt, sched, scaler, seen: dict, clip: bool = True) -> None:
    """What a user's loop does between backward() and the next step: unscale, clip, step, schedule."""
    scaler.unscale_(opt)
    if clip:
        seen["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
    seen["lrs"].append([g["lr"] for g in opt.param_groups])
    scaler.step(opt)
    scaler.update()
    sched.step()
    seen["scales"].append(float(scaler.get_scale()))


def rank_main(cfg: dict) -> None:
    """One rank of the user's loop. ``cfg``: url, variant, steps, and optionally stop_at + save, resume (with load:
    "before": the model's and optimizer's state loaded before ex.setup, as DDP scripts do),
    device ("cpu", or "cuda": the model on GPU LOCAL_RANK % count, fp16 autocast instead of bf16), clip
    (False: no clip_grad_norm_ in the loop, as when ps:// update=server clips with clip_norm=)."""
    import os
    import commlab
    variant, steps, url = cfg["variant"], cfg["steps"], cfg["url"]
    torch.set_num_threads(1)
    model, opt = build(variant)
    device = torch.device(cfg.get("device", "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        model.to(device)  # the optimizer keeps the same Parameter objects
    ex = commlab.connect(url)
    rank, world = ex.rank, ex.world_size
    accumulate = cfg.get("accumulate", "no_sync")  # or "flag", "flag-compiled", "flag-wrapper", "every"
    forward = model
    if accumulate in ("flag-compiled", "flag-wrapper"):  # setup() given torch.compile's wrapper
        forward = torch.compile(model, backend="eager")
    ck = torch.load(metrics_path(cfg["resume"], rank), weights_only=False) if cfg.get("resume") else None
    before = ck is not None and cfg.get("load") == "before"
    if before:  # as DDP scripts do: the state first, then the wrapper (the schedule made before either load:
        sched = schedule(opt, steps)  # LambdaLR reads its base lr from the groups when it is made)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
    ex.setup(forward, opt)
    if not before:
        sched = schedule(opt, steps)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=1000)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    start = 0
    if ck is not None:
        if not before:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        ex.load_state_dict(ck["exchanger"])
        start = ck["step"]
    if variant == "amp" and rank == INF_RANK:
        poison = {"on": False}
        model.out.weight.register_hook(lambda g: torch.full_like(g, math.inf) if poison["on"] else g)
    seen = {"norms": [], "lrs": [], "scales": [], "buffers_equal": []}
    for step in range(start, steps):
        if cfg.get("stop_at") == step:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "scaler": scaler.state_dict(), "exchanger": ex.state_dict(), "step": step},
                       metrics_path(cfg["save"], rank))
            break
        x, y = (t.to(device) for t in data(step, world))
        if variant == "amp" and rank == INF_RANK:
            poison["on"] = step == INF_STEP
        opt.zero_grad()
        for m in range(MICRO):
            if accumulate.startswith("flag"):  # DDP's attribute, as nanoGPT sets it: read at the forward
                set_sync_flag(forward, m == MICRO - 1, accumulate == "flag-wrapper")
            with torch.autocast(device.type, dtype=half, enabled=variant == "amp"):
                loss = F.mse_loss(forward(x[rank, m]), y[rank, m]).float() / MICRO
            if m < MICRO - 1 and accumulate == "no_sync":
                with ex.no_sync():
                    scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()  # gradients final here
        finish_step(model, opt, sched, scaler, seen, clip=variant != "bn" and cfg.get("clip", True))
        if variant == "bn":  # every rank's buffers after every step: a digest to compare across ranks
            seen["buffers_equal"].append([float(b.double().sum()) for _, b in model.named_buffers()])
    report = ex.last_report
    out = dict(snapshot(model, opt), seen=seen, rank=rank, exchanges=ex.stats.exchanges, steps=ex.stats.steps,
               staging=ex.facts().get("staging"), report=[report.exchanges, report.bytes_sent, report.bytes_received])
    ex.close()
    print(json.dumps(out), flush=True)


def set_sync_flag(module, value: bool, on_wrapper_only: bool = False) -> None:
    """``module.require_backward_grad_sync = value``; ``on_wrapper_only``: kept on torch.compile's wrapper
    itself, as torch versions whose wrapper does not pass attributes on to the model keep it."""
    if on_wrapper_only:
        object.__setattr__(module, "require_backward_grad_sync", value)
    else:
        module.require_backward_grad_sync = value


def uneven_main(cfg: dict) -> None:
    """Uneven inputs: rank r trains ``batches[r]`` steps of the BatchNorm loop (SGD with momentum, two
    micro-steps, the first under no_sync) inside ``ex.join()``, or with ``ddp: True`` inside DDP's
    ``ddp.join()``; ``divide`` is divide_by_initial_world_size. Prints every parameter, buffer and
    optimizer state tensor, and (commlab) how many exchanges and steps the rank took."""
    import commlab
    import faulthandler
    # an abort (std::terminate) shows each thread's Python stack: where in the loop or the exit it came
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    divide = cfg.get("divide", True)
    model, opt = build("bn")
    if cfg.get("ddp"):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp = DDP(model, broadcast_buffers=True)
        forward, no_sync, join = ddp, ddp.no_sync, ddp.join(divide_by_initial_world_size=divide)
    else:
        ex = commlab.connect(cfg["url"])
        rank, world = ex.rank, ex.world_size
        ex.setup(model, opt)
        forward, no_sync, join = model, ex.no_sync, ex.join(divide_by_initial_world_size=divide,
                                                             throw_on_early_termination=cfg.get("throw", False))
    try:
        run_uneven(cfg["batches"][rank], world, rank, model, opt, forward, no_sync, join)
    except RuntimeError as exc:
        if not cfg.get("throw"):
            raise
        print(json.dumps({"rank": rank, "raised": str(exc), "steps": ex.stats.steps}), flush=True)
        return
    out = dict(snapshot(model, opt), rank=rank)
    if cfg.get("ddp"):
        dist.destroy_process_group()
    else:
        out.update(exchanges=ex.stats.exchanges, steps=ex.stats.steps)
        if ex.scheme == "ps":  # every shard's update count, read once every worker has joined
            out["updates"] = [s["updates"] for s in ex.server_stats()]
        ex.close()
    print(json.dumps(out), flush=True)


def run_uneven(batches: int, world: int, rank: int, model, opt, forward, no_sync, join) -> None:
    with join:
        for step in range(batches):
            x, y = data(step, world)
            opt.zero_grad()
            for m in range(MICRO):  # the forward inside no_sync too: DDP reads it there
                with no_sync() if m < MICRO - 1 else contextlib.nullcontext():
                    F.mse_loss(forward(x[rank, m]), y[rank, m]).div(MICRO).backward()
            opt.step()


def reference(variant: str, world: int, steps: int) -> dict:
    """One process, the combined batch: the gradient of (1/N) x every rank's (micro-step-averaged) loss."""
    torch.set_num_threads(1)
    model, opt = build(variant)
    sched = schedule(opt, steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    seen = {"norms": [], "lrs": [], "scales": []}
    for step in range(steps):
        x, y = data(step, world)
        opt.zero_grad()
        for r in range(world):
            for m in range(MICRO):
                loss = F.mse_loss(model(x[r, m]), y[r, m]) / MICRO / world
                scaler.scale(loss).backward()
        finish_step(model, opt, sched, scaler, seen)
    return dict(snapshot(model, opt), seen=seen)


def ddp_main(cfg: dict) -> None:
    """The oracle for buffers: the same BatchNorm loop under DistributedDataParallel(broadcast_buffers=True)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build("bn")
    ddp = DDP(model, broadcast_buffers=True)
    sched = schedule(opt, cfg["steps"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for step in range(cfg["steps"]):
        x, y = data(step, world)
        opt.zero_grad()
        for m in range(MICRO):
            loss = F.mse_loss(ddp(x[rank, m]), y[rank, m]) / MICRO
            if m < MICRO - 1:
                with ddp.no_sync():
                    scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()
        finish_step(model, opt, sched, scaler, {"norms": [], "lrs": [], "scales": []}, clip=False)
    out = dict(snapshot(model, opt), rank=rank)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    # done: leave before DDP's reducer is torn down, which can deadlock with torch 2.13's gloo run loop
    # (~ProcessGroupGloo waits on a mutex while its run-loop thread destroys the last broadcast work;
    # half of the runs forked by the test suite's zygote, where a rank gets here sooner, hung there)
    exit_now(0)


def ddp_hook_main(cfg: dict) -> None:
    """Plain DDP beside DDP with ``commlab.ddp_hook(url)``, for each of ``cfg["urls"]``: the same model,
    optimizer and data; prints both models' parameters. Small buckets (``bucket_mb``), so that the hook
    sees several, and DDP's rebuilt ones after the first iteration; ``bucket_view``: DDP's
    ``gradient_as_bucket_view``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import commlab
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank}
    for url in cfg["urls"]:
        (plain_model, plain_opt), (hooked_model, hooked_opt) = build("mlp"), build("mlp")
        plain = DDP(plain_model)
        hooked = DDP(hooked_model, bucket_cap_mb=cfg.get("bucket_mb", 0.0003),
                     gradient_as_bucket_view=cfg.get("bucket_view", False))
        state, hook = commlab.ddp_hook(url)
        hooked.register_comm_hook(state, hook)
        for step in range(cfg["steps"]):
            x, y = data(step, world)
            for ddp, opt in ((plain, plain_opt), (hooked, hooked_opt)):
                opt.zero_grad()
                F.mse_loss(ddp(x[rank, 0]), y[rank, 0]).backward()
                opt.step()
        state.close()
        assert dist.is_initialized(), f"{url}: closing the hook destroyed DDP's process group"
        out[url] = {"plain": snapshot(plain_model, plain_opt)["params"],
                    "hooked": snapshot(hooked_model, hooked_opt)["params"]}
    dist.destroy_process_group()  # DDP's group, which the hook used and left alone
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    if "batches" in config:
        uneven_main(config)
    else:
        (ddp_main if config.get("ddp") else rank_main)(config)
