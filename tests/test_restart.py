"""Restarts (issue 28): ``commlab run --max-restarts R`` restarts every rank after a failure with the servers
kept, and a ps:// update=server job resumes from them, each step applied once.

The scripts run under the real launcher and real servers; a rank kills itself (SIGKILL) at a chosen step, and
the race that matters (one rank's push of the step is in, the other rank dies before its own) is forced by
the dying rank waiting for the servers to say so (tests/restart_script.py). Results are checked against a
single process on the combined batch, or a closed form.
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
from commlab.launch import launcher
from commlab.transport import shm

from conftest import REAL_STARTS, child_env, run_group

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "restart_script.py")
STEPS = 15


def _run(tmp_path: Path, url: str, model: str, *, workers: int = 2, restarts: int = 1, timeout: float = 180,
         **env) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return run_group([sys.executable, "-m", "commlab.tools.cli", "run", "--workers", str(workers), "--max-restarts",
                      str(restarts), "--deadline", "150", "--exchanger", url, "--log-dir", str(tmp_path / "logs"),
                      SCRIPT, str(out), str(STEPS), model], timeout, cwd=ROOT, env=child_env(TMPDIR=tmp_path / "tmp", **env),
                     capture_output=True, text=True)


def _records(tmp_path: Path, attempt: int, workers: int = 2) -> list[dict]:
    return [json.loads((tmp_path / "out" / f"rank{r}.attempt{attempt}.json").read_text()) for r in range(workers)]


def _reference(restarted_from: int, workers: int = 2) -> tuple[dict, list, float]:
    """One process on the combined batch: the script's mlp, SGD with momentum, StepLR, STEPS steps, the
    batches of steps from ``restarted_from`` on those of attempt 1 (the script draws other data per attempt)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(_batch(step, r, int(step >= restarted_from)) for r in range(workers)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        sched.step()
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    return model.state_dict(), momentum, opt.param_groups[0]["lr"]


def _batch(step: int, r: int, attempt: int):
    g = torch.Generator().manual_seed(1000 * step + r + 100_000 * attempt)
    x = torch.randn(8, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _leftovers(tmp_path: Path, before: set[str]) -> list[str]:
    """What the run left: its scratch folders (its $TMPDIR), and commlab segments in /dev/shm that are new
    and whose process is gone (other sessions' live ones may be there too)."""
    left = [str(p) for p in (tmp_path / "tmp").iterdir()]
    for name in set(os.listdir("/dev/shm")) - before:
        m = shm.NAME.fullmatch(name)
        if m and not Path(f"/proc/{m['pid']}").exists():
            left.append(name)
    return left


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.full)])
def test_a_rank_killed_with_its_step_in_flight_resumes_from_the_servers_and_applies_it_once(tmp_path, k):
    """Rank 1 dies at step 7 once rank 0's push of step 7 is on every shard; the job restarts, both ranks
    resume at ex.start_step == 7 with the servers' parameters, momentum and their own committed scheduler,
    and the end equals one process on the combined batch: step 7 applied once, from the new attempt (each
    attempt draws other data, so keeping the dead attempt's push, or adding both, gives another result)."""
    shm_before = set(os.listdir("/dev/shm"))
    r = _run(tmp_path, f"ps://?shards={k}&mode=sync&update=server", "mlp", KILL_RANK=1, KILL_STEP=7,
             KILL_AFTER_PUSH_OF=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "commlab run: rank 1 failed (signal SIGKILL); restarting every rank (restart 1 of 1)" in r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert "1 restart (failed: rank 1 (signal SIGKILL))" in summary, summary
    first = json.loads((tmp_path / "out" / "rank0.attempt0.json").read_text()) \
        if (tmp_path / "out" / "rank0.attempt0.json").exists() else None
    assert first is None  # rank 0 was stopped in step 7, never finished attempt 0
    want, momentum, lr = _reference(restarted_from=7)  # step 7 made of the new attempt's pushes alone
    for rec in _records(tmp_path, 1):
        assert rec["start_step"] == 7 and rec["ran"] == STEPS - 7, rec
        assert rec["restored"] == {"step": 7}, rec
        for key, value in want.items():
            assert torch.allclose(torch.tensor(rec["params"][key]), value, atol=1e-5), (rec["rank"], key)
        for i, m in enumerate(momentum):
            assert torch.allclose(torch.tensor(rec["momentum"][str(i)]), m, atol=1e-5), (rec["rank"], i)
        assert rec["lr"] == [pytest.approx(lr)], rec["lr"]
        for shard in rec["servers"]:  # 15 updates; rank 0's push of step 7 from attempt 0 dropped, once
            assert shard["updates"] == STEPS and shard["attempt"] == 1 and shard["replaced"] == 1, shard
    assert not _leftovers(tmp_path, shm_before)


@pytest.mark.full
def test_a_step_applied_on_one_shard_only_is_applied_on_the_other_once(tmp_path):
    """K = 2: rank 1 dies between its commits of step 7, after shard 0 applied it and before shard 1 got
    its commit (shard 1 holds step 7 gathered). The restart resumes at 7: shard 0 takes the new pushes and
    commit as duplicates, shard 1 applies step 7 from the pushes it holds, once; the end equals one process."""
    r = _run(tmp_path, "ps://?shards=2&mode=sync&update=server", "mlp", KILL_BETWEEN_COMMITS_OF=7)
    assert r.returncode == 0, r.stderr[-3000:]
    want, momentum, _ = _reference(restarted_from=8)  # step 7 on both shards from the dead attempt's pushes
    for rec in _records(tmp_path, 1):
        assert rec["start_step"] == 7, rec
        for key, value in want.items():
            assert torch.allclose(torch.tensor(rec["params"][key]), value, atol=1e-5), (rec["rank"], key)
        for i, m in enumerate(momentum):
            assert torch.allclose(torch.tensor(rec["momentum"][str(i)]), m, atol=1e-5), (rec["rank"], i)
        assert [s["updates"] for s in rec["servers"]] == [STEPS, STEPS], rec["servers"]
        assert [s["replaced"] for s in rec["servers"]] == [0, 0], rec["servers"]  # nothing was half-pushed
        assert all(s["duplicates"] >= 2 for s in rec["servers"]), rec["servers"]  # each rank's step 7, again


@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.full)])
def test_async_and_ssp_count_every_applied_push_once_across_a_restart(tmp_path, mode):
    """Constant gradients (rank r pushes r + 1): the end is w0 - lr * STEPS * (1 + 2) whatever was in flight,
    and each rank's resumed start plus the steps it ran after is STEPS."""
    shm_before = set(os.listdir("/dev/shm"))
    r = _run(tmp_path, f"ps://?shards=1&mode={mode}", "const", KILL_RANK=1, KILL_STEP=7)
    assert r.returncode == 0, r.stderr[-3000:]
    torch.manual_seed(0)
    w0 = nn.Linear(3, 1, bias=False).weight.detach()
    want = w0 - 0.01 * STEPS * (1 + 2)
    for rec in _records(tmp_path, 1):
        assert rec["start_step"] + rec["ran"] == STEPS, rec
        assert torch.allclose(torch.tensor(rec["params"]["weight"]), want, atol=1e-5), rec
        assert rec["servers"][0]["updates"] == 2 * STEPS, rec["servers"]
    assert _records(tmp_path, 1)[1]["start_step"] == 7
    assert not _leftovers(tmp_path, shm_before)


