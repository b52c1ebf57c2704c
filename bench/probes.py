"""Probes: what this machine does that a test must not assert (seconds, page-fault counts).

:func:`heap_faults` (page faults per backward, glibc's default heap against commlab's kept one),
:func:`peer_loss` (how fast the survivors of a SIGKILLed ring rank raise) and :func:`restart` (a rank
killed under ``commlab run --max-restarts 1``: time to resume, steps lost) each return a dict for
``probes.json``; :func:`lines` words them for the report. The heap and restart probes run launcher
jobs (:func:`bench.jobs.run`); the peer-loss probe starts its ranks itself, each a process group of
its own, killed with :func:`commlab.launch.launcher.kill_groups` at its end (a launcher job would stop the
survivors the moment the victim dies, before they report).

    python -m bench.probes            # all three, printed as JSON
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

from bench import jobs
from commlab.launch import launcher, scratch

GRAD_BYTES = 64 * 2**20
FAULTS = """
import json, resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from commlab.core.heap import keep_freed_memory
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
            res = jobs.run(launcher.Job(("-c", FAULTS), (mode,), name=f"heap probe {mode}"), log, timeout)
            lines = [l for l in log.read_text().splitlines() if l.startswith("[")]
            if not res.ok or not lines:
                return dict(out, error=f"{mode}: {res.error() or 'printed no counts'}")
            out[mode] = json.loads(lines[-1])
    return out


