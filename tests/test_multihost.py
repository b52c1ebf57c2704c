"""Several hosts: two server shards and three workers in five network namespaces, CURVE on; the ring
across namespace hosts (keyed, a stranger knocking; auto: shared memory within a host, tcp between).

:class:`bench.netns.Links` (uncapped) gives each process a namespace of its own with a real
address (10.91.0.H, assigned only inside namespaces this test creates) on a bridge, so the
servers bind a non-loopback address, which they only do with keys. Sync and async jobs run at
once over the same five hosts; the results are checked against closed forms. The namespaces
are deleted on the way out, also on failure. Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import netns
from commlab.transport import auth, keys

from faultkit import AGENT_ENV, Procs, finish

pytestmark = [pytest.mark.netns, pytest.mark.multiproc,
              pytest.mark.skipif(netns.link_unavailable_reason() is not None,
                                 reason=str(netns.link_unavailable_reason()))]

SUBNET = "10.91.0"
STEPS = 20
GRADS = (0.25, 0.5, 0.75)  # per worker; mean 0.5, sum 1.5: every value below is exact in float32
LR = 0.5


def namespaces(tag: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(tag)]


def test_two_shards_three_workers_five_hosts_sync_and_async_with_curve(tmp_path):
    d = keys.create(tmp_path / "keys", ["w0", "w1", "w2"])
    tag = f"cf{os.getpid() % 100000}"
    procs = Procs(tmp_path)
    with netns.Links(5, None, tag=tag, subnet=SUBNET) as links:
        try:
            assert len(namespaces(tag)) == 6  # five hosts and the hub
            urls = {}
            for mode in ("sync", "async"):
                servers = [procs.server("--mode", mode, "--shard", f"{i}/2", "--keys", str(d),
                                        bind=f"tcp://{links.addr(i)}:0", prefix=tuple(links.prefix(i)))
                           for i in range(2)]
                assert all(s.endpoint.startswith(f"tcp://{SUBNET}.") for s in servers)
                urls[mode] = (f"ps://{servers[0].address},{servers[1].address}?mode={mode}&timeout=60"
                              f"&keys={d}&piece_mb=0.001")
            final = {"sync": (), "async": ("--final-version", str(3 * STEPS))}  # async: pull once all are applied
            workers = {mode: [procs.worker(f"{url}&key_name=w{r}", r, 3, STEPS, "--grad", str(GRADS[r]), "--lr",
                                           str(LR), "--size", "1000", *final[mode], prefix=tuple(links.prefix(2 + r)))
                              for r in range(3)] for mode, url in urls.items()}
            done = {mode: finish(ws, timeout=240) for mode, ws in workers.items()}
            for mode, results in done.items():
                for r, (code, _, err) in enumerate(results):
                    assert code == 0, f"{mode} worker {r}: {err[-3000:]}"
            # sync: every worker ends on the same step-by-step mean
            for _, out, _ in done["sync"]:
                assert json.loads(out.strip().splitlines()[-1])["param"] == [-LR * 0.5 * STEPS] * 1000
            # async: every push applied once, on both shards: every worker pulls the final values
            for _, out, _ in done["async"]:
                assert json.loads(out.strip().splitlines()[-1])["param"] == [-LR * sum(GRADS) * STEPS] * 1000
        finally:
            procs.close()
    assert namespaces(tag) == []


# ----- the ring across hosts ------------------------------------------------------------------------------
RING_SUBNET = "10.93.0"
RING_DRIVER = str(Path(__file__).resolve().parent / "ring_driver.py")

STRANGER = """
import json, sys, time
from datetime import timedelta
import torch, zmq, zmq.auth
import torch.distributed as dist
from commlab.transport import wire
addr, port, server_key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.PrefixStore("1", dist.PrefixStore("commlab/", dist.TCPStore(  # the job's first exchanger's keys
    addr, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False, use_libuv=True)))
store.wait(["ring/addr/0"], timedelta(seconds=60))  # rank 0's ring address: the store gives it to anyone
raw = store.get("ring/addr/0")  # signed with the job's secret, but readable: a JSON tail
endpoint = json.loads(raw[raw.index(b'{"endpoint"'):])["endpoint"]  # after the signature, if any
ctx = zmq.Context()
plain = ctx.socket(zmq.PUSH)  # no keys at all
keyed = ctx.socket(zmq.PUSH)  # a key pair of its own, not among the authorised clients
keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
keyed.curve_serverkey = zmq.auth.load_certificate(server_key)[0]
for s in (plain, keyed):
    s.linger = 0
    s.connect(endpoint)
