"""``manifest.json``: exactly what ran, where, with what; enough to rerun it and to doubt it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "pyzmq", "msgpack", "numpy", "matplotlib", "tqdm")


def git_facts() -> dict:
    def git(*args):
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    return {"revision": git("rev-parse", "HEAD") or "unknown", "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _proc_value(path: str, key: str) -> str | None:
    """The value of the first ``KEY: value`` line of a /proc file; None where there is none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


def environment() -> dict:
    pkgs = {}
    for name in PACKAGES:
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pkgs[name] = None
    try:
        import zmq
        pkgs["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    cpu = _proc_value("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    mem = int((_proc_value("/proc/meminfo", "MemTotal") or "0 kB").split()[0]) / 2**20
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpu": cpu,
            "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "memory_gib": mem,
            "packages": pkgs}


def transport(links, link_note: str | None, regime_facts: dict) -> dict:
    """CUDA/NCCL facts, GPUDirect RDMA only on NCCL's own word, and what carried the traffic."""
    import torch
    from commlab.tools.doctor import nccl_version

    cuda = torch.cuda.is_available()
    nccl = nccl_version()
    said = [f["nccl_log"] for f in regime_facts.values() if isinstance(f, dict) and "nccl_log" in f]
    if said:
        gdr = any(s["gdrdma_used"] for s in said)
        gdr_text = ("yes, NCCL said so" if gdr else "no, NCCL reported no GPUDirect RDMA path")
    elif not cuda:
        gdr_text = "no (no CUDA here, NCCL did not run)"
    else:
        gdr_text = "unknown (NCCL did not run in this benchmark)"
    facts = {"cuda": cuda, "cuda_devices": torch.cuda.device_count() if cuda else 0, "nccl_version": nccl,
             "gpudirect_rdma": gdr_text, "nccl_said": said,
             "link": links.facts()["link"] + f", tbf {links.rate} each way per rank" if links else "loopback (127.0.0.1), one host",
             "link_facts": links.facts() if links else None}
    if link_note:
        facts["link_note"] = link_note
    return facts
