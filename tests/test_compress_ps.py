"""ps://?compress= with real servers and ranks: one program per (placement, N, K) runs several compressors.

Sync, every step: every rank's parameters are bitwise equal; update=worker: each rank's exchanged gradient
equals the in-process simulation of N ranks' compressors (commlab.compress.simulate) on the same units;
update=server: the parameters equal the server's optimizer (SGD with momentum, run here on a reference
copy) applied to that simulated aggregate; the bytes each step reports equal the closed form; resuming
from ex.state_dict() (and the model's and optimizer's) at step 3 replays steps 3..5 exactly. Async and
ssp: every push is applied once (exact update counts). async + powersgd stops commlab train with exit 2.
"""

import math

import pytest

from test_compress_allreduce import DIFFERENT, HELPERS, assert_refused_in_one_line
from test_ps_update import servers  # noqa: F401 (a fixture)

pytestmark = pytest.mark.multiproc

DEFAULT = ["compress=powersgd:2,start_iter=2", "compress=topk:0.1", "compress=fp16"]
EVERY = DEFAULT + ["compress=powersgd:2,start_iter=2&ef=0", "compress=topk:0.1&ef=0", "compress=bf16",
                   "compress=randomk:0.25", "compress=sign"]
PER_RANK = ["compress=fp16", "compress=bf16", "compress=topk:0.1", "compress=randomk:0.25", "compress=sign"]
STEPS, RESUME_AT = 6, 3

PROGRAM = HELPERS.replace("%", "%%") + """
BASE, QUERIES, STEPS, RESUME_AT, SERVER = %r, %r, %d, %d, %r
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

def units(ex):
    return [u for per in ex._pushes.units for u in per]


def simulated(ex, model, x, y, sims):
    # every rank's gradient at these (equal) parameters, 1/N of it through the simulated compressors, per unit;
    # returns each parameter's aggregate (its pieces' parts of their units' aggregates)
    params = [p for b in ex.buckets for p in b.params]
    flats = []
    for w in range(world):
        grads = dict(zip(map(id, params), torch.autograd.grad(loss(model, x[w], y[w]), params)))
        flats.append([torch.cat([(grads[id(p)] * (1.0 / world)).reshape(-1) for p in b.params]) for b in ex.buckets])
    aggs = [torch.zeros(b.numel) for b in ex.buckets]
    for u in units(ex):
        xs = [torch.cat([f[u.bucket][a:a + c] for a, c in u.ranges]) for f in flats]
        agg, at = exchange(sims, u.key, xs, u.shapes)[rank], 0
        for a, c in u.ranges:
            aggs[u.bucket][a:a + c] = agg[at:at + c]
            at += c
    return aggs


def run(model, opt, ex, steps, sims=None, ref=None):
    seen = {"digests": [], "errors": [], "bytes": [], "raw": []}
    for step in steps:
        x, y = data(step)
        want = simulated(ex, model, x, y, sims) if sims else None
        opt.zero_grad()
        loss(model, x[rank], y[rank]).backward()
        if want is not None and SERVER:  # the reference takes the simulated aggregate as its gradient
            ref_model, ref_opt = ref
            for b, agg in zip(ex.buckets, want):
                for i, p in enumerate(b.params):
                    name = b.names[i]
                    ref_model.get_parameter(name).grad = agg[b.offsets[i]:b.offsets[i] + p.numel()].view(p.shape).clone()
            ref_opt.step()
        elif want is not None:
            got = [torch.cat([p.grad.reshape(-1) for p in b.params]) for b in ex.buckets]
            seen["errors"].append(max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)))
        opt.step()
        if want is not None and SERVER:
            ref_model = ref[0]
            seen["errors"].append(max(float((p - ref_model.get_parameter(n)).abs().max())
                                      for n, p in model.named_parameters()))
        note(seen, ex, model, opt)
    return seen


out = {}
for query in QUERIES:
    sims = simulators(query, world)
    model, opt, ex = fresh(BASE + "&" + query)
    ref_model = copy.deepcopy(model)
    ref = (ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9))
    first = run(model, opt, ex, range(RESUME_AT), sims, ref)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    saved["ex"] = ex.state_dict()
    rest = run(model, opt, ex, range(RESUME_AT, STEPS), sims, ref)
    shapes = [[u.key, [list(s) for s in u.shapes]] for u in units(ex)]
    ex.close()
    model, opt, ex = fresh(BASE + "&" + query)  # a restart: fresh objects (a fresh key space on the servers), then the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    ex.load_state_dict(saved["ex"])
    again = run(model, opt, ex, range(RESUME_AT, STEPS))
    ex.close()
    out[query] = {"digests": first["digests"] + rest["digests"], "errors": first["errors"] + rest["errors"],
                  "bytes": first["bytes"] + rest["bytes"], "raw": first["raw"] + rest["raw"],
                  "resumed": again["digests"], "units": shapes}
print(json.dumps(out))
"""


