"""Parameter-server rounds: commlab's ps:// beside a torch.distributed.rpc parameter server.

One server, two workers, a 4 MiB float32 vector; a round is "push the
gradient, then pull the parameters". Aggregate rounds/s = the sum over
workers of rounds / seconds. Configurations, all on one host, in one run:

  ps tcp         commlab server (async) over tcp://127.0.0.1
  ps ipc         the same over ipc://
  ps shm         the same with transport=shm: headers over ipc://, payloads through shared memory
  rpc uv-basic   torch.distributed.rpc, TensorPipe forced onto TCP (transport uv, channel basic)
  rpc default    torch.distributed.rpc, TensorPipe's own choice (shared memory / cross-memory copies)

Each configuration runs ``--repeats`` times, alternating with the others; the
median is reported. Prints a table of rounds/s and the ratios the goals name,
and writes JSON.

    python -m bench.ps_rounds [--rounds 200] [--json ps_rounds.json]

The worker side of ``ps`` uses the client regime's benchmark hook
``PSExchanger.push_pull_async(tensor)`` after ``setup`` on a one-parameter model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1")


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(map(str, p.args[:6]))} exited {p.returncode}: {stderr[-2000:]}")
            out += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def run_ps(bind: str, numel: int, rounds: int, warmup: int, workers: int, timeout: float,
           transport: str = "") -> list[dict]:
    server = subprocess.Popen([sys.executable, "-m", "servers", "--bind", bind, "--mode", "async", "--log-every", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    try:
        sel = selectors.DefaultSelector()
        sel.register(server.stdout, selectors.EVENT_READ)
        line = server.stdout.readline() if sel.select(60) else ""
        if "listening on" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        endpoint = line.split("listening on")[1].strip()
        url = f"ps://?endpoints={endpoint}&mode=async&timeout=60" + (f"&transport={transport}" if transport else "")
        procs = [subprocess.Popen([sys.executable, "-m", "bench.ps_rounds", "--worker", url, "--rank", str(r),
                                   "--workers", str(workers), "--numel", str(numel), "--rounds", str(rounds),
                                   "--warmup", str(warmup)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
                 for r in range(workers)]
        return _collect(procs, timeout)
    finally:
        server.terminate()
        server.wait(10)


def run_rpc(kind: str, numel: int, rounds: int, warmup: int, workers: int, timeout: float) -> list[dict]:
    from commlab.launcher import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.rpc_ps", "--rank", str(r), "--world", str(workers + 1),
                               "--port", str(port), "--numel", str(numel), "--rounds", str(rounds),
                               "--warmup", str(warmup), "--transport", kind],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
             for r in range(workers + 1)]
    return _collect(procs, timeout)


def worker(url: str, rank: int, workers: int, numel: int, rounds: int, warmup: int) -> None:
    """One ps:// worker: attach, wait until every worker is attached, time push+pull rounds."""
    import torch
    from torch import nn

    import commlab
    from commlab.rendezvous import RankInfo

    torch.set_num_threads(1)
    model = nn.ParameterList([nn.Parameter(torch.zeros(numel))])
    with commlab.connect(url, RankInfo(rank, workers, rank, "127.0.0.1", 0, "flags")) as ex:
        ex.setup(model, commlab.OptimizerSpec("sgd", lr=1e-6))
        deadline = time.monotonic() + 60
        while any(len(s["workers"]) < workers for s in ex.server_stats()):
            if time.monotonic() > deadline:
                raise commlab.CommTimeout(f"rank {rank}: the other workers did not attach within 60s")
            time.sleep(0.01)
        grad = torch.full((numel,), 1e-3)
        for i in range(warmup + rounds):
            if i == warmup:
                t0 = time.perf_counter()
            ex.push_pull_async(grad).wait(60)
        seconds = time.perf_counter() - t0
    print(json.dumps({"rounds": rounds, "seconds": seconds}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ps_rounds", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="timed rounds per worker")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (the median is reported)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--mib", type=float, default=4.0, help="vector size in MiB (float32)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default="ps_rounds.json", help="where to write the results")
    p.add_argument("--only", nargs="*", help="subset of: ps-tcp ps-ipc ps-shm rpc-uv-basic rpc-default")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one ps:// worker
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.rank, a.workers, a.numel, a.rounds, a.warmup)
        return 0
    numel = int(a.mib * 2**20) // 4
    ipc_dir = tempfile.mkdtemp(prefix="commlab-bench-")
    try:
        return _compare(a, numel, ipc_dir)
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _compare(a, numel: int, ipc_dir: str) -> int:
    configs = {
        "ps-tcp": lambda: run_ps("tcp://127.0.0.1:0", numel, a.rounds, a.warmup, a.workers, a.timeout),
        "ps-ipc": lambda: run_ps(f"ipc://{ipc_dir}/ps", numel, a.rounds, a.warmup, a.workers, a.timeout),
        "ps-shm": lambda: run_ps(f"ipc://{ipc_dir}/ps-shm", numel, a.rounds, a.warmup, a.workers, a.timeout, "shm"),
        "rpc-uv-basic": lambda: run_rpc("uv-basic", numel, a.rounds, a.warmup, a.workers, a.timeout),
        "rpc-default": lambda: run_rpc("default", numel, a.rounds, a.warmup, a.workers, a.timeout),
    }
    results: dict = {}
    for rep in range(a.repeats):  # configurations alternate, so drift on a shared machine hits all alike
        for name, run in configs.items():
            if a.only and name not in a.only:
                continue
            per_worker = run()
            rate = sum(w["rounds"] / w["seconds"] for w in per_worker)
            results.setdefault(name, {"samples": [], "workers": []})
            results[name]["samples"].append(rate)
            results[name]["workers"].append(per_worker)
            print(f"  [{rep + 1}/{a.repeats}] {name:13} {rate:8.1f} rounds/s", file=sys.stderr, flush=True)
    for r in results.values():
        r["rounds_per_s"] = statistics.median(r["samples"])
    rate = {k: v["rounds_per_s"] for k, v in results.items()}
    goals = [("ps-tcp", "rpc-uv-basic", 1.5), ("ps-tcp", "rpc-default", 1.3), ("ps-ipc", "rpc-default", 2.0),
             ("ps-shm", "rpc-default", 2.0), ("ps-shm", "rpc-uv-basic", 3.0)]
    ratios = {f"{x} / {y}": {"ratio": rate[x] / rate[y], "goal": g} for x, y, g in goals if x in rate and y in rate}
    print(f"\nparameter-server rounds: 1 server, {a.workers} workers, {a.mib:g} MiB float32, push then pull")
    print(f"{'configuration':15} {'rounds/s':>10} {'GB/s (in+out)':>14}   runs")
    for name, r in rate.items():
        runs = " ".join(f"{x:.0f}" for x in results[name]["samples"])
        print(f"{name:15} {r:10.1f} {2 * r * numel * 4 / 1e9:14.2f}   {runs}")
    for name, v in ratios.items():
        verdict = "meets" if v["ratio"] >= v["goal"] else "misses"
        print(f"{name:28} {v['ratio']:5.2f} x   (goal >= {v['goal']:g} x: {verdict})")
    import torch
    import zmq
    manifest = {"python": platform.python_version(), "torch": torch.__version__, "pyzmq": zmq.__version__,
                "libzmq": zmq.zmq_version(), "cpus": os.cpu_count(), "host": platform.node(),
                "mib": a.mib, "workers": a.workers, "rounds": a.rounds, "warmup": a.warmup, "repeats": a.repeats,
                "loadavg": os.getloadavg(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(a.json).write_text(json.dumps({"manifest": manifest, "results": results, "ratios": ratios}, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
