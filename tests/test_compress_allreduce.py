"""allreduce://?compress= with real processes over gloo: every compressor (and none) in one program per N.

The program (shared with tests/test_compress_ring.py, which runs it over ring://) makes the default process
group itself first (as a DDP script would), so every exchanger borrows it: each must leave it working after
close(). Per compressor, every step: each rank's exchanged gradient equals what the in-process simulation of N
ranks' compressors (commlab.compress.simulate) computes from every rank's gradient; the parameters and the
optimizer's momentum are bitwise equal on every rank; the bytes the step reports equal the closed form; and
resuming from ex.state_dict() at step 3 replays steps 3..5 exactly.
"""

import math

import pytest

pytestmark = pytest.mark.multiproc

QUERIES = ["compress=none", "compress=fp16", "compress=bf16", "compress=powersgd:2,start_iter=2",
           "compress=powersgd:2,start_iter=2&ef=0", "compress=topk:0.1", "compress=topk:0.1&ef=0",
           "compress=randomk:0.25", "compress=sign", "compress=int8,block=64", "compress=fp4"]
# the other block quantizers move as int8 and fp4 do (gathered bytes, decoded alone): under the full marker
MORE_QUERIES = ["compress=none", "compress=int4", "compress=fp8", "compress=int8"]
STEPS, RESUME_AT = 6, 3

# what a rank program of these tests starts with (tests/test_compress_ps.py's too): a model, its optimizer and
# an exchanger from a URL, each step's data for every rank, the loss, a digest of the parameters, a step's
# bytes noted, the simulated compressors of a query
HELPERS = """
import copy, hashlib, json, os, torch, commlab
from urllib.parse import parse_qsl
from torch import nn
from commlab.compress import build
from commlab.compress.simulate import exchange

torch.set_num_threads(1)


def fresh(url):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ex = commlab.connect(url)
    ex.setup(model, opt)
    return model, opt, ex


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    world = int(os.environ["WORLD_SIZE"])
    return torch.randn(world, 8, 12, generator=g), torch.randn(world, 8, 3, generator=g)


def loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def digest(model, opt):  # the parameters' and the optimizer's momentum buffers' bits
    params = list(model.parameters())
    state = [opt.state[p]["momentum_buffer"] for p in params if p in opt.state]
    return hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in params + state)).hexdigest()[:16]


def note(seen, ex, model, opt):
    seen["bytes"].append(ex.last_report.bytes_sent)
    seen["raw"].append(ex.last_report.bytes_uncompressed)
    seen["digests"].append(digest(model, opt))


def simulators(query, world):
    # one compressor per simulated rank (none for compress=none)
    q = dict(parse_qsl(query))
    sims = [build(q["compress"], q.get("ef", "1") == "1") for _ in range(world)]
    for s in sims:
        if s is not None:
            s.bind(world)
    return [] if sims[0] is None else sims
"""

