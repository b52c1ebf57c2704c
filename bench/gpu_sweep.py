"""GPU bandwidth sweep: each regime on CUDA tensors beside the same regime on CPU tensors.

For every regime and size, N workers (sharing the GPUs there are: rank r uses
GPU r % count) train a "model" of one flat parameter of S bytes through the
Exchanger contract: backward gives a gradient of ones, ``step()`` exchanges it.
The figure is the algorithm bandwidth S / (median step time), the step timed
from before backward until the result is back in the parameter (a CUDA
synchronize included). The CUDA row of ``ring://`` over zmq pays two extra
copies through host memory (``.to("cpu")`` and back); the goal is that it keeps
>= 80% of the same regime's CPU-tensor bandwidth.

Rows: ``ring://`` (host-staged, the goal applies), ``ps://`` on CPU tensors only
(a CPU parameter server: it refuses CUDA parameters, and the sweep says so), gloo (which
stages CUDA tensors itself: a peer for our staging), and NCCL on CUDA alone
when there are at least as many GPUs as workers (its transport, and whether it
used GPUDirect RDMA, are in the manifest from ``commlab doctor``'s probe).
Regimes not registered in ``commlab.registry.REGIMES`` are skipped by name.

Writes ``bench/results/gpu-<device>.json`` and ``.md``, the device named.
Without CUDA it says so and measures nothing; ``--devices cpu`` dry-runs the
harness on CPU alone (files named ``gpu-dryrun-cpu``).

    python bench/gpu_sweep.py [--regimes ring:// ps://] [--sizes-mib 1 4 16 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

GOAL = 0.8  # CUDA-tensor bandwidth / CPU-tensor bandwidth, host-staged regimes
STAGED = ("ring",)  # schemes the goal applies to (their zmq transport copies through the host)
CPU_ONLY = {"ps": "ps:// keeps parameters on the CPU (it refuses CUDA ones)"}  # no CUDA row for these
DEFAULT_REGIMES = ("ring://", "ps://", "allreduce://?backend=gloo")
NCCL_URL = "allreduce://?backend=nccl"


class Flat(nn.Module):
    """One flat parameter: the sweep's "model"."""

    def __init__(self, numel: int, device: torch.device):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel, device=device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(url: str, device_spec: str, numel: int, steps: int, warmup: int, result: str | None) -> int:
    """One rank of one case (run as ``gpu_sweep.py --worker``)."""
    import commlab
    from commlab import rendezvous
    from commlab.optim import OptimizerSpec
    from commlab.staging import resolve_device

    torch.set_num_threads(1)
    info = rendezvous.from_env()
    device = resolve_device(device_spec, info.local_rank)
    model = Flat(numel, device)
    ex = commlab.connect(url, info)
    try:
        ex.setup(model, OptimizerSpec("sgd", lr=1e-6))
        times = []
        for i in range(warmup + steps):
            ex.zero_grad()
            _sync(device)
            t0 = time.perf_counter()
            model.w.sum().backward()
            ex.step()
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        if result and info.rank == 0:
            n = ex.stats.steps
            Path(result).write_text(json.dumps({"step_s": times, "bytes_sent_per_step": ex.stats.bytes_sent / n,
                                                "bytes_received_per_step": ex.stats.bytes_received / n,
                                                "facts": ex.facts()}, default=str))
    finally:
        ex.close()
    return 0


def registered(url: str) -> str | None:
    """None if ``url``'s regime can be built here, else why not."""
    from commlab.config import ExchangerURL
    from commlab.registry import REGIMES, regime_class

    scheme = ExchangerURL.parse(url).scheme
    if scheme not in REGIMES:
        return f"{scheme}:// is not registered in commlab.registry.REGIMES (not merged yet?)"
    try:
        regime_class(scheme)
    except ImportError as exc:
        return f"{scheme}:// cannot be imported: {exc}"
    return None


