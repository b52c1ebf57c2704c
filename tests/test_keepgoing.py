"""Keep-going on ps:// (issue 38; docs/faults.md "What survives what"): a worker that dies leaves the job, the
step in flight completes over the others, and the survivors go on, never restarted.

Three workers whose gradients are constants (rank r: ``10 ** r``), plain SGD, so the end says exactly which
ranks each step counted on each shard (tests/keepgoing_driver.py). Rank 1 kills itself at step K at a
forced point: before its push, between its pushes to two shards, or after shard 0 acknowledged its first
push message. The reference: every step before K averages the three; step K, on each shard, counts rank 1
only where its whole step had reached that shard; every later step averages ranks 0 and 2.
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

from conftest import child_env, run_group
from faultkit import DRIVER, finish, wait_until
from test_replicas import replicated
from test_restart import _leftovers

pytestmark = pytest.mark.multiproc

KG_DRIVER = DRIVER.replace("ps_driver.py", "keepgoing_driver.py")
SIZES = (6, 5, 4, 3)
ON_SHARD0 = (0, 3)  # the parameters (6 and 3 elements) assign_shards puts on shard 0 of two
T, K, LR, TIMEOUT = 10, 4, 0.01, 30


def _workers(procs, url: str, kill_at: str, *extra: str, victim: int = 1, survivors: tuple = ()) -> list[subprocess.Popen]:
    """Three keep-going drivers, ``victim`` killed at ``kill_at`` of step K; ``survivors``: the others' flags too."""
    out = []
    for r in range(3):
        args = [sys.executable, KG_DRIVER, url, "--rank", str(r), "--workers", "3", "--steps", str(T), *extra]
        if r == victim:
            args += ["--kill-step", str(K), "--kill-at", kill_at]
        else:
            args += list(survivors)
        out.append(procs.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return out


def _sync_reference(kept_on: set[int], k: int = K) -> list[torch.Tensor]:
    """Each parameter after T sync steps: three ranks' mean before k, at k on the shards in ``kept_on``; the
    survivors' after."""
    every, survivors = (1 + 10 + 100) / 3, (1 + 100) / 2
    out = []
    for i, n in enumerate(SIZES):
        shard = 0 if i in ON_SHARD0 else 1
        total = k * every + (every if shard in kept_on else survivors) + (T - k - 1) * survivors
        out.append(torch.full((n,), -LR * total, dtype=torch.float64))
    return out


def _check(results, want: list[torch.Tensor], pids: list[int]) -> list[dict]:
    recs = []
    for (code, out, err), r in zip(results, (0, 2)):
        assert code == 0, err[-3000:]
        rec = json.loads(out.strip().splitlines()[-1])
        assert rec["rank"] == r and rec["pid"] == pids[r], rec  # the survivor's own process throughout
        for got, ref in zip(rec["params"], want):
            assert torch.allclose(torch.tensor(got, dtype=torch.float64), ref, rtol=1e-6, atol=1e-6), (r, got, ref)
        recs.append(rec)
    return recs


def _sync_job(procs, update: str, kill_at: str, query: str, hold: Path | None = None) -> tuple[list, list[int], list]:
    """Two sync shards, three workers, rank 1 killed at ``kill_at`` (``query``: more of the URL): the survivors'
    (returncode, stdout, stderr), every worker's pid, the servers. ``hold`` (a path): the survivors wait at the
    top of step K until both shards lost rank 1 (forced: its death comes before their pushes of step K)."""
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode=sync&update={update}&min_workers=2"
           f"&timeout={TIMEOUT}&bucket_mb=0.000001&{query}")
    workers = _workers(procs, url, kill_at, survivors=("--hold-at", str(K), "--hold-file", str(hold)) if hold else ())
    if hold:
        wait_until(lambda: all("1" in s.stats()["members"]["lost"] for s in servers), 60, "rank 1 never lost")
        hold.touch()
    results = finish([workers[0], workers[2]], timeout=120)
    workers[1].wait(30)
    assert workers[1].returncode == -signal.SIGKILL, workers[1].communicate()[1][-3000:]
    return results, [w.pid for w in workers], servers


