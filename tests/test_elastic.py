"""A job that shrinks and grows (issue 28, item 4): ps://?mode=sync&update=server beside ranks started with
the environment torchrun's elastic agent gives them (``--nnodes 1:2``, c10d rendezvous): one store that
outlives every round (here a store process of its own, as the first agent's), ``TORCHELASTIC_USE_AGENT_STORE``,
and a ``TORCHELASTIC_RESTART_COUNT`` that does not tell rounds apart (a membership change leaves it, a joining
agent starts at 0). The harness plays the agents: it starts each round's ranks and stops the old ones.

The ranks agree on a round number through the store; the servers take a new round's membership (a sync step
averages over the new N) and drop the departed rank's half-pushed step, counted. The script's model has a
closed form (tests/elastic_script.py): each applied step moves ``w`` by ``0.01 * N * mean(1..N)``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import faultkit
from test_restart import _leftovers

pytestmark = pytest.mark.multiproc

SCRIPT = str(Path(__file__).resolve().parent / "elastic_script.py")
STEPS = 12


def _rank(procs, tmp_path: Path, url: str, store_port: int, rank: int, world: int, restart_count: int,
          **env) -> subprocess.Popen:
    """One rank as torchrun's agent starts it."""
    env = {**faultkit.AGENT_ENV, "RANK": rank, "LOCAL_RANK": 0, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": 1,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": store_port, "TORCHELASTIC_RESTART_COUNT": restart_count,
           "TORCHELASTIC_RUN_ID": "elastic", "COMMLAB_EXCHANGER": url, "OMP_NUM_THREADS": 1, "TMPDIR": tmp_path / "tmp", **env}
    return procs.popen([sys.executable, SCRIPT, str(tmp_path / "out"), str(STEPS)], {k: str(v) for k, v in env.items()},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until(server, what: str, ok, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = server.stats()
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"{what} never happened: {st}"
        time.sleep(0.05)


def _stop(p: subprocess.Popen, sig: int) -> None:
    p.send_signal(sig)
    p.communicate(timeout=30)


def _json(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "out" / name).read_text())


def _rounds(out: Path) -> list[list[dict]]:
    """The ranks' start records, grouped by attempt id in the order of the ids (each sorted by rank)."""
    starts = [json.loads(p.read_text()) | {"rank": int(p.name.split(".")[2])} for p in out.glob("start.*")]
    ids = sorted({s["attempt"] for s in starts})
    return [sorted((s for s in starts if s["attempt"] == a), key=lambda s: s["rank"]) for a in ids]


def _check_end(out: Path, attempt: int, want: torch.Tensor, ranks=(0, 1), **counts) -> None:
    """Every rank of the last attempt holds ``want``, and the shard's counters are ``counts``."""
    for r in ranks:
        end = json.loads((out / f"end.{attempt}.{r}.json").read_text())
        assert torch.allclose(torch.tensor(end["params"]), want, atol=1e-6), (r, end["params"], want)
        shard = end["servers"][0]
        assert {k: shard[k] for k in [*counts, "attempt"]} == dict(counts, attempt=attempt), shard


def _job(tmp_path: Path, procs, options: str, mode: str = "sync") -> tuple[Path, "faultkit.Server", str, int]:
    """The records' folder, a server of ``mode`` (ssp: staleness 1), the ranks' URL (with ``options``) and a
    store that outlives rounds."""
    for d in ("out", "tmp"):
        (tmp_path / d).mkdir()
    server = procs.server("--mode", mode, "--staleness", "1")
    url = f"ps://{server.address}?mode={mode}&update=server&{options}"
    return tmp_path / "out", server, url, procs.store("127.0.0.1")


def _w0() -> torch.Tensor:
    torch.manual_seed(0)
    return nn.Linear(3, 1, bias=False).weight.detach().view(-1)


def test_a_round_id_is_agreed_past_a_dead_rounds_keys_and_above_its_id():
    """The store still holds a dead round's keys (rank 1's nonce, the id it took, rank 0's answer to it, and an
    id from a clock ahead of this one); rank 1 asks 0.3 s after rank 0 has read them. Both take the same id,
    above the dead round's."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from commlab.transport.rendezvous import RankInfo, agree_round

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    dead = 10 ** 13  # a dead round's id from a clock far ahead
    for key, value in {"ask/1": "stale", "took/1": str(dead), "give/1": f"stale {dead}", "last": str(dead)}.items():
        store.set(f"commlab/round/{key}", value)
    got = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        got[r] = agree_round(dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10)),
                             RankInfo(r, 2, r, "127.0.0.1", store.port, "test"), 10)

    threads = [threading.Thread(target=rank, args=(r, 0.3 * r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {0: dead + 1, 1: dead + 1}


def test_a_job_shrinks_to_one_rank_and_grows_back_each_step_applied_once_over_its_own_n(tmp_path, procs):
    """Round 0, N = 2: rank 1 pushes step 4 and is gone for good before rank 0, held, pushed it. Round 1,
    N = 1 (restart count 1): resumes at step 4 (rank 1's half of step 4 dropped, counted as replaced); the
    round-0 rank 0, let go now, is refused in one line naming both attempts; round 1 runs to step 8, when
    the harness stops it (an agent joined). Round 2, N = 2 again, restart counts 1 and 0: resumes at 8 and
    finishes. 12 updates, w = w0 - 0.01 * (4 * 2 * 1.5 + 4 * 1 * 1 + 4 * 2 * 1.5) on every rank."""
    shm_before = set(os.listdir("/dev/shm"))
    out, server, url, store = _job(tmp_path, procs, "timeout=30")

    zombie = _rank(procs, tmp_path, url, store, 0, 2, 0, HOLD="2:4", COMMLAB_EXCHANGER=url.replace("=30", "=5"))
    victim = _rank(procs, tmp_path, url, store, 1, 2, 0)
    _until(server, "rank 1's push of step 4 alone", lambda s: s["sync_step"] == 4 and s["pushes"] == 9
           and s["waiting_for"] == [0])
    _stop(victim, signal.SIGKILL)

    alone = _rank(procs, tmp_path, url, store, 0, 1, 1, HOLD="1:8")
    _until(server, "round 1's steps 4..7", lambda s: s["sync_step"] == 8 and s["world"] == 1)
    (out / "go.2.4").touch()
    _, err = zombie.communicate(timeout=60)
    (first, _), (second,) = _rounds(out)
    assert zombie.returncode != 0
    assert err.strip().splitlines()[-1].endswith(
        f"hello from rank0 of attempt {first['attempt']}: the job on shard 0/1 is at attempt {second['attempt']} (a "
        f"process of an earlier attempt, or a store that forgot the job's rounds)"), err[-3000:]
    _stop(alone, signal.SIGTERM)

    grown = [_rank(procs, tmp_path, url, store, 0, 2, 1), _rank(procs, tmp_path, url, store, 1, 2, 0)]
    for p in grown:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]

    rounds = _rounds(out)
    assert [[(s["rank"], s["world"], s["start_step"]) for s in ranks] for ranks in rounds] == [
        [(0, 2, 0), (1, 2, 0)], [(0, 1, 4)], [(0, 2, 8), (1, 2, 8)]]
    w0 = _w0()
    assert torch.allclose(torch.tensor(rounds[1][0]["params"]), w0 - 0.01 * 4 * 2 * 1.5, atol=1e-6)
    for s in rounds[2]:
        assert torch.allclose(torch.tensor(s["params"]), w0 - 0.01 * (12 + 4), atol=1e-6), s
    _check_end(out, rounds[2][0]["attempt"], w0 - 0.01 * (12 + 4 + 12), updates=STEPS, replaced=1, resized=2, world=2)
    assert not _leftovers(tmp_path, shm_before)


# the rendezvous on a store none of the agents hosts (so any may go), a short last call; torch's default keep-alive
# (a tighter one declared a busy live agent dead on this 2-core machine)
def test_ssp_counts_the_new_membership_so_a_departed_slow_rank_holds_nobody_back(tmp_path, procs):
    """ssp, staleness 1. Round 0, N = 2: rank 1 stops before step 2, rank 0 runs to its bound (pushes 0..3,
    then its pull waits for rank 1), and both go (rank 1 for good). Round 1, N = 1: the survivor resumes at
    4 and finishes alone: the departed rank's clock (2) is no longer the slowest, or it would wait forever.
    Every push applied once: w = w0 - 0.02 * (4 * 1 + 2 * 2) - 0.01 * 8 * 1, 14 updates."""
    shm_before = set(os.listdir("/dev/shm"))
    out, server, url, store = _job(tmp_path, procs, "timeout=30", mode="ssp")
    first = [_rank(procs, tmp_path, url, store, 0, 2, 0), _rank(procs, tmp_path, url, store, 1, 2, 0, HOLD="2:2")]
    _until(server, "rank 0 at its bound, rank 1 before step 2", lambda s: s["updates"] == 6 and s["waiting_for"] == [1])
    for p in first:
        _stop(p, signal.SIGKILL)
    alone = _rank(procs, tmp_path, url, store, 0, 1, 1)
    _, err = alone.communicate(timeout=120)
    assert alone.returncode == 0, err[-3000:]
    rounds = _rounds(out)
    assert [[(s["rank"], s["world"], s["start_step"]) for s in ranks] for ranks in rounds] == [
        [(0, 2, 0), (1, 2, 0)], [(0, 1, 4)]], rounds
    _check_end(out, rounds[1][0]["attempt"], _w0() - 0.02 * (4 + 4) - 0.01 * 8, ranks=(0,), updates=4 + 2 + 8,
               replaced=0, resized=1, world=1)
    assert not _leftovers(tmp_path, shm_before)


RDZV_CONF = "is_host=false,join_timeout=90,last_call_timeout=3,close_timeout=5"


def _agent(procs, tmp_path: Path, url: str, rdzv_port: int, name: str, **env) -> subprocess.Popen:
    """One torchrun agent of ``--nnodes 1:2`` x 1 rank; its output in ``name``.log. Its ranks' store is rank 0's
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with the agent's shared store, torch 2.13's agent that joins a later
    round as group rank 1 waits for a MASTER_PORT the rank-0 agent wrote only in its first round."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "3", "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{rdzv_port}", "--rdzv-id", "elastic", "--rdzv-conf", RDZV_CONF,
            SCRIPT, str(tmp_path / "out"), str(STEPS)]
    env = {"COMMLAB_EXCHANGER": url, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp"),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    with open(tmp_path / f"{name}.log", "w") as log:
        return procs.popen(argv, env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for(path: Path, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


@pytest.mark.full
def test_under_torchrun_elastic_a_departed_agent_shrinks_the_job_and_a_joining_one_grows_it(tmp_path, procs):
    """Real torchrun agents (--nnodes 1:2, c10d rendezvous). Round 0, N = 2: agent B's rank pushes step 4 and B
    is killed for good (agent and rank); agent A's rank pushes step 4 after that: the step is gathered (both
    pushes in), A's commit times out, A restarts its rank. Round 1, N = 1: step 4 is applied once, from round
    0's two pushes with round 1's lr, then steps 5..7 over N = 1; an agent C joins while A's rank waits before
    step 8, and torchrun restarts the group (a membership change: C's restart count is 0, A's 1). Round 2,
    N = 2, resumes at 8. w = w0 - 0.01 * (4 * 2 * 1.5 + 1 * 1.5 + 3 * 1 * 1 + 4 * 2 * 1.5); 12 updates."""
    shm_before = set(os.listdir("/dev/shm"))
    out, server, url, rdzv = _job(tmp_path, procs, "timeout=5&retries=0")
    a = _agent(procs, tmp_path, url, rdzv, "a", HOLD="2:4,1:8")
    b = _agent(procs, tmp_path, url, rdzv, "b")
    _until(server, "B's push of step 4 alone", lambda s: s["sync_step"] == 4 and s["pushes"] == 9
           and len(s["waiting_for"]) == 1, timeout=150)
    (round0,) = _rounds(out)
    gone = [s["pid"] for s in round0 if s["agent"] == b.pid]
    assert len(round0) == 2 and len(gone) == 1, (round0, b.pid)
    os.killpg(b.pid, signal.SIGKILL)
    os.kill(gone[0], signal.SIGKILL)  # torchrun starts each rank in a session of its own
    b.wait(30)
    (out / "go.2.4").touch()
    _until(server, "round 1's steps 4..7", lambda s: s["sync_step"] == 8 and s["world"] == 1, timeout=150)
    c = _agent(procs, tmp_path, url, rdzv, "c")
    for agent, name in ((a, "a"), (c, "c")):
        assert agent.wait(180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    rounds = _rounds(out)
    assert [[(s["rank"], s["world"], s["start_step"]) for s in ranks] for ranks in rounds] == [
        [(0, 2, 0), (1, 2, 0)], [(0, 1, 4)], [(0, 2, 8), (1, 2, 8)]], rounds
    _check_end(out, rounds[2][0]["attempt"], _w0() - 0.01 * (12 + 1.5 + 3 + 12), updates=STEPS, replaced=0,
               resized=2, world=2)
    torchs = ("torchelastic_", "torchinductor_")  # torch's own scratch (the killed agent B could not remove its own)
    assert not [p for p in _leftovers(tmp_path, shm_before) if not Path(p).name.startswith(torchs)]
