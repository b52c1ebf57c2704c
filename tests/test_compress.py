"""commlab.compress in one process: closed forms of every compressor, error feedback's conservation,
payload bytes, state round trips, and refusals. N ranks are simulated in lockstep (commlab.compress.simulate)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from commlab import ConfigError
from commlab.compress import build, check_fits
from commlab.compress.codecs import pack_bits, unpack_bits
from commlab.compress import powersgd
from commlab.compress.powersgd import layout
from commlab.compress.seam import nbytes, pack, unpack
from commlab.compress.simulate import exchange
from commlab.core.registry import resolve

SPECS = ["fp16", "bf16", "powersgd:2,start_iter=0", "topk:0.1", "randomk:0.25", "sign", "int8", "int4", "fp4", "fp8"]
# a bucket as the exchanger makes one: parameters' shapes in order, flattened back to back
SHAPES = (torch.Size([64, 32]), torch.Size([32]), torch.Size([10, 32]), torch.Size([10]))
N_EL = sum(math.prod(s) for s in SHAPES)  # 2410


def ranks(spec: str, n: int, ef: bool = False):
    comps = [build(spec, ef) for _ in range(n)]
    for c in comps:
        c.bind(n)
    return comps


def vectors(draw_size=st.integers(1, 300), lo=2.0**-14, hi=6e4):
    mags = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    signed = st.tuples(mags, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])
    return draw_size.flatmap(lambda n: st.lists(signed, min_size=n, max_size=n))


@settings(max_examples=40, deadline=None)
@given(vectors(), st.sampled_from([("fp16", torch.float16, 2.0**-11), ("bf16", torch.bfloat16, 2.0**-8)]))
def test_casts_round_trip_within_unit_roundoff(values, case):
    spec, dtype, u = case
    x = torch.tensor(values, dtype=torch.float32)
    (out,) = exchange(ranks(spec, 1), 0, [x], (x.shape,))
    assert bool(((out - x).abs() <= u * x.abs()).all())
    assert torch.equal(out, x.to(dtype).float())


def test_casts_are_summed_in_float32_in_rank_order():
    xs = [torch.randn(500, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    outs = exchange(ranks("fp16", 3), 0, xs, (xs[0].shape,))
    want = xs[0].half().float() + xs[1].half().float() + xs[2].half().float()
    assert all(torch.equal(o, want) for o in outs)


def test_a_ring_sums_casts_per_hop_rounding_each_partial_once():
    """ring://'s order: element s (N = 3 elements, one per segment) starts at rank s, each later rank adds in
    float32 and rounds to fp16. 1 + 2^-11 is a tie that rounds back to 1, so the order decides: 1 first loses
    both 2^-11; 2^-11 + 2^-11 first keeps them (1 + 2^-10, exact in fp16, the float32 sum's rounding)."""
    tiny = 2.0 ** -11
    xs = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([tiny] * 3), torch.tensor([tiny] * 3)]
    outs = exchange(ranks("fp16", 3), 0, xs, (xs[0].shape,), per_hop=True)
    assert all(o.tolist() == [1.0, 1.0 + 2 * tiny, 1.0] for o in outs)
    assert exchange(ranks("fp16", 3), 0, xs, (xs[0].shape,))[0].tolist() == [1.0 + 2 * tiny] * 3  # in rank order


@settings(max_examples=40, deadline=None)
@given(vectors(lo=0.0, hi=1e3), st.sampled_from(["0.01", "0.1", "0.5", "1"]))
def test_topk_keeps_the_k_largest_magnitudes(values, f):
    x = torch.tensor(values, dtype=torch.float32)
    comp = build(f"topk:{f}", ef=False)
    comp.bind(1)
    values_sent, idx = comp.start(0, x, (x.shape,))
    k = max(1, math.ceil(float(f) * x.numel() - 1e-9))
    assert idx.numel() == k == len(set(idx.tolist())) and idx.dtype == torch.int32
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    kept[idx.long()] = True
    assert torch.equal(values_sent, x[idx.long()])
    if k < x.numel():
        assert x[kept].abs().min() >= x[~kept].abs().max()
    out = torch.empty_like(x)
    comp.finish(0, [[values_sent, idx]], out)
    assert torch.equal(out, torch.where(kept, x, torch.zeros_like(x)))