@pytest.mark.parametrize("update,kill_at,kept_on,lost_pushes,transport", [
    ("server", "partial", set(), [1, 0], "tcp"),  # shard 0 had half of rank 1's step: taken out again
    # shard 0 had all of it: kept there; its death forced before the survivors' pushes of step K (held), or after
    # shard 0 completed step K with them (between-done)
    ("worker", "between-held", {0}, [0, 0], "tcp"),
    ("worker", "between-done", {0}, [0, 0], "tcp"),
    pytest.param("server", "partial", set(), [1, 0], "shm", marks=pytest.mark.full),  # (read from its link)
    pytest.param("server", "before", set(), [0, 0], "tcp", marks=pytest.mark.full),
    pytest.param("server", "between-held", {0}, [0, 0], "tcp", marks=pytest.mark.full),
    pytest.param("server", "between-done", {0}, [0, 0], "tcp", marks=pytest.mark.full),
    pytest.param("worker", "before", set(), [0, 0], "tcp", marks=pytest.mark.full),
    pytest.param("server", "setup", set(), [0, 0], "tcp", marks=pytest.mark.full),  # the start gate counts it out
])
def test_sync_survivors_go_on_without_the_dead_rank(procs, tmp_path, update, kill_at, kept_on, lost_pushes, transport):
    shm_before = set(os.listdir("/dev/shm"))
    held = kill_at.endswith("-held")
    results, pids, servers = _sync_job(procs, update, kill_at.removesuffix("-held"), f"transport={transport}",
                                       hold=tmp_path / "go" if held else None)
    k = 0 if kill_at == "setup" else K
    recs = _check(results, _sync_reference(kept_on, k), pids)
    for shard, stats in enumerate(recs[-1]["servers"]):
        assert stats["updates"] == T, stats  # every step applied once: none twice, none lost
        assert stats["lost_pushes"] == lost_pushes[shard], stats
        # the first step the shard gathered without rank 1: K + 1 where its whole step K was in (kept), whether or
        # not the survivors' pushes of step K had come before its connection closed
        left_at = k + 1 if shard in kept_on else k
        assert stats["members"]["lost"]["1"]["step"] == left_at, stats["members"]
        assert stats["members"]["lost"]["1"]["why"] == "its connection closed"
    for s in servers:
        s.stop()
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("commlab")]


@pytest.mark.parametrize("how", ["broadcast", pytest.param("average", marks=pytest.mark.full)])
def test_when_rank_0_dies_the_buffers_come_from_the_ranks_left(procs, how):
    """Module buffers under keep-going: each rank adds rank + 1 to its buffer before each step; rank 0 dies before
    step K. broadcast: rank 0's, then the lowest rank left's (rank 1: + 2 a step); average: the mean over the
    step's ranks (+ 2 a step, then + 2.5). Before, the shard waited for rank 0's buffers (or every rank's) for ever."""
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode=sync&update=server&min_workers=2"
           f"&timeout={TIMEOUT}&bucket_mb=0.000001&transport=tcp&buffers={how}")
    workers = _workers(procs, url, "before", "--buffer", victim=0)
    results = finish([workers[1], workers[2]], timeout=120)
    assert workers[0].wait(30) == -signal.SIGKILL
    per_step = (1, 2) if how == "broadcast" else (2, 2.5)
    seen = K * per_step[0] + (T - K) * per_step[1]
    want = [torch.full((n,), -LR * (K * 111 / 3 + (T - K) * 55), dtype=torch.float64) for n in SIZES]
    for (code, out, err), r in zip(results, (1, 2)):
        assert code == 0, err[-3000:]
        rec = json.loads(out.strip().splitlines()[-1])
        assert rec["rank"] == r and rec["pid"] == workers[r].pid, rec
        assert rec["buffers"] == [[seen] * 3], (r, rec["buffers"], seen)
        for got, ref in zip(rec["params"], want):
            assert torch.allclose(torch.tensor(got, dtype=torch.float64), ref, rtol=1e-6, atol=1e-6), (r, got, ref)
        assert all(stats["updates"] == T for stats in rec["servers"]), rec["servers"]


@pytest.mark.parametrize("mode,kill_at,query", [
    ("async", "partial", ""), pytest.param("ssp", "before", "", marks=pytest.mark.full),
    # compress=fp16 (tests/test_keepgoing_compress.py has sync): each push decoded alone; unscaled 1, 10 and 100
    # are exact in fp16, so error feedback's residuals stay 0 and the closed form holds as it is
    pytest.param("async", "partial", "&compress=fp16", marks=pytest.mark.full),
    pytest.param("ssp", "before", "&compress=fp16", marks=pytest.mark.full),
])
def test_async_and_ssp_survivors_go_on_and_the_dead_ranks_partial_step_is_never_applied(procs, mode, kill_at, query):
    """Each push applied alone (x -= lr g): the end is -lr (T (1 + 100) + K 10) on every element, with
    2T + K updates per shard; ssp's survivors are not held back by the dead rank's clock."""
    servers = [procs.server("--mode", mode, "--staleness", "1", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode={mode}&min_workers=2"
           f"&timeout={TIMEOUT}&bucket_mb=0.000001&transport=tcp{query}")
    workers = _workers(procs, url, kill_at, "--final-updates", str(2 * T + K))
    results = finish([workers[0], workers[2]], timeout=120)
    want = [torch.full((n,), -LR * (T * 101 + K * 10), dtype=torch.float64) for n in SIZES]
    _check(results, want, [w.pid for w in workers])
    workers[1].wait(30)  # (async: the survivors may finish before rank 1 reached step K)
    deadline = time.monotonic() + 30
    while not all("1" in s.stats()["members"]["lost"] for s in servers):
        assert time.monotonic() < deadline, [s.stats()["members"] for s in servers]
        time.sleep(0.02)
    for shard, stats in enumerate(s.stats() for s in servers):
        assert stats["updates"] == 2 * T + K, stats
        assert stats["lost_pushes"] == (1 if kill_at == "partial" and shard == 0 else 0), (stats["members"], stats["last_step"], stats["updates"], stats["pushes"])
        assert stats["last_step"]["1"] == K - 1, stats


# ----- a replacement heals live (commlab run --replace, --spares) ------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "restart_script.py")


def _run_replace(tmp_path: Path, *flags: str, steps: int = 20, kill: int = 4, victim: int = 1, workers: int = 3,
                 min_workers: int = 2, step_sleep: float = 0.25, **env):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "tmp").mkdir()
    return run_group([sys.executable, "-m", "commlab.tools.cli", "run", "--workers", str(workers), *flags, "--deadline",
                      "150", "--exchanger",
                      f"ps://?shards=2&mode=sync&update=server&min_workers={min_workers}&timeout=30",
                      "--log-dir", str(tmp_path / "logs"), SCRIPT, str(out), str(steps), "mlp"], 180, cwd=ROOT,
                     env=child_env(TMPDIR=tmp_path / "tmp", REPLACE_KILL_STEP=kill, REPLACE_KILL_RANK=victim,
                                   STEP_SLEEP=step_sleep, **env), capture_output=True, text=True)


