"""Calibration: the constants of the cost model, measured on this machine.

- **Transports** (alpha, beta per transport): fitted to a ``commlab bench`` run folder's
  ``bandwidth.json`` (exchange time against size at the run's N), each regime through its own
  formula: an all-reduce ``t = 2(N-1) alpha + 2(N-1)/N S beta``, a push-pull against K shards on one
  host ``t = 2 alpha + 2 max(1, N/K) S beta`` (the shard's link carries N S / K each way). Without a
  folder, :func:`calibration_run` starts a short ``commlab bench bandwidth`` (a process of its own).
- **Server costs**: the seconds per byte of adding one gradient into a sum, and of one optimizer
  step (plain SGD, as the workers' default), timed in this process on 16 MiB tensors, one thread.
- **Compute**: forward and backward per sample, and the moment each gradient bucket is ready during
  backward, taken from the real model with a post-accumulate-grad hook on every parameter and
  commlab's own bucketing (reverse parameter order, ``bucket_mb``).
- **The clock**: every compute time is the calibrating thread's CPU time (``cpu_clock``), whatever else the
  machine runs; what a worker gets of the cores while all compute is :func:`cpu_share`'s.
"""

from __future__ import annotations

import gc
import importlib
import json
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from commlab.base.errors import ConfigError
from commlab.core.exchanger import make_buckets
from commlab.core.heap import keep_freed_gradients, release_freed_memory
from commlab.core.manifest import model_manifest
from commlab.plan.costmodel import Bucket, Calibration, Compute, Transport

# bench regime name -> transport it calibrates (and shards, for push-pull)
BENCH_REGIMES = {"gloo": ("gloo", 0), "nccl": ("nccl", 0), "ring-tcp": ("ring", 0), "ring-ipc": ("ring-ipc", 0),
                 "ring-torch": ("ring-torch", 0), "ps-1": ("ps", 1), "ps-2": ("ps", 2)}
CALIBRATION_REGIMES = "gloo,ring-tcp,ring-torch,ps-1"
CALIBRATION_SIZES = "64K,1M,8M"
# every calibrated compute time is this thread's CPU time (all of it runs in the calling thread, one intra-op
# thread): what the work costs while it has a core, however busy the machine is; what a worker gets of the
# cores while all compute is cpu_share's part
cpu_clock = time.thread_time


# ----- the model -----------------------------------------------------------------------------------
def load_model(spec: str, seed: int = 0, input_shape: tuple[int, ...] | None = None) -> tuple[nn.Module, tuple[int, ...]]:
    """A model and the shape of one input sample, from a built-in name or ``module:function``.

    Built-in names are the training worker's models (``workers.models``), looked up by name at run
    time like any ``module:function``, so the library does not import ``workers/``. A user's function
    takes no arguments and returns a module; give the sample's shape with ``input_shape``.
    """
    if ":" not in spec:
        try:
            models = importlib.import_module("workers.models")
        except ImportError as exc:
            raise ConfigError(f"model {spec!r}: built-in models need the checkout's workers/ package "
                              f"({exc}); or give module:function") from exc
        if spec not in models.MODELS:
            raise ConfigError(f"unknown model {spec!r}; built-in: {', '.join(models.MODELS)}, or module:function")
        model, side = models.build_model(spec, seed)
        return model, input_shape or (1, side, side)
    mod, _, fn = spec.partition(":")
    try:
        model = getattr(importlib.import_module(mod), fn)()
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model {spec!r}: cannot load {fn} from {mod}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec!r}: {fn}() returned {type(model).__name__}, not a torch.nn.Module")
    if input_shape is None:
        raise ConfigError(f"model {spec!r}: give the shape of one input sample (--input-shape, e.g. 3,32,32)")
    return model, tuple(input_shape)


