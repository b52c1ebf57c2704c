"""A job admits only its own processes, on loopback too (commlab.transport.auth): strangers with the right ports but
not the job's secret are dropped and counted, never read as a rank's data, and cannot make a server hold
memory or key spaces.

The session's secret is set by conftest (every process the tests start proves it); a stranger here is a
socket that does not, or one that proves another secret, or one that replays what a real process sent.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import zmq
from torch import nn

import commlab
from commlab.transport import auth, psproto, shm, sockets as transport, wire
from commlab.base.errors import AuthError, ConfigError
from commlab.transport.rendezvous import RankInfo

from faultkit import Procs, Raw

OTHER = auth.JobSecret(b"another job's secret, 32 bytes!!", "test")


# ----- one process: the proofs, the store's signatures, where the secret comes from ---------------------------
def test_handshake_proves_both_ways_and_a_replay_fails():
    s = auth.load()
    i, r = auth.Initiator(s, "rank1", "server"), auth.Responder(s, "server0")
    proof = i.prove(r.challenge(i.hello()))
    assert i.done(r.check(proof)) == "server0" and r.peer_name == "rank1"
    again = auth.Responder(s, "server0")  # a recorded proof, replayed to a fresh challenge
    again.challenge(i.hello())
    with pytest.raises(AuthError, match="did not prove"):
        again.check(proof)
    stranger = auth.Initiator(OTHER, "rank1", "server")  # right protocol, wrong secret: refused both ways
    with pytest.raises(AuthError, match="did not prove"):
        stranger.prove(auth.Responder(s, "server0").challenge(stranger.hello()))
    with pytest.raises(AuthError, match="did not prove"):
        auth.Responder(s, "server0").check(auth.Initiator(OTHER, "x", "y").prove(
            auth.Responder(OTHER, "server0").challenge(i.hello())))


def test_store_values_are_signed_and_a_forged_or_moved_one_is_refused():
    s = auth.load()
    blob = s.sign("ring/addr/0", b"tcp://127.0.0.1:5")
    assert s.open("ring/addr/0", blob) == b"tcp://127.0.0.1:5"
    for key, value in [("ring/addr/1", blob), ("ring/addr/0", b"tcp://127.0.0.1:6"),
                       ("ring/addr/0", OTHER.sign("ring/addr/0", b"tcp://127.0.0.1:5"))]:
        with pytest.raises(AuthError, match="not signed with the job's secret"):
            s.open(key, value)


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path):
    path = auth.create_file(str(tmp_path))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert auth.load({auth.SECRET_FILE_ENV: path}).key == open(path, "rb").read()
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="no one else may read"):
        auth.load({auth.SECRET_FILE_ENV: path})
    with pytest.raises(ConfigError, match="at least 16"):
        auth.load({auth.SECRET_ENV: "short"})
    assert auth.load({}) is None and auth.load({auth.SECRET_ENV: ""}) is None


# ----- ps://: a stranger at the server's port -----------------------------------------------------------------
def _job(endpoint: str, steps: int = 3) -> list[dict]:
    """Two ranks (threads) of nn.Linear(4, 2) on fixed data, sync SGD: every rank's parameters after ``steps``."""
    out: list = [None, None]
    torch.manual_seed(0)  # here, not in the threads: they would draw from torch's one generator in either order
    init = nn.Linear(4, 2).state_dict()

    def rank(r: int):
        model = nn.Linear(4, 2)
        model.load_state_dict(init)
        ex = commlab.connect(f"ps://{endpoint}?timeout=30&transport=tcp", RankInfo(r, 2, r, "127.0.0.1", 0, "flags"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ex.setup(model, opt)
        for t in range(steps):
            ex.zero_grad()
            x = torch.full((3, 4), float(r + 1 + t))
            model(x).pow(2).sum().backward()
            ex.step()  # (steps the optimizer it was set up with)
        out[r] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ex.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out), "a rank did not finish"
    return out


def _reference(steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for t in range(steps):
        grads = []
        for r in range(2):
            model.zero_grad()
            model(torch.full((3, 4), float(r + 1 + t))).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _commlab_shm(pid: int) -> set[str]:
    """The server process ``pid``'s /dev/shm entries (``commlab-RUN-PID.START-...``; another xdist worker's jobs
    make and remove their own meanwhile)."""
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith("commlab-") and f"-{pid}." in f}


@pytest.mark.multiproc
def test_a_stranger_at_a_ps_server_is_refused_holds_nothing_and_the_job_trains(tmp_path):
    procs = Procs(tmp_path)
    try:
        server = procs.server("--mode", "sync")
        shm_before = _commlab_shm(server.proc.pid)
        # a well-formed hello that asks for a shared-memory link of 2 x 256 MiB, on 70 new key spaces
        hello = {"rank": 0, "world": 2, "mode": "sync", "shard": [0, 1], "shm_host": shm.host_identity(),
                 "optim": {"class": "torch.optim.sgd.SGD", "groups": [{"params": ["w"], "hyper": {"lr": 0.1}}]},
                 "manifest": [["w", [2**26], "float32"]], "pieces": [["w", "float32", 2**26]]}
        stranger = Raw(server.endpoint, "rank0", secret=None)
        sent = 0
        for n in range(70):
            reply = stranger.request("hello", **dict(hello, space=f"s{n}"))
            sent += 1
            assert reply.op == "error" and "serves only its job's processes" in reply.meta["reason"]
        stranger.send([b"\x00junk", b"more junk"])
        stranger.send([auth.pack({"proof": b"x" * 32})])  # a proof before any hello
        assert stranger.reply()[0].op == "error"
        # a replay: a real handshake recorded, then its hello and proof sent again on a new connection
        tp = transport.Transport()
        sock = tp.connect(zmq.DEALER, server.endpoint)
        side = auth.Initiator(auth.load(), "rank0", "server")
        sock.send(side.hello())
        proof = side.prove(transport.recv(sock, 10, "server")[0].bytes)
        sock.send(proof)
        side.done(transport.recv(sock, 10, "server")[0].bytes)
        replay = tp.connect(zmq.DEALER, server.endpoint)
        replay.send(side.hello())
        transport.recv(replay, 10, "server")  # a fresh challenge
        replay.send(proof)
        assert "refused" in auth.unpack(transport.recv(replay, 10, "server")[0].bytes, "reply")
        replay.send(wire.encode("hello", "rank0", -1, (), dict(hello, id=1))[0])
        assert transport.recv(replay, 10, "server")[0].bytes.find(b"serves only its job") >= 0
        sock.close(0), replay.close(0), tp.close()
        with pytest.raises(AuthError, match="did not prove the job's secret"):  # a client of another job
            Raw(server.endpoint, "rank0", secret=OTHER)
        stats = server.stats()
        a = stats["auth"]
        # refused: 70 hellos, the junk, the replayed connection's hello; failed: a proof first, the replay (the
        # client of another job gave up itself: the server did not prove its secret)
        assert a["required"] and a["refused_messages"] == sent + 2 and a["failed_handshakes"] == 2, a
        assert stats["spaces"] == {} and stats["shm_links"] == 0 and _commlab_shm(server.proc.pid) == shm_before
        stranger.close()
        # the server's own job trains as a quiet run does
        ranks = _job(server.address)
        want = _reference()
        for got in ranks:
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    finally:
        procs.close()


@pytest.mark.multiproc
def test_a_key_space_whose_processes_are_gone_is_freed_with_its_shared_memory(tmp_path):
    """No bye: the connection closes (as a killed process's does), its link goes at once, its key space once
    the peer timeout passed."""
    procs = Procs(tmp_path)
    try:
        server = procs.server("--mode", "sync", "--peer-timeout", "1")
        raw = Raw(server.endpoint, "rank0")
        hello = {"rank": 0, "world": 1, "mode": "sync", "shard": [0, 1], "shm_host": shm.host_identity(),
                 "optim": {"class": "torch.optim.sgd.SGD", "groups": [{"params": ["w"], "hyper": {"lr": 0.1}}]},
                 "manifest": [["w", [8], "float32"]], "pieces": [["w", "float32", 8]], "space": "gone"}
        reply = raw.request("hello", **hello)
        assert reply.op == "ok" and "segment" in json.dumps(reply.meta["shm_link"]) or "in" in reply.meta["shm_link"]
        assert server.stats()["shm_links"] == 1
        raw.close()
        deadline = time.monotonic() + 30
        while True:
            stats = server.stats()
            if stats["spaces"].get("gone", {}).get("live") is False:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        assert stats["shm_links"] == 0 and stats["auth"]["spaces_freed"] == 1
    finally:
        procs.close()


# ----- ring://: a stranger at every link, before the neighbours connect ------------------------------------------
def _ring_with_stranger(transport_kind: str, monkeypatch, stranger) -> list:
    """Two ring ranks (threads) meet through a store hosted here; each rank's own connection to its neighbour
    waits until ``stranger(store)`` has done its worst (so the stranger comes first, by construction). Then
    three all-reduces with closed-form sums. Returns each rank's (wrong elements, facts)."""
    import torch.distributed as dist
    from commlab.transport import store as store_mod
    from commlab.regimes import ring

    host = store_mod.host("127.0.0.1", 60)
    go = threading.Event()
    if transport_kind == "shm":
        attach = ring.ShmOffer.attach

        def late_attach(*a, **k):
            assert go.wait(60)
            return attach(*a, **k)
        monkeypatch.setattr(ring.ShmOffer, "attach", staticmethod(late_attach))
    else:
        connect = ring.ZmqKind.connect_outbound

        def late_connect(self):
            assert go.wait(60)
            return connect(self)
        monkeypatch.setattr(ring.ZmqKind, "connect_outbound", late_connect)
    out: list = [None, None]

    def rank(r: int):
        client = dist.TCPStore("127.0.0.1", host.port, 2, False, timedelta(seconds=60), use_libuv=True)
        store = dist.PrefixStore("job", client)
        ex = commlab.connect(f"ring://?transport={transport_kind}&timeout=60", RankInfo(r, 2, r, "127.0.0.1", 0, "flags"))
        ex.meet(store=store)
        wrong = 0
        for size in (1, 1000, 300_001):
            base = (torch.arange(size, dtype=torch.float32) % 7) - 3
            x = base * (r + 1)
            ex.allreduce(x)
            wrong += int((x != base * 3).sum())
        out[r] = (wrong, ex.facts())
        ex.close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    spy = dist.PrefixStore("job/1", dist.TCPStore("127.0.0.1", host.port, 2, False, timedelta(seconds=60),
                                                        use_libuv=True))
    leftovers: list = []
    try:
        stranger(spy, leftovers)  # its connections stay open until the ranks are through
    finally:
        go.set()
        for t in threads:
            t.join(120)
        for thing in leftovers:
            thing.destroy(linger=0) if isinstance(thing, zmq.Context) else thing.close()
    assert all(o is not None for o in out), "a rank did not finish"
    return out


def _offer(spy, key: str) -> dict:
    """What a stranger reads in the store: the value is signed, not hidden."""
    spy.wait([key], timedelta(seconds=60))
    raw = spy.get(key)
    return json.loads(raw[len(auth.SIGNED) + 32:])  # after the signature


@pytest.mark.multiproc
def test_a_stranger_at_every_tcp_link_of_a_ring_is_refused_and_the_sums_are_exact(monkeypatch):
    def stranger(spy, leftovers):
        ctx = zmq.Context()
        for r in range(2):
            offer = _offer(spy, f"ring/addr/{r}")
            ep = offer["endpoint"]
            host, port = ep.removeprefix("tcp://").rsplit(":", 1)
            junk = socket.create_connection((host, int(port)))  # bytes that are no zmq at all
            junk.sendall(os.urandom(126))
            leftovers.append(junk)
            null = ctx.socket(zmq.PUSH)  # zmq without credentials, sending a chunk header for the next collective
            plain = ctx.socket(zmq.PUSH)  # the right user name, a password proved with another job's secret
            plain.plain_username = f"ring-rank{1 - r}".encode()
            plain.plain_password = OTHER.answer("initiator", bytes.fromhex(offer["nonce"]), b"", f"ring-rank{1 - r}",
                                                f"ring-rank{r}").hex().encode()
            replay = ctx.socket(zmq.PUSH)  # what the store shows, replayed as the password
            replay.plain_username, replay.plain_password = f"ring-rank{1 - r}".encode(), offer["nonce"].encode()
            for s in (null, plain, replay):
                s.linger = 0
                s.connect(ep)
                s.send(wire.chunk_header(1 - r, 1, 0, 0, 0, 1, torch.float32) + b"\0\0\x80\x7f", zmq.NOBLOCK)
                leftovers.append(s)
        leftovers.append(ctx)

    for wrong, facts in _ring_with_stranger("tcp", monkeypatch, stranger):
        assert wrong == 0 and facts["authentication"].startswith("job secret"), facts
        # junk, no credentials, a wrong proof, a replay: each fails zmq's handshake before the rank's own
        # connection is made (the rank's connect waited for them), so each is counted by the time the sums are
        assert facts["refused"]["connections"] >= 3, facts


@pytest.mark.multiproc
def test_a_stranger_at_every_shm_link_of_a_ring_is_refused_and_the_sums_are_exact(monkeypatch):
    conns = []

    def stranger(spy, leftovers):
        for r in range(2):
            offer = _offer(spy, f"ring/shm/{r}")
            nonce = bytes.fromhex(offer["nonce"])
            real = auth.Offer(auth.load())  # a claim made for another offer's nonce, replayed
            for msg in (os.urandom(60), auth.Offer(OTHER).claim(nonce, f"ring-rank{1 - r}", f"ring-rank{r}"),
                        real.claim(os.urandom(32), f"ring-rank{1 - r}", f"ring-rank{r}")):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                conn.connect(offer["socket"])
                conn.send(msg)  # the rank reads it once it accepts (after this returns)
                conns.append(conn)


    for wrong, facts in _ring_with_stranger("shm", monkeypatch, stranger):
        assert wrong == 0 and facts["authentication"].startswith("job secret"), facts
        assert facts["refused"]["connections"] == 3, facts
    for conn in conns:  # each was closed without a word
        conn.settimeout(30)
        assert conn.recv(1024) == b""
        conn.close()
