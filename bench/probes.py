"""Probes: what this machine does that a test must not assert (seconds, page-fault counts).

:func:`heap_faults` (page faults per backward, glibc's default heap against commlab's kept one),
:func:`peer_loss` (how fast the survivors of a SIGKILLed ring rank raise) and :func:`restart` (a rank
killed under ``commlab run --max-restarts 1``: time to resume, steps lost) each return a dict for
``probes.json``; :func:`lines` words them for the report. The heap and restart probes run launcher
jobs (:func:`bench.jobs.run`); the peer-loss probe starts its ranks itself, each a process group of
its own, killed with :func:`commlab.launch.launcher.kill_groups` at its end (a launcher job would stop the
survivors the moment the victim dies, before they report).

:func:`keepgoing` (issue 38's detection and heal goals; not in ``all``: runs of a minute or more each)
runs ``commlab run --replace`` (or ``--spares 1``) of :mod:`bench.chaos_worker` over
``ps://?shards=2&mode=sync&update=server&min_workers=2`` with 3 workers; rank 1 sends itself SIGKILL or
SIGSTOP at the top of a step, and the figures come from the ranks' wall-clock step logs, read and
accounted by :mod:`bench.chaos` (the chaos bench's own functions): seconds from the signal to the
survivors' next step, and after a kill to the replacement's first step, beside a plain process start
timed in the same run. A table on stdout, the JSON with ``--out``.

    python -m bench.probes            # heap, peer-loss, restart, handshake, printed as JSON
    python -m bench.probes keepgoing [--signal kill|stop] [--heal replace|spares] [--runs 3] [--model mlp-25m]
"""

from __future__ import annotations

import argparse
import itertools
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


# ----- keep-going: a worker killed or frozen in a ps:// job that goes on (issue 38's detection and heal goals) -----

KEEPGOING_URL = "ps://?shards=2&mode=sync&update=server&min_workers=2"
KEEPGOING_WORKERS, KEEPGOING_VICTIM = 3, 1
# issue 38: the survivors' next step within 0.5 s of a kill -9 (its connections close at once), within
# heartbeat_s + 0.5 s of a SIGSTOP; a replacement healed within 3 s of the kill with --spares 1 (without
# spares: reported beside a plain process start)
NEXT_STEP_GOAL_S, HEAL_SPARES_GOAL_S = 0.5, 3.0
START = "import torch, commlab"  # what a plain process start pays before a replacement's own work


def keepgoing_args(a) -> None:
    """ValueError (one line naming the option) for options the keep-going probe cannot run with."""
    from workers.models import MODELS

    if a.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {a.runs}")
    if a.kill_at is not None and a.kill_at < 1:
        raise ValueError(f"--kill-at must be >= 1 (every rank takes a step first), got {a.kill_at}")
    if a.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {a.model!r}")
    if not 0.1 <= a.heartbeat_s <= 60:
        raise ValueError(f"--heartbeat-s must be in [0.1, 60] seconds, got {a.heartbeat_s:g}")
    if a.deadline <= 0:
        raise ValueError(f"--deadline must be > 0 seconds, got {a.deadline:g}")
    if not 0 <= a.step_sleep <= 10:
        raise ValueError(f"--step-sleep must be in [0, 10] seconds, got {a.step_sleep:g}")