@pytest.mark.parametrize("flags,victim", [(("--replace",), 1), pytest.param(("--spares", "1"), 1, marks=pytest.mark.full),
                                          pytest.param(("--replace",), 0, marks=pytest.mark.full)])
def test_a_replacement_enters_with_a_survivors_parameters_and_momentum_while_the_others_train_on(tmp_path, flags,
                                                                                             victim):
    """Rank 1 dies at the top of step 4; the launcher starts a process in its place (or hands the rank to a
    spare) and touches nothing else; it enters at a step boundary E holding, bit for bit, the parameters and
    momentum a survivor held after step E - 1; every rank ends with the same parameters; the summary says
    when it entered. With --spares 1 a new spare starts in the place of the one handed out."""
    shm_before = set(os.listdir("/dev/shm"))
    r = _run_replace(tmp_path, *flags, victim=victim)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"rank {victim} died (signal SIGKILL); replaced by a " in r.stderr, r.stderr[-3000:]
    if "--spares" in flags:  # the spare handed out is replaced by a new idle one, stopped with the job (leftovers)
        assert "; spare 1 starts in its place)" in r.stderr, r.stderr[-3000:]
    assert "restarting" not in r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert f"1 replaced (rank {victim} (signal SIGKILL; entered at step " in summary and " s after the death))" in summary, summary
    out = tmp_path / "out"
    rep = json.loads((out / f"rank{victim}.replacement.json").read_text())
    entered = rep["healed"]["step"]
    assert entered > 4 and rep["healed"]["seconds"] > 0, rep["healed"]
    survivors = [json.loads((out / f"rank{r}.attempt0.json").read_text()) for r in range(3) if r != victim]
    for rec in survivors:
        assert rec["start_step"] == 0 and rec["ran"] == 20, rec  # one process ran every step
        held = rec["after"][str(entered - 1)]
        assert held["params"] == rep["params"] and held["momentum"] == rep["momentum"], rec["rank"]
    end = json.loads((out / f"rank{victim}.replacement.end.json").read_text())
    assert all(rec["params"] == end["params"] for rec in survivors)
    assert not _leftovers(tmp_path, shm_before)


# ----- a replacement under update=worker: a live peer's state, relayed by the shards ------------------------

KW, TW, MU = 3, 9, 0.9  # rank 1 dies at the top of step KW; the survivors wait at step KW + 2 for its replacement


def _worker_replacement(procs, min_workers: int, flags: tuple[str, ...], donor: tuple[str, ...] = ()):
    """Two shards, update=worker, SGD with momentum; rank 1 killed at the top of step KW; once every shard has it
    lost and the survivors wait at the top of step KW + 2, a new process for rank 1 (a fresh hello: a
    replacement), which the survivors wait for (so it enters at KW + 3). ``flags``: every rank's extra flags,
    ``donor``: rank 0's. (rank 0, rank 2, the replacement)'s (code, out, err), their pids, the servers."""
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode=sync&update=worker"
           f"&min_workers={min_workers}&timeout={TIMEOUT}&bucket_mb=0.000001&transport=tcp")
    args = lambda r, *more: [sys.executable, KG_DRIVER, url, "--rank", str(r), "--workers", "3", "--steps", str(TW),
                             "--momentum", str(MU), "--record", "--wait-entry", str(KW + 2), *flags, *more]
    popen = lambda argv: procs.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = popen(args(1, "--kill-step", str(KW)))
    survivors = [popen(args(0, *donor)), popen(args(2))]
    assert victim.wait(60) == -signal.SIGKILL, victim.communicate()[1][-3000:]
    # the survivors wait at the top of step KW + 2: every shard has rank 1 lost and gathers that step
    wait_until(lambda: all("1" in st["members"]["lost"] and st["sync_step"] == KW + 2 for st in
                           (s.stats() for s in servers)), 60, "every shard at step KW + 2 without rank 1")
    replacement = popen(args(1))
    procs_ = [*survivors, replacement]
    return finish(procs_, timeout=120), [p.pid for p in procs_], servers


