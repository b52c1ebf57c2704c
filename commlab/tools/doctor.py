"""``commlab doctor``: what this machine offers for moving gradients, and what NCCL chose.

It reports, in this order: torch, CUDA and the driver; the GPUs and their
topology (``nvidia-smi topo -m``); NCCL's version; RDMA devices
(``/sys/class/infiniband``: InfiniBand, or RoCE when the link layer is
Ethernet); whether a peer-memory kernel module (``nvidia_peermem`` or
``nv_peer_mem``) is loaded. Then, if CUDA and NCCL are there, it runs a short
NCCL all-reduce through ``allreduce://?backend=nccl`` itself (2 processes on 2
GPUs when there are at least 2, else 1 process of world size 1) with
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH`` and reads NCCL's own log
for the transport it chose (P2P, SHM or NET; IB or Socket) and for GPUDirect
RDMA. Its channel lines say ``via NET/IB/0/GDRDMA`` when a network transfer
goes straight from GPU memory to the NIC.

Nothing here claims GPUDirect RDMA on its own: a loaded module or an RDMA
device only makes it possible; ``gpudirect_rdma.used`` is true only when a
NCCL channel line says GDRDMA. The zmq regimes never use it: ``ring://`` over
zmq copies CUDA tensors to host memory and back, ``ps://`` refuses them.

Run ``commlab doctor`` (or ``python -m commlab.tools.doctor``), ``--json`` for the
manifest form; benchmarks call :func:`transport_facts`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from commlab.launch import scratch
from commlab.regimes.allreduce import nccl_version  # noqa: F401  (doctor reports it; the regime owns it)


PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem")
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH"}
PROBE_MARK = "COMMLAB_PROBE "
PROBE_NUMEL = 4 * 2**20  # 16 MiB of float32: big enough that NCCL sets up its channels
ZMQ_DATA_PATH = ("ring:// over zmq or shared memory and ps:// copy CUDA buckets through pinned host memory "
                 "(commlab.core.staging: down on a copy stream from the backward hook on, up as each range "
                 "arrives); neither uses GPUDirect RDMA")


def _run(argv: list[str], timeout: float = 20.0) -> str | None:
    """stdout of a tool, or None if it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def cuda_facts() -> dict:
    """torch's CUDA build, the driver, and the visible GPUs."""
    facts: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                   "cuda_available": torch.cuda.is_available(), "gpu_count": 0, "gpus": []}
    if torch.version.cuda is None:
        facts["why_no_cuda"] = f"this torch build ({torch.__version__}) has no CUDA support"
    elif not facts["cuda_available"]:
        facts["why_no_cuda"] = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU "
                                f"(no driver, or CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} "
                                f"hides them)")
    if facts["cuda_available"]:
        facts["gpu_count"] = torch.cuda.device_count()
        for i in range(facts["gpu_count"]):
            p = torch.cuda.get_device_properties(i)
            facts["gpus"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                  "memory_gib": round(p.total_memory / 2**30, 1)})
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if driver:
        facts["driver"] = driver.strip().splitlines()[0]
    else:
        proc = Path("/proc/driver/nvidia/version")
        facts["driver"] = proc.read_text().splitlines()[0].strip() if proc.exists() else None
    return facts


def gpu_topology() -> str | None:
    """``nvidia-smi topo -m`` (links between GPUs and NICs), or None without nvidia-smi."""
    out = _run(["nvidia-smi", "topo", "-m"])
    return out.rstrip() if out else None


def rdma_devices(root: str | os.PathLike = "/sys/class/infiniband") -> list[dict]:
    """One entry per RDMA device port: name, port, state, link layer (InfiniBand, or Ethernet = RoCE), rate."""
    base = Path(root)
    if not base.is_dir():
        return []

    def read(p: Path) -> str | None:
        try:
            return p.read_text().strip()
        except OSError:
            return None

    found = []
    for dev in sorted(base.iterdir()):
        ports = sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []
        for port in ports:
            link = read(port / "link_layer")
            found.append({"device": dev.name, "port": port.name, "state": read(port / "state"),
                          "link_layer": link, "kind": "RoCE" if link == "Ethernet" else link,
                          "rate": read(port / "rate")})
        if not ports:
            found.append({"device": dev.name, "port": None, "state": None, "link_layer": None, "kind": None,
                          "rate": None})
    return found


