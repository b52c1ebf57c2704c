"""``commlab bench gpu-sweep``: each regime on CUDA tensors beside the same regime on CPU tensors.

For every regime and size, N workers (sharing the GPUs there are: rank r uses GPU r % count) train
a "model" of one flat parameter of S bytes through the Exchanger contract: backward gives a
gradient of ones, ``step()`` exchanges it. A sample is one step, timed from before backward until
the result is back in the parameter (a CUDA synchronize included); the record's algbw is
S / (median step time). The CUDA rows of ``ring://`` (zmq or shared memory) and ``ps://`` pay two
extra copies through pinned host memory (:mod:`commlab.core.staging`: down on a copy stream from the backward
hook on, up as each range arrives); the goal is that they keep >= 80% of the same regime's
CPU-tensor bandwidth: "URL S CUDA / CPU algbw" carries its 95% bootstrap interval over the steps
(:mod:`bench.verdict`, unpaired).

Rows: ``ring://`` and ``ps://`` (host-staged: the goal applies), gloo (which stages CUDA tensors itself,
through commlab's ``allreduce://``), and NCCL on CUDA alone when there is a GPU per worker (its transport
and GPUDirect RDMA: ``commlab doctor``'s probe, in the document). Regimes that cannot be built here are
skipped with the reason; every case is a job of the launcher (:func:`bench.records.run_ranks`). Writes
``bench/results/gpu-<device>.json`` (:mod:`bench.records`' document) and ``.md``. Without CUDA it
measures nothing and says so; ``--devices cpu`` dry-runs the harness (files ``gpu-dryrun-cpu``).

    commlab bench gpu-sweep [--regimes ring:// ps://] [--sizes-mib 1 4 16 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bench import records as rec
from bench import regimes as R
from bench import verdict
from bench.text import slug

CASE = "gpu-sweep"
ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.8  # CUDA-tensor bandwidth / CPU-tensor bandwidth, host-staged regimes
STAGED = ("ring", "ps")  # schemes the goal applies to (they copy CUDA buckets through pinned host mirrors)
DEFAULT_REGIMES = ("ring://", "ps://", "allreduce://?backend=gloo")
NCCL_URL = "allreduce://?backend=nccl"


def rank_main(device_spec: str, numel: int, steps: int, warmup: int) -> int:
    """One rank of one case ($COMMLAB_EXCHANGER, torchrun's environment); rank 0 reports the step times."""
    import json

    import commlab
    from commlab.core import metrics
    from commlab.transport import rendezvous
    from commlab.core.optim import OptimizerSpec
    from commlab.core.staging import resolve_device

    torch.set_num_threads(1)
    info = rendezvous.from_env()
    device = resolve_device(device_spec, info.local_rank)
    model = nn.ParameterList([nn.Parameter(torch.zeros(numel, device=device))])  # one flat parameter
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ex = commlab.connect(rank=info)
    try:
        ex.setup(model, OptimizerSpec("sgd", lr=1e-6))
        times = []
        for i in range(warmup + steps):
            ex.zero_grad()
            sync()
            t0 = time.perf_counter()
            model[0].sum().backward()
            ex.step()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        if info.rank == 0:
            n = ex.stats.steps
            metrics.report(0, rank=0, step_s=times, bytes_sent_per_step=ex.stats.bytes_sent / n,
                           bytes_received_per_step=ex.stats.bytes_received / n,
                           facts=json.loads(json.dumps(ex.facts(), default=str)))
    finally:
        ex.close()
    return 0


def run_case(url: str, device: str, numel: int, workers: int, steps: int, warmup: int, timeout: float) -> dict:
    """``workers`` ranks of ``url`` (the launcher starts the servers its regime plans) on ``device``
    tensors; rank 0's report (``step_s``, bytes per step, the regime's ``facts``), or ``{"error": ...}``."""
    try:
        ranks = rec.run_ranks(f"gpu-sweep {url} on {device}", ("-m", "bench.gpu_sweep", "--rank-of"),
                              ["--device", device, "--numel", str(numel), "--steps", str(steps),
                               "--warmup", str(warmup)], workers=workers, deadline_s=timeout, exchanger=url)
    except rec.CaseFailed as exc:
        return {"error": str(exc)}
    got = next((r for r in ranks[0] if "step_s" in r), None)
    return got if got is not None else {"error": "rank 0 reported no steps"}


def to_record(url: str, device: str, got: dict, a, numel: int) -> dict:
    return rec.record(CASE, url, kind="regime", method=rec.method_of(url), workers=a.workers, size_bytes=numel * 4,
                      times_s=got["step_s"], url=url, warmup=a.warmup, device=device,
                      bytes_sent_per_step=got["bytes_sent_per_step"],
                      bytes_received_per_step=got["bytes_received_per_step"], facts=got["facts"])


def verdicts(records: list[dict]) -> list[tuple[str, verdict.Verdict]]:
    """CUDA / CPU algbw (= the CPU step's time over the CUDA step's) per regime and size that ran on both."""
    out = []
    for r in records:
        if r["device"] != "cuda":
            continue
        cpu = next((c for c in records if c["device"] == "cpu" and c["url"] == r["url"]
                    and c["size_bytes"] == r["size_bytes"]), None)
        if cpu is not None:
            out.append((f"{r['url']} {r['size_bytes'] / 2**20:g} MiB CUDA / CPU algbw",
                        verdict.compare("cuda", r["samples_us"], "cpu", cpu["samples_us"], paired=False)))
    return out


def markdown(device: str, a, records: list[dict], vs: list[tuple[str, verdict.Verdict]], skipped: list,
             failures: list[dict], facts: dict) -> str:
    cuda = facts["cuda"]
    lines = [f"# GPU sweep on {device}", "",
             f"{a.workers} workers, {a.steps} timed steps per case, torch {cuda['torch']}, CUDA {cuda['torch_cuda']}, "
             f"NCCL {facts['nccl_version']}.", "",
             "time = one step (backward + exchange + update, synchronized); algbw = bytes of the parameter / median "
             f"step time. Goal: a host-staged regime on CUDA tensors keeps >= {GOAL:.0%} of its CPU-tensor algbw.", "",
             *rec.table(records, [("device", "device")]), ""]
    for label, v in vs:
        goal = f" ({rec.goal_text(v, GOAL)})" if label.split("://")[0] in STAGED else ""
        lines.append(f"- {rec.ratio_line(label, v)}{goal}")
    if skipped or failures:
        lines += ["", "## Not measured"]
        lines += [f"- `{url}`: {why}" for url, why in skipped]
        lines += [f"- `{f['regime']}`: {f['error']}" for f in failures]
    g = facts["gpudirect_rdma"]
    probe = facts["nccl_probe"]
    lines += ["", "## Data paths",
              f"- zmq regimes: {facts['zmq_regimes']}",
              f"- NCCL probe: {'ok' if probe.get('ok') else probe.get('error') or probe.get('reason')}; "
              f"channels via {', '.join(probe.get('transports', [])) or '(none)'}",
              f"- GPUDirect RDMA used by NCCL: {g['used']} ({g['why']})"]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="commlab bench gpu-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regimes", nargs="+", default=list(DEFAULT_REGIMES))
    ap.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 4, 16, 64])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--devices", nargs="+", choices=("cuda", "cpu"), default=["cuda", "cpu"])
    ap.add_argument("--no-nccl", action="store_true", help="leave out the NCCL reference row")
    ap.add_argument("--case-timeout", type=float, default=300.0, help="seconds one case may take")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--rank-of", action="store_true", help=argparse.SUPPRESS)  # one rank of one case
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.workers < 1:
        ap.error("--steps and --workers must be >= 1, --warmup >= 0")
    if a.rank_of:
        return rank_main(a.device, a.numel, a.steps, a.warmup)

    from commlab.tools import doctor

    cuda = "cuda" in a.devices
    if cuda and not torch.cuda.is_available():
        why = doctor.cuda_facts().get("why_no_cuda", "torch sees no GPU")
        print(f"commlab bench gpu-sweep: skipped: no CUDA ({why}); nothing measured. "
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
    print(f"gpu-sweep on {device_name}: {a.workers} workers, sizes {a.sizes_mib} MiB", flush=True)
    records, failures = [], []
    for url in regimes:
        why = R.unavailable(url)
        if why:
            print(f"  {url}: skipped: {why}", flush=True)
            skipped.append((url, why))
            continue
        devices = ["cuda"] if url == NCCL_URL else a.devices
        for mib in a.sizes_mib:
            numel = max(1, int(mib * 2**20) // 4)
            for dev in devices:
                got = run_case(url, dev, numel, a.workers, a.steps, a.warmup, a.case_timeout)
                if "error" in got:
                    failures.append(rec.failure(CASE, f"{url} {mib:g} MiB on {dev}", got["error"], url))
                    print(f"  {url} {mib:g} MiB on {dev}: {got['error']}", flush=True)
                    continue
                records.append(to_record(url, dev, got, a, numel))
                print(f"  {url} {mib:g} MiB on {dev}: {records[-1]['algbw_gbps']:.2f} GB/s", flush=True)
    vs = verdicts(records)
    facts = doctor.transport_facts(run_nccl_probe=cuda)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"gpu-{slug(device_name)}"
    config = {k: v for k, v in vars(a).items() if k not in ("rank_of", "device", "numel")}
    rec.write(base.with_suffix(".json"), CASE, dict(config, goal=GOAL), records, vs, failures, device=device_name,
              skipped=skipped, transport_facts=facts)
    base.with_suffix(".md").write_text(markdown(device_name, a, records, vs, skipped, failures, facts))
    for label, v in vs:
        print(rec.ratio_line(label, v))
    print(f"wrote {base}.json and {base}.md")
    return 0


if __name__ == "__main__":  # python -m bench.gpu_sweep: the same as commlab bench gpu-sweep
    sys.exit(main())