PROGRAM = HELPERS + """
import torch.distributed as dist

dist.init_process_group("gloo")  # before commlab, as under DDP: every exchanger below borrows it
rank, world = dist.get_rank(), dist.get_world_size()
QUERIES, STEPS, RESUME_AT, URL, PER_HOP = %r, %d, %d, %r, %r  # PER_HOP: fp16/bf16 summed as a ring sums them
URL += "timeout=30&bucket_mb=0.0005&"


def run(query, model, opt, ex, steps, sims=None):
    seen = {"digests": [], "errors": [], "bytes": [], "raw": []}
    for step in steps:
        x, y = data(step)
        want = []
        if sims is not None:  # every rank's gradient at these (equal) parameters, through simulated compressors
            params = [p for b in ex.buckets for p in b.params]
            flats = []
            for w in range(world):
                grads = dict(zip(map(id, params), torch.autograd.grad(loss(model, x[w], y[w]), params)))
                flats.append([torch.cat([(grads[id(p)] * (1.0 / world)).reshape(-1) for p in b.params])
                              for b in ex.buckets])
            for b in ex.buckets:
                xs = [f[b.index] for f in flats]
                shapes = tuple(p.shape for p in b.params)
                want.append(exchange(sims, b.index, xs, shapes, PER_HOP)[rank] if sims else
                            sum(xs[1:], xs[0].clone()))
        opt.zero_grad()
        loss(model, x[rank], y[rank]).backward()
        if want:
            got = [torch.cat([p.grad.reshape(-1) for p in b.params]) for b in ex.buckets]
            seen["errors"].append(max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)))
        opt.step()
        note(seen, ex, model, opt)
    return seen


out = {}
for query in QUERIES:
    sims = simulators(query, world)
    model, opt, ex = fresh(URL + query)
    first = run(query, model, opt, ex, range(RESUME_AT), sims)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # torch's: references
    saved["ex"] = ex.state_dict()  # the exchanger's is a snapshot already
    rest = run(query, model, opt, ex, range(RESUME_AT, STEPS), sims)
    shapes = [[list(p.shape) for p in b.params] for b in ex.buckets]
    links = ex.facts().get("links")
    ex.close()
    model, opt, ex = fresh(URL + query)  # a restart: fresh objects, then the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    ex.load_state_dict(saved["ex"])
    again = run(query, model, opt, ex, range(RESUME_AT, STEPS))
    ex.close()
    t = torch.ones(1)
    dist.all_reduce(t)  # the borrowed group still works after every close()
    out[query] = {"digests": first["digests"] + rest["digests"], "errors": first["errors"] + rest["errors"],
                  "bytes": first["bytes"] + rest["bytes"], "raw": first["raw"] + rest["raw"], "resumed": again["digests"], "shapes": shapes,
                  "group_alive": dist.is_initialized() and t.item() == world, "rank": rank, "links": links}
dist.destroy_process_group()
print(json.dumps(out))
"""


