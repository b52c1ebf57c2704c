"""Probes: what this machine does that a test must not assert (seconds, page-fault counts).

- :func:`heap_faults`: minor page faults per backward of a layer whose weight gradient is a fresh
  64 MiB tensor every step, with glibc's default heap and with commlab's kept heap
  (:func:`commlab.heap.keep_freed_memory`). The default maps and faults in every page anew.
- :func:`peer_loss`: seconds from a ring rank's death (SIGKILL, mid-collective) until each survivor's
  all-reduce raises, against the ring's timeout: a loss seen as a loss, not by running out the clock.

Each runs its processes as a group of its own with a deadline (:mod:`bench.jobs`) and returns a
dict for ``probes.json``; :func:`lines` words them for the report.

    python -m bench.probes            # both, printed as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from commlab import scratch
from bench.jobs import python, run_job, stop_groups, wait_all

GRAD_BYTES = 64 * 2**20
FAULTS = """
import json, resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from commlab.heap import keep_freed_memory
    assert keep_freed_memory(128 * 2**20)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
layer, x = torch.nn.Linear(4096, 4096), torch.randn(64, 4096)
counts = []
for _ in range(12):  # the weight gradient is a fresh 64 MiB tensor in every backward
    layer.weight.grad = layer.bias.grad = None
    before = faults()
    layer(x).sum().backward()
    counts.append(faults() - before)
print(json.dumps(counts))
"""


def heap_faults(timeout: float = 90.0) -> dict:
    """Page faults per backward, glibc's default heap against the kept one (12 backwards each)."""
    out = {"grad_bytes": GRAD_BYTES, "pages": GRAD_BYTES // 4096}
    with scratch.folder("probe") as tmp:
        for mode in ("system", "keep"):
            log = Path(tmp) / f"{mode}.log"
            res = run_job([python(), "-c", FAULTS, mode], log, timeout)
            lines = [l for l in log.read_text().splitlines() if l.startswith("[")]
            if not res.ok or not lines:
                return dict(out, error=f"{mode}: {res.error() or 'printed no counts'}")
            out[mode] = json.loads(lines[-1])
    return out


def _rank_peer_loss(a) -> int:
    """One ring rank: meet, all-reduce until the ring breaks; the victim kills itself mid-collective."""
    import torch

    import commlab
    from commlab.errors import CommError

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ex = commlab.connect(f"ring://?transport=tcp&timeout={a.timeout:g}&chunk_mb=1")
    ex.meet()
    x = torch.ones(4 * 2**20)
    for _ in range(3):
        ex.allreduce_async(x.fill_(1.0)).wait(a.timeout)
    Path(a.ready, str(rank)).touch()
    if rank == a.victim:
        deadline = time.monotonic() + a.timeout
        while len(os.listdir(a.ready)) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        handle = ex.allreduce_async(x.fill_(1.0))  # inside a collective
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
        handle.wait(a.timeout)
    started = time.monotonic()
    try:  # wait longer than the ring's own timeout: its error, which names the culprit, comes first
        while True:
            ex.allreduce_async(x.fill_(1.0)).wait(3 * a.timeout)
    except CommError as exc:
        result = {"error": type(exc).__name__, "names_victim": f"rank {a.victim}" in str(exc),
                  "seconds": time.monotonic() - started}
    Path(f"{a.out}.rank{rank}").write_text(json.dumps(result))
    os._exit(0)  # the ring's threads may still wait on a dead socket


def peer_loss(world: int = 3, victim: int = 1, timeout: float = 20.0, deadline: float = 90.0) -> dict:
    """Kill rank ``victim`` of a ``world``-rank ring mid-collective; how long each survivor took to raise."""
    from commlab import store as store_mod
    from commlab.launcher import AGENT_STORE

    out = {"world": world, "victim": victim, "timeout_s": timeout, "survivors": {}}
    with scratch.folder("probe") as tmp:
        ready = Path(tmp, "ready")
        ready.mkdir()
        # the rendezvous store, hosted here on port 0 as the launcher hosts it: every rank is a client.
        # Not launcher.run_job: it would stop the survivors the moment the victim dies, before they report.
        store = store_mod.host("127.0.0.1", deadline)
        root = str(Path(__file__).resolve().parent.parent)
        procs: list[subprocess.Popen] = []
        try:
            for r in range(world):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), **{AGENT_STORE: "True"},
                           PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
                procs.append(subprocess.Popen([python(), "-m", "bench.probes", "peer-loss-rank", "--ready", str(ready),
                                               "--victim", str(victim), "--timeout", str(timeout),
                                               "--out", str(Path(tmp, "loss"))], env=env, start_new_session=True,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_all(procs, deadline, f"peer-loss probe ({world} ranks)")
        except (TimeoutError, OSError) as exc:
            out["error"] = str(exc)
        finally:
            stop_groups(procs)
        for r in range(world):
            p = Path(tmp, f"loss.rank{r}")
            if r != victim and p.exists():
                out["survivors"][str(r)] = json.loads(p.read_text())
    return out


def lines(probes: dict) -> list[str]:
    """The report's words for what the probes measured."""
    out = []
    h = probes.get("heap")
    if h:
        if "error" in h:
            out.append(f"- Heap: the page-fault probe failed: {h['error']}")
        else:
            med = lambda v: statistics.median(v[2:])
            out.append(f"- Heap: a backward whose weight gradient is a fresh {h['grad_bytes'] >> 20} MiB tensor "
                       f"({h['pages']} pages) page-faulted {med(h['system']):.0f} times (median from the third step) "
                       f"with glibc's default heap, {med(h['keep']):.0f} with the kept heap "
                       f"(`commlab.heap.keep_freed_memory`); first step {h['system'][0]} / {h['keep'][0]}.")
    p = probes.get("peer_loss")
    if p:
        s = p["survivors"]
        if not s:
            out.append(f"- A killed ring rank: no survivor reported ({p.get('error', 'no result')}).")
        else:
            secs = [v["seconds"] for v in s.values()]
            kinds = sorted({v["error"] for v in s.values()})
            named = sum(v["names_victim"] for v in s.values())
            out.append(f"- A killed ring rank (rank {p['victim']} of {p['world']}, SIGKILL mid-all-reduce): "
                       f"{len(s)} of {p['world'] - 1} survivors raised {', '.join(kinds)} "
                       f"{min(secs):.2f}-{max(secs):.2f} s after entering the broken all-reduce (the victim died "
                       f"0.2 s into it; the ring's timeout: {p['timeout_s']:g} s), "
                       f"{named} naming rank {p['victim']}.")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes")
    p.add_argument("what", nargs="?", default="all", choices=("all", "heap", "peer-loss", "peer-loss-rank"))
    p.add_argument("--ready")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.what == "peer-loss-rank":
        return _rank_peer_loss(a)
    got = {}
    if a.what in ("all", "heap"):
        got["heap"] = heap_faults()
    if a.what in ("all", "peer-loss"):
        got["peer_loss"] = peer_loss()
    print(json.dumps(got, indent=1))
    print("\n".join(lines(got)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
