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

import pytest
import torch

from commlab import compress
from commlab.compress.seam import summed
from test_keepgoing import K, LR, ON_SHARD0, SIZES, T, TIMEOUT, _check, _sync_job, _sync_reference

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
    # PowerSGD (two summed rounds, pulled by the workers: published sums): the vectors travel uncompressed, exact;
    # ef=0, as its residuals (input - aggregate / N) sum to zero only over every rank: the dead rank's goes with it
    pytest.param("powersgd:1&ef=0", "server", "before", set(), [0, 0], marks=pytest.mark.full),
])
def test_compressed_sync_survivors_go_on_without_the_dead_rank(procs, spec, update, kill_at, kept_on, lost_pushes):
    shm_before = set(os.listdir("/dev/shm"))
    results, pids, servers = _sync_job(procs, update, kill_at, f"transport=tcp&compress={spec}")
    want = _sync_reference(kept_on) if spec.startswith("powersgd") else _compressed_reference(spec, kept_on)
    recs = _check(results, want, pids)
    for shard, stats in enumerate(recs[-1]["servers"]):
        assert stats["updates"] == T, stats  # every step applied once: none twice, none lost
        assert stats["lost_pushes"] == lost_pushes[shard], stats
        # the first step the shard gathered without rank 1 (kept: K + 1, before or after step K was complete)
        assert stats["members"]["lost"]["1"]["step"] == (K + 1 if shard in kept_on else K), stats["members"]
        assert not stats["members"]["ended"], stats["members"]
    for s in servers:
        s.stop()
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("commlab")]

