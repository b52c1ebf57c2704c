"""ps:// with ``transport=shm|auto`` (commlab.transport.psshm): what a link is made of, who owns its segments, and
that nothing stays in /dev/shm, whoever is killed. The arithmetic under shm is checked by the tests of
tests/test_ps.py, tests/test_ps_update.py and tests/test_fuzz.py, parametrized over tcp and shm."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import commlab
from commlab.launch import launcher
from commlab.transport import psproto, psshm, shm, wire
from commlab.base.errors import ConfigError
from commlab.core.manifest import describe_optimizer, model_manifest
from commlab.transport.rendezvous import RankInfo

from faultkit import ENV, LAUNCHER_ENV, REPO, START_TIMEOUT, Raw, children_of, kill9, wait_for_rank_process, wait_until

pytestmark = pytest.mark.multiproc


def segments_of(pids) -> list[str]:
    """Entries in /dev/shm owned (by their name) by one of ``pids``."""
    pids = {str(p) for p in pids}
    return sorted(n for n in os.listdir(shm.SHM_DIR)
                  if (m := shm.NAME.fullmatch(n)) is not None and m["pid"] in pids)


def raw_hello(server, rank: int = 0, world: int = 1, **extra):
    """A bare client's hello for nn.Linear(3, 2) (update=worker, sync), asking for a link."""
    model = nn.Linear(3, 2)
    manifest = [[n, list(s), d] for n, s, d in model_manifest(model)]
    pieces = psproto.assign_shards(model_manifest(model), 1, 2**24)[0]
    raw = Raw(server.endpoint, f"rank{rank}")
    optim = describe_optimizer(commlab.OptimizerSpec("sgd", lr=0.5).build(list(model.parameters())), model)
    h = raw.request("hello", rank=rank, world=world, mode="sync", manifest=manifest, shard=[0, 1],
                    pieces=[[p.key, p.dtype, p.count] for p in pieces], optim=optim,
                    shm_host=shm.host_identity(), **extra)
    assert h.op == "ok", h.meta
    return raw, h.meta["shm_link"], [(p.key, p.dtype, p.count) for p in pieces]



def test_layout_places_every_piece_aligned_and_apart():
    at, size = psshm.layout([("w", "float32", 6), ("b", "float16", 3), ("e", "float64", 0), ("z", "uint8", 65)])
    assert at == {"w": 0, "b": 64, "e": 128, "z": 128} and size == 256


def test_payloads_through_a_link_arrive_as_frames_would_both_ways():
    """The seam the client and the server send through without asking how (psshm.Payloads): what one end
    of a link places, the other end takes back bit for bit from a header-only message, worker to server
    (a push) and server to worker (a reply); a connection without a link (FRAMES) sends data frames."""
    pieces = [("w", "float32", 6), ("b", "float16", 3)]
    w, b = torch.randn(6), torch.tensor([1.5, -2.0, 65504.0], dtype=torch.float16)
    parts = [*wire.split("w", w), *wire.split("b", b)]
    server = psshm.Link.create(shm.new_run_id(), "s0-test", pieces)
    worker = psshm.Link.attach(server.describe(), pieces)  # one process holds both ends here
    try:
        for sender, receiver in ((worker, server), (server, worker), (psshm.FRAMES, psshm.FRAMES)):
            frames = wire.encode("push", "rank0", 3, parts, {"id": 1}, sender.place(parts))
            assert len(frames) == (len(parts) + 1 if sender is psshm.FRAMES else 1)  # data frames, or the header alone
            h = wire.decode(frames, region=receiver.rx_size)
            got = [wire.frame_tensor(spec, f) for spec, f in zip(h.frames, receiver.take(h, frames[1:]))]
            assert torch.equal(got[0], w) and torch.equal(got[1], b)
        assert worker.reply_meta() == {"shm_reply": True} and psshm.FRAMES.reply_meta() == {}
        assert worker.place([]) is None  # nothing to send: a header alone, as over zmq
    finally:
        worker.close()
        server.close()
    assert not os.path.exists(server.inbound.segment.path) and not os.path.exists(server.outbound.segment.path)


def test_a_link_lives_under_the_server_goes_once_mapped_and_on_sigterm(procs):
    server = procs.server("--mode", "sync")
    raw, offer, pieces = raw_hello(server)
    try:
        names = segments_of([server.proc.pid])
        assert len(names) == 2 and {n.rsplit("-", 1)[1] for n in names} == {"in", "out"}
        assert [os.path.join(shm.SHM_DIR, n) for n in names] == sorted([offer["in"], offer["out"]])
        assert all(os.stat(os.path.join(shm.SHM_DIR, n)).st_mode & 0o777 == 0o600 for n in names)
        link = psshm.Link.attach(offer, pieces)  # the client's side: maps, then unlinks both files
        assert segments_of([server.proc.pid]) == []
        link.close()
        raw2, _, _ = raw_hello(server)  # a second connection of the same sender replaces the link
        assert server.stats()["shm_links"] == 1 and len(segments_of([server.proc.pid])) == 2
    finally:
        raw.close()
    assert server.stop() == 0
    assert segments_of([server.proc.pid]) == []  # SIGTERM: the unmapped link's files went with the server
    raw2.close()