def test_max_restarts_below_zero_is_one_line_naming_it(tmp_path):
    r = run_group([sys.executable, "-m", "commlab.tools.cli", "run", "--max-restarts", "-1", SCRIPT], 60, cwd=ROOT,
                  env=child_env(), capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["commlab run: --max-restarts must be >= 0, got -1"], r.stderr


LM = ["examples/charlm.py", "--steps", "12", "--lr", "1e-2", "--warmup", "3", "--d-model", "32", "--layers", "1",
      "--heads", "2", "--context", "32", "--batch-size", "8", "--eval-batches", "2", "--log-every", "1",
      "--threads", "1"]


def _lm_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if "test_acc" not in line]


@pytest.mark.full
def test_charlm_under_ring_restarts_from_its_checkpoint_and_equals_the_uninterrupted_run(tmp_path):
    """No server state under ring://: rank 1 is killed (SIGKILL from here) once both ranks reported step 7;
    the restarted ranks load the checkpoint rank 0 wrote after step 6 (examples/charlm.py does so by
    itself when TORCHELASTIC_RESTART_COUNT > 0), run steps again, and every step's loss equals the run
    that never stopped."""
    url = "ring://"
    whole = tmp_path / "whole.jsonl"
    r = run_group([sys.executable, "-m", "commlab.tools.cli", "run", "--workers", "2", "--exchanger", url, "--metrics",
                   str(whole), *LM], 180, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = tmp_path / "m.jsonl"
    cli = launcher.start_group([sys.executable, "-m", "commlab.tools.cli", "run", "--workers", "2", "--max-restarts", "1",
                                "--exchanger", url, "--metrics", str(metrics), *LM, "--checkpoint",
                                str(tmp_path / "lm.pt"), "--checkpoint-every", "6"],
                               child_env(**REAL_STARTS), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        victim = faultkit.wait_for_rank_process(cli.pid, rank=1, timeout=60)
        deadline = time.monotonic() + 120
        while not all(path.exists() and any(row["step"] >= 7 for row in _lm_rows(path))
                      for path in (metrics, Path(f"{metrics}.rank1"))):  # past the checkpoint of step 6
            assert time.monotonic() < deadline and cli.poll() is None, "the ranks never reported step 7"
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        out, err = cli.communicate(timeout=180)
    finally:
        launcher.kill_groups([cli], grace=0)
    assert cli.returncode == 0, err[-3000:]
    assert "rank 1 failed (signal SIGKILL); restarting every rank (restart 1 of 1)" in err, err[-3000:]
    rows = _lm_rows(metrics)
    steps = [row["step"] for row in rows]
    assert len(steps) > len(set(steps)) and sorted(set(steps)) == list(range(12)), steps  # some steps ran twice
    assert {row["step"]: row["loss"] for row in rows} == {row["step"]: row["loss"] for row in _lm_rows(whole)}


def test_a_server_that_dies_is_named_and_not_restarted(tmp_path):
    """Restarts are for ranks: the servers hold the state, so a dead one ends the job (restarting servers
    is theirs: --resume), in one line naming it."""
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(600)\n")
    cli = launcher.start_group([sys.executable, "-m", "commlab.tools.cli", "run", "--workers", "2", "--max-restarts", "3",
                                "--exchanger", "ps://?shards=1", str(script)], child_env(**REAL_STARTS), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        faultkit.wait_for_rank_process(cli.pid, rank=1, timeout=60)  # the server started before the ranks
        server = [p for p in faultkit.children_of(cli.pid)
                  if b"servers" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
        assert len(server) == 1, server
        os.kill(server[0], signal.SIGKILL)
        _, err = cli.communicate(timeout=60)
    finally:
        launcher.kill_groups([cli], grace=0)
    assert cli.returncode == 1, err
    assert "commlab run: server 0 failed first (signal SIGKILL); stopped the others" in err, err
    assert "restarting" not in err, err


def test_the_restart_probe_is_worded_from_its_numbers():
    from bench import probes

    got = probes.lines({"restart": {"steps": 40, "kill_at": 25, "checkpoint_every": 10, "regimes": {
        "ps-server": {"url": "ps://?update=server", "kill_to_first_step_s": 11.87, "resumed_at": 25,
                      "done_before_kill": 25, "steps_lost": 0},
        "ring": {"url": "ring://", "error": "rank 0 failed first"}}}})
    assert got == ["- A rank killed at step 25 under `commlab run --max-restarts 1`, ps://?update=server: the first "
                   "step after the restart came 11.87 s after the kill; resumed at step 25 of 25 done, 0 step(s) lost.",
                   "- A restarted job (ring://): the probe failed: rank 0 failed first"]


@pytest.mark.full
def test_the_same_restart_under_torchrun_with_servers_started_beside_it(tmp_path, procs):
    """torchrun --max-restarts 1 and a server started on its own (commlab server): the in-flight race of
    the first test, the same end (the servers count the attempts from TORCHELASTIC_RESTART_COUNT)."""
    server = procs.server("--mode", "sync")
    (tmp_path / "out").mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--monitor-interval", "0.1", SCRIPT, str(tmp_path / "out"), str(STEPS), "mlp"]
    r = run_group(argv, 240, "torchrun --max-restarts 1", cwd=ROOT, capture_output=True, text=True,
                  env=child_env(COMMLAB_EXCHANGER=f"ps://{server.address}?mode=sync&update=server", OMP_NUM_THREADS=1,
                                KILL_RANK=1, KILL_STEP=7, KILL_AFTER_PUSH_OF=0))
    assert r.returncode == 0, r.stderr[-3000:]
    want, momentum, _ = _reference(restarted_from=7)
    for rec in _records(tmp_path, 1):
        assert rec["start_step"] == 7 and rec["restored"] == {"step": 7}, rec
        for key, value in want.items():
            assert torch.allclose(torch.tensor(rec["params"][key]), value, atol=1e-5), (rec["rank"], key)
        assert rec["servers"][0]["updates"] == STEPS and rec["servers"][0]["replaced"] == 1, rec["servers"]


ATTEMPTS = """
import os, sys, time
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(sys.argv[1], "a") as fh:
    fh.write(f"{rank} {attempt} {os.environ['MASTER_PORT']} {os.environ['TORCHELASTIC_MAX_RESTARTS']}\\n")
if attempt == "0" and rank == "1":
    sys.exit(3)
time.sleep(600)
"""


def test_every_attempt_gets_the_restart_count_and_a_fresh_store_and_the_deadline_spans_them(tmp_path):
    script, seen = tmp_path / "attempts.py", tmp_path / "seen.txt"
    script.write_text(ATTEMPTS)
    r = run_group([sys.executable, "-m", "commlab.tools.cli", "run", "--workers", "2", "--max-restarts", "2", "--deadline",
                   "4", "--exchanger", "noop://", str(script), str(seen)], 120, cwd=ROOT, env=child_env(),
                  capture_output=True, text=True)
    assert r.returncode == 124, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "commlab run: passed its deadline of 4s with rank 0, rank 1 still running; stopped every process "
        "(after 1 restart (failed: rank 1 (exit code 3)))"), r.stderr
    rows = sorted(tuple(line.split()) for line in seen.read_text().splitlines())
    assert [(rank, attempt, limit) for rank, attempt, _, limit in rows] == [
        ("0", "0", "2"), ("0", "1", "2"), ("1", "0", "2"), ("1", "1", "2")], rows
    ports = {attempt: {port for _, a, port, _ in rows if a == attempt} for attempt in ("0", "1")}
    assert len(ports["0"]) == len(ports["1"]) == 1 and ports["0"] != ports["1"], ports  # one store per attempt


def test_a_restart_that_cannot_reach_its_servers_fails_naming_the_shard(tmp_path, procs):
    """Servers started beside the job (named in the URL) and gone: each attempt's setup times out naming the
    shard; after the restarts the launcher's last line names the rank and how many restarts there were."""
    server = procs.server("--mode", "sync")
    address = server.address
    server.proc.kill()
    server.proc.wait(10)
    r = _run(tmp_path, f"ps://{address}?mode=sync&update=server&timeout=2&retries=0", "mlp", timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"shard 0/1 at tcp://{address} did not answer hello within 2s" in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    # the launcher's summary: its first line names the rank; the restarts end it, after the rank's last log lines
    # when it quotes them (whether it has them to quote depends on when the rank's log reached the file)
    said = [ln for ln in lines if ln.startswith("commlab run: rank ")]
    assert said and "failed first (exit code 1); stopped the others" in said[-1], lines[-5:]
    assert "(after 1 restart (failed: rank " in lines[-1], lines[-1]


def test_a_rank_killed_between_its_applied_step_and_commit_state_replays_that_step(tmp_path):
    """Issue 38, item 7: rank 1 dies after the servers applied its step 9 and its scheduler stepped, before
    ex.commit_state: its kept state belongs to step 9, the servers resume at 10. The restarted rank 1 resumes
    at 9 (ex.restored_step) and replays step 9 (run by its loop, pushed nowhere), so its scheduler is where
    the uninterrupted run's is: every rank ends with the reference's parameters, momentum and learning
    rate (StepLR halves it at step 10: one step behind, rank 1 would end with twice the rate)."""
    r = _run(tmp_path, "ps://?shards=1&mode=sync&update=server", "mlp", KILL_BEFORE_COMMIT_STATE=9)
    assert r.returncode == 0, r.stderr[-3000:]
    want, momentum, lr = _reference(restarted_from=10)
    recs = _records(tmp_path, 1)
    for rec in recs:
        for key, value in want.items():
            assert torch.allclose(torch.tensor(rec["params"][key]), value, atol=1e-5), (rec["rank"], key)
        for i, m in enumerate(momentum):
            assert torch.allclose(torch.tensor(rec["momentum"][str(i)]), m, atol=1e-5), (rec["rank"], i)
        assert rec["lr"] == [pytest.approx(lr)], (rec["rank"], rec["lr"])
        assert rec["servers"][0]["updates"] == STEPS, rec["servers"]
    assert [(rec["start_step"], rec["restored_step"]) for rec in recs] == [(10, 10), (9, 9)], recs
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "its committed state belongs to step 9, the servers are at step 10: the loop replays steps 9..9" in log