def measure_compute(model: nn.Module, sample_shape: tuple[int, ...], batch: int, name: str = "model",
                    reps: int = 5, bucket_mb: float = 25.0, threads: int = 1) -> Compute:
    """Forward/backward time per sample and each bucket's ready moment, median of ``reps`` timed steps.

    The loss is a plain sum over the outputs (the gradients' shapes and the backward's work are the
    model's; the loss function's cost is negligible beside it). The backward is a worker's: each gradient,
    as it lands, is moved into its bucket scaled by 1/N and the parameter's ``grad`` left as the bucket's view,
    as an exchanger's hook does (a read and a write of every gradient byte: ~10 ms of the 25M MLP's step
    here, which the model alone would miss). Blocks for about ``reps + 2`` steps.
    """
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        buckets = make_buckets(named, int(bucket_mb * 2**20), carry_presence=False)
        landed: dict[int, float] = {}
        views = {id(p): b.view(j) for b in buckets for j, p in enumerate(b.params)}

        def moved(p: torch.Tensor, i: int) -> None:  # as an exchanger's hook moves a gradient into its bucket
            view, g = views[id(p)], p.grad
            assert g is not None  # the hook runs once the gradient has accumulated
            torch.mul(g, 0.5, out=view)  # scaled by 1/N (N = 2 here; the cost is the same for any N)
            p.grad = view
            landed[i] = cpu_clock()

        handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: moved(p, i)) for i, (_, p) in enumerate(named)]
        index = {id(p): i for i, (_, p) in enumerate(named)}
        x = torch.rand(batch, *sample_shape)
        fwd, bwd, fracs = [], [], []
        try:
            for rep in range(reps + 2):
                model.zero_grad(set_to_none=True)
                landed.clear()
                t0 = cpu_clock()
                loss = model(x).float().sum()
                t1 = cpu_clock()
                loss.backward()
                t2 = cpu_clock()
                if rep < 2:  # warm-up: first touches of memory, lazy initialisation
                    continue
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                fracs.append([max(landed[index[id(p)]] for p in b.params) - t1 for b in buckets])
        finally:
            for h in handles:
                h.remove()
        b_med = statistics.median(bwd)
        ready = np.median(np.array(fracs), axis=0) / b_med
        manifest = model_manifest(model)
        shapes = {n: (s, d) for n, s, d in manifest}
        out = tuple(Bucket(b.numel * b.buffer.element_size(), float(min(1.0, r)),
                           tuple((n, shapes[n][0], shapes[n][1]) for n in b.names)) for b, r in zip(buckets, ready))
        return Compute(name, batch, statistics.median(fwd) / batch, b_med / batch, out, tuple(manifest))
    finally:
        torch.set_num_threads(old_threads)