def run_case(url: str, device: str, numel: int, workers: int, steps: int, warmup: int, timeout: float) -> dict:
    """Start servers (if the regime plans any) and ``workers`` ranks; return rank 0's timings or the error."""
    from commlab.launcher import Proc, free_port, planned_servers, stop_all

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(workers),
               LOCAL_WORLD_SIZE=str(workers), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs: list[Proc] = []
    with (planned_servers(url, workers) as (url_w, server_argvs),
          tempfile.TemporaryDirectory(prefix="gpu-sweep-") as tmp):
        result, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        with log.open("w") as fh:
            try:
                for i, argv in enumerate(server_argvs):
                    procs.append(Proc(f"server {i}", subprocess.Popen([sys.executable, "-m", "servers", *argv],
                                                                      env=env, stdout=fh, stderr=subprocess.STDOUT)))
                for r in range(workers):
                    argv = [sys.executable, __file__, "--worker", "--url", str(url_w), "--device", device,
                            "--numel", str(numel), "--steps", str(steps), "--warmup", str(warmup),
                            "--result", str(result)]
                    procs.append(Proc(f"rank {r}", subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                                                     stdout=fh, stderr=subprocess.STDOUT)))
                ranks = [p for p in procs if p.name.startswith("rank")]
                deadline = time.monotonic() + timeout
                failed = None
                while time.monotonic() < deadline:
                    failed = next((p for p in procs if p.popen.poll() not in (None, 0)), None)
                    if failed or all(p.popen.poll() == 0 for p in ranks):
                        break
                    time.sleep(0.05)
                stuck = [p.name for p in ranks if p.popen.poll() is None]
            finally:
                stop_all(procs, grace=3.0)
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
        if failed is not None:
            return {"error": f"{failed.name} failed (exit {failed.popen.returncode}): {tail}"}
        if stuck:
            return {"error": f"{', '.join(stuck)} did not finish within {timeout:g}s: {tail}"}
        if not result.exists():
            return {"error": f"rank 0 wrote no result: {tail}"}
        out = json.loads(result.read_text())
    med = statistics.median(out["step_s"])
    out.update(median_s=med, p90_s=sorted(out["step_s"])[int(0.9 * (len(out["step_s"]) - 1))],
               algbw_gbps=numel * 4 / med / 1e9)
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def markdown(doc: dict) -> str:
    facts = doc["transport_facts"]
    lines = [f"# GPU sweep on {doc['device']}", "",
             f"{doc['date']}, commit {doc['commit']}, {doc['workers']} workers, {doc['steps']} timed steps per case "
             f"(median), torch {facts['cuda']['torch']}, CUDA {facts['cuda']['torch_cuda']}, "
             f"NCCL {facts['nccl_version']}.", "",
             "algbw = bytes of the parameter / median step time (backward + exchange + update, synchronized). "
             f"Goal: a host-staged regime on CUDA tensors keeps >= {GOAL:.0%} of its CPU-tensor algbw.", "",
             "| regime | MiB | CPU GB/s | CUDA GB/s | CUDA / CPU | goal |", "|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        cpu, cuda = row.get("cpu", {}), row.get("cuda", {})

        def cell(r):
            return f"{r['algbw_gbps']:.2f}" if "algbw_gbps" in r else ("-" if not r else "error")
        ratio = row.get("ratio")
        goal = "" if ratio is None or row["scheme"] not in STAGED else ("met" if ratio >= GOAL else "NOT met")
        lines.append(f"| `{row['url']}` | {row['mib']:g} | {cell(cpu)} | {cell(cuda)} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {goal} |")
    problems = [(row["url"], row["mib"], dev, row[dev]["error"]) for row in doc["rows"] for dev in ("cpu", "cuda")
                if "error" in row.get(dev, {})]
    if doc["skipped"] or problems:
        lines += ["", "## Not measured"]
        lines += [f"- `{url}`: {why}" for url, why in doc["skipped"]]
        lines += [f"- `{url}` {mib:g} MiB on {dev}: {err}" for url, mib, dev, err in problems]
    g = facts["gpudirect_rdma"]
    probe = facts["nccl_probe"]
    lines += ["", "## Data paths",
              f"- zmq regimes: {facts['zmq_regimes']}",
              f"- NCCL probe: {'ok' if probe.get('ok') else probe.get('error') or probe.get('reason')}; "
              f"channels via {', '.join(probe.get('transports', [])) or '(none)'}",
              f"- GPUDirect RDMA used by NCCL: {g['used']} ({g['why']})"]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--regimes", nargs="+", default=list(DEFAULT_REGIMES))
    ap.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 4, 16, 64])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--devices", nargs="+", choices=("cuda", "cpu"), default=["cuda", "cpu"])
    ap.add_argument("--no-nccl", action="store_true", help="leave out the NCCL reference row")
    ap.add_argument("--case-timeout", type=float, default=300.0, help="seconds one case may take")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.workers < 1:
        ap.error("--steps and --workers must be >= 1, --warmup >= 0")
    if a.worker:
        return worker(a.url, a.device, a.numel, a.steps, a.warmup, a.result)

    from commlab import doctor

    cuda = "cuda" in a.devices
    if cuda and not torch.cuda.is_available():
        why = doctor.cuda_facts().get("why_no_cuda", "torch sees no GPU")
        print(f"gpu_sweep: skipped: no CUDA ({why}); nothing measured. "
              f"`--devices cpu` dry-runs the harness on CPU tensors alone.")
        return 0
    regimes = list(a.regimes)
    skipped: list[tuple[str, str]] = []
    if cuda and not a.no_nccl:
        if torch.cuda.device_count() >= a.workers:
            regimes.append(NCCL_URL)
        else:
            skipped.append((NCCL_URL, f"needs a GPU per worker: {torch.cuda.device_count()} GPU(s) for "
                                      f"{a.workers} workers"))
    device_name = torch.cuda.get_device_name(0) if cuda else "dryrun-cpu"
    print(f"gpu_sweep on {device_name}: {a.workers} workers, sizes {a.sizes_mib} MiB", flush=True)
    rows = []
    for url in regimes:
        why = registered(url)
        if why:
            print(f"  {url}: skipped: {why}", flush=True)
            skipped.append((url, why))
            continue
        devices = ["cuda"] if url == NCCL_URL else a.devices
        cpu_only = CPU_ONLY.get(url.split("://")[0])
        if cpu_only and "cuda" in devices:
            devices = [d for d in devices if d != "cuda"]
            print(f"  {url} on cuda: skipped: {cpu_only}", flush=True)
            skipped.append((f"{url} on cuda", cpu_only))
        for mib in a.sizes_mib:
            numel = max(1, int(mib * 2**20) // 4)
            row: dict = {"url": url, "scheme": url.split("://")[0], "mib": mib}
            for dev in devices:
                row[dev] = run_case(url, dev, numel, a.workers, a.steps, a.warmup, a.case_timeout)
                got = row[dev]
                text = f"{got['algbw_gbps']:.2f} GB/s" if "algbw_gbps" in got else got["error"]
                print(f"  {url} {mib:g} MiB on {dev}: {text}", flush=True)
            if "algbw_gbps" in row.get("cuda", {}) and "algbw_gbps" in row.get("cpu", {}):
                row["ratio"] = row["cuda"]["algbw_gbps"] / row["cpu"]["algbw_gbps"]
            rows.append(row)
    doc = {"device": device_name, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "argv": sys.argv[1:], "workers": a.workers, "steps": a.steps, "goal": GOAL,
           "rows": rows, "skipped": skipped, "transport_facts": doctor.transport_facts(run_nccl_probe=cuda)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"gpu-{slug(device_name)}"
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    base.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {base}.json and {base}.md")
    staged = [r for r in rows if r["scheme"] in STAGED and "ratio" in r]
    if staged:
        worst = min(staged, key=lambda r: r["ratio"])
        print(f"worst host-staged CUDA/CPU ratio: {worst['ratio']:.2f} ({worst['url']} {worst['mib']:g} MiB); "
              f"goal {GOAL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