def test_topk_fraction_is_read_exactly():
    comp = build("topk:0.01", ef=False)
    x = torch.arange(100, dtype=torch.float32)
    assert comp.start(0, x, (x.shape,))[0].numel() == 1  # ceil(0.01 * 100) = 1, not 2 from 1.0000000000000002


def test_randomk_draws_the_same_indices_on_every_rank_and_new_ones_each_step():
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    comps = ranks("randomk:0.05", 3)
    seen = []
    for step in range(2):
        idx = comps[0].indices(0, 1000, "cpu")
        assert all(torch.equal(c.indices(0, 1000, "cpu"), idx) for c in comps)
        outs = exchange(comps, 0, xs, (xs[0].shape,))
        want = torch.zeros(1000)
        want[idx] = xs[0][idx] + xs[1][idx] + xs[2][idx]
        assert idx.numel() == 50 and all(torch.allclose(o, want, rtol=0, atol=1e-6) for o in outs)
        seen.append(set(idx.tolist()))
    assert seen[0] != seen[1]


def test_sign_is_one_bit_and_a_scale():
    x = torch.tensor([0.5, -2.0, 0.0, 3.5, -1.0])
    comp = build("sign", ef=False)
    comp.bind(1)
    bits, scale = comp.start(0, x, (x.shape,))
    assert bits.tolist() == [0b10110000] and scale.item() == pytest.approx(7.0 / 5)
    out = torch.empty_like(x)
    comp.finish(0, [[bits, scale]], out)
    assert torch.allclose(out, torch.tensor([1.0, -1, 1, 1, -1]) * 7.0 / 5)
    b = torch.rand(37) > 0.5
    assert torch.equal(unpack_bits(pack_bits(b), 37), b)


def low_rank(n, m, r, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("n_ranks", [1, 3])
def test_powersgd_is_exact_on_a_gradient_of_rank_at_most_R(r, n_ranks):
    # every rank's matrix shares the column space of A, so their sum has rank <= r <= R = 3: one step from the
    # random first Q (rank(M Q) = rank(M) almost surely) returns the sum; the vector travels uncompressed
    R = 3
    a = torch.randn(64, r, generator=torch.Generator().manual_seed(1))
    xs = []
    for w in range(n_ranks):
        g = torch.Generator().manual_seed(10 + w)
        xs.append(torch.cat([(a @ torch.randn(r, 48, generator=g)).reshape(-1), torch.randn(64, generator=g)]))
    shapes = (torch.Size([64, 48]), torch.Size([64]))
    outs = exchange(ranks(f"powersgd:{R},start_iter=0", n_ranks), 0, xs, shapes)
    want = sum(xs)
    for out in outs:
        assert torch.equal(out, outs[0])
        assert (out - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.equal(out[64 * 48:], want[64 * 48:]) or n_ranks > 1  # one rank: the vector's bits as sent


@pytest.mark.parametrize("n, m, r", [(5, 7, 2), (37, 11, 4), (64, 40, 3), (4099, 33, 4)])
def test_powersgd_grouped_products_equal_one_product(n, m, r, monkeypatch):
    """M Q, M^T P and P Q^T by groups of rows (with a tail of rows past the last group, and M^T P's groups
    summed over several chunks) equal the one-call products to float32 rounding."""
    monkeypatch.setattr(powersgd, "CHUNK", 4 * r * m)  # several chunks of M^T P's partial products
    g = torch.Generator().manual_seed(n * m + r)
    mat, q, p = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, m), (m, r), (n, r)))
    out = torch.empty(n, m)
    powersgd.outer(p.float(), q.float(), out)
    for got, want in ((powersgd.project(mat.float(), q.float()), mat @ q),
                      (powersgd.back_project(mat.float(), p.float()), mat.t() @ p), (out, p @ q.t())):
        assert got.is_contiguous() and got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * math.sqrt(max(n, m)))