def _floats(hexed: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(hexed), dtype=torch.float32).double()


def test_a_replacement_under_update_worker_takes_a_live_peers_parameters_buffers_and_momentum(procs):
    """update=worker: the shards hold sums only, so the replacement takes the state of rank 0 (the lowest live
    rank), which sends it through the shards after its optimizer step KW + 2: before its first step the
    replacement holds, bit for bit, the parameters, buffer and momentum every survivor holds at the top of step
    KW + 3; every rank ends with the same bits; and those are SGD with momentum over the mean of the ranks each
    step counted (rank 1 absent from step KW to its entry), the buffer rank 0's."""
    shm_before = set(os.listdir("/dev/shm"))
    results, pids, servers = _worker_replacement(procs, 2, ("--buffer",))
    recs = []
    for code, out, err in results:
        assert code == 0, err[-3000:]
        recs.append(json.loads(out.strip().splitlines()[-1]))
    entry = KW + 3
    rep = recs[2]
    assert rep["rank"] == 1 and rep["start_step"] == entry, rep["start_step"]
    assert f"a replacement, entered at step {entry}" in results[2][1] and "(healed from rank 0)" in results[2][1]
    for rec, pid in zip(recs[:2], pids):
        assert rec["pid"] == pid and rec["start_step"] == 0  # the survivor's own process throughout
        assert rec["at"][str(entry)] == rep["entry"], rec["rank"]  # params, buffer, momentum: bitwise
        assert rec["end"] == rep["end"], rec["rank"]
    p = buf = 0.0  # the closed form: SGD(lr, momentum) on the mean gradient, element by element
    for t in range(TW):
        g = (1 + 100) / 2 if KW <= t < entry else (1 + 10 + 100) / 3
        buf = g if t == 0 else MU * buf + g
        p -= LR * buf
    for hp, hm in zip(rep["end"]["params"], rep["end"]["momentum"]):
        assert torch.allclose(_floats(hp), torch.full_like(_floats(hp), p), rtol=1e-5), (_floats(hp), p)
        assert torch.allclose(_floats(hm), torch.full_like(_floats(hm), buf), rtol=1e-5), (_floats(hm), buf)
    assert _floats(rep["end"]["buffers"][0]).tolist() == [TW] * 3  # rank 0's: one per step
    for stats in rep["servers"]:
        assert stats["updates"] == TW and stats["lost_pushes"] == 0, stats
        assert stats["members"]["replaced"] == 1 and stats["members"]["lost"] == {} and stats["relays"] == {}, stats
    for s in servers:
        s.stop()
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("commlab")]


def test_a_replacement_whose_donor_dies_sending_is_refused_by_name_and_the_others_train_on(procs):
    """Rank 0 SIGKILLs itself as it is about to send shard 1 its state for the replacement: the replacement exits
    with one line naming rank 0 and the step, never trains on a partial state; rank 2 (min_workers=1) trains on
    alone to the end."""
    # (no buffer: the others' buffer pulls would wait for rank 0's, under buffers=broadcast)
    results, _, servers = _worker_replacement(procs, 1, (), ("--die-donating",))
    (code0, _, err0), (code2, out2, err2), (code1, _, err1) = results
    assert code0 == -signal.SIGKILL, err0[-3000:]
    assert code1 == 1, err1[-3000:]
    said = [line for line in err1.splitlines() if line.startswith("commlab.base.errors.RemoteError: ")]
    assert len(said) == 1 and (f"the state of step {KW + 2} for rank 1 (a replacement entering at step {KW + 3}) did "
                               f"not reach shard ") in said[0] and (": rank 0, the live peer sending it, left the job "
                                                                    "(its connection closed)") in said[0], err1[-3000:]
    assert code2 == 0, err2[-3000:]
    assert all(st["updates"] == TW for st in json.loads(out2.strip().splitlines()[-1])["servers"])
    for s in servers:
        s.stop()