def process_start(timeout: float = 120.0) -> float | None:
    """Seconds a plain process takes to start and import torch and commlab (``python -c START``), started as
    the job's processes are (:func:`commlab.launch.launcher.start_group`, its starter); None if it failed."""
    from bench.chaos import env_of

    t = time.monotonic()
    p = launcher.start_group([sys.executable, "-c", START], env_of(None), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        launcher.kill_groups([p], grace=0)
    return time.monotonic() - t if code == 0 else None


def keepgoing_run(folder: Path, sig: str, heal: str, model: str, kill_at: int, url: str, deadline: float,
                  step_sleep: float = 0.0) -> dict:
    """One job: ``commlab run --workers 3 --replace`` (or ``--spares 1``) of :mod:`bench.chaos_worker` under
    ``url``; rank 1 sends itself SIGKILL or SIGSTOP at the top of step ``kill_at`` (before its forward, so the
    survivors' step ``kill_at`` cannot complete before its loss is seen). Stopped once the survivors logged
    that step (and, after a kill, the replacement its first); then a plain process start is timed. Figures
    from the ranks' wall-clock step logs (:func:`bench.chaos.account`). ``step_sleep``: seconds each step
    sleeps before its exchange (the smoke test's tiny model: its steps would outrun the replacement's entry)."""
    from bench import chaos

    a = argparse.Namespace(workers=KEEPGOING_WORKERS, model=model, batch_size=32, lr=0.05,
                           spares=1 if heal == "spares" else 0)
    e = chaos.Entry("commlab", url, True, folder)
    out: dict = {}
    kill: dict | None = None
    chaos.start_commlab(e, a, None, 0, ["--signal-at", str(kill_at), "--signal-slot", str(KEEPGOING_VICTIM),
                                        "--signal", sig, "--step-sleep", str(step_sleep)])
    try:
        until = time.monotonic() + deadline
        while True:
            recs = chaos.read_steps(folder)
            sent = next((r for r in recs if r.get("ev") == "signal"), None)
            if sent is not None and kill is None:
                kill = {"t": sent["t"], "pid": sent["pid"], "step": sent["step"],
                        **({"slot": sent["slot"]} if sig == "kill" else {})}  # a frozen process is not replaced
            if kill is not None and chaos.settled(recs, [kill]):
                break
            if e.procs[0].poll() is not None:
                raise RuntimeError(f"the job ended (exit {e.procs[0].returncode}) first: {chaos.last_line(e)}")
            if time.monotonic() > until:
                who = "no rank signalled itself" if kill is None else "the survivors or the replacement did not step"
                raise RuntimeError(f"{who} within --deadline {deadline:g}s: {chaos.last_line(e)}")
            time.sleep(0.05)
    except RuntimeError as exc:
        out["error"] = str(exc)
    finally:
        if kill is not None and sig == "stop":  # frozen: it would hold its SIGTERM until the launcher's SIGKILL
            try:
                os.kill(kill["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.kill_groups(e.procs, grace=10)
    out["process_start_s"] = process_start()
    out["load"] = list(os.getloadavg())
    recs = chaos.read_steps(folder)
    t0 = chaos.training_start(recs, KEEPGOING_WORKERS)
    if kill is None or t0 is None:
        return out
    last = max(r["t"] for r in recs)
    (row,) = chaos.account(recs, [kill], t0, max(1.0, last - t0 + 1.0))["kills"]
    steps = [r for r in recs if r.get("ev") == "step" and chaos.held_up(r, kill)]
    survivors = [r for r in steps if r["slot"] != KEEPGOING_VICTIM]
    new = [r for r in steps if r["slot"] == KEEPGOING_VICTIM and r.get("samples", 0) > 0]
    first = lambda rs: min(rs, key=lambda r: r["t"]) if rs else None
    nxt, healed = first(survivors), first(new)
    # the survivors' own step time before the signal: what a next step takes with nobody lost
    gaps = [y["t"] - x["t"] for slot in range(KEEPGOING_WORKERS) if slot != KEEPGOING_VICTIM
            for x, y in itertools.pairwise(sorted((r for r in recs if r.get("ev") == "step" and r["slot"] == slot
                                                   and r["t"] < kill["t"]), key=lambda r: r["t"]))]
    out.update(signal_step=kill["step"], victim_pid=kill["pid"], next_step_s=row["next_step_s"],
               next_step=nxt and nxt["step"], next_step_slot=nxt and nxt["slot"],
               step_s_before=statistics.median(gaps) if gaps else None)
    if sig == "kill":
        out.update(heal_s=row.get("heal_s"), entered_at=healed and healed["step"],
                   replacement_pid=healed and healed["pid"])
    return out


def keepgoing(sig: str = "kill", heal: str = "replace", runs: int = 3, model: str = "mlp", kill_at: int = 20,
              heartbeat_s: float = 1.0, deadline: float = 300.0, step_sleep: float = 0.0, progress=None) -> dict:
    """Issue 38's detection and heal goals, ``runs`` jobs one after the other (:func:`keepgoing_run`): per run
    the seconds from the signal to the survivors' next step (goal: 0.5 s after a kill, heartbeat_s + 0.5 s
    after a SIGSTOP), and after a kill the seconds to the replacement's first step (goal with spares: 3 s),
    beside a plain process start (interpreter, torch, commlab) timed after the job."""
    from workers.models import MODELS

    url = KEEPGOING_URL + (f"&heartbeat_s={heartbeat_s:g}" if sig == "stop" else "")
    goal = NEXT_STEP_GOAL_S + (heartbeat_s if sig == "stop" else 0.0)
    doc = {"signal": sig, "heal": heal, "url": url, "workers": KEEPGOING_WORKERS, "victim": KEEPGOING_VICTIM,
           "kill_at": kill_at, "model": model, "model_is": MODELS[model][2], "heartbeat_s": heartbeat_s if sig == "stop"
           else None, "step_sleep_s": step_sleep, "next_step_goal_s": goal, "heal_goal_s": HEAL_SPARES_GOAL_S if heal == "spares" else None,
           "command": f"commlab run --workers {KEEPGOING_WORKERS} {'--spares 1' if heal == 'spares' else '--replace'} "
                      f"--exchanger '{url}' -m bench.chaos_worker -- --log DIR --model {model} --batch-size 32 "
                      f"--lr 0.05 --signal-at {kill_at} --step-sleep {step_sleep:g} "
                      f"--signal-slot {KEEPGOING_VICTIM} --signal {sig}", "runs": []}
    for i in range(runs):
        with scratch.folder("probe") as tmp:
            run = dict(run=i + 1, **keepgoing_run(Path(tmp), sig, heal, model, kill_at, url, deadline, step_sleep))
        doc["runs"].append(run)
        if progress:
            progress(f"keepgoing run {i + 1}/{runs}: " + ", ".join(f"{k} {v}" for k, v in run.items() if k != "run"))
    return doc


def keepgoing_table(doc: dict) -> list[str]:
    """The probe's runs as a markdown table, with its goals."""
    from bench.text import fmt, table

    kill = doc["signal"] == "kill"
    rows = []
    for r in doc["runs"]:
        rows.append([str(r["run"]), fmt(r.get("signal_step")), fmt(r.get("next_step_s"), 3), fmt(r.get("next_step")),
                     fmt(r.get("step_s_before"), 3),
                     *([fmt(r.get("heal_s"), 3), fmt(r.get("entered_at"))] if kill else []),
                     fmt(r.get("process_start_s"), 3), " ".join(f"{x:.1f}" for x in r.get("load", [])),
                     r.get("error", "")])
    heal_goal = f" (goal <= {doc['heal_goal_s']:g})" if doc["heal_goal_s"] else " (beside a plain start)"
    head = ["run", "signal at step", f"signal → survivors' next step, s (goal <= {doc['next_step_goal_s']:g})",
            "that step", "survivors' step before, median s",
            *([f"kill → replacement's first step, s{heal_goal}", "entered at step"] if kill else []),
            f"plain process start (`{START}`), s", "load 1/5/15 min", "error"]
    said = (f"{doc['workers']} workers, rank {doc['victim']} sends itself SIG{doc['signal'].upper()} at the top of step "
            f"{doc['kill_at']}; `{doc['command']}`; model {doc['model']} ({doc['model_is']}), batch 32")
    return [said, ""] + table(head, rows)


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
                   choices=("all", "heap", "peer-loss", "peer-loss-rank", "restart", "restart-rank", "handshake",
                            "keepgoing"))
    p.add_argument("--ready")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--out", help="keepgoing: write its JSON here")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, help="the step at which the victim is killed (restart: 25; keepgoing: 20)")
    p.add_argument("--every", type=int, default=10)
    g = p.add_argument_group("keepgoing")
    g.add_argument("--signal", choices=("kill", "stop"), default="kill", help="SIGKILL, or SIGSTOP (heartbeat_s)")
    g.add_argument("--heal", choices=("replace", "spares"), default="replace", help="commlab run --replace / --spares 1")
    g.add_argument("--runs", type=int, default=3)
    g.add_argument("--model", default="mlp", help="workers/models.py's (mlp: 1.9M parameters; mlp-25m; tiny)")
    g.add_argument("--heartbeat-s", type=float, default=1.0, help="with --signal stop: the URL's heartbeat_s")
    g.add_argument("--deadline", type=float, default=300.0, help="seconds one run may take")
    g.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (a tiny model's stand-in "
                                                                 "for compute)")
    a = p.parse_args(argv)
    if a.what == "peer-loss-rank":
        return _rank_peer_loss(a)
    if a.what == "restart-rank":
        return _rank_restart(a)
    if a.what == "keepgoing":
        try:
            keepgoing_args(a)
        except ValueError as exc:
            print(f"python -m bench.probes keepgoing: {exc}", file=sys.stderr)
            return 2
        doc = keepgoing(a.signal, a.heal, a.runs, a.model, a.kill_at or 20, a.heartbeat_s, a.deadline, a.step_sleep,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
        print("\n".join(keepgoing_table(doc)))
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1))
            print(f"wrote {a.out}", file=sys.stderr)
        return 1 if any("error" in r for r in doc["runs"]) else 0
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