def wire_bytes(query: str, shapes: list[list[list[int]]], step: int, n: int, summed=None, per_hop: bool = False) -> int:
    """Bytes one rank sends in one step. ``summed(elements, itemsize)``: what an all-reduce sends, by default
    2(N-1)/N x its bytes (a ring's count); an all-gather sends (N-1) x S. Each bucket's presence flags (one
    float32 a parameter) travel with round 0: in the same all-reduce as float32 payloads, packed with gathered
    ones, in an all-reduce of their own beside fp16/bf16 summed ``per_hop``."""
    spec = dict(p.split("=", 1) for p in query.split("&"))["compress"]
    name, _, arg = spec.partition(",")[0].partition(":")
    allreduce = summed or (lambda elements, itemsize: 2 * (n - 1) * elements * itemsize // n)
    gather = lambda size: (n - 1) * size
    total = 0
    for bucket in shapes:
        numel, flags = sum(math.prod(s) for s in bucket), len(bucket)
        k = max(1, math.ceil(float(arg or 1) * numel - 1e-9))
        if name == "none":
            total += allreduce(numel + flags, 4)
        elif name in ("fp16", "bf16"):
            total += allreduce(numel, 2) + allreduce(flags, 4) if per_hop else gather(2 * numel + 4 * flags)
        elif name == "topk":
            total += gather(8 * k + 4 * flags)
        elif name == "sign":
            total += gather(math.ceil(numel / 8) + 4 + 4 * flags)
        elif name in ("int8", "int4", "fp4", "fp8"):  # codes (one or two a byte), a float32 scale per block
            block = int(spec.partition("block=")[2] or (256 if name in ("int8", "fp8") else 64))
            codes = numel if name in ("int8", "fp8") else math.ceil(numel / 2)
            total += gather(codes + 4 * math.ceil(numel / block) + 4 * flags)
        elif name == "randomk":
            total += allreduce(k + flags, 4)
        elif name == "powersgd":
            rank, start_iter = int(arg), 2
            if step < start_iter:
                total += allreduce(numel + flags, 4)
                continue
            p = q = plain = 0
            for s in bucket:
                rows, cols = s[0], math.prod(s) // s[0]
                r = min(rows, cols, rank)
                if len(s) >= 2 and (rows + cols) * r * 2 < rows * cols:
                    p, q = p + rows * r, q + cols * r
                else:
                    plain += math.prod(s)
            total += allreduce(plain + p + flags, 4) + allreduce(q, 4)
    return total


def run_every_compressor(run_ranks, n: int, url: str, per_hop: bool, queries=QUERIES) -> list[dict]:
    """Each rank's results of PROGRAM over ``url``, every query of ``queries`` (compress=none first) in turn."""
    return [r.json() for r in run_ranks(PROGRAM % (queries, STEPS, RESUME_AT, url, per_hop), n, timeout=150)]


def check(results: list[dict], n: int, sent, bitwise, queries=QUERIES) -> None:
    """Ranks identical after every step; each rank's exchanged gradient the simulation's (exactly where
    ``bitwise(query)``, else within 1e-5); bytes sent ``sent(query, shapes, step, rank)``; the uncompressed
    equivalent an all-reduce's 2(N-1)/N of the buckets (numel and flags, float32); resume replays exactly."""
    for query in queries:
        mine = [res[query] for res in results]
        for step in range(STEPS):
            assert len({m["digests"][step] for m in mine}) == 1, f"{query}: ranks differ after step {step}"
        for m in mine:
            assert max(m["errors"]) <= (0.0 if bitwise(query) else 1e-5), \
                f"{query}: exchanged gradient off the simulation by {max(m['errors'])}"
            assert m["resumed"] == m["digests"][RESUME_AT:], f"{query}: resuming at step {RESUME_AT} diverged"
            assert m["group_alive"]
            want = [sent(query, m["shapes"], s, m["rank"]) for s in range(STEPS)]
            assert m["bytes"] == want, f"{query}: bytes sent {m['bytes']}, closed form {want}"
            raw = [0] * STEPS if query == "compress=none" else \
                [sum(2 * (n - 1) * 4 * (sum(map(math.prod, b)) + len(b)) // n for b in m["shapes"])] * STEPS
            assert m["raw"] == raw, f"{query}: uncompressed equivalent {m['raw']}, closed form {raw}"
    plain = results[0]["compress=none"]
    assert len(plain["shapes"]) == 2  # two buckets: rounds of several buckets interleave
    for query in queries[1:]:  # every compressor sent fewer bytes than the uncompressed exchange, and changed the run
        mine = results[0][query]
        assert sum(mine["bytes"]) < sum(plain["bytes"]), query
        assert mine["digests"][-1] != plain["digests"][-1], query


@pytest.mark.parametrize("n, queries", [(2, QUERIES), pytest.param(3, QUERIES, marks=pytest.mark.full),
                                        pytest.param(2, MORE_QUERIES, marks=pytest.mark.full)])
def test_every_compressor_keeps_ranks_identical_and_matches_the_simulation(run_ranks, n, queries):
    results = run_every_compressor(run_ranks, n, "allreduce://?", per_hop=False, queries=queries)
    # N=2: one addition, the same in gloo as in the simulation, bit for bit; N=3: gloo's ring adds in another
    # order than rank order, and PowerSGD's state carries the rounding difference on
    check(results, n, lambda query, shapes, step, rank: wire_bytes(query, shapes, step, n), lambda query: n == 2,
          queries)


def assert_refused_in_one_line(url: str, says: str) -> None:
    """``commlab train --exchanger URL`` exits 2 before anything starts, with one line that says ``says``."""
    from conftest import commlab_train
    proc = commlab_train(["--exchanger", url, "--workers", "2"], timeout=60)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_a_bad_spec_stops_commlab_train_in_one_line_before_anything_starts():
    assert_refused_in_one_line("allreduce://?compress=powersgd:0",
                               "option 'compress': 'powersgd:0' (powersgd:R): R=0 must be >= 1")


# rank 1 compresses with topk:0.01, the others with fp16, through the URL given (tests/test_compress_ps.py's too)
DIFFERENT = """
import os, torch, commlab
from torch import nn
spec = "topk:0.01" if os.environ["RANK"] == "1" else "fp16"
ex = commlab.connect(%r + spec)
try:
    ex.setup(nn.Linear(4, 3), commlab.OptimizerSpec())
    print("no error")
except (commlab.ConfigError, commlab.RemoteError) as e:
    print("REFUSED", e)
except commlab.CommTimeout as e:  # a rank whose peers were refused
    print("TIMEOUT", e)
"""


@pytest.mark.parametrize("scheme", ["allreduce", "ring"])
def test_ranks_that_compress_differently_are_refused_by_name(run_ranks, scheme):
    res = run_ranks(DIFFERENT % f"{scheme}://?timeout=20&compress=", 2, check=False, timeout=60)
    for r in res:  # both: rank 1, and rank 0, which reads every rank's
        assert "REFUSED rank 1 has compress=topk:0.01&ef=1 but rank 0 has compress=fp16&ef=1: every rank must " \
               "compress alike" in r.out, r.out + r.err