def test_a_job_whose_every_rank_died_before_its_replacement_entered_fails_naming_the_rank(tmp_path):
    """The double kill (the launcher's fix of f4b0c9a): 2 ranks, min_workers=1. Rank 1 dies at the top of step 3;
    its replacement is held before its hello; once it started, rank 0 dies at the top of step 4 (forced: it waits
    for the replacement's file). Every rank is then a replacement that has not entered: the launcher used to take
    that for 'every other rank finished', stop both and end rc 0 with no rank having finished. Now it watches on:
    the shards lost their quorum (0 of 2 left), rank 0's replacement is refused by name when it asks to enter, and
    the job fails naming it. (Reverting the fix: rc 0 and '... never entered' in the summary.)"""
    shm_before = set(os.listdir("/dev/shm"))
    r = _run_replace(tmp_path, "--replace", workers=2, min_workers=1, steps=10, kill=3, step_sleep=0,
                     REPLACE_HOLD=1, DIE_AT="4:1")
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    for victim in (1, 0):
        assert f"rank {victim} died (signal SIGKILL); replaced by a " in r.stderr, r.stderr[-3000:]
    assert "commlab run: rank 0 failed first (exit code 1); stopped the others" in r.stderr, r.stderr[-3000:]
    assert "the job lost its quorum on shard " in r.stderr and "0 of 2 left, min_workers=1" in r.stderr, r.stderr[-3000:]
    assert "replaced (" not in r.stdout and "the replacement was stopped before it entered" not in r.stderr
    assert (tmp_path / "out" / "rank1.replacement1.started").exists()  # (held: it never said hello)
    assert not (tmp_path / "out" / "rank0.attempt0.json").exists()  # no rank finished
    assert not _leftovers(tmp_path, shm_before)


def test_a_replacement_killed_after_it_entered_is_replaced_again_and_the_job_ends_right(tmp_path):
    """2 ranks, min_workers=1. Rank 1 dies at the top of step 3; its replacement enters at E1, replays up to it and
    dies at the top of step E1 (the shards count it from E1 on: the step completes without it); a second enters at
    E2. Forced, not timed: rank 0 waits at the top of step 6 until every shard let the first replacement enter,
    and at step 10 for the second (so E1 <= 7 and E2 <= 11). The job ends rc 0, the summary names both entries,
    the second replacement holds rank 0's parameters and momentum after E2 - 1 bit for bit when it enters and
    ends equal to it; every shard applied each of the 14 steps once and let 2 replacements in."""
    shm_before = set(os.listdir("/dev/shm"))
    steps = 14
    r = _run_replace(tmp_path, "--replace", workers=2, min_workers=1, steps=steps, kill=3, step_sleep=0,
                     REPLACE_DIE=1, WAIT_AT="6:1,10:2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("rank 1 died (signal SIGKILL); replaced by a ") == 2, r.stderr[-3000:]
    out = tmp_path / "out"
    first, second = (json.loads((out / f"rank1.replacement{n}.json").read_text()) for n in ("", "2"))
    e1, e2 = first["healed"]["step"], second["healed"]["step"]
    assert 3 < e1 <= 7 and e1 < e2 <= 11, (e1, e2)
    summary = r.stdout.strip().splitlines()[-1]
    assert (f"2 replaced (rank 1 (signal SIGKILL; entered at step {e1}, healed " in summary
            and f"; rank 1 (signal SIGKILL; entered at step {e2}, healed " in summary), summary
    rec = json.loads((out / "rank0.attempt0.json").read_text())
    assert rec["start_step"] == 0 and rec["ran"] == steps, rec
    held = rec["after"][str(e2 - 1)]
    assert held["params"] == second["params"] and held["momentum"] == second["momentum"]
    end = json.loads((out / "rank1.replacement.end.json").read_text())
    assert end["pid"] == second["pid"], end
    assert end["params"] == rec["params"] and end["momentum"] == rec["momentum"] and end["lr"] == rec["lr"]
    for shard in rec["servers"]:
        assert shard["updates"] == steps and shard["entered"] == 2 and shard["duplicates"] == 0, rec["servers"]
    assert not _leftovers(tmp_path, shm_before)


# ----- the quorum, and a process that comes back ----------------------------------------------------------

def test_a_quorum_below_min_workers_ends_the_job_naming_the_ranks_lost(procs):
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode=sync&update=server&min_workers=3"
           f"&timeout={TIMEOUT}&transport=tcp")
    workers = _workers(procs, url, "before")
    for code, _, err in finish([workers[0], workers[2]], timeout=120):
        assert code == 1, err[-3000:]
        assert "the job lost its quorum on shard " in err and ": rank(s) [1] lost (rank 1: its connection closed at " \
            f"step {K}), 2 of 3 left, min_workers=3" in err, err[-3000:]