def sent_bytes(query: str, units: list, step: int) -> int:
    """Payload bytes one rank pushes in one step: per unit of n float32 elements (closed forms of
    docs/compress.md; PowerSGD: round 0's P and plain tensors, round 1's Q)."""
    spec = dict(p.split("=", 1) for p in query.split("&"))["compress"]
    name, _, arg = spec.partition(",")[0].partition(":")
    total = 0
    for _, shapes in units:
        n = sum(math.prod(s) for s in shapes)
        k = max(1, math.ceil(float(arg or 1) * n - 1e-9))
        if name in ("fp16", "bf16"):
            total += 2 * n
        elif name == "topk":
            total += 8 * k
        elif name == "randomk":
            total += 4 * k
        elif name == "sign":
            total += math.ceil(n / 8) + 4
        elif name == "powersgd":
            if step < 2:  # start_iter=2: uncompressed, in round 0
                total += 4 * n
                continue
            for s in shapes:
                rows, cols = s[0], math.prod(s) // s[0]
                r = min(rows, cols, int(arg))
                if len(s) >= 2 and (rows + cols) * r * 2 < rows * cols:
                    total += 4 * (rows + cols) * r
                else:
                    total += 4 * math.prod(s)
    return total


def check_sync(results, queries, n):
    for query in queries:
        mine = [res[query] for res in results]
        for step in range(STEPS):
            assert len({m["digests"][step] for m in mine}) == 1, f"{query}: ranks differ after step {step}"
        for m in mine:
            assert len(m["errors"]) == STEPS
            # the server adds in rank order, as the simulation does: bit for bit
            assert max(m["errors"]) == 0.0, f"{query}: off the simulation by {max(m['errors'])}"
            assert m["resumed"] == m["digests"][RESUME_AT:], f"{query}: resuming at step {RESUME_AT} diverged"
            want = [sent_bytes(query, m["units"], s) for s in range(STEPS)]
            assert m["bytes"] == want, f"{query}: bytes sent {m['bytes']}, closed form {want}"
            raw = 4 * sum(sum(math.prod(s) for s in shapes) for _, shapes in m["units"])
            assert m["raw"] == [raw] * STEPS, f"{query}: uncompressed equivalent {m['raw']}, closed form {raw}"
            assert sum(m["bytes"]) < sum(m["raw"]), query


def run_sync(run_ranks, servers, update, n, k, queries, mode="sync"):
    base = servers(k, mode) + f"?update={update}&timeout=30&bucket_mb=0.0005" + ("&piece_mb=0.0004" if k > 1 else "")
    program = PROGRAM % (base, queries, STEPS, RESUME_AT, update == "server")
    results = [r.json() for r in run_ranks(program, n, timeout=240)]
    check_sync(results, queries, n)
    assert len(results[0][queries[0]]["units"]) == 2 * k  # two buckets: rounds of several units interleave


@pytest.mark.parametrize("update", ["worker", "server"])
def test_sync_compressors_match_the_simulation(run_ranks, servers, update):
    run_sync(run_ranks, servers, update, 2, 1, DEFAULT)