def test_powersgd_warm_start_converges_to_the_best_rank_R_approximation():
    # above rank R, steps on a fixed M are a subspace iteration: with singular values 8, 4, 2 | 0.2, 0.1 the
    # result tends to the truncated SVD (Eckart-Young), geometrically at rate 0.2 / 2 per step
    g = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(40, 5, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 5, generator=g, dtype=torch.float64))
    s = torch.tensor([8.0, 4.0, 2.0, 0.2, 0.1], dtype=torch.float64)
    m = (u * s) @ v.t()
    best = (u[:, :3] * s[:3]) @ v[:, :3].t()
    comps = ranks("powersgd:3,start_iter=0", 1)
    errors = []
    for _ in range(12):
        (out,) = exchange(comps, 0, [m.reshape(-1).clone()], (torch.Size([40, 30]),))
        errors.append(float((out.view(40, 30) - best).norm() / m.norm()))
    assert errors[-1] < 1e-9 and errors[-1] < errors[0]


def test_powersgd_warm_up_is_uncompressed_and_small_tensors_stay_uncompressed():
    lay = layout(SHAPES, 4, 2.0)
    assert [(o, n, m, r) for o, n, m, r in lay.matrices] == [(0, 64, 32, 4)]  # (10+32)*4*2 = 336 > 320: plain
    assert lay.plain == ((2048, 32), (2080, 320), (2400, 10))
    x = torch.randn(N_EL)
    comps = ranks("powersgd:4,start_iter=2", 1)
    for step in range(3):
        (out,) = exchange(comps, 0, [x], SHAPES)
        assert torch.equal(out, x) == (step < 2)


def payload_bytes(spec: str, steps: int = 1):
    """Bytes of each round's payload, per step, as the regime receives them from the compressor."""
    comp = build(spec, ef=True)
    comp.bind(1)
    x = torch.randn(N_EL)
    sizes = []
    for _ in range(steps):
        payload, rounds = comp.start(0, x, SHAPES), []
        for rnd in range(comp.rounds):
            rounds.append(nbytes(payload))
            assert pack(payload).numel() == nbytes(payload)
            combined = payload if comp.summable else [payload]
            payload = comp.advance(0, rnd + 1, combined) if rnd + 1 < comp.rounds else None
        comp.finish(0, combined, torch.empty_like(x))
        sizes.append(rounds)
    return sizes


def test_payload_bytes_equal_the_closed_forms():
    n = N_EL
    assert payload_bytes("fp16") == payload_bytes("bf16") == [[2 * n]]
    assert payload_bytes("topk:0.01") == [[8 * math.ceil(0.01 * n)]]  # k = 25 values and int32 indices
    assert payload_bytes("randomk:0.01") == [[4 * 25]]
    assert payload_bytes("sign") == [[math.ceil(n / 8) + 4]]
    # the block quantizers: codes (n bytes, or two a byte) and one float32 scale per block (2410 = 9 x 256 + 106)
    assert payload_bytes("int8") == payload_bytes("fp8") == [[n + 4 * 10]]
    assert payload_bytes("int4") == payload_bytes("fp4") == [[1205 + 4 * 38]]  # ceil(2410 / 64) = 38
    assert payload_bytes("int8,block=7") == [[n + 4 * 345]] and payload_bytes("fp4,block=2410") == [[1205 + 4]]
    # powersgd:4: one warm-up step (all of it), then P of the 64x32 matrix with the rest uncompressed, and Q
    assert payload_bytes("powersgd:4,start_iter=1", 2) == [[4 * n, 0], [4 * (362 + 64 * 4), 4 * 32 * 4]]


def test_pack_unpack_round_trip():
    parts = [torch.randn(5), torch.arange(3, dtype=torch.int32), torch.tensor([7], dtype=torch.uint8),
             torch.randn(2, 2).half()]
    back = unpack(pack(parts), parts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, back))


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_conserves_what_was_not_sent(spec):
    # per rank: sum over steps of its share of the aggregate, plus its last residual, equals the sum of its inputs
    n_ranks, steps = 2, 6
    comps = ranks(spec, n_ranks, ef=True)
    shapes = (torch.Size([24, 20]), torch.Size([20]))
    g = torch.Generator().manual_seed(3)
    sent = [torch.zeros(500, dtype=torch.float64) for _ in comps]
    total = [torch.zeros(500, dtype=torch.float64) for _ in comps]
    for _ in range(steps):
        xs = [torch.randn(500, generator=g) for _ in comps]
        exchange(comps, 0, xs, shapes)
        for w, c in enumerate(comps):
            sent[w] += c.share(0).double()
            total[w] += xs[w].double()
    for w, c in enumerate(comps):
        assert c.residuals[0].abs().max() > 0  # something was held back, so the identity is not vacuous
        assert (sent[w] + c.residuals[0].double() - total[w]).abs().max() < 1e-5 * total[w].abs().max()