def test_a_frozen_worker_leaves_after_heartbeat_s_and_is_refused_when_it_thaws(procs, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at step 4: its connections fall silent, the shards close them once the
    heartbeat TTL it asked for (1 s) runs out, and the others train on. Thawed (SIGCONT) while they still
    train, its push of step 4 comes on a new connection of a process of an earlier membership epoch: refused
    by name, not merged; the survivors finish with every step applied once."""
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode=sync&update=server&min_workers=2"
           f"&heartbeat_s=1&timeout={TIMEOUT}&transport=tcp")
    steps = 60
    args = lambda r: [sys.executable, KG_DRIVER, url, "--rank", str(r), "--workers", "3", "--steps", str(steps),
                      "--sleep", "0.05"]
    frozen = procs.popen([*args(1), "--stop-at", str(K)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    survivors = [procs.popen(args(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 2)]
    deadline = time.monotonic() + 60
    while not all("1" in s.stats()["members"]["lost"] for s in servers):
        assert time.monotonic() < deadline, [s.stats()["members"] for s in servers]
        time.sleep(0.02)
    lost_at = time.monotonic()
    assert all(s.stats()["updates"] < steps for s in servers)  # the others still train
    os.kill(frozen.pid, signal.SIGCONT)
    code, _, err = finish([frozen], timeout=60)[0]
    assert code == 1, err[-3000:]
    assert "the rank left the job on shard " in err and "refused, not merged" in err, err[-3000:]
    for code, _, err in finish(survivors, timeout=120):
        assert code == 0, err[-3000:]
    for s in servers:
        st = s.stats()
        assert st["updates"] == steps and st["members"]["lost"]["1"]["why"] == "its connection closed", st
    print(f"rank 1 frozen at step {K}; left the job {lost_at - deadline + 60:.2f} s into the wait (heartbeat_s=1)")


def test_keep_going_options_are_refused_at_parse_time_in_one_line(capsys):
    from commlab.launch import launcher
    from commlab.tools.cli import check_url

    for query, said in [("min_workers=-1", "min_workers must be >= 0"), ("heartbeat_s=0.05", "option 'heartbeat_s': at least 0.1"),
                        ("heartbeat_s=7000", "heartbeat_s must be >= 0 and <= 6553"),
                        ("min_workers=x", "option 'min_workers': 'x' is not a valid int")]:
        problem = check_url(f"ps://?shards=1&{query}")
        assert problem is not None and said in problem and "\n" not in problem, (query, problem)
    assert launcher.run_job(launcher.Job((SCRIPT,), spares=-1)) == 2  # before anything starts
    assert capsys.readouterr().err.strip().splitlines() == [
        "commlab run: --spares must be >= 0 and <= 256 (idle ranks this host starts), got -1"]


def test_a_spare_pays_the_first_optimizers_imports_while_idle_and_draws_no_random_numbers():
    """A spare's warm-up (commlab.core.optim.warm_up): torch._dynamo, which every torch.optim constructor imports the
    first time (most of a spare's heal under the chaos case's CPU cap), is loaded before a rank is handed over, and
    the user's random stream is where it was. In a fresh interpreter (this one may have imported it already)."""
    code = ("import sys, torch; assert 'torch._dynamo' not in sys.modules; s = torch.get_rng_state(); "
            "from commlab.core.optim import warm_up; warm_up(); "
            "assert 'torch._dynamo' in sys.modules, 'not warmed'; assert torch.equal(s, torch.get_rng_state())")
    r = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_new_backup_pays_the_first_optimizers_imports_before_it_attaches():
    """A backup (``commlab server --replica-of``) warms up before it asks for its primary's state: the primary holds
    its replies until the backup acknowledges what follows the state, and loading the state builds the shard's
    optimizer, whose first construction imported torch._dynamo (about 2 s of held replies per new backup under the
    chaos case's CPU cap). The real server's main, its attach replaced by the check (no primary needed)."""
    code = ("import os, sys\n"
            "from servers import replication as R\n"
            "def attach(self):\n"
            "    os._exit(0 if 'torch._dynamo' in sys.modules else 3)\n"
            "R.Replication._attach = attach\n"
            "from servers.__main__ import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "--bind", "tcp://127.0.0.1:0", "--mode", "sync", "--shard", "0/1",
                        "--replica-of", "tcp://127.0.0.1:9"], env=child_env(), capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, ("not warmed before the attach" if r.returncode == 3 else r.stderr[-2000:])


# ----- keep-going on replicated shards (ps://?replicas=2&min_workers=M) ------------------------------------

def _momentum_reference(counted: list[tuple[int, ...]], lr: float, mu: float) -> float:
    """Every element after len(counted) SGD steps with momentum ``mu`` (torch's: the first step's buffer is the
    gradient), step t's gradient the mean of 10 ** r over ``counted[t]``, in float64."""
    x, buf = 0.0, None
    for ranks in counted:
        g = sum(10.0 ** r for r in ranks) / len(ranks)
        buf = g if buf is None else mu * buf + g
        x -= lr * buf
    return x


@pytest.mark.parametrize("how", ["stop", pytest.param("kill", marks=pytest.mark.full)])
def test_keep_going_on_a_replicated_shard_the_backup_keeps_the_membership(procs, tmp_path, how):
    """3 workers, one shard on a primary and a backup, sync update=server, SGD with momentum (its state on the
    shard). Rank 1 leaves at the top of step 3 (``stop``: it SIGSTOPs itself and leaves once heartbeat_s=1 ran
    out; ``kill``: kill -9): the loss happens on the primary's socket, which the backup never sees, so it must come
    to the backup in the stream (it used not to: the promoted backup's step 3 waited for rank 1 forever). The
    primary kills itself once it served rank 0's push of step 5 and the backup acked it; ranks 0 and 2 fail over
    and train on to step 8, where they wait. A replacement for rank 1 enters through the backup-turned-primary.
    ``stop``: rank 1's old process is then thawed: its hello (epoch 0) on the new primary is refused by name
    (a rank taken over by a new process used to let its old process's hello in, which then took the connection
    from the replacement). The end: every rank's parameters equal bit for bit and equal the closed form in which
    rank 1 counts in steps 0-2 and from its replacement's entry on; the new primary applied each of the 12 steps
    once and holds every rank at step 11."""
    steps, k, p, s = 12, 3, 5, 8
    pairs, servers = replicated(procs, "sync", shards=1, fault=f"acked:push:0:{p}")
    primary, backup = pairs[0]
    beat = "&heartbeat_s=1" if how == "stop" else ""
    url = (f"ps://{servers}?mode=sync&update=server&replicas=2&min_workers=2{beat}&timeout={TIMEOUT}"
           f"&transport=tcp")
    release = tmp_path / "release"
    common = ["--workers", "3", "--steps", str(steps), "--momentum", "0.9"]
    run = lambda r, *extra, env=None: procs.popen([sys.executable, KG_DRIVER, url, "--rank", str(r), *common, *extra],
                                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = run(1, *(["--stop-at", str(k)] if how == "stop" else ["--kill-step", str(k), "--kill-at", "before"]))
    survivors = [run(r, "--hold-at", str(s), "--hold-file", str(release)) for r in (0, 2)]
    # (not asked of the primary: its fault may have killed it by then, and a probe of a dead primary times out; the
    # backup takes a loss only from the primary's stream, so its loss is the primary's)
    wait_until(lambda: "1" in backup.stats()["members"]["lost"], 60, "the backup never lost rank 1")
    assert primary.proc.wait(60) == -signal.SIGKILL  # its fault, at rank 0's push of step 5
    wait_until(lambda: backup.stats()["replica"]["role"] == "primary", 60, "the backup never took over")
    replacement = run(1, env={"COMMLAB_REPLACEMENT": f"{time.time():.6f}"})
    wait_until(lambda: backup.stats()["members"]["replaced"] == 1, 60, "the replacement never entered")
    if how == "stop":
        os.kill(victim.pid, signal.SIGCONT)
        code, _, err = finish([victim], timeout=60)[0]
        assert code == 1, err[-3000:]
        assert "hello from rank 1 of membership epoch 0: the rank left the job and a new process took it over" in err \
            and "refused, not merged" in err, err[-3000:]
    else:
        assert victim.wait(30) == -signal.SIGKILL
    release.touch()
    recs = []
    for code, out, err in finish([*survivors, replacement], timeout=120):
        assert code == 0, err[-3000:]
        recs.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["pid"] for r in recs[:2]] == [w.pid for w in survivors]  # the survivors' own processes throughout
    entered = recs[2]["start_step"]
    assert p < entered <= s + 1, entered
    counted = [(0, 1, 2) if t < k or t >= entered else (0, 2) for t in range(steps)]
    want = _momentum_reference(counted, LR, 0.9)
    for rec in recs:
        assert rec["params"] == recs[0]["params"], rec["rank"]  # bit for bit
        for got in rec["params"]:
            assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.full((len(got),), want,
                                                                                      dtype=torch.float64),
                                  rtol=1e-6, atol=1e-7), (got, want)
    stats = backup.stats()
    assert stats["updates"] == steps and stats["lost_pushes"] == 0, stats
    assert stats["last_step"] == {str(r): steps - 1 for r in range(3)}, stats["last_step"]
    assert stats["members"]["replaced"] == 1 and not stats["members"]["lost"], stats["members"]
    assert stats["replica"]["promoted"] == 1, stats["replica"]


