"""Faults and strangers: keys, a killed worker, a killed server shard, and load, with real processes.

The ring's "every survivor raises within the timeout, naming the lost rank" is
tests/test_ring.py::test_killed_rank_is_named_by_every_survivor (not repeated here); the launcher's "exits
non-zero naming the rank" for allreduce:// is tests/test_allreduce.py; here it is checked for ps://.
Every process is killed at the end (:class:`faultkit.Procs`), every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

import commlab
from commlab.transport import keys, shm
from commlab.base.errors import CommTimeout
from commlab.transport.rendezvous import RankInfo

from faultkit import finish, kill9, kill_rank_under_launcher, wait_until
from test_security import RecordingProxy

pytestmark = pytest.mark.multiproc



def param_of(out: str) -> list[float]:
    return json.loads(out.strip().splitlines()[-1])["param"]


# ----- authentication ----------------------------------------------------------------------------

def test_server_refuses_a_public_address_without_keys_and_says_how(procs, tmp_path):
    public = procs.popen([sys.executable, "-m", "commlab.tools.cli", "server", "--bind", "tcp://0.0.0.0:0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    missing = procs.popen([sys.executable, "-m", "commlab.tools.cli", "server", "--keys", str(tmp_path / "none")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (code, _, err), (code2, _, err2) = finish([public, missing], timeout=120)
    assert code == 2
    assert "refusing to bind tcp://0.0.0.0:0 without authentication" in err
    assert "--keys DIR" in err and "--insecure" in err
    assert code2 == 2 and "create it with 'commlab keys" in err2


class Probe(nn.Module):
    """One parameter whose bytes spell a sentinel: visible in any plaintext init message."""

    MARK = b"commlab-sentinel" * 4  # 64 bytes: 16 finite float32 values

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.frombuffer(bytearray(self.MARK), dtype=torch.float32).clone())


def _train_through_proxy(server, url_query: str, steps: int = 2) -> tuple[list, bytes]:
    proxy = RecordingProxy(server.port)
    try:
        model = Probe()
        start = model.w.detach().clone()
        url = f"ps://127.0.0.1:{proxy.port}?timeout=10&retries=0{url_query}"
        with commlab.connect(url, RankInfo(0, 1, 0, "127.0.0.1", 0, "flags")) as ex:
            ex.setup(model, commlab.OptimizerSpec("sgd", lr=0.5))
            for _ in range(steps):
                ex.zero_grad()
                model.w.sum().backward()
                ex.step()
        torch.testing.assert_close(model.w.detach(), start - 0.5 * steps, rtol=0, atol=1e-6 * start.abs().max())
        return model.w.tolist(), bytes(proxy.seen)
    finally:
        proxy.close()


def test_keys_encrypt_the_real_server_and_shut_out_strangers(procs, tmp_path):
    d = keys.create(tmp_path / "keys", ["worker"])
    stranger_dir = keys.create(tmp_path / "stranger", ["worker"])  # valid keys the server never authorised
    plain = procs.server("--mode", "sync")
    secure = procs.server("--mode", "sync", "--keys", str(d))
    # control: without keys the init message shows the parameter bytes on the wire
    _, seen = _train_through_proxy(plain, "")
    assert Probe.MARK in seen and b"rank0" in seen
    # with keys: same training, nothing readable
    _, seen = _train_through_proxy(secure, f"&keys={d}&key_name=worker")
    assert len(seen) > 1000 and Probe.MARK not in seen and b"rank0" not in seen and b"push" not in seen
    # a client without keys, or with a key the server does not know: no reply, no data
    for query in ("", f"&keys={stranger_dir}"):
        model = Probe()
        before = model.w.detach().clone()
        url = f"ps://{secure.address}?timeout=2&retries=0{query}"
        with pytest.raises(CommTimeout, match=r"did not answer hello within 2s") as caught:
            commlab.connect(url, RankInfo(0, 1, 0, "127.0.0.1", 0, "flags")).setup(model, commlab.OptimizerSpec())
        assert (caught.value.peer, caught.value.op) == ("shard 0", "receive")  # typed fields, not only the text
        assert torch.equal(model.w.detach(), before)
    stats = _secure_stats(secure, d)
    assert stats["workers"] == [0] and stats["updates"] == 2  # the authorised worker's two steps only


def _secure_stats(server, d) -> dict:
    model = Probe()
    url = f"ps://{server.address}?timeout=10&keys={d}"
    with commlab.connect(url, RankInfo(0, 1, 0, "127.0.0.1", 0, "flags")) as ex:
        ex.setup(model, commlab.OptimizerSpec("sgd", lr=0.5))
        return ex.server_stats()[0]


# ----- a worker dies -------------------------------------------------------------------------------

TIMEOUT = 8  # the workers' configured timeout, seconds


def test_a_killed_worker_is_named_by_sync_survivors_and_async_goes_on(procs):
    """Both at once (one sync and one async server, three workers each, rank 1 killed in both).
    Sync: the survivors' pulls time out; a probe finds the shard alive and waiting for rank 1,
    which the error names. Async: the survivors finish and every push is applied once."""
    sync = procs.server("--mode", "sync")
    sync_url = f"ps://{sync.address}?mode=sync&timeout={TIMEOUT}"
    sync_workers = [procs.worker(sync_url, r, 3, 100000, "--sleep", "0.02") for r in range(3)]
    server = procs.server("--mode", "async")
    url = f"ps://{server.address}?mode=async&timeout={TIMEOUT}"
    victim = procs.worker(url, 1, 3, 100000, "--sleep", "0.01")
    survivors = [procs.worker(url, r, 3, 150, "--grad", "0.25", "--lr", "0.5", "--sleep", "0.01") for r in (0, 2)]
    wait_until(lambda: sync.stats()["updates"] >= 5, 90, "no sync step was applied")
    kill9(sync_workers[1])
    killed_at = time.monotonic()
    wait_until(lambda: server.stats()["last_step"].get("1", -1) >= 5, 90, "the async victim never stepped")
    kill9(victim)
    results = finish([sync_workers[0], sync_workers[2]], timeout=3 * TIMEOUT + 30)
    took = time.monotonic() - killed_at
    for code, _, err in results:
        assert code != 0
        assert "CommTimeout" in err and "waits for rank(s) [1] (dead or stalled?)" in err, err[-2000:]
    print(f"sync survivors raised {took:.1f}s after the kill (timeout {TIMEOUT}s + one probe)")
    for code, _, err in finish(survivors, timeout=120):
        assert code == 0, err[-2000:]
    stats = server.stats()
    # every push applied once: the survivors' 2 x 150 and the victim's before it died
    assert stats["updates"] == stats["pushes"] > 2 * 150
    assert stats["duplicates"] == 0 and stats["refused"] == 0
    # each update moved every element by lr * grad = 0.125, exactly
    code, out, err = finish([procs.worker(url, 0, 3, 0)], 60)[0]
    assert code == 0, err
    assert param_of(out) == [-0.125 * stats["updates"]] * 5


def test_launcher_exits_non_zero_naming_the_killed_ps_worker():
    code, err, left = kill_rank_under_launcher(f"ps://?shards=2&mode=sync&timeout={TIMEOUT}", "tiny", rank=1,
                                               settle_s=3)
    assert code != 0
    assert "rank 1 failed first (signal SIGKILL)" in err
    assert left == []


# ----- a server dies -------------------------------------------------------------------------------

STEPS = 150


def _train(procs, url: str, out) -> subprocess.Popen:
    # a process group of its own (Procs.popen): finish() and Procs.close() stop its ranks too
    return procs.popen([sys.executable, "-m", "commlab.tools.cli", "train", "--no-progress", "--exchanger", url,
                        "--workers", "2", "--model", "tiny", "--steps", str(STEPS), "--batch-size", "16",
                        "--optimizer", "adam", "--lr", "0.01", "--seed", "3", "--save-params", str(out)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_killed_sync_shard_resumes_and_the_run_ends_as_if_never_interrupted(procs, tmp_path, transport):
    """Checkpoint every update; kill -9 mid-run; restart with --resume on the same port. The
    workers time out, find a new server process, hello again (shm: a new link) and resend the
    step's pushes; the result equals, bit for bit, a run against a server that never died (2
    workers: the mean of two gradients does not depend on their arrival order)."""
    ckpt = tmp_path / "ckpt"
    victim = procs.server("--mode", "sync", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    steady = procs.server("--mode", "sync")
    query = f"mode=sync&timeout={TIMEOUT}&bucket_mb=0.004&transport={transport}"
    interrupted = _train(procs, f"ps://{victim.address}?{query}", tmp_path / "interrupted.pt")
    reference = _train(procs, f"ps://{steady.address}?{query}", tmp_path / "reference.pt")
    at_kill = wait_until(lambda: (u := victim.stats()["updates"]) >= 20 and u, 120, "the run never reached step 20")
    kill9(victim.proc)
    restarted = procs.server("--mode", "sync", "--resume", str(ckpt), "--checkpoint-every", "1",
                             bind=f"tcp://127.0.0.1:{victim.port}")
    for code, _, err in finish([interrupted, reference], timeout=240):
        assert code == 0, err[-3000:]
    stats = restarted.stats()
    assert at_kill < STEPS and stats["updates"] == STEPS and stats["version"] == STEPS
    got, ref = torch.load(tmp_path / "interrupted.pt"), torch.load(tmp_path / "reference.pt")
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    dead = str(victim.proc.pid)
    assert not [n for n in os.listdir(shm.SHM_DIR) if (m := shm.NAME.fullmatch(n)) and m["pid"] == dead]
    print(f"server killed after {at_kill} of {STEPS} sync updates; resumed; duplicates seen after the "
          f"restart: {stats['duplicates']}; result bit-identical to the uninterrupted run")


# ----- load ----------------------------------------------------------------------------------------

def _constant_worker(url: str, rank: int, world: int, steps: int, size: int, errors: list, finals: dict) -> None:
    """tests/ps_driver.py's worker, as a thread: gradient 0.25 everywhere, ``steps`` steps; then, once the
    server applied every worker's steps, the newest parameters (``finals[rank]``)."""
    try:
        model = nn.ParameterList([nn.Parameter(torch.zeros(size))])
        with commlab.connect(url, RankInfo(rank, world, rank, "127.0.0.1", 0, "flags")) as ex:
            ex.setup(model, commlab.OptimizerSpec("sgd", lr=0.5))
            for _ in range(steps):
                ex.zero_grad()
                (model[0] * 0.25).sum().backward()
                ex.step()
            wait_until(lambda: ex.server_stats()[0]["version"] >= world * steps, 120, "not every update landed",
                       every=0.01)
            ex.pull_latest()
            finals[rank] = model[0].detach().tolist()
    except BaseException as exc:  # reported by the test
        errors.append(f"rank {rank}: {exc!r}")