def peer_memory_modules(modules: str | os.PathLike = "/proc/modules") -> list[str]:
    """Which GPUDirect peer-memory kernel modules are loaded (an empty list if none, or no /proc)."""
    try:
        names = {line.split()[0] for line in Path(modules).read_text().splitlines() if line.strip()}
    except OSError:
        return []
    return [m for m in PEER_MEMORY_MODULES if m in names]


# A channel line: "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA" (older NCCL: "Ring 00 : ...").
_CHANNEL = re.compile(r"\b(?:Channel|Ring) \d+(?:/\d+)? : (\S+) -> (\S+)(?: \[(send|receive)\])? via (\S+)")
_NETWORK = re.compile(r"Using network (\S+)")
_VERSION = re.compile(r"NCCL version (\S+)")
_GDR = re.compile(r"GPU ?Direct RDMA[^\n]*?\b(enabled|disabled)\b", re.IGNORECASE)


def parse_nccl_log(text: str) -> dict:
    """What NCCL said it did, from its ``NCCL_DEBUG=INFO`` output.

    ``transports`` are the distinct ``via`` words of its channel lines (``P2P/IPC``,
    ``SHM/direct/direct``, ``NET/IB/0/GDRDMA``...); ``kinds`` their first parts (P2P, SHM,
    NET/IB, NET/Socket...). ``gdrdma_used`` is true only if a channel line says GDRDMA.
    """
    transports: set[str] = set()
    kinds: set[str] = set()
    gdr_lines: list[str] = []
    enabled: list[str] = []
    disabled: list[str] = []
    networks: set[str] = set()
    version = None
    for line in text.splitlines():
        m = _CHANNEL.search(line)
        if m:
            via = m.group(4)
            transports.add(via)
            parts = via.split("/")
            kinds.add("/".join(parts[:2]) if parts[0] in ("NET", "COLLNET") and len(parts) > 1 else parts[0])
            if "GDRDMA" in via:
                gdr_lines.append(line.strip())
        m = _NETWORK.search(line)
        if m:
            networks.add(m.group(1))
        m = _VERSION.search(line)
        if m and version is None:
            version = m.group(1)
        m = _GDR.search(line)
        if m:
            (enabled if m.group(1).lower() == "enabled" else disabled).append(line.strip())
    return {"nccl_version_logged": version, "network": sorted(networks), "transports": sorted(transports),
            "kinds": sorted(kinds), "gdrdma_used": bool(gdr_lines), "gdrdma_channel_lines": gdr_lines[:8],
            "gdr_enabled_lines": enabled[:8], "gdr_disabled_lines": disabled[:8]}