def _rank_peer_loss(a) -> int:
    """One ring rank: meet, all-reduce until the ring breaks; the victim kills itself mid-collective."""
    import torch

    import commlab
    from commlab.base.errors import CommError

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
    from commlab.transport import store as store_mod

    out = {"world": world, "victim": victim, "timeout_s": timeout, "survivors": {}}
    with scratch.folder("probe") as tmp:
        ready = Path(tmp, "ready")
        ready.mkdir()
        # the rendezvous store, hosted here on port 0 as the launcher hosts it: every rank is a client.
        # Not a launcher job: it would stop the survivors the moment the victim dies, before they report.
        store = store_mod.host("127.0.0.1", deadline)
        procs: list[subprocess.Popen] = []
        try:
            for r in range(world):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), **{launcher.AGENT_STORE: "True"},
                           PYTHONPATH=os.pathsep.join(p for p in (str(jobs.ROOT), os.environ.get("PYTHONPATH")) if p))
                procs.append(launcher.start_group(
                    [sys.executable, "-m", "bench.probes", "peer-loss-rank", "--ready", str(ready), "--victim",
                     str(victim), "--timeout", str(timeout), "--out", str(Path(tmp, "loss"))], env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            until = time.monotonic() + deadline
            for p in procs:
                p.wait(max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            out["error"] = f"peer-loss probe ({world} ranks) did not finish within {deadline:g}s; its processes were killed"
        except OSError as exc:
            out["error"] = str(exc)
        finally:
            launcher.kill_groups(procs, grace=0)
        for r in range(world):
            p = Path(tmp, f"loss.rank{r}")
            if r != victim and p.exists():
                out["survivors"][str(r)] = json.loads(p.read_text())
    return out


RESTART_URLS = {"ps-server": "ps://?shards=1&mode=sync&update=server", "ring": "ring://?transport=tcp"}


def _rank_restart(a) -> int:
    """One rank of the restart probe: an MLP for ``a.steps`` steps from where the job's state says (the
    servers' ``ex.start_step``, else a checkpoint rank 0 writes every ``a.every`` steps); a line per step
    done (attempt, step, wall-clock time); the victim, on attempt 0, notes the time and SIGKILLs itself
    when it reaches ``a.kill_at``."""
    import torch
    from torch import nn

    import commlab

    torch.set_num_threads(1)
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ex = commlab.connect()
    ex.setup(model, opt)
    start, ckpt = ex.start_step, Path(a.out, "ckpt.pt")
    if not ex.keeps_state and attempt > 0 and ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    log = Path(a.out, f"steps.rank{rank}")
    for step in range(start, a.steps):
        if attempt == 0 and rank == a.victim and step == a.kill_at:
            Path(a.out, "killed").write_text(json.dumps({"t": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(64, 256, generator=g)
        ex.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
        if not ex.keeps_state and rank == 0 and (step + 1) % a.every == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1}, f"{ckpt}.tmp")
            os.replace(f"{ckpt}.tmp", ckpt)
        with log.open("a") as fh:
            fh.write(json.dumps({"attempt": attempt, "step": step, "t": time.time()}) + "\n")
    ex.close()
    return 0


def restart(steps: int = 40, kill_at: int = 25, every: int = 10, timeout: float = 150.0) -> dict:
    """Per regime of :data:`RESTART_URLS`: 2 ranks under ``commlab run --max-restarts 1``, rank 1 killed
    when it reaches step ``kill_at``; seconds from the kill to the first step done after the restart, and
    the steps lost (done before the kill by every rank, and done again)."""
    out = {"steps": steps, "kill_at": kill_at, "checkpoint_every": every, "regimes": {}}
    for name, url in RESTART_URLS.items():
        with scratch.folder("probe") as tmp:
            job = launcher.Job(("-m", "bench.probes"), ("restart-rank", "--out", tmp, "--steps", str(steps),
                                                         "--kill-at", str(kill_at), "--every", str(every)),
                               2, url, max_restarts=1, name=f"restart probe {name}")
            res = jobs.run(job, Path(tmp, "job.log"), timeout)
            killed = Path(tmp, "killed")
            if not res.ok or not killed.exists():
                out["regimes"][name] = {"url": url, "error": res.error() or "no rank was killed"}
                continue
            kill = json.loads(killed.read_text())
            per_rank = [[json.loads(line) for line in Path(tmp, f"steps.rank{r}").read_text().splitlines()]
                        for r in range(2)]
            # a step is done once every rank has done it: before the kill, the fewest any rank did
            done = min(sum(1 for row in rows if row["attempt"] == 0) for rows in per_rank)
            after = sorted((row for rows in per_rank for row in rows if row["attempt"] == 1), key=lambda row: row["t"])
            resumed = min(row["step"] for row in after)
            out["regimes"][name] = {"url": url, "kill_to_first_step_s": after[0]["t"] - kill["t"],
                                    "resumed_at": resumed, "done_before_kill": done, "steps_lost": done - resumed}
    return out


def handshake(tries: int = 200) -> dict:
    """What the job's secret costs a ``ps://`` connection (issue 35: at most 5 ms): against one server on
    loopback, taking turns, a fresh connection plus the mutual handshake (two round trips) beside a fresh
    connection plus one refused request (one round trip, no proof); and the handshake's own work (both sides'
    HMACs) in this process. Medians and 90th percentiles in ms."""
    import zmq

    from commlab.transport import auth, sockets, wire
    env = dict(os.environ)
    env.setdefault(auth.SECRET_ENV, os.urandom(24).hex())
    secret = auth.load(env)
    p = launcher.spawn("server", [sys.executable, "-m", "servers", "--bind", "tcp://127.0.0.1:0", "--log-every", "0"],
                       env, None, report_endpoint=True)
    tp = sockets.Transport()
    proved: list[float] = []
    refused: list[float] = []
    try:
        endpoint = launcher.await_endpoints([p], 60)[0]
        for _ in range(tries):
            t0 = time.perf_counter()
            sock = tp.connect(zmq.DEALER, endpoint)
            sockets.handshake(sock, secret, "rank0", "server", 10)
            proved.append(time.perf_counter() - t0)
            sock.close(0)
            t0 = time.perf_counter()
            sock = tp.connect(zmq.DEALER, endpoint)
            sockets.send(sock, wire.encode("stats", "rank0", -1, (), {"id": 1}), timeout=10)
            sockets.recv(sock, 10, "server")
            refused.append(time.perf_counter() - t0)
            sock.close(0)
    finally:
        launcher.stop_all([p], grace=0)
        tp.close()
    work: list[float] = []
    for _ in range(tries):  # both sides' messages, in one process: the cryptography alone
        t0 = time.perf_counter()
        a, b = auth.Initiator(secret, "rank0", "server"), auth.Responder(secret, "server")
        a.done(b.check(a.prove(b.challenge(a.hello()))))
        work.append(time.perf_counter() - t0)
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))] * 1e3
    return {"tries": tries, **{f"{k}_ms": {"median": q(v, 0.5), "p90": q(v, 0.9)}
                               for k, v in (("connect_and_handshake", proved), ("connect_and_one_request", refused),
                                            ("handshake_work", work))}}


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
                       f"(`commlab.core.heap.keep_freed_memory`); first step {h['system'][0]} / {h['keep'][0]}.")
    r = probes.get("restart")
    for name, v in (r or {}).get("regimes", {}).items():
        if "error" in v:
            out.append(f"- A restarted job ({v['url']}): the probe failed: {v['error']}")
        else:
            out.append(f"- A rank killed at step {r['kill_at']} under `commlab run --max-restarts 1`, {v['url']}: "
                       f"the first step after the restart came {v['kill_to_first_step_s']:.2f} s after the kill; "
                       f"resumed at step {v['resumed_at']} of {v['done_before_kill']} done, "
                       f"{v['steps_lost']} step(s) lost" + (f" (a checkpoint every {r['checkpoint_every']} steps)"
                                                            if not v["url"].startswith("ps://") else "") + ".")
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
    p.add_argument("what", nargs="?", default="all",
                   choices=("all", "heap", "peer-loss", "peer-loss-rank", "restart", "restart-rank", "handshake"))
    p.add_argument("--ready")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=25)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args(argv)
    if a.what == "peer-loss-rank":
        return _rank_peer_loss(a)
    if a.what == "restart-rank":
        return _rank_restart(a)
    got = {}
    if a.what in ("all", "heap"):
        got["heap"] = heap_faults()
    if a.what in ("all", "peer-loss"):
        got["peer_loss"] = peer_loss()
    if a.what in ("all", "restart"):
        got["restart"] = restart()
    if a.what in ("all", "handshake"):
        got["handshake"] = handshake()
    print(json.dumps(got, indent=1))
    print("\n".join(lines(got)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