def test_without_error_feedback_nothing_is_kept():
    comps = ranks("topk:0.1", 1, ef=False)
    exchange(comps, 0, [torch.randn(100)], (torch.Size([100]),))
    assert comps[0].state_dict() == {}


@pytest.mark.parametrize("spec", SPECS + ["powersgd:2,start_iter=2"])
def test_state_dict_round_trip_resumes_identically(spec):
    shapes = (torch.Size([24, 20]), torch.Size([20]))
    inputs = [[torch.randn(500, generator=torch.Generator().manual_seed(10 * s + w)) for w in range(2)]
              for s in range(6)]
    straight = ranks(spec, 2, ef=True)
    for s in range(3):
        exchange(straight, 0, inputs[s], shapes)
    resumed = ranks(spec, 2, ef=True)
    for c, old in zip(resumed, straight):
        c.load_state_dict(old.state_dict())
    for s in range(3, 6):
        a = exchange(straight, 0, inputs[s], shapes)
        b = exchange(resumed, 0, inputs[s], shapes)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {s}"


def test_declarations():
    decl = {s.split(":")[0]: (c.summable, c.rounds, c.sync_only) for s in SPECS for c in [build(s)]}
    assert decl == {"fp16": (True, 1, False), "bf16": (True, 1, False), "powersgd": (True, 2, True),
                    "topk": (False, 1, False), "randomk": (True, 1, False), "sign": (False, 1, False),
                    "int8": (False, 1, False), "int4": (False, 1, False), "fp4": (False, 1, False),
                    "fp8": (False, 1, False)}
    assert all(build(s).decodes_alone for s in ("int8", "int4", "fp4", "fp8"))
    check_fits(build("powersgd:2"), "ps", synchronous=True)
    with pytest.raises(ConfigError, match="powersgd:2 needs every rank's payload at every step"):
        check_fits(build("powersgd:2"), "ps", synchronous=False)


@pytest.mark.parametrize("spec,words", [
    ("zip", "'zip' names no compressor; known: none, fp16, bf16"),
    ("powersgd:0", "R=0 must be >= 1"), ("powersgd:-2", "R=-2 must be >= 1"), ("powersgd", "needs a rank R"),
    ("powersgd:2.5", "R='2.5' is not an integer"), ("topk:0", "F=0 is outside (0, 1]"),
    ("randomk:1.01", "F=1.01 is outside (0, 1]"), ("topk:abc", "F='abc' is not a number"),
    ("sign:2", "takes no ':' argument"), ("powersgd:2,start_iter=-1", "start_iter='-1': must be >= 0"),
    ("fp16,x=1", "unknown setting(s) ['x']"), ("int8,block=0", "block='0': must be >= 1"),
    ("fp8:2", "takes no ':' argument"), ("int4,block=x", "block='x' is not a valid int"),
])
def test_bad_specs_fail_in_one_line_naming_the_option(spec, words):
    with pytest.raises(ConfigError) as info:
        resolve(f"allreduce://?compress={spec}")
    text = str(info.value)
    assert text.startswith("option 'compress': ") and words in text and "\n" not in text


def test_the_summary_gives_the_ratio_to_uncompressed():
    from commlab.core.metrics import summary
    line = summary({"step": 9, "bytes_sent": 1500, "bytes_received": 1500, "bytes_uncompressed": 12000}, 2.0)
    assert line == "10 steps in 2.0 s, 1.5 KiB sent, 1.5 KiB received per step by rank 0 (0.125x of uncompressed)"


def test_the_url_carries_compress_and_ef():
    _, opts = resolve("allreduce://?compress=topk:0.01&ef=0")
    assert (opts.compress, opts.ef) == ("topk:0.01", False)
    assert resolve("allreduce://")[1].compress == "none"
    assert (resolve("ring://?compress=fp16&ef=0")[1].compress, resolve("ring://?ef=0")[1].ef) == ("fp16", False)
    with pytest.raises(ConfigError, match=r"^option 'compress': 'powersgd:0' \(powersgd:R\): R=0 must be >= 1$"):
        resolve("ring://?compress=powersgd:0")