@pytest.mark.full
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("update", ["worker", "server"])
def test_sync_every_compressor_matches_the_simulation(run_ranks, servers, update, n, k):
    run_sync(run_ranks, servers, update, n, k, EVERY)


@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.full)])
def test_one_async_rank_gets_its_decoded_push_applied(run_ranks, servers, mode):
    """One rank, so the order of updates is known: the server applies exactly the push's decoding (with the
    rank's error feedback), as SGD on the simulated aggregate of one rank."""
    run_sync(run_ranks, servers, "server", 1, 1, ["compress=topk:0.1", "compress=randomk:0.25"], mode)


ASYNC = """
import json, os, torch, commlab
from torch import nn
torch.set_num_threads(1)
BASE, QUERIES, STEPS = %r, %r, %d
rank = int(os.environ["RANK"])
out = {}
for query in QUERIES:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ex = commlab.connect(BASE + "&" + query)
    ex.setup(model, opt)
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(8, 12, generator=g)), torch.randn(8, 3, generator=g)).backward()
        opt.step()
    out[query] = {"sent": ex.stats.bytes_sent, "raw": ex.stats.bytes_uncompressed}
    ex.close()
print(json.dumps(out))
"""


def updates_of(endpoint: str) -> dict:
    from commlab.regimes.ps import server_stats
    return server_stats(endpoint)["spaces"]


@pytest.mark.parametrize("mode,k,n,queries", [
    ("async", 1, 2, ["compress=topk:0.1", "compress=fp16"]),
    ("ssp", 1, 2, ["compress=topk:0.1", "compress=fp16"]),
    *[pytest.param(mode, k, n, PER_RANK + ["compress=topk:0.1&ef=0"], marks=pytest.mark.full)
      for mode in ("async", "ssp") for k in (1, 2) for n in (2, 3)],
])
def test_async_applies_every_compressed_push_once(run_ranks, servers, mode, k, n, queries):
    steps = 8
    url = servers(k, mode)
    base = url + "?timeout=30&bucket_mb=0.0005" + ("&piece_mb=0.0004" if k > 1 else "")
    results = [r.json() for r in run_ranks(ASYNC % (base, queries, steps), n, timeout=120)]
    for res in results:
        for query in queries:
            assert 0 < res[query]["sent"] < res[query]["raw"], query
    for endpoint in url.removeprefix("ps://").split(","):
        spaces = updates_of(endpoint)
        assert [s["updates"] for s in spaces.values()] == [n * steps] * len(queries), spaces  # one per (rank, step)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_powersgd_without_sync_stops_commlab_train_in_one_line_naming_compress(mode):
    assert_refused_in_one_line(f"ps://?mode={mode}&compress=powersgd:2",
                               "option 'compress': powersgd:2 needs every rank's payload at every step")


def test_ranks_that_compress_differently_are_refused_by_name(run_ranks, servers):
    res = run_ranks(DIFFERENT % (servers(1) + "?timeout=3&retries=0&compress="), 2, check=False, timeout=60)
    said = [r.out for r in res]
    assert sum("REFUSED" in out for out in said) == 1, said  # the second hello; the first fixed compress=
    assert any("asks for compress=topk:0.01&ef=1, the first worker of shard 0/1 for compress=fp16&ef=1: every rank "
               "must compress alike" in out or "asks for compress=fp16&ef=1, the first worker of shard 0/1 for "
               "compress=topk:0.01&ef=1: every rank must compress alike" in out for out in said), said


JOIN = """
import commlab, torch
from torch import nn
model = nn.Linear(4, 2)
ex = commlab.connect(%r)
ex.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
entered = False
try:
    with ex.join():
        entered = True
except commlab.ConfigError as exc:
    print("REFUSED", entered, exc)
ex.close()
"""


def test_join_with_compression_is_refused_before_the_loop_it_wraps(run_ranks, servers):
    (res,) = run_ranks(JOIN % (servers(1) + "?timeout=10&compress=fp16"), 1, timeout=60)
    assert "REFUSED False ps:// compress=: ex.join() (uneven inputs) is not supported with compression" in res.out