@pytest.mark.parametrize("order", ["hello-then-kill", "kill-then-hello", "kill-new-backup-then-hello"])
def test_a_primary_killed_while_a_replacement_waits_for_its_first_step_hands_it_to_the_backup(procs, tmp_path, order):
    """The chaos run's case (servers killed too): a rank dies, its replacement says hello and waits to enter, and
    then the primary dies. 3 workers, one shard on a primary and a backup, sync update=server, momentum on the
    shard; rank 1 killed -9 at the top of step 3; ranks 0 and 2 held at the top of step 5 (forced: a file); the
    replacement's hello is served by the primary (between two steps: it enters at step 5 there, and through the
    stream on the backup) and it waits for step 5's gate; then the test kills the primary -9 and releases the
    survivors. [kill-then-hello]: the primary is killed before the replacement starts, so its first hello goes
    to a dead server and the backup (not promoted yet: the survivors are held) takes it; [kill-new-backup-then-hello]
    also starts a new backup of that backup at once, as ``commlab run`` does (it attaches once the hello promoted
    it). Everyone fails over; the
    replacement enters through the backup-turned-primary; every rank ends at the closed form in which rank 1 is
    absent from step 3 to its entry, bit for bit equal, and the new primary applied each step once."""
    from faultkit import kill9

    steps, k, s = 10, 3, 5
    pairs, servers = replicated(procs, "sync", shards=1)
    primary, backup = pairs[0]
    url = f"ps://{servers}?mode=sync&update=server&replicas=2&min_workers=2&timeout={TIMEOUT}&transport=tcp"
    release = tmp_path / "release"
    common = ["--workers", "3", "--steps", str(steps), "--momentum", "0.9"]
    run = lambda r, *extra, env=None: procs.popen([sys.executable, KG_DRIVER, url, "--rank", str(r), *common, *extra],
                                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = run(1, "--kill-step", str(k), "--kill-at", "before")
    survivors = [run(r, "--hold-at", str(s), "--hold-file", str(release)) for r in (0, 2)]
    assert victim.wait(60) == -signal.SIGKILL
    wait_until(lambda: "1" in backup.stats()["members"]["lost"], 60, "the backup never lost rank 1")
    said = lambda st: st["members"]["replaced"] == 1 and not st["members"]["lost"] and st["replica"]["held"] == 0
    if order != "hello-then-kill":
        kill9(primary.proc)
        if order == "kill-new-backup-then-hello":  # as commlab run does: a new backup for the shard, at once
            procs.server("--mode", "sync", "--shard", "0/1", "--replica-log", "4", "--replica-of", backup.endpoint)
        replacement = run(1, env={"COMMLAB_REPLACEMENT": f"{time.time():.6f}"})
        wait_until(lambda: said(backup.stats()), 60, "the replacement never said hello to the backup")
    else:
        replacement = run(1, env={"COMMLAB_REPLACEMENT": f"{time.time():.6f}"})
        # its hello answered (and so held by the backup): the survivors wait between two steps, so it entered at once
        wait_until(lambda: said(primary.stats()), 60, "the replacement never said hello")
        kill9(primary.proc)
    release.touch()
    recs = []
    for code, out, err in finish([*survivors, replacement], timeout=120):
        assert code == 0, err[-3000:]
        recs.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["pid"] for r in recs[:2]] == [w.pid for w in survivors]
    entered = recs[2]["start_step"]
    assert k < entered <= steps, entered
    counted = [(0, 1, 2) if t < k or t >= entered else (0, 2) for t in range(steps)]
    want = _momentum_reference(counted, LR, 0.9)
    for rec in recs:
        assert rec["params"] == recs[0]["params"], rec["rank"]
        for got in rec["params"]:
            assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.full((len(got),), want,
                                                                                      dtype=torch.float64),
                                  rtol=1e-6, atol=1e-7), (got, want)
    stats = backup.stats()
    assert stats["replica"]["role"] == "primary" and stats["updates"] == steps and stats["lost_pushes"] == 0, stats
    assert stats["members"]["replaced"] == 1 and not stats["members"]["lost"], stats["members"]
    if order == "kill-new-backup-then-hello":  # the new backup attached to the backup-turned-primary
        assert stats["replica"]["backup"] is not None, stats["replica"]