class RecordingMover:
    """One rank's transport, recording the order collectives are issued in."""

    world_size = 1

    def __init__(self):
        self.issued = []

    def allreduce_async(self, tensor, what=""):
        from commlab.base.handles import DoneHandle
        self.issued.append(("sum", what.split(", ")[-1]))
        return DoneHandle(what=what)

    def allgather_async(self, tensor, what=""):
        from commlab.base.handles import DoneHandle
        self.issued.append(("gather", what.split(", ")[-1]))
        return DoneHandle([tensor.clone()], what=what)

    @staticmethod
    def sums_exactly(dtype):
        return dtype in (torch.float32, torch.float64)


def test_the_seam_issues_every_buckets_later_rounds_before_finishing_the_first():
    from types import SimpleNamespace
    from commlab.compress.seam import CompressState, start_compressed
    comp = build("powersgd:2,start_iter=0")
    comp.bind(1)
    mover = RecordingMover()
    buckets = []
    for i in range(3):
        params = [torch.nn.Parameter(torch.zeros(24, 20)), torch.nn.Parameter(torch.zeros(20))]
        buffer = torch.randn(500 + 2)
        buckets.append(SimpleNamespace(index=i, params=params, grads=buffer[:500], flags=buffer[500:], buffer=buffer))
    state = CompressState(comp)
    handles = [start_compressed(state, b, mover, f"bucket {b.index}", True) for b in buckets]
    handles[0].wait(10)
    r0, r1 = "powersgd:2 round 0", "powersgd:2 round 1"
    assert mover.issued == [("sum", r0)] * 3 + [("sum", r1)] * 3  # every Q in flight before bucket 0 is finished
    for h in handles[1:]:
        h.wait(10)
    assert len(mover.issued) == 6  # nothing more once every bucket is in its last round
    # and gather-only payloads travel as bytes, once per bucket
    topk = build("topk:0.1")
    topk.bind(1)
    mover.issued.clear()
    start_compressed(CompressState(topk), buckets[0], mover, "bucket 0", True).wait(10)
    assert mover.issued == [("gather", "topk:0.1 round 0")]


def test_two_compression_states_on_one_mover_keep_their_own_steps():
    """The step's order of exchanges lives in the state handed to each start (seam.CompressState), not on the
    mover: a second exchange starting its step on the same mover (another exchanger, a DDP hook) between two
    buckets of the first leaves the first's step whole, and every bucket decodes as it does alone."""
    from commlab.compress.seam import CompressState
    from commlab.plan.compression import _AllMe

    def state():
        comp = build("powersgd:2,start_iter=0", False)  # compressed (two rounds) from the first step
        comp.bind(2)
        return CompressState(comp)

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(48, 16, generator=g) for _ in range(2)]
    mover = _AllMe(2, ("float32",))

    alone = state()
    ref = [x.reshape(-1).clone() for x in grads]
    handles = [alone.start(i, x, ((48, 16),), None, mover, f"alone {i}", first=i == 0) for i, x in enumerate(ref)]
    for h in handles:
        h.wait(10.0)

    a, b = state(), state()
    out = [x.reshape(-1).clone() for x in grads]
    ha0 = a.start(0, out[0], ((48, 16),), None, mover, "a 0", first=True)
    hb0 = b.start(0, grads[0].reshape(-1).clone(), ((48, 16),), None, mover, "b 0", first=True)
    ha1 = a.start(1, out[1], ((48, 16),), None, mover, "a 1", first=False)
    assert a.train == [ha0, ha1] and b.train == [hb0]
    assert ha0.round == 0 and ha1.round == 0
    ha0.wait(10.0)  # brings a's later bucket to its last round too, as the seam's order requires
    assert ha1.round == 1
    ha1.wait(10.0)
    hb0.wait(10.0)
    for got, want in zip(out, ref):
        assert torch.equal(got, want)
    assert not torch.equal(out[0], grads[0].reshape(-1))  # compressed: rank 2 of a random matrix is not exact


def blockwise(values, sizes):
    """A vector of blocks of very different magnitudes (so one scale per block matters), with a zero block."""
    g = torch.Generator().manual_seed(len(values))
    parts = [torch.tensor(values, dtype=torch.float32), torch.zeros(sizes)]
    parts += [torch.randn(sizes, generator=g) * 10.0 ** e for e in (-6, 0, 4)]
    return torch.cat(parts)


