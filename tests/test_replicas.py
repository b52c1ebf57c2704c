"""Replicated shards (``ps://?replicas=2``, servers/replication.py): a primary killed at exact points.

Each kill is forced by the primary itself ($COMMLAB_SERVER_FAULT, :class:`servers.replication.Fault`) at one
request: on its arrival (before a push is applied), after serving it but never streamed to the backup, after
serving and streaming it but before the backup's ack, and once the backup acked it. The workers (tests/ps_driver.py,
a constant gradient) fail over to the backup and finish; the result is the closed form of a run that never
failed (every update applied once: sync ``-lr * g * steps``, async ``updates == workers * steps``), and the
backup's counts say so. A backup started mid-run takes the primary's state and ends bit for bit equal to it.
The same with a real model and Adam against an uninterrupted run is under ``full`` (test_replicated_train_*).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from commlab.regimes.ps import server_stats
from commlab.transport import shm

from faultkit import Raw, finish, kill9, wait_until

pytestmark = pytest.mark.multiproc

TIMEOUT = 20  # the workers' timeout: a failover must not wait for it (the closed connection says so at once)
LR, GRAD = 0.5, 0.25



def replicated(procs, mode: str, shards: int = 1, fault: str = "", fault_shard: int = 0,
               log: str = "4") -> tuple[list, str]:
    """``shards`` shards of two servers each (the primary first, its backup attached); the primary of
    ``fault_shard`` runs with ``$COMMLAB_SERVER_FAULT=fault``. ``log``: their --replica-log. Returns
    [(primary, backup)] and the URL's servers."""
    pairs = []
    for i in range(shards):
        env = {"COMMLAB_SERVER_FAULT": fault} if fault and i == fault_shard else None
        primary = procs.server("--mode", mode, "--shard", f"{i}/{shards}", "--replica-log", log, env=env)
        backup = procs.server("--mode", mode, "--shard", f"{i}/{shards}", "--replica-log", log,
                              "--replica-of", primary.endpoint)
        pairs.append((primary, backup))
    return pairs, ",".join(f"{p.address},{b.address}" for p, b in pairs)


def digest(server) -> dict:
    raw = Raw(server.endpoint)
    try:
        return raw.request("stats", digest=True).meta["stats"]
    finally:
        raw.close()


def param_of(out: str) -> list[float]:
    return json.loads(out.strip().splitlines()[-1])["param"]


class Scenario:
    """One job against replicated shards whose primary dies at one point; checked against its closed form."""

    def __init__(self, procs, mode: str, fault: str, shards: int = 1, fault_shard: int = 0, steps: int = 30,
                 update: str = "server", workers: int = 2, query: str = "", log: str = "4",
                 sleeps: tuple[float, ...] = ()):
        self.mode, self.steps, self.workers, self.fault = mode, steps, workers, fault
        self.pairs, servers = replicated(procs, mode, shards, fault, fault_shard, log)
        self.victim = self.pairs[fault_shard][0]
        url = f"ps://{servers}?mode={mode}&replicas=2&update={update}&timeout={TIMEOUT}{query}"
        extra = ["--final-version", str(workers * steps)] if mode == "async" else []
        self.ranks = [procs.worker(url, r, workers, steps, "--grad", str(GRAD), "--lr", str(LR), "--sleep",
                                   str(sleeps[r] if sleeps else 0.01), *extra) for r in range(workers)]

    def check(self) -> None:
        for code, out, err in finish(self.ranks, timeout=180):
            assert code == 0, f"{self.fault}: {err[-3000:]}"
            updates = self.steps * (self.workers if self.mode == "async" else 1)
            assert param_of(out) == [-LR * GRAD * updates] * 5, self.fault  # every update once: exact in float32
        assert self.victim.proc.wait(10) == -9, f"{self.fault}: the primary was not killed by its fault"
        for primary, backup in self.pairs:
            alive = backup if primary is self.victim else primary
            stats = alive.stats()
            assert stats["replica"]["role"] == "primary", stats["replica"]
            want = self.workers * self.steps if self.mode == "async" else self.steps
            assert stats["updates"] == stats["version"] == want, (self.fault, stats)
            assert stats["last_step"] == {str(r): self.steps - 1 for r in range(self.workers)}
        dead = str(self.victim.proc.pid)
        assert not [n for n in os.listdir(shm.SHM_DIR) if (m := shm.NAME.fullmatch(n)) and m["pid"] == dead]


