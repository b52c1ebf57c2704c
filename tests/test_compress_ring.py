"""ring://?compress= with real processes: every compressor (and none) in one program per N and transport.

Per compressor, every step: each rank's exchanged gradient equals what the in-process simulation of N ranks'
compressors (commlab.compress.simulate) computes from every rank's gradient, with fp16/bf16 added as the ring
adds them per hop (float32 partials rounded once per hop: simulate's per_hop=True follows the ring's segment
order); the parameters are bitwise equal on every rank; the bytes the step reports equal the closed form; and
resuming from ex.state_dict() at step 3 replays steps 3..5 exactly.
"""

import math

import pytest

from test_compress_allreduce import QUERIES, RESUME_AT, STEPS

pytestmark = pytest.mark.multiproc

PROGRAM = """
import copy, hashlib, json, torch, commlab
from urllib.parse import parse_qsl
from torch import nn
from commlab.compress import build
from commlab.compress.simulate import exchange

torch.set_num_threads(1)
QUERIES, STEPS, RESUME_AT, TRANSPORT = %r, %d, %d, %r


def fresh(query):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ex = commlab.connect("ring://?timeout=30&bucket_mb=0.0005&" + TRANSPORT + "&" + query)
    ex.setup(model, opt)
    return model, opt, ex


rank, world = None, None


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world, 8, 12, generator=g), torch.randn(world, 8, 3, generator=g)


def loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def digest(model):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def run(model, opt, ex, steps, sims=None):
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
                want.append(exchange(sims, b.index, xs, shapes, per_hop=True)[rank] if sims else
                            sum(xs[1:], xs[0].clone()))
        opt.zero_grad()
        loss(model, x[rank], y[rank]).backward()
        if want:
            got = [torch.cat([p.grad.reshape(-1) for p in b.params]) for b in ex.buckets]
            seen["errors"].append(max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)))
        opt.step()
        seen["bytes"].append(ex.last_report.bytes_sent)
        seen["raw"].append(ex.last_report.bytes_uncompressed)
        seen["digests"].append(digest(model))
    return seen


out = {}
for query in QUERIES:
    q = dict(parse_qsl(query))
    model, opt, ex = fresh(query)
    rank, world = ex.rank, ex.world_size
    sims = [build(q["compress"], q.get("ef", "1") == "1") for _ in range(world)]
    sims = [] if sims[0] is None else sims
    for s in sims:
        s.bind(world)
    first = run(model, opt, ex, range(RESUME_AT), sims)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # torch's: references
    saved["ex"] = ex.state_dict()  # the exchanger's is a snapshot already
    rest = run(model, opt, ex, range(RESUME_AT, STEPS), sims)
    shapes = [[list(p.shape) for p in b.params] for b in ex.buckets]
    links = ex.facts()["links"]
    ex.close()
    model, opt, ex = fresh(query)  # a restart: fresh objects, then the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    ex.load_state_dict(saved["ex"])
    again = run(model, opt, ex, range(RESUME_AT, STEPS))
    ex.close()
    out[query] = {"digests": first["digests"] + rest["digests"], "errors": first["errors"] + rest["errors"],
                  "bytes": first["bytes"] + rest["bytes"], "raw": first["raw"] + rest["raw"],
                  "resumed": again["digests"], "shapes": shapes, "links": links, "rank": rank}
print(json.dumps(out))
"""


