"""ring://: sums equal a float64 reference, training equals local://, a killed rank is named.

Multi-process tests spawn real ranks (torchrun's environment; rank 0's process hosts the store on a
loopback port the kernel picks and hands it to the others), forward
child tracebacks, kill the siblings on any failure and never wait without a deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from commlab.base.errors import CommError, ConfigError, ProtocolError
from commlab.transport.store import host as host_store
from commlab.regimes.ring import SWAP_STEPS, bytes_moved, ring_schedule, ring_steps, segment_bounds
from commlab.transport import wire
from zygote import ENV as ZYGOTE_ENV

from conftest import run_group

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


# ----- a small multi-process harness ----------------------------------------------------------------
def _child(fn, rank, world, ports, args, results):
    torch.seed()  # forked from the fork server: this rank's own seeds, as a fresh interpreter's
    np.random.seed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    try:
        if rank == 0:  # rank 0's process hosts the store on a port of the kernel's choosing: it dies with rank 0
            hosted = host_store("127.0.0.1", 60)
            for _ in range(world - 1):
                ports.put(hosted.port)
            port = hosted.port
        else:
            port = ports.get(timeout=60)
        os.environ["MASTER_PORT"] = str(port)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        results.put((rank, "error", traceback.format_exc()))
    if rank == 0:  # the others may still read reports in the store: it stays until run_ranks kills this process
        time.sleep(300)


def _context():
    """Ranks forked by multiprocessing's fork server, which imports torch, torch._dynamo, commlab and this
    module once per pytest run (a spawned rank imported them again: 3-4 s of CPU each); it forks before
    any thread pool or zmq context exists. ``COMMLAB_ZYGOTE=off`` spawns each rank, as before."""
    if os.environ.get(ZYGOTE_ENV) == "off":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "numpy", "commlab", "commlab.regimes.ring", __name__])
    return ctx


def run_ranks(fn, world: int, *args, timeout: float = 60.0, on_start=None) -> dict[int, object]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return {rank: result}.

    A child's exception fails the test with its traceback; every child is killed on the way out.
    ``on_start(procs)`` may act on the running children (kill or stop one) and returns the ranks
    that will not report.
    """
    ctx = _context()
    results, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, world, ports, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    silent: set[int] = set()
    try:
        if on_start is not None:
            silent = set(on_start(procs))
        expected = world - len(silent)
        while len(out) < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out))} did not finish within {timeout:g}s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for a child that died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out | silent]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with {procs[dead[0]].exitcode} without a result")
                continue
            if status == "error":  # collect what the others say for a moment: the first failure may be elsewhere
                errors = {rank: value}
                try:
                    while len(errors) < world:
                        r, st, v = results.get(timeout=2.0)
                        if st == "error":
                            errors[r] = v
                except Exception:
                    pass
                raise RuntimeError("\n".join(f"rank {r} failed:\n{v}" for r, v in sorted(errors.items())))
            out[rank] = value
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)


