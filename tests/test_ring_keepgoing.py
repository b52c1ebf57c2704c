"""Keep going when a rank dies (issue 38, item 3): ``ring://`` and ``allreduce://`` with ``min_workers=M``.

The ranks run tests/ring_keepgoing_script.py, started as torchrun's agent starts them (each its own process, the
rendezvous store in a process of its own, which outlives any rank); a replacement is started the same way for
the dead rank. Faults are forced at exact points by the script's hooks (a SIGKILL inside a step's exchange, or
between its exchange and its vote; a SIGSTOP), never by timing. Every result is compared with one process
that averages, step by step, the gradients of the ranks that took part in that step: the dead rank's
gradient is absent exactly for the steps it missed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import faultkit
from test_restart import _leftovers

pytestmark = pytest.mark.multiproc

SCRIPT = str(Path(__file__).resolve().parent / "ring_keepgoing_script.py")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ring_keepgoing_script as ks  # noqa: E402  (the script's model, data and optimizer, for the reference)


def _rank(procs, tmp_path: Path, url: str, port: int, rank: int, world: int, steps: int, **env) -> subprocess.Popen:
    env = {**faultkit.AGENT_ENV, "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "COMMLAB_EXCHANGER": url, "OMP_NUM_THREADS": 1,
           "TMPDIR": tmp_path / "tmp", **env}
    return procs.popen([sys.executable, SCRIPT, str(tmp_path / "out"), str(steps)], {k: str(v) for k, v in env.items()},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start(tmp_path: Path, url: str, world: int, steps: int, **env):
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    procs = faultkit.Procs(tmp_path)
    port = procs.store("127.0.0.1")
    ranks = [_rank(procs, tmp_path, url, port, r, world, steps, **env) for r in range(world)]
    return procs, port, ranks


def _records(tmp_path: Path) -> dict[int, dict]:
    """pid -> what that rank wrote."""
    out = {}
    for f in (tmp_path / "out").glob("rank*.pt"):
        rec = torch.load(f, weights_only=False)
        rec["rank"] = int(f.name.split(".")[0].removeprefix("rank"))
        out[rec["pid"]] = rec
    return out


def _reference(steps: int, members: dict[int, list[int]]) -> list[dict]:
    """One process: at each step, the mean of the gradients of that step's members (each on its own batch), Adam."""
    model, opt = ks.build()
    states = []
    for step in range(steps):
        grads = []
        for r in members[step]:
            opt.zero_grad()
            x, y = ks.batch(step, r)
            torch.nn.functional.mse_loss(model.body(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / len(grads)
        opt.step()
        model.calls += 1
        states.append(ks.snapshot(model, opt))
    return states


def _same(a: dict, b: dict, exact: bool, what: str) -> None:
    for part in ("params", "buffers"):
        for i, (x, y) in enumerate(zip(a[part], b[part], strict=True)):
            if exact:
                assert torch.equal(x, y), f"{what}: {part}[{i}] differs"
            else:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {part}[{i}]: {m}")
    assert a["optim"].keys() == b["optim"].keys(), what
    for i in a["optim"]:
        for k, v in a["optim"][i].items():
            w = b["optim"][i][k]
            if exact:
                assert torch.equal(v, w), f"{what}: optimizer state {i}.{k} differs"
            else:
                torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {i}.{k}: {m}")


def _wait_file(path: Path, procs_: list[subprocess.Popen], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        assert not any(p.poll() not in (None, 0) for p in procs_), "a rank failed before the fault"
        time.sleep(0.02)


@pytest.mark.parametrize("url,said", [
    ("ring://?min_workers=-1", "min_workers must be >= 0"),
    ("ring://?min_workers=2&heartbeat_s=nan", "heartbeat_s must be a finite number"),
    ("ring://?min_workers=2&sync_every=4", "option 'min_workers' (keep going) with sync_every="),
    ("ring://?min_workers=2&transport=torch", "option 'min_workers' (keep going) needs the ring's own links"),
    ("ring://?min_workers=2&heartbeat_s=30&timeout=10", "option 'heartbeat_s': 30 s must be below timeout"),
    ("allreduce://?min_workers=2&backend=nccl", "option 'min_workers' (keep going) needs backend=gloo"),
])
def test_keep_going_options_are_checked_when_the_url_is_parsed(url, said):
    from commlab.base.config import ExchangerURL
    from commlab.base.errors import ConfigError
    from commlab.core.registry import regime_class
    parsed = ExchangerURL.parse(url)
    with pytest.raises(ConfigError, match=re.escape(said)):
        regime_class(parsed.scheme).options_from_url(parsed)


@pytest.mark.parametrize("url,where,victim", [
    ("ring://?transport=tcp&min_workers=2&bucket_mb=0.00001&timeout=60", "exchange", 1),
    pytest.param("ring://?transport=shm&min_workers=2&bucket_mb=0.00001&timeout=60", "vote", 1, marks=pytest.mark.full),
    pytest.param("ring://?transport=auto&min_workers=2&bucket_mb=0.00001&timeout=60", "exchange", 0,
                 marks=pytest.mark.full),
    pytest.param("allreduce://?min_workers=2&bucket_mb=0.00001&timeout=60", "exchange", 1, marks=pytest.mark.full),
])
def test_a_rank_killed_inside_a_step_is_left_out_of_it_and_its_replacement_is_healed(tmp_path, url, where, victim):
    """3 ranks; rank 1 (or 0) SIGKILLs itself inside step 4 (``where``); the survivors (pids unchanged) discard the
    step, re-form and redo it over the other two; a replacement asks to join, step 7's commit admits it, it takes
    the lowest survivor's state and trains from step 8. Every rank's parameters, buffers and Adam state equal the
    one-process reference whose step s averages the gradients of step s's members; the replacement's state when
    it enters equals the survivors' after step 7, bit for bit; nothing is left behind."""
    world, steps, kill, admit = 3, 12, 4, 7
    others = [r for r in range(world) if r != victim]
    before_shm = set(os.listdir("/dev/shm"))
    procs, port, ranks = _start(tmp_path, url, world, steps, KG_KILL=f"{victim}:{kill}:{where}",
                                KG_AWAIT_JOIN=f"{victim}:{admit}")
    try:
        pids = [p.pid for p in ranks]
        assert ranks[victim].wait(120) == -signal.SIGKILL, ranks[victim].communicate()
        replacement = _rank(procs, tmp_path, url, port, victim, world, steps, KG_ASK_AT=admit, KG_WATCH=others[0])
        done = faultkit.finish([ranks[r] for r in others] + [replacement], 180)
        assert [rc for rc, _, _ in done] == [0, 0, 0], "\n".join(f"[{w}] {err[-2500:]}" for w, (_, _, err) in
                                                                 zip((*others, "replacement"), done))
    finally:
        procs.close()
    recs = _records(tmp_path)
    survivors = {pid: rec for pid, rec in recs.items() if pid in pids}
    assert sorted(r["rank"] for r in survivors.values()) == others  # the survivors never restarted: their own pids
    new = [rec for pid, rec in recs.items() if pid not in pids]
    assert len(new) == 1 and new[0]["rank"] == victim and new[0]["start_step"] == admit + 1
    members = {s: (others if kill <= s <= admit else [0, 1, 2]) for s in range(steps)}
    for rec in recs.values():
        for s, m in rec["members"].items():
            assert m == members[s], f"rank {rec['rank']} (pid {rec['pid']}) step {s}: members {m}"
    ref = _reference(steps, members)
    first = next(rec for rec in survivors.values() if rec["rank"] == others[0])
    for rec in recs.values():
        for s, state in rec["states"].items():
            _same(state, ref[s], False, f"rank {rec['rank']} (pid {rec['pid']}) after step {s}")
            _same(state, first["states"][s], True, f"rank {rec['rank']} against rank {others[0]} after step {s}")
    _same(new[0]["entered"], first["states"][admit], True, "the replacement as it entered, after step 7")
    assert new[0]["facts"]["healed"]["step"] == admit + 1 and first["facts"]["lost"] == [] \
        and first["facts"]["members"] == [0, 1, 2], (new[0]["facts"], first["facts"])
    assert _leftovers(tmp_path, before_shm) == []


@pytest.mark.parametrize("when", [pytest.param("heal", marks=pytest.mark.full), "reform"])
def test_a_member_killed_while_a_replacement_meets_or_is_healed_is_left_out_and_the_heal_is_redone(tmp_path, when):
    """Rank 1 dies inside step 4; its replacement is admitted at step 7; rank 2 dies as the heal begins (heal), or
    as the ring of the admitting epoch forms, while the replacement, in its setup, waits for rank 2's link (reform:
    the replacement re-forms with rank 0 instead of failing). Ranks 0 and the replacement re-form, the heal is
    (re)done from rank 0, and they train on over {0, 1}: the reference holds with ranks {0, 2} for steps 4-7 and
    {0, 1} from step 8."""
    url = "ring://?transport=tcp&min_workers=2&bucket_mb=0.00001&timeout=60"
    world, steps, kill, admit = 3, 12, 4, 7
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    procs = faultkit.Procs(tmp_path)
    port = procs.store("127.0.0.1")
    env = {"KG_AWAIT_JOIN": f"1:{admit}"}
    ranks = [_rank(procs, tmp_path, url, port, 0, world, steps, **env),
             _rank(procs, tmp_path, url, port, 1, world, steps, KG_KILL=f"1:{kill}:exchange", **env),
             _rank(procs, tmp_path, url, port, 2, world, steps, KG_KILL=f"2:{admit}:{when}", **env)]
    try:
        pids = [p.pid for p in ranks]
        assert ranks[1].wait(120) == -signal.SIGKILL
        replacement = _rank(procs, tmp_path, url, port, 1, world, steps, KG_ASK_AT=admit)
        done = faultkit.finish([ranks[0], replacement], 180)
        assert [rc for rc, _, _ in done] == [0, 0], "\n".join(err[-2500:] for _, _, err in done)
        assert ranks[2].wait(10) == -signal.SIGKILL
    finally:
        procs.close()
    recs = _records(tmp_path)
    members = {s: ([0, 1, 2] if s < kill else [0, 2] if s <= admit else [0, 1]) for s in range(steps)}
    ref = _reference(steps, members)
    assert sorted((r["rank"], r["pid"] in pids) for r in recs.values()) == [(0, True), (1, False)]
    for rec in recs.values():
        for s, m in rec["members"].items():
            assert m == members[s], f"rank {rec['rank']} step {s}: members {m}"
        for s, state in rec["states"].items():
            _same(state, ref[s], False, f"rank {rec['rank']} after step {s}")
    r0 = next(rec for rec in recs.values() if rec["rank"] == 0)
    new = next(rec for rec in recs.values() if rec["rank"] == 1)
    _same(new["entered"], r0["states"][admit], True, "the replacement as it entered")


@pytest.mark.full
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_killed_while_the_ring_re_forms_is_left_out_too(tmp_path, transport):
    """4 ranks: rank 1 dies inside step 4, rank 2 as its ring re-forms for the redo; ranks 0 and 3 re-form again (a
    shared-memory link's wait for the dead neighbour ends on its death, not the timeout) and redo step 4 over
    {0, 3}: the reference holds."""
    url = f"ring://?transport={transport}&min_workers=2&bucket_mb=0.00001&timeout=60"
    world, steps, kill = 4, 8, 4
    procs, _, ranks = _start(tmp_path, url, world, steps, KG_KILL1=f"1:{kill}:exchange", KG_KILL2=f"2:{kill}:reform")
    try:
        done = faultkit.finish([ranks[0], ranks[3]], 120)
        assert [rc for rc, _, _ in done] == [0, 0], "\n".join(err[-2500:] for _, _, err in done)
        assert ranks[1].wait(10) == ranks[2].wait(10) == -signal.SIGKILL
    finally:
        procs.close()
    recs = _records(tmp_path)
    members = {s: ([0, 1, 2, 3] if s < kill else [0, 3]) for s in range(steps)}
    ref = _reference(steps, members)
    assert sorted(r["rank"] for r in recs.values()) == [0, 3]
    for rec in recs.values():
        assert rec["members"] == members, rec["members"]
        for s, state in rec["states"].items():
            _same(state, ref[s], False, f"rank {rec['rank']} after step {s}")


@pytest.mark.full
def test_with_error_feedback_a_replacement_takes_the_shared_compressor_state_and_no_residual(tmp_path):
    """compress=int8 with error feedback: rank 1 dies inside step 4, its replacement enters at step 8. The survivors
    agree bit for bit at every step (each step's sums are every rank's); the replacement enters with rank 0's
    parameters and Adam state and the compressor's shared state, and no residual of its own (a residual is what a
    rank's own gradients have not got across: rank 0's would count its error twice)."""
    url = "ring://?transport=tcp&min_workers=2&bucket_mb=0.00001&timeout=60&compress=int8"
    world, steps, kill, admit = 3, 12, 4, 7
    procs, port, ranks = _start(tmp_path, url, world, steps, KG_KILL=f"1:{kill}:exchange", KG_AWAIT_JOIN=f"1:{admit}")
    try:
        pids = [p.pid for p in ranks]
        assert ranks[1].wait(120) == -signal.SIGKILL
        replacement = _rank(procs, tmp_path, url, port, 1, world, steps, KG_ASK_AT=admit)
        done = faultkit.finish([ranks[0], ranks[2], replacement], 180)
        assert [rc for rc, _, _ in done] == [0, 0, 0], "\n".join(err[-2500:] for _, _, err in done)
    finally:
        procs.close()
    recs = _records(tmp_path)
    r0 = next(rec for pid, rec in recs.items() if rec["rank"] == 0 and pid in pids)
    members = {s: ([0, 2] if kill <= s <= admit else [0, 1, 2]) for s in range(steps)}
    for rec in recs.values():
        assert all(m == members[s] for s, m in rec["members"].items()), rec["members"]
        for s, state in rec["states"].items():
            _same(state, r0["states"][s], True, f"rank {rec['rank']} against rank 0 after step {s}")
    new = next(rec for pid, rec in recs.items() if pid not in pids)
    _same(new["entered"], r0["states"][admit], True, "the replacement as it entered")
    entered, theirs = new["entered"]["compress"], r0["states"][admit]["compress"]
    assert entered["residuals"] == {} and theirs["residuals"], (entered, theirs)
    assert entered["inner"] == theirs["inner"]


def test_a_quorum_below_min_workers_ends_the_job_naming_the_ranks_lost(tmp_path):
    url = "ring://?transport=tcp&min_workers=2&bucket_mb=0.00001&timeout=60"
    before_shm = set(os.listdir("/dev/shm"))
    procs, _, ranks = _start(tmp_path, url, 2, 8, KG_KILL="1:3:exchange")
    try:
        (rc0, _, err0), (rc1, _, _) = faultkit.finish(ranks, 120)
    finally:
        procs.close()
    assert rc1 == -signal.SIGKILL
    assert rc0 != 0
    last = err0.strip().splitlines()[-1]
    assert "QuorumLost" in last and "below min_workers=2: lost rank(s) [1]" in last, err0[-2000:]
    assert _leftovers(tmp_path, before_shm) == []


@pytest.mark.full
def test_a_stopped_rank_that_comes_back_after_the_others_re_formed_is_refused(tmp_path):
    """Rank 1 SIGSTOPs itself inside step 3; ranks 0 and 2 take it for dead after heartbeat_s, re-form and finish;
    continued, rank 1 finds itself left out of the new membership epoch and stops, merging nothing."""
    url = "ring://?transport=tcp&min_workers=2&heartbeat_s=1&bucket_mb=0.00001&timeout=60"
    world, steps = 3, 8
    procs, _, ranks = _start(tmp_path, url, world, steps, KG_KILL="1:3:stop")
    try:
        done = faultkit.finish([ranks[0], ranks[2]], 120)
        for rc, out, err in done:
            assert rc == 0, err[-3000:]
        os.kill(ranks[1].pid, signal.SIGCONT)
        (rc1, _, err1), = faultkit.finish([ranks[1]], 60)
    finally:
        procs.close()
    assert rc1 != 0
    assert "StaleMember" in err1 and "was left out of membership epoch 1" in err1, err1[-2000:]
    recs = _records(tmp_path)
    assert sorted(r["rank"] for r in recs.values()) == [0, 2]
    members = {s: ([0, 1, 2] if s < 3 else [0, 2]) for s in range(steps)}
    ref = _reference(steps, members)
    for rec in recs.values():
        assert rec["members"] == members
        for s, state in rec["states"].items():
            _same(state, ref[s], False, f"rank {rec['rank']} after step {s}")