def test_a_killed_server_leaves_its_segments_to_the_next_start(procs):
    """kill -9 before any worker mapped them: the files stay, named after the dead server, until the
    next server (or launcher, or shm client) starts and sweeps them."""
    server = procs.server("--mode", "sync")
    raw, _, _ = raw_hello(server)
    raw.close()
    assert len(segments_of([server.proc.pid])) == 2
    kill9(server.proc)
    assert len(segments_of([server.proc.pid])) == 2
    procs.server("--mode", "sync")
    assert segments_of([server.proc.pid]) == []


@pytest.mark.parametrize("victim", ["worker", "server"])
def test_kill_9_in_an_shm_run_leaves_nothing_in_dev_shm(procs, victim):
    server = procs.server("--mode", "async")
    url = f"ps://{server.address}?mode=async&timeout=10&retries=0&transport=shm"
    workers = [procs.worker(url, r, 2, 100000, "--barrier", "--size", "100000") for r in range(2)]
    pids = [server.proc.pid, *(w.pid for w in workers)]
    wait_until(lambda: server.stats()["updates"] > 20, 60, "the run did not get going")
    assert server.stats()["shm_links"] == 2
    assert segments_of(pids) == []  # mapped by both ends, unlinked: nothing a kill -9 could strand
    if victim == "worker":
        kill9(workers[0])
        assert segments_of(pids) == []
        kill9(workers[1])
        assert server.stop() == 0
    else:
        kill9(server.proc)
        for w in workers:  # each names the dead shard and exits
            _, err = w.communicate(timeout=60)
            assert w.returncode != 0 and "shard 0/1" in err, err[-2000:]
    assert segments_of(pids) == []


def test_launcher_trains_over_shm_and_a_killed_rank_leaves_no_segment(tmp_path):
    """``commlab train --exchanger 'ps://?shards=2&transport=shm'``: servers on ipc sockets for the
    headers, payloads in segments; kill -9 of a rank: the launcher stops the rest and nothing of any
    of its processes stays in /dev/shm."""
    cli = launcher.start_group([sys.executable, "-m", "commlab.tools.cli", "train", "--no-progress", "--exchanger",
                                "ps://?shards=2&mode=async&transport=shm&timeout=20", "--workers", "2",
                                "--model", "tiny", "--steps", "100000"], LAUNCHER_ENV, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = {cli.pid}
    try:
        victim = wait_for_rank_process(cli.pid, rank=1, timeout=START_TIMEOUT)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # training runs; remember every process of the job
            seen |= set(children_of(cli.pid))
            time.sleep(0.1)
        assert len(seen) >= 5, seen  # launcher, 2 servers, 2 ranks
        os.kill(victim, signal.SIGKILL)
        _, err = cli.communicate(timeout=90)
    finally:
        launcher.kill_groups([cli], grace=0)
    assert cli.returncode != 0 and "rank 1 failed first (signal SIGKILL)" in err, err[-3000:]
    assert segments_of(seen) == []


def test_auto_takes_shm_on_this_host_and_frames_across_a_network_namespace(procs, tmp_path):
    """auto: shm with a server of this boot id and network namespace; a server in another namespace
    (reached over an ipc socket, which crosses namespaces) refuses a link, and the client falls back
    to zmq frames and says why in facts(); transport=shm there is a ConfigError."""
    same = procs.server("--mode", "sync")
    for query in ("&transport=auto", ""):  # auto is the default
        ex = commlab.connect(f"ps://{same.address}?timeout=20{query}", RankInfo.single())
        ex.setup(nn.Linear(3, 2), commlab.OptimizerSpec("sgd", lr=0.5))
        assert ex.facts()["transport"] == {"asked": "auto", "payloads": {same.endpoint: "shm"}}
        ex.close()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a server in another network namespace needs root and unshare")
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here")
    other = procs.server("--mode", "sync", bind=f"ipc://{tmp_path}/other", prefix=("unshare", "-n"))
    model = nn.Linear(3, 2)
    ex = commlab.connect(f"ps://?endpoints={other.endpoint}&timeout=20&transport=auto", RankInfo.single())
    try:
        ex.setup(model, commlab.OptimizerSpec("sgd", lr=0.5))
        facts = ex.facts()["transport"]
        assert facts["payloads"] == {other.endpoint: "zmq frames"}
        assert "another host or network namespace" in facts["why_not_shm"][other.endpoint]
        ex.zero_grad()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in model.parameters()]
        ex.step()  # update=worker: the average (1) comes back over frames
        for b, p in zip(before, model.parameters()):
            assert torch.allclose(p.detach(), b - 0.5)
    finally:
        ex.close()
    ex = commlab.connect(f"ps://?endpoints={other.endpoint}&timeout=20&transport=shm", RankInfo.single())
    with pytest.raises(ConfigError, match="transport=shm: .*another host or network namespace.*transport=auto"):
        ex.setup(nn.Linear(3, 2), commlab.OptimizerSpec("sgd", lr=0.5))
    ex.close()