def nccl_probe(timeout: float = 90.0, numel: int = PROBE_NUMEL) -> dict:
    """Run a short all-reduce through ``allreduce://?backend=nccl`` with NCCL's debug log on.

    2 processes (one GPU each) if there are >= 2 GPUs, else 1 process of world size 1.
    Blocks up to ``timeout`` seconds; every process is stopped on return.
    """
    from commlab.launch import launcher
    from commlab.transport import store

    if not torch.cuda.is_available():
        return {"ran": False, "reason": cuda_facts().get("why_no_cuda", "no CUDA")}
    if nccl_version() is None:
        return {"ran": False, "reason": f"torch {torch.__version__} has no NCCL"}
    world = 2 if torch.cuda.device_count() >= 2 else 1
    here = str(Path(__file__).resolve().parents[2])  # the probe imports this very commlab
    hosted = store.host("127.0.0.1", timeout)  # every rank a client of a port already bound, as under run_job
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(hosted.port), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), PYTHONUNBUFFERED="1", **NCCL_DEBUG_ENV,
                PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    base[launcher.AGENT_STORE] = "True"
    procs: list[launcher.Proc] = []
    with scratch.folder("doctor") as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in range(world)]
        try:
            for r in range(world):
                argv = [sys.executable, "-m", "commlab.tools.doctor", "--probe-worker", "--numel", str(numel),
                        "--probe-timeout", str(timeout)]
                procs.append(launcher.spawn(f"rank {r}", argv, dict(base, RANK=str(r), LOCAL_RANK=str(r)), logs[r]))
            deadline = time.monotonic() + timeout
            while any(p.popen.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            stuck = [p.name for p in procs if p.popen.poll() is None]
        finally:
            launcher.stop_all(procs, grace=2.0)
        text = "\n".join(log.read_text(errors="replace") for log in logs)
    result: dict = {"ran": True, "world_size": world, "numel": numel, "env": dict(NCCL_DEBUG_ENV)}
    result.update(parse_nccl_log(text))
    answers = probe_answers(text)
    result["ok"] = len(answers) == world and all(a["correct"] for a in answers) and not stuck
    if stuck:
        result["error"] = f"{', '.join(stuck)} did not finish the probe within {timeout:g}s"
    elif not result["ok"]:
        bad = [p.name for p in procs if p.popen.returncode != 0]
        wrong = [f"rank {a['rank']}" for a in answers if not a["correct"]]
        tail = [line for line in text.splitlines() if PROBE_MARK not in line][-6:]
        result["error"] = ("wrong all-reduce result on " + ", ".join(wrong) if wrong else
                           f"{', '.join(bad) or 'a rank'} failed") + ": " + " | ".join(tail)
    return result


def probe_answers(text: str) -> list[dict]:
    """The probe workers' result lines. NCCL writes to the same stdout, so a marker may sit
    anywhere in a line, and a line NCCL broke into is skipped (the probe then counts it missing)."""
    answers = []
    for line in text.splitlines():
        if PROBE_MARK in line:
            try:
                answers.append(json.loads(line[line.index(PROBE_MARK) + len(PROBE_MARK):]))
            except ValueError:
                continue
    return answers


def _probe_worker(numel: int, timeout: float) -> int:
    """One rank of :func:`nccl_probe` (run as ``python -m commlab.tools.doctor --probe-worker``)."""
    from commlab.transport import rendezvous
    from commlab.regimes.allreduce import AllReduceExchanger, AllReduceOptions

    info = rendezvous.from_env()
    ex = AllReduceExchanger(AllReduceOptions(timeout=timeout, backend="nccl"), info)
    try:
        ex.meet()
        t = torch.full((numel,), float(info.rank + 1), device=torch.device("cuda", torch.cuda.current_device()))
        ex.allreduce_async(t, "doctor's NCCL probe").wait(timeout)
        expected = info.world_size * (info.world_size + 1) / 2
        correct = bool((t == expected).all().item())
        print(PROBE_MARK + json.dumps({"rank": info.rank, "correct": correct, "expected": expected,
                                       "first": t[0].item()}), flush=True)
    finally:
        ex.close()
    return 0


def transport_facts(run_nccl_probe: bool, probe_timeout: float = 90.0) -> dict:
    """Everything :func:`main` reports, as one JSON-able dict for a benchmark manifest.

    ``run_nccl_probe`` runs :func:`nccl_probe` (seconds, spawns processes) when CUDA and
    NCCL are there; without it, ``gpudirect_rdma.used`` stays None (not known), never True.
    """
    cuda = cuda_facts()
    facts: dict = {"host": socket.gethostname(), "kernel": platform.release(), "python": platform.python_version(),
                   "cuda": cuda, "topology": gpu_topology(), "nccl_version": nccl_version(),
                   "rdma_devices": rdma_devices(), "peer_memory_modules": peer_memory_modules()}
    probe = nccl_probe(probe_timeout) if run_nccl_probe else {"ran": False, "reason": "not asked for"}
    facts["nccl_probe"] = probe
    facts["gpudirect_rdma"] = gpudirect_verdict(probe, facts["rdma_devices"], facts["peer_memory_modules"],
                                                cuda["cuda_available"])
    facts["zmq_regimes"] = ZMQ_DATA_PATH
    return facts


def gpudirect_verdict(probe: dict, rdma: list, modules: list, cuda_available: bool) -> dict:
    """``used``: True only on NCCL's word (a GDRDMA channel line); None when the probe did not run."""
    if probe.get("ran") and probe.get("ok"):
        used: bool | None = probe["gdrdma_used"]
        if used:
            why = "NCCL's channel lines say GDRDMA"
        elif not any(k.startswith("NET") for k in probe["kinds"]):
            why = ("NCCL used no network transport (" + (", ".join(probe["kinds"]) or "a single rank")
                   + "), so GPUDirect RDMA did not come into play")
        else:
            why = "NCCL's network channels do not say GDRDMA: data went through host memory"
    elif not cuda_available:
        used, why = False, "no CUDA here"
    else:
        used = None
        state = f"failed ({probe.get('error')})" if probe.get("ran") else f"did not run ({probe.get('reason')})"
        why = f"the NCCL probe {state}"
    # "possible": an RDMA NIC and a peer-memory module are there. NCCL >= 2.19 can also reach
    # GPU memory through DMA-BUF without the module, which is why "used" is NCCL's word alone.
    return {"used": used, "why": why, "rdma_nic_and_peer_memory_module": bool(rdma) and bool(modules)}


def format_report(f: dict) -> str:
    """The human-readable form of :func:`transport_facts`."""
    cuda = f["cuda"]
    lines = [f"commlab doctor on {f['host']} (Linux {f['kernel']}, Python {f['python']})"]
    if cuda["cuda_available"]:
        lines.append(f"CUDA: yes, torch {cuda['torch']} built for CUDA {cuda['torch_cuda']}, driver {cuda['driver']}")
    else:
        lines.append(f"CUDA: NO. {cuda['why_no_cuda']}. Only CPU regimes can run here "
                     f"(allreduce://?backend=nccl and CUDA parameters cannot).")
        if cuda["driver"]:
            lines.append(f"  (an NVIDIA driver is installed: {cuda['driver']})")
    lines.append(f"GPUs: {cuda['gpu_count']}")
    lines += [f"  [{g['index']}] {g['name']}, compute {g['capability']}, {g['memory_gib']} GiB" for g in cuda["gpus"]]
    if f["topology"]:
        lines.append("topology (nvidia-smi topo -m):")
        lines += ["  " + line for line in f["topology"].splitlines()]
    else:
        lines.append("topology: nvidia-smi not found or failed")
    lines.append(f"NCCL: {f['nccl_version'] or 'not available (no CUDA, or torch without NCCL)'}")
    if f["rdma_devices"]:
        lines.append("RDMA devices (/sys/class/infiniband):")
        lines += [f"  {d['device']} port {d['port']}: {d['kind']}, {d['state']}, {d['rate']}" for d in f["rdma_devices"]]
    else:
        lines.append("RDMA devices: none (/sys/class/infiniband is empty or absent: no InfiniBand or RoCE)")
    mods = f["peer_memory_modules"]
    lines.append(f"peer-memory module: {', '.join(mods)} loaded" if mods else
                 f"peer-memory module: not loaded ({' / '.join(PEER_MEMORY_MODULES)} absent from /proc/modules)")
    p = f["nccl_probe"]
    if not p["ran"]:
        lines.append(f"NCCL probe: not run: {p['reason']}")
    else:
        state = "ok" if p["ok"] else f"FAILED: {p.get('error')}"
        lines.append(f"NCCL probe: all-reduce of {p['numel']} floats over {p['world_size']} process(es): {state}")
        lines.append(f"  network: {', '.join(p['network']) or '(none logged)'}; "
                     f"channels via: {', '.join(p['transports']) or '(none: one rank)'}")
        for line in (p["gdrdma_channel_lines"] + p["gdr_enabled_lines"] + p["gdr_disabled_lines"])[:6]:
            lines.append(f"  | {line}")
    g = f["gpudirect_rdma"]
    verdict = {True: "USED", False: "not used", None: "unknown"}[g["used"]]
    lines.append(f"GPUDirect RDMA: {verdict}: {g['why']}")
    lines.append(f"zmq regimes: {f['zmq_regimes']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="commlab doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the facts as JSON (what a benchmark manifest holds)")
    ap.add_argument("--no-probe", action="store_true", help="skip the NCCL all-reduce probe")
    ap.add_argument("--probe-timeout", type=float, default=90.0, help="seconds the probe may take")
    ap.add_argument("--probe-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, default=PROBE_NUMEL, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe_worker:
        return _probe_worker(a.numel, a.probe_timeout)
    facts = transport_facts(run_nccl_probe=not a.no_probe, probe_timeout=a.probe_timeout)
    print(json.dumps(facts, indent=2) if a.json else format_report(facts))
    probe = facts["nccl_probe"]
    return 1 if probe["ran"] and not probe["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