# ----- single process: the schedule and the wire ------------------------------------------------------
def test_schedule_visits_every_segment_and_moves_2_n_minus_1_over_n():
    for world in (2, 3, 4, 5):
        for r in range(world):
            sent = [ring_schedule(r, world, t)[0] for t in range(2 * world - 2)]
            got = [ring_schedule(r, world, t)[1] for t in range(2 * world - 2)]
            assert sorted(sent[:world - 1]) == sorted(set(range(world)) - {(r + 1) % world})  # RS: all but the one it owns
            assert got[world - 2] == (r + 1) % world  # the last reduce-scatter receive completes its own segment
            # what r sends at step t is what its right neighbour receives at step t
            assert sent == [ring_schedule((r + 1) % world, world, t)[1] for t in range(2 * world - 2)]
        n = 1000 * world
        assert bytes_moved(n, 4, 0, world) == (2 * (world - 1) * n * 4 // world,) * 2
    assert segment_bounds(7, 3) == [0, 2, 4, 7]
    assert bytes_moved(0, 4, 0, 3) == (0, 0)


def test_two_ranks_swap_small_tensors_in_one_step_and_ring_the_rest():
    from commlab.core.registry import connect
    from commlab.transport.rendezvous import RankInfo

    def plan(url, rank, world, n, itemsize=4):
        return connect(url, RankInfo(rank, world, rank, "127.0.0.1", 1, "test")).plan(n, itemsize)

    for rank in (0, 1):
        assert plan("ring://", rank, 2, 7) == ([0, 7], 1, SWAP_STEPS)
        assert plan("ring://", rank, 2, MIB) == ([0, MIB], 1, SWAP_STEPS)  # 4 MiB: the default swap_kb
        assert plan("ring://?chunk_mb=1", rank, 2, MIB) == ([0, MIB], 4, SWAP_STEPS)
        # chunk_mb=0 (the default): the transport's own, decided by the option so every rank cuts alike
        assert plan("ring://?transport=shm", rank, 2, MIB) == ([0, MIB], 2, SWAP_STEPS)  # 2 MiB chunks
        assert plan("ring://?transport=auto", rank, 2, MIB) == ([0, MIB], 1, SWAP_STEPS)  # tcp's 4 MiB
        assert plan("ring://?transport=shm&chunk_mb=4", rank, 2, MIB) == ([0, MIB], 1, SWAP_STEPS)
        assert plan("ring://", rank, 2, MIB + 1) == ([0, MIB // 2, MIB + 1], 1, ring_steps(rank, 2))
        assert plan("ring://?swap_kb=0", rank, 2, 7) == ([0, 3, 7], 1, ring_steps(rank, 2))
        assert plan("ring://?swap_kb=1", rank, 2, 128, 8) == ([0, 128], 1, SWAP_STEPS)
        assert plan("ring://?swap_kb=1", rank, 2, 129, 8)[2] == ring_steps(rank, 2)
    assert ring_steps(1, 2) == ((1, 0, True), (0, 1, False))
    for world in (3, 4):  # the swap is for two ranks only: with more, every step is the ring's
        assert plan("ring://", 1, world, 7)[2] == ring_steps(1, world)
        assert len(ring_steps(1, world)) == 2 * world - 2
    # the same bytes either way: S each way at N = 2
    assert bytes_moved(1001, 4, 0, 2) == (4004, 4004)


def test_chunk_header_checks_every_field():
    good = wire.chunk_header(1, 5, 2, 0, 100, 7, torch.float32)
    wire.check_chunk_header(good, good, "rank 1")
    with pytest.raises(ProtocolError, match=r"rank 1 sent chunk with count 8 \(expected 7\).*same size"):
        wire.check_chunk_header(wire.chunk_header(1, 5, 2, 0, 100, 8, torch.float32), good, "rank 1")
    with pytest.raises(ProtocolError, match=r"collective 6 \(expected 5\)"):
        wire.check_chunk_header(wire.chunk_header(1, 6, 2, 0, 100, 7, torch.float32), good, "rank 1")
    with pytest.raises(ProtocolError, match="3-byte chunk header"):
        wire.check_chunk_header(b"abc", good, "rank 1")


def _shm_link(run: str, rank: int, slot_bytes: int):
    """A real shared-memory link, both ends in this process: (sender's segment and socket, receiver's)."""
    import json
    from commlab.regimes.ring import ShmOffer
    offer = ShmOffer(run, rank, slot_bytes)
    receiver = ShmOffer.attach(json.loads(offer.describe()))[0]
    return offer.accept(5.0, f"rank {rank + 1}", rank + 1), receiver


def test_shm_link_delivers_what_was_sent_before_the_sender_closed():
    """The left neighbour placed its last chunks and closed (its part of the collective was done) while
    this rank had read only the first: the rest is still read, although the kernel reports a reset
    first (the closed end left a TAKEN signal unread). And a sender that closes with linger waits until
    its chunks were taken, so it leaves nothing unread."""
    import threading
    from commlab.transport import shm
    from commlab.regimes.ring import shm_slot_bytes
    from commlab.regimes.ring_links import SLOTS, Collective, ShmInbox, ShmOutbox

    slot, k, n = shm_slot_bytes(0.001), SLOTS, 256 * SLOTS  # k chunks of 256 floats, one per slot
    run = shm.new_run_id()
    store_all = ((0, 0, False),)  # one step that stores: the all-gather's last
    try:
        for linger in (0.0, 5.0):
            (seg_out, conn_out), (seg_in, conn_in, theirs) = _shm_link(run, 2, slot)
            (seg_next, conn_next), right_end = _shm_link(run, 0, slot)  # rank 0's own link to its right
            outbox = ShmOutbox(seg_out, conn_out, slot, 2, 0, "rank 0 (right)", 5.0, lambda: None)
            mine = ShmOutbox(seg_next, conn_next, slot, 0, 1, "rank 1 (right)", 5.0, lambda: None)
            inbox = ShmInbox(seg_in, conn_in, theirs, 0, 2, "rank 2 (left)", 5.0, lambda: None, mine)
            sent = torch.arange(n, dtype=torch.float32) + linger
            got = torch.zeros(n)
            outbox.begin(Collective(sent, 0, [0, n], k, store_all))
            inbox.begin(Collective(got, 0, [0, n], k, store_all))
            for j in range(k):
                outbox.send(0, j)
            outbox.finish()  # every chunk placed: the sender's part is done
            inbox.store(0, 0)  # this rank reads the first and says TAKEN
            if linger:
                reader = threading.Thread(target=lambda: [inbox.store(0, j) for j in range(1, k)])
                timer = threading.Timer(0.3, reader.start)  # the rest is read while the sender lingers
                timer.start()
                outbox.close(linger)
                timer.join()
                reader.join(5)
                assert outbox.taken == outbox.sent == k  # it waited for every chunk to be taken
            else:
                outbox.close(0.0)  # gone with a TAKEN signal unread
                for j in range(1, k):
                    inbox.store(0, j)
            assert torch.equal(got, sent)
            for half in (inbox, mine):
                half.close()
            right_end[0].close()
            right_end[1].close()
    finally:
        shm.sweep_stale()


def test_options_are_validated():
    from commlab.core.registry import connect
    from commlab.transport.rendezvous import RankInfo
    with pytest.raises(ConfigError, match="chunk_mb must be >= 0"):
        connect("ring://?chunk_mb=-1", RankInfo.single())
    with pytest.raises(ConfigError, match=r"'transport': 'udp' is not one of"):
        connect("ring://?transport=udp", RankInfo.single())
    with pytest.raises(ConfigError, match=r"'io_threads': '3' is not one of \[1, 2\]"):
        connect("ring://?io_threads=3", RankInfo.single())
    with pytest.raises(ConfigError, match="sndbuf_kb must be >= 0"):
        connect("ring://?sndbuf_kb=-1", RankInfo.single())
    with pytest.raises(ConfigError, match="swap_kb must be >= 0"):
        connect("ring://?swap_kb=-1", RankInfo.single())
    # a non-loopback address: keys or insecure=1, said in so many words; one line either way
    with pytest.raises(ConfigError, match=r"^ring://: refusing to bind 10\.0\.0\.1 without authentication .*"
                                          r"keys=DIR .* or insecure=1$"):
        connect("ring://?host=10.0.0.1", RankInfo.single())
    assert connect("ring://?host=10.0.0.1&insecure=1", RankInfo.single()).options.insecure
    assert connect("ring://?host=10.0.0.1&keys=/nonexistent", RankInfo.single()).options.keys
    assert connect("ring://?host=10.0.0.1&transport=shm", RankInfo.single())  # shm binds no address


# ----- several processes: sums --------------------------------------------------------------------------
def _data(seed: int, rank: int, n: int, dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 100 + rank), dtype=torch.float64).to(dtype)


def _sums(rank, world, queries, big_queries):
    import commlab
    torch.manual_seed(0)
    from commlab.transport.rendezvous import connect_store, from_env
    store = connect_store(from_env(), 30)  # one store per process, shared by the three exchangers
    report = []
    cases = [(n, torch.float32) for n in (0, 1, 7, MIB // 4 + 3)]
    cases += [(7, torch.float64), (MIB // 4 + 3, torch.float64), (MIB // 4 + 3, torch.float16),
              (MIB // 4 + 3, torch.bfloat16), (1000, torch.int64)]
    tolerance = {torch.float32: 1e-6, torch.float64: 1e-13, torch.float16: 2**-10, torch.bfloat16: 2**-7,
                 torch.int64: 0.0}
    for query in queries:
        with commlab.connect(f"ring://?{query}&timeout=30") as ex:
            ex.meet(store)
            if "auto" in query or "shm" in query:  # one host, one network namespace: shared memory both ways
                assert ex.facts()["links"] == {"from_left": "shm", "to_right": "shm"}, ex.facts()
                if "chunk_mb" not in query:  # the transport's own chunk; auto takes shm's with the whole ring here
                    assert ex.facts()["chunk_mb"] == 2.0, ex.facts()
            for i, (n, dtype) in enumerate(cases):
                x = _data(i, rank, n, dtype) if dtype.is_floating_point else torch.arange(n) * (rank + 1)
                inputs = [_data(i, k, n, dtype).double() if dtype.is_floating_point else torch.arange(n) * (k + 1)
                          for k in range(world)]
                ref, scale = sum(inputs), sum(v.abs() for v in inputs)  # error relative to the summands' size
                ex.allreduce_async(x, what=f"{n} x {dtype}").wait(30)
                err = ((x.double() - ref).abs().max() / scale.max()).item() if n else 0.0
                if not err <= tolerance[dtype]:
                    raise AssertionError(f"{query} {n} x {dtype} at N={world}: relative error {err:.3g}")
                report.append((query, n, str(dtype), err))
            if query in big_queries:  # 64 MiB, cheap to check: rank k holds (k+1) x the same vector
                base = (torch.arange(16 * MIB) % 9973).float() * 0.37 - 1000.0
                x = base * (rank + 1)
                ex.allreduce_async(x, what="64 MiB").wait(60)
                ref = sum((base * (k + 1)).double() for k in range(world))
                err = ((x.double() - ref).abs().max() / ref.abs().max()).item()
                if not err <= 1e-6:
                    raise AssertionError(f"{query} 64 MiB at N={world}: relative error {err:.3g}")
                report.append((query, 64 * MIB, "float32", err))
    return report


N2_SWAP_64M = "transport=tcp&chunk_mb=2&swap_kb=65536"
N2 = ("transport=tcp&chunk_mb=0.25", "transport=ipc&chunk_mb=0.25&swap_kb=0", "transport=torch&chunk_mb=0.25",
      N2_SWAP_64M)
# shared memory: the swap (up to 4 MiB, 4 slots of 0.25 MiB: 16 chunks queue behind them), the two-step
# ring, and the 64 MiB swap in 2 MiB chunks (each added into only once its own copy has left for a slot)
N2_SHM = ("transport=shm&chunk_mb=0.25", "transport=shm&chunk_mb=0.25&swap_kb=0",
          "transport=shm&chunk_mb=2&swap_kb=65536")
N3 = ("transport=ipc&chunk_mb=0.25", "transport=torch&chunk_mb=0.25", "transport=tcp&chunk_mb=0.25&io_threads=1&sndbuf_kb=0")
N3_SHM = ("transport=shm&chunk_mb=0.25", "transport=auto")  # auto on one host: shm links, shm's 2 MiB chunks


@pytest.mark.multiproc
@pytest.mark.parametrize("world,queries,big", [
    # N = 2: up to 4 MiB the ranks swap in one step (tcp, torch), ipc rings every size; the last one
    # swaps 64 MiB in zero-copy 2 MiB chunks (added into only after zmq has sent them)
    (2, N2, N2),
    (2, N2_SHM, N2_SHM),
    (3, N3, ("transport=ipc&chunk_mb=0.25",)),
    (3, N3_SHM, N3_SHM),
    (4, ("transport=tcp&chunk_mb=0.25", "transport=shm&chunk_mb=0.5"), ("transport=tcp&chunk_mb=0.25",
                                                                       "transport=shm&chunk_mb=0.5"))],
    ids=["2-zmq-torch", "2-shm", "3-zmq-torch", "3-shm-auto", "4-tcp-shm"])
def test_sums_equal_float64_reference(world, queries, big):
    """Sizes 0, 1, 7, 1 MiB + 3 elements (float32, float64, float16, bfloat16, int64) and 64 MiB."""
    results = run_ranks(_sums, world, queries, big, timeout=150)
    assert all(len(r) == len(results[0]) for r in results.values())


def _mismatch(rank, world, query):
    import commlab
    with commlab.connect(f"ring://?timeout=20{query}") as ex:
        ex.meet()
        try:
            ex.allreduce_async(torch.ones(8 + rank)).wait(20)
        except CommError as exc:
            result = type(exc).__name__, str(exc), exc.peer, exc.origin
        else:
            result = None
        ex.store.add("test/done", 1)  # rank 0 hosts the store: it stays until rank 1 has read the report
        deadline = time.monotonic() + 20
        while ex.store.add("test/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    return result


TRANSPORTS = pytest.mark.parametrize("transport", ["tcp", "shm"])


@pytest.mark.multiproc
@TRANSPORTS
def test_ranks_with_different_sizes_raise_naming_the_sender(transport):
    results = run_ranks(_mismatch, 2, f"&transport={transport}&swap_kb=0", timeout=60)
    # The two-step ring: rank 0 (8 elements) expects [4, 8) from rank 1 (9 elements), which sends [4, 9):
    # rank 0 sees the lie first; rank 1 then sees rank 0 leave the ring and reads rank 0's report in the store.
    kind, text, peer, origin = results[0]
    assert kind == "ProtocolError" and "rank 1 (left neighbour) sent chunk with count 5 (expected 4)" in text, text
    assert (peer, origin) == (1, None)
    kind, text, peer, origin = results[1]
    assert kind == "PeerLost" and "rank 0 reports" in text and "same size" in text, text
    assert (peer, origin) == (1, 0)  # the culprit is rank 1 itself (its size differs), as rank 0 saw first


@pytest.mark.multiproc
@TRANSPORTS
def test_swapping_ranks_with_different_sizes_raise_naming_each_other(transport):
    results = run_ranks(_mismatch, 2, f"&transport={transport}", timeout=60)
    # The one-step swap: both send their whole tensor at once, so each may see the other's wrong count
    # itself, or see the other leave first (it closes without waiting for its own message to go out)
    # and read its report; either way the count that disagrees is named.
    for rank, other, theirs, mine in ((0, 1, 9, 8), (1, 0, 8, 9)):
        kind, text, peer, origin = results[rank]
        lie = f"rank {other} (left neighbour) sent chunk with count {theirs} (expected {mine})"
        assert (kind == "ProtocolError" and lie in text and (peer, origin) == (other, None)) or (
            kind == "PeerLost" and f"rank {other} reports" in text and f"count {mine} (expected {theirs})" in text
            and (peer, origin) == (rank, other)), text


# ----- several processes: a rank dies ------------------------------------------------------------------
def _until_killed(rank, world, ready_dir, timeout, transport="tcp"):
    import commlab
    ex = commlab.connect(f"ring://?transport={transport}&timeout={timeout}&chunk_mb=1")
    ex.meet()
    x = torch.ones(4 * MIB)
    for _ in range(3):
        ex.allreduce_async(x.fill_(1.0)).wait(timeout)
    Path(ready_dir, str(rank)).touch()
    started = time.monotonic()
    try:  # wait longer than the ring's own timeout: its error, which names the culprit, comes first
        while True:
            ex.allreduce_async(x.fill_(1.0)).wait(3 * timeout)
    except CommError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started, exc.peer


def _wait_in_ring(folder, world: int, procs, timeout: float = 60.0) -> None:
    """Until every rank has left its mark in ``folder`` (it is inside its collectives), or fail."""
    deadline = time.monotonic() + timeout
    while len(list(folder.iterdir())) < world:
        if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
            raise RuntimeError("the ranks never all reached the ring")
        time.sleep(0.05)


def _shm_entries(pids) -> list[str]:
    """Entries in /dev/shm owned (by name) by any of ``pids``."""
    from commlab.transport import shm
    return [name for name in os.listdir(shm.SHM_DIR)
            if (m := shm.NAME.fullmatch(name)) is not None and int(m["pid"]) in pids]


@pytest.mark.multiproc
@pytest.mark.parametrize("world,victim,transport", [(4, 1, "tcp"), (3, 0, "tcp"), (4, 1, "shm"), (3, 0, "shm")])
def test_killed_rank_is_named_by_every_survivor(tmp_path, world, victim, transport):
    # victim rank 1: not every survivor is its neighbour; rank 0: hosts the store too
    timeout = 20.0
    pids = set()

    def kill_when_ready(procs):
        pids.update(p.pid for p in procs)
        _wait_in_ring(tmp_path, world, procs)
        time.sleep(0.2)  # well inside a collective by now
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(5)
        return {victim}

    results = run_ranks(_until_killed, world, str(tmp_path), timeout, transport, timeout=90, on_start=kill_when_ready)
    assert sorted(results) == [r for r in range(world) if r != victim]
    for rank, (kind, text, elapsed, peer) in results.items():
        assert f"rank {victim}" in text, f"rank {rank}: {kind}: {text}"
        # noticed as a loss, not by running out the clock (how fast: python -m bench.probes peer-loss)
        assert kind == "PeerLost", f"rank {rank}: {kind}: {text}"
        assert peer == victim, f"rank {rank}: peer={peer}: {text}"
    # run_ranks killed the survivors with SIGKILL too: shared memory was unlinked as soon as it was mapped
    assert _shm_entries(pids) == []


@pytest.mark.multiproc
@TRANSPORTS
def test_stalled_rank_is_named_by_every_survivor(tmp_path, transport):
    world, victim, timeout = 3, 1, 3.0

    def stop_when_ready(procs):
        _wait_in_ring(tmp_path, world, procs)
        os.kill(procs[victim].pid, signal.SIGSTOP)  # alive, connected, silent; killed by run_ranks at the end
        return {victim}

    results = run_ranks(_until_killed, world, str(tmp_path), timeout, transport, timeout=90,
                        on_start=stop_when_ready)
    for rank, (kind, text, elapsed, peer) in results.items():
        # its right neighbour times out naming it; the rest read that report (or see that neighbour leave)
        assert f"rank {victim}" in text and kind in ("CommTimeout", "PeerLost"), f"rank {rank}: {kind}: {text}"
        assert "did not complete" not in text, text  # the ring's own bounded wait answered, not the caller's
        assert peer == victim, f"rank {rank}: peer={peer}: {text}"


# ----- training equals the single-process large-batch reference ------------------------------------------
def _train(tmp_path: Path, url: str, workers: int, batch: int, name: str) -> dict:
    out = tmp_path / f"{name}.pt"
    cmd = [sys.executable, "-m", "commlab.tools.cli", "train", "--exchanger", url, "--workers", str(workers),
           "--batch-size", str(batch), "--model", "tiny", "--momentum", "0.9", "--steps", "20",
           "--save-params", str(out), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = run_group(cmd, 120, f"commlab train --exchanger {url} ({name})", cwd=ROOT, env=env, capture_output=True,
                     text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.multiproc
@TRANSPORTS
def test_training_reproduces_local_large_batch(tmp_path, transport):
    # 3 buckets in flight on the communication thread, several chunks per segment
    url, workers = f"ring://?transport={transport}&bucket_mb=0.002&chunk_mb=0.001", 2
    ref = _train(tmp_path, "local://", 1, 8 * workers, "local")
    got = _train(tmp_path, url, workers, 8, "ring")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
