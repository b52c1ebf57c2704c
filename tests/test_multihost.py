"""Several hosts: two server shards and three workers in five network namespaces, CURVE on.

:class:`commlab.netns.Links` (uncapped) gives each process a namespace of its own with a real
address (10.91.0.H, assigned only inside namespaces this test creates) on a bridge, so the
servers bind a non-loopback address, which they only do with keys. Sync and async jobs run at
once over the same five hosts; the results are checked against closed forms. The namespaces
are deleted on the way out, also on failure. Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from commlab import keys, netns

from faultkit import Procs, finish

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
            workers = {mode: [procs.worker(f"{url}&key_name=w{r}", r, 3, STEPS, "--grad", str(GRADS[r]), "--lr",
                                           str(LR), "--size", "1000", prefix=tuple(links.prefix(2 + r)))
                              for r in range(3)] for mode, url in urls.items()}
            done = {mode: finish(ws, timeout=240) for mode, ws in workers.items()}
            for mode, results in done.items():
                for r, (code, _, err) in enumerate(results):
                    assert code == 0, f"{mode} worker {r}: {err[-3000:]}"
            # sync: every worker ends on the same step-by-step mean
            for _, out, _ in done["sync"]:
                assert json.loads(out.strip().splitlines()[-1])["param"] == [-LR * 0.5 * STEPS] * 1000
            # async: every push applied once, on both shards: pull the final values from a fresh process
            # on worker 2's host
            code, out, err = finish([procs.worker(f"{urls['async']}&key_name=w0", 0, 3, 0, "--size", "1000",
                                                  prefix=tuple(links.prefix(4)))], timeout=120)[0]
            assert code == 0, err[-3000:]
            assert json.loads(out.strip().splitlines()[-1])["param"] == [-LR * sum(GRADS) * STEPS] * 1000
        finally:
            procs.close()
    assert namespaces(tag) == []