def test_a_replacement_is_given_the_servers_alive_now_after_both_named_in_the_url_died(tmp_path):
    """commlab run's replicated servers (ReplicaSets): the primary dies and a backup of the backup starts; then the
    old backup dies and a backup of that one starts. The URL the job began with names two dead servers: a replacement
    or a spare handed a rank now must get the URL of the two alive (a chaos run's replacements, given the old URL,
    failed over between two dead servers until their timeout and ended the job)."""
    from commlab.launch import launcher
    from commlab.transport import auth

    env = child_env()
    env[auth.SECRET_FILE_ENV] = auth.create_file(str(tmp_path))
    procs: list = []
    with launcher.server_plan("ps://?mode=sync&update=server&replicas=2", 2) as (template, argvs):
        sets = launcher.ReplicaSets(env, tmp_path, procs, lambda line: None)
        try:
            url = launcher.start_servers(template, argvs, env, tmp_path, 60, procs, replica_sets=sets)
            first = [p.endpoint for p in procs]
            assert all(e in url for e in first) and sets.current(url) == url
            for victim in list(procs[:2]):  # the primary, then (once its successor is up) the old backup
                victim.popen.kill()
                victim.popen.wait(30)
                sets.check()
                launcher.await_endpoints([procs[-1]], 60)
            alive = [p.endpoint for p in procs if p.popen.poll() is None]
            now = sets.current(url)
            assert len(alive) == 2 and all(e in now for e in alive) and not any(e in now for e in first), (now, first)
        finally:
            launcher.stop_all(procs)