def quantize(spec, x):
    """(decoded, per-element scale) of one rank's x through ``spec`` without error feedback."""
    comp = build(spec, ef=False)
    comp.bind(1)
    codes, scale = comp.start(0, x, (x.shape,))
    assert codes.dtype == torch.uint8 and scale.numel() == math.ceil(x.numel() / comp.block)
    (out,) = exchange(ranks(spec, 1), 0, [x], (x.shape,))
    return out, scale.repeat_interleave(comp.block)[:x.numel()]


@settings(max_examples=15, deadline=None)
@given(vectors(st.integers(1, 100), lo=0.0, hi=1e3), st.sampled_from(["int8", "int4", "int8,block=5", "int4,block=3"]))
def test_integer_quantizers_round_to_the_nearest_step_of_the_block_scale(values, spec):
    x = blockwise(values, 70)
    out, s = quantize(spec, x)
    top = 127 if spec.startswith("int8") else 7
    assert torch.equal(out, torch.round(torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0)).clamp(-top, top) * s)
    assert bool(((x - out).abs() <= s / 2 * (1 + 1e-6)).all())  # |x - q(x)| <= s/2, up to x/s's own rounding
    assert bool((out[values.__len__():values.__len__() + 70] == 0).all())  # the zero block: scale 0, zeros


@settings(max_examples=15, deadline=None)
@given(vectors(st.integers(1, 100), lo=0.0, hi=1e3), st.sampled_from(["fp4", "fp4,block=5"]))
def test_fp4_rounds_to_the_nearest_e2m1_value_of_the_block_scale(values, spec):
    x = blockwise(values, 70)
    out, s = quantize(spec, x)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0).clamp(-6, 6)
    nearest = grid[(v.abs().unsqueeze(1) - grid).abs().argmin(1)]  # argmin: the first of a tie, the smaller one
    assert torch.equal(out, torch.where(v < 0, -nearest, nearest) * s)
    bound = torch.maximum(s / 4, x.abs() / 4)  # half the gap of the grid where |x| / s falls
    assert bool(((x - out).abs() <= bound * (1 + 1e-6)).all())


@settings(max_examples=15, deadline=None)
@given(vectors(st.integers(1, 100), lo=0.0, hi=1e3))
def test_fp8_is_e4m3_of_the_block_scaled_value_within_its_bound(values):
    x = blockwise(values, 300)
    out, s = quantize("fp8", x)
    v = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0).clamp(-448, 448)
    assert torch.equal(out, v.to(torch.float8_e4m3fn).float() * s)
    bound = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)  # 3 mantissa bits; subnormals below 2^-6 s
    assert bool(((x - out).abs() <= bound * (1 + 1e-6)).all())


def test_quantizers_pack_two_nibbles_a_byte_and_decode_each_rank_alone():
    from commlab.compress.quant import pack_nibbles, unpack_nibbles
    nib = torch.tensor([1, 15, 7, 8, 0], dtype=torch.uint8)
    assert pack_nibbles(nib).tolist() == [0xF1, 0x87, 0x00] and torch.equal(unpack_nibbles(pack_nibbles(nib), 5), nib)
    # one block: scale 1 for fp4 (5, between 4 and 6, is a tie: down to 4), 6/7 for int4 (3 / (6/7) = 3.5: to 4)
    x = torch.tensor([-6.0, 5.0, -0.2, 0.3, 3.0])
    for spec, want in (("fp4", [-6.0, 4.0, 0.0, 0.5, 3.0]), ("int4", [-6.0, 36 / 7, 0.0, 0.0, 24 / 7])):
        comps = ranks(spec, 2)
        outs = exchange(comps, 0, [x, -x], (x.shape,))
        assert all(o.abs().max() == 0 for o in outs)  # rank 1's codes are rank 0's negated: they cancel exactly
        torch.testing.assert_close(quantize(spec, x)[0], torch.tensor(want))
        with pytest.raises(ValueError, match=f"{spec}: payload of"):
            comps[0].decode_add(0, comps[0].start(0, x, (x.shape,)), 7, {}, torch.zeros(7))
