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
           "COMMLAB_EXCHANGER": url, "OMP_NUM_THREADS": 1, "TMPDIR": tmp_path / "tmp", **env}
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


def test_a_job_shrinks_to_one_rank_and_grows_back_each_step_applied_once_over_its_own_n(tmp_path, procs):
    """Round 0, N = 2: rank 1 pushes step 4 and its agent is gone for good before rank 0 pushed it; rank 0 is
    stopped (torchrun: it times out, its agent restarts it). Round 1, N = 1: resumes at step 4 (rank 1's half
    of step 4 dropped, counted as replaced) and runs to step 8, when an agent joins and torchrun stops it.
    Round 2, N = 2 again, ranks renumbered and restart counts 1 and 0: resumes at 8 and finishes. 12 updates
    in all, w = w0 - 0.01 * (4 * 2 * 1.5 + 4 * 1 * 1 + 4 * 2 * 1.5) on every rank; a rank of a forgotten
    round (a fresh store) is refused in one line naming the attempts."""
    shm_before = set(os.listdir("/dev/shm"))
    for d in ("out", "tmp"):
        (tmp_path / d).mkdir()
    server = procs.server("--mode", "sync")
    url = f"ps://{server.address}?mode=sync&update=server&timeout=30"
    store = procs.store("127.0.0.1")

    held = _rank(procs, tmp_path, url, store, 0, 2, 0, HOLD=4)
    victim = _rank(procs, tmp_path, url, store, 1, 2, 0)
    _until(server, "rank 1's push of step 4 alone", lambda s: s["sync_step"] == 4 and s["pushes"] == 9
           and s["waiting_for"] == [0])
    _stop(victim, signal.SIGKILL)
    _stop(held, signal.SIGKILL)

    alone = _rank(procs, tmp_path, url, store, 0, 1, 1, HOLD=8)
    _until(server, "round 1's steps 4..7", lambda s: s["sync_step"] == 8 and s["attempt"] == 1)
    _stop(alone, signal.SIGTERM)

    stale = _rank(procs, tmp_path, url, procs.store("127.0.0.1"), 0, 1, 1)  # a store that forgot rounds 0 and 1
    _, err = stale.communicate(timeout=90)
    assert stale.returncode != 0
    assert "hello from rank0 of attempt 0: the job on shard 0/1" in err and "is at attempt 1 (a process of an " \
        "earlier attempt, or a store that forgot the job's rounds)" in err, err[-3000:]

    grown = [_rank(procs, tmp_path, url, store, 0, 2, 1), _rank(procs, tmp_path, url, store, 1, 2, 0)]
    for p in grown:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]

    torch.manual_seed(0)
    w0 = nn.Linear(3, 1, bias=False).weight.detach().view(-1)
    starts = {(a, r): _json(tmp_path, f"start.{a}.{r}.json") for a, r in [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]}
    assert sorted(p.name for p in (tmp_path / "out").glob("start.*")) == sorted(f"start.{a}.{r}.json" for a, r in starts)
    assert {k: (s["world"], s["start_step"]) for k, s in starts.items()} == {
        (0, 0): (2, 0), (0, 1): (2, 0), (1, 0): (1, 4), (2, 0): (2, 8), (2, 1): (2, 8)}
    assert torch.allclose(torch.tensor(starts[1, 0]["params"]), w0 - 0.01 * 4 * 2 * 1.5, atol=1e-6)
    for r in (0, 1):
        assert torch.allclose(torch.tensor(starts[2, r]["params"]), w0 - 0.01 * (12 + 4), atol=1e-6), r
        end = _json(tmp_path, f"end.2.{r}.json")
        assert torch.allclose(torch.tensor(end["params"]), w0 - 0.01 * (12 + 4 + 12), atol=1e-6), (r, end)
        shard = end["servers"][0]
        assert {k: shard[k] for k in ("updates", "replaced", "resized", "world", "attempt")} == {
            "updates": STEPS, "replaced": 1, "resized": 2, "world": 2, "attempt": 2}, shard
    assert not _leftovers(tmp_path, shm_before)