def test_eight_workers_500_async_pushes_each_exact_count_and_flat_memory(procs):
    """Eight workers (threads of this process, each with its own client and connections, so
    that eight interpreters do not spend the test importing torch) against one server process."""
    server = procs.server("--mode", "async")
    url = f"ps://{server.address}?mode=async&timeout=60"
    rss_idle = server.rss_kib()
    errors: list = []
    finals: dict = {}
    threads = [threading.Thread(target=_constant_worker, args=(url, r, 8, 500, 1024, errors, finals), daemon=True)
               for r in range(8)]
    for t in threads:
        t.start()
    # "start" once every worker is attached and stepping: first-use costs (8 connections, the
    # optimizer, torch's kernels) are paid by then, so what follows is growth per message
    wait_until(lambda: errors or (s := server.stats())["workers"] == list(range(8)) and
               min(s["last_step"].values()) >= 20, 120, "not every worker reached step 20")
    rss_start = server.rss_kib()
    deadline = time.monotonic() + 240
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    assert errors == [] and not any(t.is_alive() for t in threads)
    rss_end = server.rss_kib()
    stats = server.stats()
    assert stats["updates"] == 4000 and stats["version"] == 4000 and stats["duplicates"] == 0
    assert stats["queue"] == 0
    # 4000 updates of lr * grad, exact in float32: what every worker pulls once all landed
    assert [finals[r] for r in range(8)] == [[-0.125 * 4000] * 1024] * 8
    params_kib = 1024 * 4 // 1024
    growth = rss_end - rss_start
    print(f"server RSS: {rss_idle} KiB idle, {rss_start} KiB with 8 workers stepping, {rss_end} KiB after "
          f"4000 updates (+{growth} KiB)")
    # the parameters (4 KiB) and their one reused gradient buffer per worker, plus allocator slack:
    # a leak of 1 KiB per update alone would be 4000 KiB
    assert growth <= params_kib * 9 + 2048