def test_a_replicated_primary_killed_mid_step_loses_nothing_and_applies_nothing_twice(procs):
    """Three jobs at once: sync (update=server, two shards, payloads in shared memory) whose shard 1 primary dies
    on rank 1's push of step 13 after serving it, before the backup's ack (shard 0 holds the push: between two
    shards' pushes); async (payloads in tcp frames) whose primary dies on the arrival of rank 0's push of step 9;
    the sync job again, 10 steps, with backups that apply each record as it arrives (--replica-log 0), rank 1
    sleeping 0.3 s a step so that rank 0's push of step 5 is the first of its step when shard 1's primary dies
    once the backup acknowledged it: the backup holds that push's header without the step's average, drops the half
    step when promoted, and both ranks push it again there. The first two backups log the stream and catch up when promoted
    (the default), the first with a fresh state copy from its primary every few steps (--replica-log 0.00002: 21
    bytes), so that it loads one and applies the log after it. A sync step's pushes reach the backup as headers,
    their average once (SUMS): shard 0 of the last job streamed its initial parameters and 10 averages, not the 20
    pushes."""
    jobs = [Scenario(procs, "sync", "unacked:push:1:13:1", shards=2, fault_shard=1, log="0.00002"),
            Scenario(procs, "async", "recv:push:0:9", query="&transport=tcp"),
            Scenario(procs, "sync", "acked:push:0:5:1", shards=2, fault_shard=1, log="0", steps=10,
                     sleeps=(0.01, 0.3))]
    for job in jobs:
        job.check()
    promoted = [b.stats()["replica"] for job in jobs for p, b in job.pairs if p is job.victim]
    assert promoted[0]["copies"] >= 3 and promoted[1].get("copies", 0) == 0 and promoted[2].get("copies", 0) == 0, \
        promoted
    assert promoted[2].get("elided_dropped") == 1, promoted[2]
    shard0 = jobs[2].pairs[0][0].stats()
    piece = shard0["bytes_in"] // 21  # rank 0's initial parameters, then 10 steps of 2 pushes
    assert shard0["pushes"] == 20 and shard0["bytes_in"] == 21 * piece > 0, shard0
    assert shard0["replica"]["sums"] == 10 and shard0["replica"]["streamed"] == 11 * piece, shard0  # not 21


@pytest.mark.full
@pytest.mark.parametrize("fault", ["recv:push:1:5", "unsent:push:0:5", "unacked:commit:1:5", "acked:commit:0:5",
                                   "acked:push:1:6", "unsent:commit:1:6"])
def test_sync_primary_killed_at_each_point(procs, fault):
    Scenario(procs, "sync", fault, shards=2, fault_shard=int(fault[-1]) % 2).check()


@pytest.mark.full
@pytest.mark.parametrize("fault", ["recv:push:1:5", "unsent:push:0:5", "unacked:push:1:5", "acked:push:0:5"])
def test_async_primary_killed_at_each_point(procs, fault):
    Scenario(procs, "async", fault).check()


@pytest.mark.full
@pytest.mark.parametrize("fault", ["unsent:push:1:5", "acked:push:0:6"])
def test_sync_update_worker_primary_killed(procs, fault):
    Scenario(procs, "sync", fault, update="worker").check()


def test_a_backup_started_mid_run_catches_up_bit_for_bit(procs, tmp_path):
    """A primary alone under a sync Adam job; a backup attaches at a step boundary, takes the state (parameters,
    Adam's moments and step, every rank's last step), follows the stream, and ends bit for bit equal to the
    primary: the key space's checkpoint each writes when the job's last rank closes it (the backup applies
    that bye too) holds the same tensors and values. It logs the stream, with a fresh copy of the state from the
    primary every 100 bytes or so (--replica-log 0.0001), and catches up once the space is freed. Then the primary
    dies and the backup serves a new job."""
    primary = procs.server("--mode", "sync", "--checkpoint-dir", str(tmp_path / "p"), "--replica-log", "0.0001")
    steps = 120
    url = f"ps://{primary.address}?mode=sync&update=server&timeout={TIMEOUT}"
    ranks = [procs.worker(url, r, 2, steps, "--optimizer", "adam", "--lr", "0.01", "--sleep", "0.02")
             for r in range(2)]
    wait_until(lambda: primary.stats()["updates"] >= 15, 120, "the job never reached step 15")
    backup = procs.server("--mode", "sync", "--replica-of", primary.endpoint, "--checkpoint-dir", str(tmp_path / "b"))
    taken = digest(backup)
    for code, _, err in finish(ranks, timeout=180):
        assert code == 0, err[-3000:]
    assert 15 <= taken["version"] < steps, "the backup did not attach mid-run"
    got, ref = (torch.load(tmp_path / d / "shard-0-of-1.pt", weights_only=True) for d in ("b", "p"))
    assert ref["version"] == steps and ref["optimizer"]["state"], ref["version"]
    _same(got, ref)
    held = backup.stats()["replica"]
    assert held["applied"] == primary.stats()["replica"]["acked"] and held["copies"] >= 10 and held["logged"] == 0, held
    kill9(primary.proc)
    code, out, err = finish([procs.worker(f"ps://{primary.address},{backup.address}?mode=sync&update=server"
                                          f"&replicas=2&timeout={TIMEOUT}", 0, 1, 2, "--optimizer", "adam",
                                          "--lr", "0.01")], 60)[0]
    assert code == 0, err[-2000:]
    assert backup.stats()["replica"]["role"] == "primary"