def ring_sent(numel: int, rank: int, n: int) -> int:
    """Elements ``rank`` sends in a ring all-reduce of ``numel``: every segment once in the reduce-scatter, then
    every segment but those of ranks r+1 and r+2 in the all-gather (segment s: [s numel/N, (s+1) numel/N)). At
    N = 2, numel (the two-rank swap sends it all at once)."""
    size = [(s + 1) * numel // n - s * numel // n for s in range(n)]
    return 2 * numel - size[(rank + 1) % n] - size[(rank + 2) % n]


def wire_bytes(query: str, shapes: list[list[list[int]]], step: int, rank: int, n: int) -> int:
    """Bytes ``rank`` sends in one step. Summed: float32 payloads and the bucket's presence flags (one float32 a
    parameter) in one all-reduce; fp16/bf16 payloads in one per-hop all-reduce at 2 bytes an element, the flags
    in another. Gathered: (N-1) x the payload and flags."""
    spec = dict(p.split("=", 1) for p in query.split("&"))["compress"]
    name, _, arg = spec.partition(",")[0].partition(":")
    total = 0
    for bucket in shapes:
        numel, flags = sum(math.prod(s) for s in bucket), len(bucket)
        gather = lambda size: (n - 1) * size
        k = max(1, math.ceil(float(arg or 1) * numel - 1e-9))
        if name == "none":
            total += 4 * ring_sent(numel + flags, rank, n)
        elif name in ("fp16", "bf16"):
            total += 2 * ring_sent(numel, rank, n) + 4 * ring_sent(flags, rank, n)
        elif name == "topk":
            total += gather(8 * k + 4 * flags)
        elif name == "sign":
            total += gather(math.ceil(numel / 8) + 4 + 4 * flags)
        elif name == "randomk":
            total += 4 * ring_sent(k + flags, rank, n)
        elif name == "powersgd":
            r_max, start_iter = int(arg), 2
            if step < start_iter:
                total += 4 * ring_sent(numel + flags, rank, n)
                continue
            p = q = plain = 0
            for s in bucket:
                rows, cols = s[0], math.prod(s) // s[0]
                r = min(rows, cols, r_max)
                if len(s) >= 2 and (rows + cols) * r * 2 < rows * cols:
                    p, q = p + rows * r, q + cols * r
                else:
                    plain += math.prod(s)
            total += 4 * ring_sent(plain + p + flags, rank, n) + 4 * ring_sent(q, rank, n)
    return total


def check(results: list[dict], n: int, bitwise: bool) -> None:
    for query in QUERIES:
        mine = [res[query] for res in results]
        for step in range(STEPS):
            assert len({m["digests"][step] for m in mine}) == 1, f"{query}: ranks differ after step {step}"
        for m in mine:
            # N=2: one addition, the same on the ring as in the simulation, bit for bit; fp16/bf16 per hop at any N
            # (the simulation follows the ring's order); N=3 float32 sums: the ring adds segment s from rank s on
            # (not in rank order, and the flags ride in the same flat), and PowerSGD's state carries that on
            exact = bitwise or any(c in query for c in ("fp16", "bf16", "topk", "sign"))
            assert max(m["errors"]) <= (0.0 if exact else 1e-5), \
                f"{query}: exchanged gradient off the simulation by {max(m['errors'])}"
            assert m["resumed"] == m["digests"][RESUME_AT:], f"{query}: resuming at step {RESUME_AT} diverged"
            want = [wire_bytes(query, m["shapes"], s, m["rank"], n) for s in range(STEPS)]
            assert m["bytes"] == want, f"{query}: bytes sent {m['bytes']}, closed form {want}"
            # what an all-reduce of the buckets (numel and flags, float32) would send: 2(N-1)/N of it, rounded down
            raw = [0] * STEPS if query == "compress=none" else \
                [sum(2 * (n - 1) * 4 * (sum(map(math.prod, b)) + len(b)) // n for b in m["shapes"])] * STEPS
            assert m["raw"] == raw, f"{query}: uncompressed equivalent {m['raw']}, closed form {raw}"
    plain = results[0]["compress=none"]
    assert len(plain["shapes"]) == 2  # two buckets: rounds of several buckets interleave
    for query in QUERIES[1:]:  # every compressor sent fewer bytes than the uncompressed exchange, and changed the run
        mine = results[0][query]
        assert sum(mine["bytes"]) < sum(plain["bytes"]), query
        assert mine["digests"][-1] != plain["digests"][-1], query


@pytest.mark.parametrize("n, transport, links", [
    (2, "transport=auto", "shm"),  # the default: shared memory on one host; the two-rank swap
    pytest.param(3, "transport=auto", "shm", marks=pytest.mark.full),
    pytest.param(2, "transport=tcp&swap_kb=0&chunk_mb=0.0002", "tcp", marks=pytest.mark.full),  # two steps, chunks
    pytest.param(3, "transport=ipc&chunk_mb=0.0002", "ipc", marks=pytest.mark.full),
    pytest.param(2, "transport=torch&swap_kb=0&chunk_mb=0.0002", "torch", marks=pytest.mark.full),
])
def test_every_compressor_keeps_ranks_identical_and_matches_the_simulation(run_ranks, n, transport, links):
    results = [r.json() for r in run_ranks(PROGRAM % (QUERIES, STEPS, RESUME_AT, transport), n, timeout=150)]
    assert {res[QUERIES[0]]["links"]["to_right"] for res in results} == {links}
    check(results, n, bitwise=n == 2)


def test_a_bad_spec_stops_commlab_train_in_one_line_before_anything_starts():
    from conftest import commlab_train
    proc = commlab_train(["--exchanger", "ring://?compress=topk:1.5", "--workers", "2"], timeout=60)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "option 'compress': 'topk:1.5' (topk:F): F=1.5 is outside (0, 1]" in lines[0], \
        proc.stderr