# a chunk from "rank 2" (rank 0's left neighbour) for the next collectives, one element
forged = [wire.chunk_header(2, seq, 0, 0, 0, 1, torch.float32) + b"\\0\\0\\x80\\x7f" for seq in range(1, 40)]
store.set("stranger/knocking", "1")
queued, end = 0, time.monotonic() + 6
while time.monotonic() < end:
    for s in (plain, keyed):
        for m in forged[:4]:
            try:
                s.send(m, zmq.NOBLOCK)
                queued += 1
            except zmq.Again:
                pass
    time.sleep(0.01)
print(queued, flush=True)
ctx.destroy(linger=0)
"""


@pytest.fixture(scope="module")
def ring_hosts(tmp_path_factory):
    """Four namespace hosts (10.93.0.1-4) and a 'commlab keys' folder with one client pair per rank."""
    folder = tmp_path_factory.mktemp("ringkeys")
    d = keys.create(folder / "keys", ["w0", "w1", "w2"])
    tag = f"cr{os.getpid() % 100000}"
    with netns.Links(4, None, tag=tag, subnet=RING_SUBNET) as links:
        yield links, d, folder
    assert namespaces(tag) == []


def _ring_ranks(procs: Procs, links, hosts: list[int], url: str, *extra: str, env: dict | None = None):
    """One ring driver per rank, rank r in namespace host ``hosts[r]``; the store in a process of its own
    on host ``hosts[0]``, bound to port 0 there. Returns the ranks and the store's port."""
    port = procs.store(links.addr(hosts[0]), tuple(links.prefix(hosts[0])))
    out = []
    for r, h in enumerate(hosts):
        cmd = [*links.prefix(h), sys.executable, RING_DRIVER, url.format(r=r), "--rank", str(r), "--workers",
               str(len(hosts)), "--master-addr", links.addr(hosts[0]), "--master-port", str(port), *extra]
        out.append(procs.popen(cmd, {**AGENT_ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True))
    return out, port


def test_ring_across_hosts_with_keys_sums_exactly_and_strangers_get_nothing(ring_hosts, tmp_path):
    links, d, _ = ring_hosts
    procs = Procs(tmp_path)
    try:
        url = f"ring://?transport=tcp&host=auto&keys={d}&key_name=w{{r}}&chunk_mb=1&timeout=60"
        ranks, port = _ring_ranks(procs, links, [0, 1, 2], url, "--rounds", "3", "--await", "stranger/knocking")
        stranger = procs.popen([*links.prefix(3), sys.executable, "-c", STRANGER, links.addr(0), str(port),
                                str(d / "server.key")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = finish(ranks + [stranger], timeout=240)
        failed = {r: err[-3000:] for r, (code, _, err) in enumerate(results[:3]) if code != 0}
        assert not failed, "\n".join(f"rank {r}: {err}" for r, err in failed.items())
        for r, (code, out, err) in enumerate(results[:3]):
            got = json.loads(out.strip().splitlines()[-1])
            assert got["wrong"] == 0 and got["authentication"].startswith("CURVE"), got
            assert got["links"] == {"from_left": "tcp", "to_right": "tcp"}, got
        assert results[3][0] == 0, results[3][2][-3000:]
    finally:
        procs.close()


def test_ring_insecure_control_a_stranger_breaks_it(ring_hosts, tmp_path):
    """The same stranger against insecure=1: its forged chunk reaches rank 0 (so the test above detects)."""
    links, d, _ = ring_hosts
    procs = Procs(tmp_path)
    try:
        url = "ring://?transport=tcp&host=auto&insecure=1&chunk_mb=1&timeout=20"
        # no keys and no job secret (the ranks' environment names none): nothing shuts the stranger out
        ranks, port = _ring_ranks(procs, links, [0, 1, 2], url, "--rounds", "30", "--await", "stranger/knocking",
                                  env={auth.SECRET_ENV: ""})
        stranger = procs.popen([*links.prefix(3), sys.executable, "-c", STRANGER, links.addr(0), str(port),
                                str(d / "server.key")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = finish(ranks + [stranger], timeout=240)
        code, _, err = results[0]
        # rank 0 takes the forged message for its left neighbour's (a wrong size or header): without keys,
        # anyone who can reach the address can speak for a rank
        assert code != 0 and "ProtocolError" in err and "rank 2 (left neighbour) sent" in err, err[-3000:]
    finally:
        procs.close()


def test_ring_auto_shares_memory_within_a_host_and_keeps_tcp_between_hosts(ring_hosts, tmp_path):
    """Ranks 0 and 1 share host 0, rank 2 is on host 1: 0 -> 1 is shared memory, 1 -> 2 and 2 -> 0 are tcp."""
    links, d, _ = ring_hosts
    procs = Procs(tmp_path)
    try:
        url = f"ring://?transport=auto&host=auto&keys={d}&key_name=w{{r}}&chunk_mb=1&timeout=60"
        results = finish(_ring_ranks(procs, links, [0, 0, 1], url, "--rounds", "2")[0], timeout=240)
        expected = [{"from_left": "tcp", "to_right": "shm"}, {"from_left": "shm", "to_right": "tcp"},
                    {"from_left": "tcp", "to_right": "tcp"}]
        for r, (code, out, err) in enumerate(results):
            assert code == 0, f"rank {r}: {err[-3000:]}"
            got = json.loads(out.strip().splitlines()[-1])
            assert got["wrong"] == 0 and got["links"] == expected[r], got
    finally:
        procs.close()


def test_ring_training_across_hosts_equals_local(ring_hosts, tmp_path):
    """Two ranks on two hosts, keyed, batch 8 each: the parameters local:// reaches with batch 16."""
    links, d, folder = ring_hosts
    procs = Procs(tmp_path)
    try:
        common = ["--model", "tiny", "--momentum", "0.9", "--steps", "10", "--no-progress"]
        ref = tmp_path / "local.pt"
        local = procs.popen([sys.executable, "-m", "workers", "--exchanger", "local://", "--batch-size", "16",
                             "--save-params", str(ref), *common], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
        port, out = procs.store(links.addr(0), tuple(links.prefix(0))), tmp_path / "ring.pt"
        ranks = []
        for r in range(2):
            url = f"ring://?transport=tcp&host=auto&keys={d}&key_name=w{r}&timeout=60&bucket_mb=0.002&chunk_mb=0.001"
            ranks.append(procs.popen([*links.prefix(r), sys.executable, "-m", "workers", "--exchanger", url,
                                      "--rank", str(r), "--workers", "2", "--master-addr", links.addr(0),
                                      "--master-port", str(port), "--batch-size", "8", "--save-params", str(out),
                                      *common], AGENT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for i, (code, _, err) in enumerate(finish([local, *ranks], timeout=240)):
            assert code == 0, f"process {i}: {err[-3000:]}"
        import torch
        want, got = torch.load(ref), torch.load(out)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    finally:
        procs.close()


# ----- the launcher across hosts --------------------------------------------------------------------------
def test_a_bench_job_places_ranks_store_and_servers_in_namespaces_and_trains(tmp_path):
    """bench.jobs.run over a Links topology: two ranks on hosts 0 and 1 (the store beside rank 0),
    the two shards ps:// plans on hosts 2 and 3, each bound to port 0 on its namespace's address
    and reporting what it bound. Sync PS with SGD equals local:// on the combined batch."""
    from bench import jobs
    from commlab.launch import launcher
    from conftest import child_env, run_group

    tag = f"cj{os.getpid() % 100000}"
    common = ["--model", "tiny", "--steps", "5", "--lr", "0.1"]
    with netns.Links(4, None, tag=tag) as links:
        ps = tmp_path / "ps.pt"
        job = launcher.worker_job("ps://?shards=2&mode=sync&timeout=60", 2,
                                  ["--batch-size", "8", "--save-params", str(ps), *common], env=child_env())
        res = jobs.run(job, tmp_path / "job.log", 240, links)
        said = res.log.read_text()
        assert res.ok, said[-3000:]
        assert all(f"listening on tcp://{links.addr(h)}:" in said for h in (2, 3)), said[-3000:]
        assert f"listening on tcp://{links.addr(0)}:" in said, said[-3000:]  # the store, beside rank 0
    assert namespaces(tag) == []
    ref = tmp_path / "local.pt"
    r = run_group([sys.executable, "-m", "workers", "--exchanger", "local://", "--batch-size", "16", "--no-progress",
                   "--save-params", str(ref), *common], 240, env=child_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    import torch
    want, got = torch.load(ref), torch.load(ps)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