def test_a_backup_attached_before_rank_0_initialised_the_shard_follows_its_init(procs, tmp_path):
    """Rank 1 said hello (the key space exists, its model described) and waits at the start gate; rank 0 has not
    initialised it. A backup attaches then (its state has no parameters yet), applies rank 0's init from the
    stream, and ends bit for bit equal to the primary."""
    primary = procs.server("--mode", "sync", "--checkpoint-dir", str(tmp_path / "p"))
    url = f"ps://{primary.address}?mode=sync&update=server&timeout={TIMEOUT}"
    args = ("--optimizer", "adam", "--lr", "0.01")
    late = procs.worker(url, 1, 2, 20, *args)
    wait_until(lambda: primary.stats()["workers"] == [1], 120, "rank 1 never said hello")
    backup = procs.server("--mode", "sync", "--replica-of", primary.endpoint, "--checkpoint-dir", str(tmp_path / "b"))
    for code, _, err in finish([procs.worker(url, 0, 2, 20, *args), late], timeout=180):
        assert code == 0, err[-3000:]
    got, ref = (torch.load(tmp_path / d / "shard-0-of-1.pt", weights_only=True) for d in ("b", "p"))
    assert ref["version"] == 20
    _same(got, ref)
    assert backup.stats()["replica"]["role"] == "backup"


def test_a_new_backup_keeps_the_state_it_attached_with_and_loads_it_at_its_first_catch_up(procs):
    """The state a backup takes at its attach is a copy like the primary's fresh ones (--replica-log, default 4):
    kept as it came, not loaded while the primary's replies wait for the backup's acks of what follows it. One
    rank under way (Adam: moments to carry); the backup attaches mid-run; it has loaded nothing (applied -1) while
    it logs the stream. The rank frozen and every reply released, a digest makes it catch up once: its state is
    the primary's, bit for bit."""
    primary = procs.server("--mode", "sync")
    url = f"ps://{primary.address}?mode=sync&update=server&timeout={TIMEOUT}"
    rank = procs.worker(url, 0, 1, 100_000, "--optimizer", "adam", "--lr", "0.01", "--sleep", "0.01")
    try:
        wait_until(lambda: primary.stats()["updates"] >= 5, 120, "the job never reached step 5")
        backup = procs.server("--mode", "sync", "--replica-of", primary.endpoint)
        wait_until(lambda: backup.stats()["replica"]["logged"] >= 20, 60, "the backup never followed the stream")
        held = backup.stats()["replica"]
        assert held["applied"] == -1 and held.get("loaded", 0) == 0 and held["logged"] > 0, held
        os.kill(rank.pid, signal.SIGSTOP)
        wait_until(lambda: (lambda r: r["held"] == 0 and r["acked"] == r["seq"])(primary.stats()["replica"]), 60,
                   "the primary still held replies")
        mine, theirs = digest(backup), digest(primary)
        assert mine["digests"] == theirs["digests"] and mine["digests"], (mine["digests"], theirs["digests"])
        assert backup.stats()["replica"]["loaded"] == 1 and mine["updates"] == theirs["updates"] >= 5
    finally:
        rank.kill()


