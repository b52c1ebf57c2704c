"""Resume per compressor: a job stopped at step 10 and restarted from every rank's checkpoint ends where the
uninterrupted 20-step run ends, bit for bit, on every rank.

One program for every compressor (and none). The first job runs, per compressor, the 20 steps whole, then
10 steps from scratch and saves each rank's ``model.state_dict()``, ``optimizer.state_dict()`` (AdamW: its
moments are state too) and ``ex.state_dict()`` (residuals, PowerSGD's Q and step counters, random-k's seed
and steps) with ``torch.save``, and exits, as a preempted job does. A second job (new processes) loads them
into fresh objects and runs steps 10..19. Every step's parameters and optimizer state, as a digest, must
equal the uninterrupted run's on every rank; the ranks' digests must equal each other. Several buckets
(``bucket_mb`` tiny), so per-bucket state is keyed correctly; PowerSGD's warm-up ends before the stop.
Under ``allreduce://`` the program makes the default process group first, which every exchanger borrows.
``allreduce://`` in the default run; ``ring://`` and ``ps://`` (sync, ``update=worker``, one shard) under
``full`` (each skipped, saying so, where this checkout's regime does not take ``compress=`` yet).
"""

from __future__ import annotations

import pytest

from bench.regimes import unavailable
from test_ps_update import servers  # noqa: F401 (a fixture)

pytestmark = pytest.mark.multiproc

QUERIES = ["compress=none", "compress=fp16", "compress=bf16", "compress=powersgd:2,start_iter=3", "compress=topk:0.1",
           "compress=randomk:0.25", "compress=sign"]
STEPS, STOP = 20, 10

PROGRAM = """
import hashlib, json, torch, torch.distributed as dist, commlab
from torch import nn

torch.set_num_threads(1)
URL, QUERIES, STEPS, STOP, CK, PHASE = %r
if URL.startswith("allreduce://"):  # one group for the program's many exchangers: each borrows it
    dist.init_process_group("gloo")


def fresh(query):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ex = commlab.connect(URL + ("&" if "?" in URL else "?") + "bucket_mb=0.0005&" + query)
    ex.setup(model, opt)
    return model, opt, ex


def digest(model, opt):
    tensors = [p.detach() for p in model.parameters()]
    tensors += [torch.as_tensor(v) for s in opt.state_dict()["state"].values() for _, v in sorted(s.items())]
    return hashlib.sha1(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()[:16]


def run(model, opt, ex, steps):
    seen = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(ex.world_size, 8, 12, generator=g), torch.randn(ex.world_size, 8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[ex.rank]), y[ex.rank]).backward()
        opt.step()
        seen.append(digest(model, opt))
    return seen


out = {}
for i, query in enumerate(QUERIES):
    model, opt, ex = fresh(query)
    path = CK %% (i, ex.rank)
    if PHASE == "first":
        whole = run(model, opt, ex, range(STEPS))
        ex.close()
        model, opt, ex = fresh(query)
        run(model, opt, ex, range(STOP))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "ex": ex.state_dict()}, path)
        out[query] = {"whole": whole, "buckets": len(ex.buckets)}
    else:
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        ex.load_state_dict(saved["ex"])
        out[query] = {"resumed": run(model, opt, ex, range(STOP, STEPS))}
    ex.close()
if dist.is_initialized():
    dist.destroy_process_group()
print(json.dumps(out))
"""

RING = "ring://?timeout=60"
PS = "ps://?mode=sync&update=worker&timeout=60"  # one shard, started here (the servers fixture)


def takes_compress(url: str):
    return pytest.mark.skipif(unavailable(url + "&compress=fp16") is not None,
                              reason=f"this checkout's {url.split(':')[0]}:// does not take compress= yet")


@pytest.mark.parametrize("url", ["allreduce://?timeout=60",
                                 pytest.param(RING, marks=[pytest.mark.full, takes_compress(RING)]),
                                 pytest.param(PS, marks=[pytest.mark.full, takes_compress(PS)])])
def test_every_compressor_resumes_from_every_ranks_checkpoint_as_if_never_stopped(run_ranks, servers, tmp_path, url):
    if url.startswith("ps://"):
        url = servers(1, "sync") + url.removeprefix("ps://")
    ck = str(tmp_path / "ck-%d.rank%d.pt")
    first = [r.json() for r in run_ranks(PROGRAM % ((url, QUERIES, STEPS, STOP, ck, "first"),), 2, timeout=150)]
    again = [r.json() for r in run_ranks(PROGRAM % ((url, QUERIES, STEPS, STOP, ck, "resume"),), 2, timeout=150)]
    for query in QUERIES:
        whole = first[0][query]["whole"]
        assert first[0][query]["buckets"] >= 2
        assert all(f[query]["whole"] == whole for f in first), f"{query}: ranks differ in the uninterrupted run"
        assert len(set(whole)) == STEPS, f"{query}: a step changed nothing"
        for rank, res in enumerate(again):
            assert res[query]["resumed"] == whole[STOP:], f"{query}: rank {rank}'s resumed run left the uninterrupted one"
