"""Keep-going on ps:// under compress= (issue 38; docs/faults.md "What survives what"): a worker killed with a
compressed step half-pushed leaves the job, the step in flight completes over the others, averaged over them.

The workers of tests/keepgoing_driver.py (rank r's gradient is ``10 ** r`` everywhere, plain SGD, each
parameter a bucket of its own, so each unit is one parameter); rank 1 kills itself at step K before its push,
between its pushes to two shards, or after shard 0 acknowledged its first push message. The reference runs the
same compressor (error feedback on, the default) in this process for each rank, as the workers do, and sums
what the shard sums: every rank's payload before K, at K rank 1's only on the shards that held its whole step,
the survivors' after, each sum that leaves rank 1 out multiplied by 3/2 (the mean over the two). So the lossy
arithmetic of fp16 (summable) and sign (gather-only) is the workers' own, and the end says exactly which ranks
each step counted on each shard.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from commlab import compress
from commlab.compress.seam import summed
from faultkit import finish
from test_keepgoing import K, LR, ON_SHARD0, SIZES, T, TIMEOUT, _check, _sync_reference, _workers

pytestmark = pytest.mark.multiproc


def _counted(t: int, shard: int, kept_on: set[int]) -> list[int]:
    return [0, 1, 2] if t < K or t == K and shard in kept_on else [0, 2]


def _compressed_reference(spec: str, kept_on: set[int]) -> list[torch.Tensor]:
    """Each parameter after T sync steps, the workers' compressors run here: a rank compresses its 1/3-scaled
    gradient plus its residual, the shard adds the counted ranks' payloads in rank order (fp16: in float32;
    sign: each decoded alone), and x 3/2 when two count; SGD steps on that mean in float32."""
    comps = [compress.build(spec, True) for _ in range(3)]
    for c in comps:
        c.bind(3)
    params = [torch.zeros(n) for n in SIZES]
    for t in range(T):
        for i, n in enumerate(SIZES):
            counted = _counted(t, 0 if i in ON_SHARD0 else 1, kept_on)
            payloads = {}
            for r in sorted({0, 2, *counted}):
                payloads[r] = comps[r].start(i, torch.full((n,), 10.0 ** r).mul_(1 / 3), [(n,)])
            mean = torch.zeros(n)
            if comps[0].summable:
                mean.copy_(summed([payloads[r] for r in counted])[0])
            else:
                for r in counted:
                    comps[0].decode_add(i, payloads[r], n, {}, mean)
            if len(counted) != 3:
                mean.mul_(3 / len(counted))
            for r, payload in payloads.items():  # error feedback's bookkeeping: the share is the own decoding
                comps[r].finish(i, payload if comps[r].summable else [payload], torch.empty(n))
            params[i].add_(mean, alpha=-LR)
    return [p.double() for p in params]


@pytest.mark.parametrize("spec,update,kill_at,kept_on,lost_pushes", [
    ("fp16", "server", "partial", set(), [1, 0]),  # held payloads: taken out of the sum (or never in it)
    ("sign", "worker", "between", {0}, [0, 0]),  # whole on shard 0: kept there; shard 1's sums over the survivors
    pytest.param("sign", "server", "partial", set(), [1, 0], marks=pytest.mark.full),
    pytest.param("fp16", "server", "between", {0}, [0, 0], marks=pytest.mark.full),
    pytest.param("fp16", "worker", "before", set(), [0, 0], marks=pytest.mark.full),
    pytest.param("sign", "server", "before", set(), [0, 0], marks=pytest.mark.full),
    # PowerSGD (two summed rounds, pulled by the workers: a published sum): the vectors travel uncompressed
    pytest.param("powersgd:1", "server", "before", set(), [0, 0], marks=pytest.mark.full),
])
def test_compressed_sync_survivors_go_on_without_the_dead_rank(procs, spec, update, kill_at, kept_on, lost_pushes):
    shm_before = set(os.listdir("/dev/shm"))
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode=sync&update={update}&min_workers=2"
           f"&timeout={TIMEOUT}&bucket_mb=0.000001&transport=tcp&compress={spec}")
    workers = _workers(procs, url, kill_at)
    results = finish([workers[0], workers[2]], timeout=120)
    workers[1].wait(30)
    assert workers[1].returncode == -signal.SIGKILL, workers[1].communicate()[1][-3000:]
    want = _sync_reference(kept_on) if spec.startswith("powersgd") else _compressed_reference(spec, kept_on)
    recs = _check(results, want, [w.pid for w in workers])
    for shard, stats in enumerate(recs[-1]["servers"]):
        assert stats["updates"] == T, stats  # every step applied once: none twice, none lost
        assert stats["lost_pushes"] == lost_pushes[shard], stats
        # (update=worker: shard 0 finishes step K once the survivors' pushes are in too, maybe before rank 1 died)
        left_at = {K, K + 1} if shard in kept_on and update == "worker" else {K}
        assert stats["members"]["lost"]["1"]["step"] in left_at, stats["members"]
        assert not stats["members"]["ended"], stats["members"]
    for s in servers:
        s.stop()
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("commlab")]


@pytest.mark.full
@pytest.mark.parametrize("mode,kill_at", [("async", "partial"), ("ssp", "before")])
def test_compressed_async_and_ssp_survivors_go_on_and_the_dead_ranks_partial_step_is_never_applied(procs, mode,
                                                                                                   kill_at):
    """async and ssp, compress=fp16: each push decoded alone (unscaled 1, 10 and 100 are exact in fp16, the
    residuals stay 0): the end is -lr (T (1 + 100) + K 10), 2T + K updates per shard, rank 1's half-push never
    applied; ssp's survivors are not held back by the dead rank's clock."""
    servers = [procs.server("--mode", mode, "--staleness", "1", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://?endpoints={','.join(s.endpoint for s in servers)}&mode={mode}&min_workers=2"
           f"&timeout={TIMEOUT}&bucket_mb=0.000001&transport=tcp&compress=fp16")
    workers = _workers(procs, url, kill_at, "--final-updates", str(2 * T + K))
    results = finish([workers[0], workers[2]], timeout=120)
    want = [torch.full((n,), -LR * (T * 101 + K * 10), dtype=torch.float64) for n in SIZES]
    _check(results, want, [w.pid for w in workers])
    workers[1].wait(30)  # (the survivors may finish before rank 1 reached step K)
    deadline = time.monotonic() + 30
    while not all("1" in s.stats()["members"]["lost"] for s in servers):
        assert time.monotonic() < deadline, [s.stats()["members"] for s in servers]
        time.sleep(0.02)
    for shard, st in enumerate(s.stats() for s in servers):
        assert st["updates"] == 2 * T + K, st
        assert st["lost_pushes"] == (1 if kill_at == "partial" and shard == 0 else 0), st
        assert st["last_step"]["1"] == K - 1, st