def _same(a, b, where: str = "state") -> None:
    """Equal bit for bit: tensors by their bytes (dtype and shape too), containers item by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_replica_options_are_checked_when_parsed(procs):
    from commlab.base.config import ExchangerURL
    from commlab.base.errors import ConfigError
    from commlab.regimes.ps import _options

    for bad in ("replicas=3", "replicas=0", "replicas=x"):
        with pytest.raises(ConfigError, match="replicas"):
            _options(ExchangerURL.parse(f"ps://127.0.0.1:1,127.0.0.1:2?{bad}"))
    for bad in ("replica_log=-1", "replica_log=x", "replica_log=2000"):
        with pytest.raises(ConfigError, match="replica_log"):
            _options(ExchangerURL.parse(f"ps://127.0.0.1:1,127.0.0.1:2?replicas=2&{bad}"))
    cli = [sys.executable, "-m", "commlab.tools.cli", "train", "--exchanger", "ps://?shards=1&replicas=3"]
    server = [sys.executable, "-m", "servers", "--log-every", "0"]
    runs = [procs.popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            procs.popen(server, env={"COMMLAB_SERVER_FAULT": "later:push:1:2"}, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True),
            procs.popen([*server, "--replica-log", "-2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    for (code, _, err), what in zip(finish(runs, 120), ("replicas", "COMMLAB_SERVER_FAULT", "--replica-log")):
        assert code == 2 and what in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.full
@pytest.mark.parametrize("fault", ["unacked:commit:1:40:0", "recv:push:0:41:1"])
def test_replicated_train_under_the_launcher_ends_as_if_never_interrupted(procs, tmp_path, fault):
    """commlab train, 2 shards x 2 replicas, a tiny model under Adam: a primary dies at an exact point (the
    launcher's servers share one environment: the fault names its shard, and backups ignore it); the workers
    fail over, the launcher starts a new backup of the survivor, the run ends rc 0 with parameters equal bit for
    bit to the same run whose servers never died."""
    def train(url: str, out, env=None):
        return procs.popen([sys.executable, "-m", "commlab.tools.cli", "train", "--no-progress", "--exchanger", url,
                            "--workers", "2", "--model", "tiny", "--steps", "80", "--batch-size", "16",
                            "--optimizer", "adam", "--lr", "0.01", "--seed", "3", "--save-params", str(out)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    url = f"ps://?shards=2&replicas=2&mode=sync&update=server&timeout={TIMEOUT}&bucket_mb=0.004"
    runs = [train(url, tmp_path / "killed.pt", {"COMMLAB_SERVER_FAULT": fault}), train(url, tmp_path / "ref.pt")]
    (code, _, err), (code2, _, err2) = finish(runs, timeout=400)
    assert code == 0 and code2 == 0, (err[-3000:], err2[-3000:])
    assert "injected fault" in err and "starting a new backup" in err and "took over" in err, err[-3000:]
    got, ref = torch.load(tmp_path / "killed.pt"), torch.load(tmp_path / "ref.pt")
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_the_replication_link_is_a_client_link_curve_and_the_job_secret(procs, tmp_path):
    """With --keys the backup connects to its primary as a CURVE client (DIR/replica.key_secret, admitted by
    DIR/clients like any worker's key), after proving the job's secret; without that key it exits 2 saying how
    to make it."""
    from commlab.transport import keys

    d = keys.create(tmp_path / "keys", ["worker", "replica"])
    primary = procs.server("--mode", "sync", "--keys", str(d))
    backup = procs.server("--mode", "sync", "--keys", str(d), "--replica-of", primary.endpoint)
    curve = keys.client_keys(d, "worker")
    for server, role in ((primary, "primary"), (backup, "backup")):
        raw = Raw(server.endpoint, curve=curve)
        try:
            assert raw.request("stats").meta["stats"]["replica"]["role"] == role
        finally:
            raw.close()
    no_replica = keys.create(tmp_path / "bare", ["worker"])
    lone = procs.popen([sys.executable, "-m", "servers", "--keys", str(no_replica), "--replica-of", primary.endpoint],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, _, err = finish([lone], 120)[0]
    assert code == 2 and "replica.key_secret" in err and len(err.strip().splitlines()) == 1, err


def test_a_shard_whose_servers_are_all_gone_fails_by_name_after_its_timeout():
    """Both servers of a replicated shard dead from the start: the worker's hello fails over between them at a bounded
    rate (a pause once every server failed lately) and ends after the timeout with the shard and server named; it
    used to spin, opening a watched connection at a time as fast as it could, and end in zmq's "Address already in
    use" or "Too many open files" (a chaos run's replacement did)."""
    import socket
    import time

    import commlab
    from commlab.base.errors import CommError
    from commlab.transport.rendezvous import RankInfo

    ports = []
    for _ in range(2):  # ports nobody listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    url = f"ps://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}?mode=sync&replicas=2&timeout=1&retries=0&transport=tcp"
    ex = commlab.connect(url, RankInfo.single())
    model = torch.nn.Linear(2, 2)
    started = time.monotonic()
    with pytest.raises(CommError, match=r"shard 0/1 at tcp://127\.0\.0\.1:\d+"):
        ex.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert time.monotonic() - started < 30
    ex.close()