def measure_server_costs(nbytes: int = 16 * 2**20, reps: int = 7) -> tuple[float, float]:
    """(seconds per byte to add a gradient into a sum, seconds per byte of one SGD step), one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = nbytes // 4
        acc, g = torch.rand(n), torch.rand(n)
        p = nn.Parameter(torch.rand(n))
        p.grad = torch.rand(n)
        opt = torch.optim.SGD([p], lr=0.01)
        adds, steps = [], []
        for _ in range(reps):
            t0 = cpu_clock()
            acc.add_(g, alpha=0.5)
            t1 = cpu_clock()
            opt.step()
            t2 = cpu_clock()
            adds.append(t1 - t0)
            steps.append(t2 - t1)
        return statistics.median(adds) / nbytes, statistics.median(steps) / nbytes
    finally:
        torch.set_num_threads(old)


# ----- the transports ------------------------------------------------------------------------------
def fit_line(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """``t = a + b S`` by least squares on relative error (small and large sizes count alike); a, b >= 0."""
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    if len(s) == 1 or np.ptp(s) == 0:
        return 0.0, float(np.median(t / s))
    A = np.stack([1 / t, s / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(s * t / t**2) / np.sum(s * s / t**2))
    if b < 0:
        a, b = float(np.median(t)), 0.0
    return float(a), float(b)


def transports_from_records(records: list[dict]) -> dict[str, Transport]:
    """alpha and beta per transport from ``bandwidth.json`` records (see the module's text)."""
    out: dict[str, Transport] = {}
    groups: dict[tuple, list] = {}
    for r in records:
        if r.get("kind", "regime") != "regime" or r["regime"] not in BENCH_REGIMES or r.get("wrong"):
            continue
        groups.setdefault((r["regime"], r["workers"]), []).append((r["size_bytes"], r["time_us"] * 1e-6))
    for (name, n), pts in sorted(groups.items()):
        key, shards = BENCH_REGIMES[name]
        a, b = fit_line([p[0] for p in pts], [p[1] for p in pts])
        if shards:
            alpha, beta = a / 2, b / (2 * max(1.0, n / shards))
        else:
            alpha, beta = a / (2 * (n - 1)), b / (2 * (n - 1) / n)
        out.setdefault(key, Transport(alpha, beta, f"fitted: {name}, N={n}, {len(pts)} sizes"))
    return out


def transports_from_run(run_dir: str | Path) -> dict[str, Transport]:
    """Transports calibrated from a ``commlab bench`` run folder (its ``bandwidth.json``)."""
    path = Path(run_dir) / "bandwidth.json"
    if not path.exists():
        raise ConfigError(f"{run_dir} has no bandwidth.json: give a 'commlab bench' run folder that ran the "
                          f"bandwidth phase, or let plan calibrate (--calibrate)")
    found = transports_from_records(json.loads(path.read_text()))
    if not found:
        raise ConfigError(f"{path} holds no record of {', '.join(BENCH_REGIMES)}: nothing to calibrate from")
    return found


# a synthetic worker: argv[1] seconds of CPU, then it says so ("x") and waits for the others ("g"), again
_SPIN = ("import sys, time\n"
         "cpu, out, inp = float(sys.argv[1]), sys.stdout.buffer, sys.stdin.buffer\n"
         "while True:\n"
         "    c0, x = time.thread_time(), 0\n"
         "    while time.thread_time() - c0 < cpu:\n"
         "        for _ in range(1000): x += 1\n"
         "    out.write(b'x'); out.flush()\n"
         "    if inp.read(1) != b'g': break\n")


def cpu_share(procs: int, seconds: float = 2.0, step_cpu_s: float = 0.1, syncs: int = 1,
              timeout: float = 60.0) -> float:
    """The share of a core each of ``procs`` workers gets here now while they compute in lockstep: ``procs``
    processes of their own each burn ``step_cpu_s`` of CPU per step in ``syncs`` equal parts and wait for one
    another after each part (a synchronous step of pure compute whose exchange makes the ranks meet ``syncs``
    times, once per bucket and round), for about ``seconds`` after a first part; the share is
    ``parts x step_cpu_s / syncs / wall``, at most 1. Each runs in a session of its own, as the launcher starts every
    worker: with the kernel's autogroup scheduling a session is a group sharing the cores with the others
    (processes of one session would split one group's share). A lockstep step waits for the slowest, so the
    share is what the workers pay, not one process's average. Blocks about ``seconds`` plus the processes'
    start; every process is ended before it returns, also on an error (``ConfigError`` for ``procs < 1``,
    ``seconds <= 0``, ``step_cpu_s <= 0`` or ``syncs < 1``, naming it, and for a process that did not answer within
    ``timeout``, naming it)."""
    for name, value, ok in (("procs", procs, procs >= 1), ("seconds", seconds, seconds > 0),
                            ("step_cpu_s", step_cpu_s, step_cpu_s > 0), ("syncs", syncs, syncs >= 1)):
        if not ok:
            raise ConfigError(f"cpu_share: {name} must be {'>= 1' if name in ('procs', 'syncs') else '> 0'}, "
                              f"not {value:g}")
    part = step_cpu_s / syncs
    ps = [subprocess.Popen([sys.executable, "-c", _SPIN, repr(part)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, start_new_session=True) for _ in range(procs)]
    pipes = [(p.stdin, p.stdout) for p in ps]
    try:
        steps, t0 = -1, 0.0
        while steps < 3 * syncs or time.perf_counter() - t0 < seconds:
            for i, (p, (_, out)) in enumerate(zip(ps, pipes)):
                assert out is not None  # made with stdout=PIPE
                ready, _, _ = select.select([out], [], [], timeout)
                if not ready or out.read(1) != b"x":
                    raise ConfigError(f"cpu_share: process {i} of {procs} did not finish its step within "
                                      f"{timeout:g}s (exit {p.poll()})")
            steps += 1
            if steps == 0:  # the first part ends: every interpreter is up, timing starts
                t0 = time.perf_counter()
            elapsed = time.perf_counter() - t0
            for into, _ in pipes:
                assert into is not None  # made with stdin=PIPE
                into.write(b"g")
                into.flush()
        return min(1.0, steps * part / elapsed)
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
            p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()


def calibration_run(out_dir: str | Path, workers: int = 2, regimes: str = CALIBRATION_REGIMES,
                    sizes: str = CALIBRATION_SIZES, timeout: float = 240.0) -> Path:
    """Run a short ``commlab bench bandwidth`` into ``out_dir`` (a process of its own, at most
    ``timeout`` seconds) and return the folder."""
    argv = [sys.executable, "-m", "bench", "bandwidth", "--regimes", regimes, "--workers", str(workers),
            "--sizes", sizes, "--repeat-mb", "48", "--max-iters", "20", "--ceilings", "",
            "--budget-s", str(max(30.0, timeout - 30)), "--out", str(out_dir)]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"the calibration run did not finish within {timeout:g}s") from exc
    if res.returncode != 0:
        raise ConfigError(f"the calibration run failed: {(res.stderr or res.stdout).strip()[-500:]}")
    return Path(out_dir)


def calibrate(model: str, batch: int, run_dir: str | Path | None = None, input_shape=None, seed: int = 0,
              reps: int = 5, bucket_mb: float = 25.0) -> Calibration:
    """Measure the model's compute and the server costs here; transports from ``run_dir`` if given
    (else the assumed figures, marked as such, until a calibration run supplies them)."""
    net, shape = load_model(model, seed, input_shape)
    keep_freed_gradients(net.parameters())  # as every worker's exchanger does (heap=keep, the default)
    compute = measure_compute(net, shape, batch, model, reps=reps, bucket_mb=bucket_mb)
    del net
    gc.collect()
    release_freed_memory()  # the model and its gradients, kept in the heap for the timing, are done with
    add, opt = measure_server_costs()
    transports = transports_from_run(run_dir) if run_dir else {}
    return Calibration(transports, add, opt, compute,
                       {"run_dir": str(run_dir) if run_dir else None, "torch": torch.__version__,
                        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
