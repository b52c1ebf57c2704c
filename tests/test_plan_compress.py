"""The planner's compression model: byte counts equal the compressors' payloads exactly, the compressed step
and the crossover rate by closed forms on hand-made profiles, and `commlab plan`'s table and refusals.
One process; no time is asserted (measured encode/decode times are only used, never checked).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from commlab.compress import build, simulate as sim
from commlab.base.errors import ConfigError
from commlab.plan import calibrate as C
from commlab.plan import compression as K
from commlab.plan.__main__ import main as plan_main
from commlab.plan.costmodel import Bucket, Calibration, Compute, CompressorCost, Topology, Transport, parse_regime
from commlab.plan.simulate import simulate

SPECS = ("fp16", "bf16", "powersgd:2,start_iter=1", "powersgd:4", "topk:0.01", "topk:0.3", "randomk:0.05", "sign",
         "int8", "int4,block=7", "fp4", "fp8")
RING = parse_regime("ring://")


def small_model() -> nn.Module:
    """Matrices that gain under PowerSGD, one that does not (4 x 3), vectors, a conv kernel, odd sizes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.Flatten(), nn.Linear(6 * 6 * 6, 130), nn.ReLU(), nn.Linear(130, 4),
                         nn.Linear(4, 3))


def profile(sizes, fwd=0.0, bwd=0.0, alpha=0.0, beta=0.0, opt=0.0, fracs=None) -> Calibration:
    """Buckets of ``sizes`` bytes with no parameter list (so no presence flags), ready at ``fracs`` of
    backward, every transport alike; per-sample times at batch 1."""
    fracs = fracs or [(i + 1) / len(sizes) for i in range(len(sizes))]
    tr = Transport(alpha, beta, "test")
    compute = Compute("hand", 1, fwd, bwd, tuple(Bucket(s, f, ()) for s, f in zip(sizes, fracs)), ())
    return Calibration({"ring": tr, "ring-torch": tr, "gloo": tr}, 0.0, opt, compute)


def cost(moves, wire, enc, dec, world=2) -> CompressorCost:
    return CompressorCost("hand", True, world, K.WIDE, moves, wire, enc, dec)


def hosts(rate: float, n_per_host: int = 1) -> Topology:
    return Topology(n_per_host, rate, 1e15)


@pytest.fixture(scope="module")
def compute() -> Compute:
    return C.measure_compute(small_model(), (3, 8, 8), batch=2, reps=1, bucket_mb=0.1)


class Keeping:
    """A compressor that keeps the last payload of every round it sent (per bucket and round)."""

    def __init__(self, inner):
        self.inner, self.payloads = inner, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, key, x, shapes):
        self.payloads[key, 0] = payload = self.inner.start(key, x, shapes)
        return payload

    def advance(self, key, rnd, combined):
        self.payloads[key, rnd] = payload = self.inner.advance(key, rnd, combined)
        return payload


# ----- byte counts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("ef", [True, False])
def test_payload_bytes_are_the_closed_form_of_what_each_round_carries(spec, ef, compute):
    """Two ranks in lockstep (commlab.compress.simulate) on the model's buckets, past the warm-up: each round's
    payload has exactly payload_nbytes()'s bytes; and the planner's measured wire bytes are those plus the
    bucket's presence flags in round 0, moved as the seam moves them."""
    assert len(compute.buckets) == 2
    comps = [Keeping(build(spec, ef)) for _ in range(2)]
    for c in comps:
        c.inner.bind(2)
    buckets = K.exchange_buckets(compute)
    g = torch.Generator().manual_seed(1)
    for _ in range(comps[0].warmup_steps + 2):
        for bk in buckets:
            shapes = tuple(p.shape for p in bk.params)
            sim.exchange(comps, bk.index, [torch.randn(bk.numel, generator=g) for _ in comps], shapes)
    measured = K.measure(compute, spec, ef, world=2, reps=1)
    for bk in buckets:
        shapes = tuple(p.shape for p in bk.params)
        closed = comps[0].payload_nbytes(shapes, 4)
        assert len(closed) == comps[0].rounds
        for r, nbytes in enumerate(closed):
            assert [sum(t.numel() * t.element_size() for t in c.payloads[bk.index, r]) for c in comps] == [nbytes] * 2
        flags = 4 * len(bk.params)
        assert measured.wire_bytes[bk.index] == tuple(n + (flags if r == 0 else 0) for r, n in enumerate(closed))
        kinds = set(measured.moves[bk.index]) - {"none"}
        # round 0 carries float32 flags beside the payload: a narrow cast is gathered (the seam sums one dtype)
        assert kinds == ({"sum"} if comps[0].summable and spec not in ("fp16", "bf16") else {"gather"})


def test_closed_forms_by_hand():
    """The table in commlab/compress/codecs.py and powersgd.py, on shapes whose numbers are easy to check."""
    shapes = (torch.Size([100, 50]), torch.Size([50]), torch.Size([3, 2]))  # 5056 elements
    assert build("fp16").payload_nbytes(shapes) == (2 * 5056,)
    assert build("topk:0.01").payload_nbytes(shapes) == (8 * 51,)  # ceil(50.56)
    assert build("randomk:0.01").payload_nbytes(shapes) == (4 * 51,)
    assert build("sign").payload_nbytes(shapes) == (632 + 4,)
    # codes (one a byte, or two) and a float32 scale per block: ceil(5056 / 256) = 20, ceil(5056 / 64) = 79
    assert build("int8").payload_nbytes(shapes) == build("fp8").payload_nbytes(shapes) == (5056 + 4 * 20,)
    assert build("int4").payload_nbytes(shapes) == build("fp4").payload_nbytes(shapes) == (2528 + 4 * 79,)
    # rank 4: 100 x 50 gains ((100 + 50) * 4 * 2 < 5000), the vector and 3 x 2 travel as they are
    assert build("powersgd:4").payload_nbytes(shapes) == (4 * (50 + 6 + 100 * 4), 4 * 50 * 4)
    assert build("powersgd:4").warmup_steps == 10 and build("powersgd:4,start_iter=0").warmup_steps == 0
    assert build("fp16").warmup_steps == 0


# ----- the step and the crossover by closed form ----------------------------------------------------------
def test_uncompressed_prediction_is_the_simulators_ring_step():
    cal = profile([3 * 2**22, 2**24], fwd=0.01, bwd=0.03, alpha=50e-6, beta=0.3e-9, opt=1e-10, fracs=[0.4, 1.0])
    for n in (2, 3, 8):
        for rate in (12.5e6, 1.25e8, 1.25e10):
            expected = simulate(cal, hosts(rate), RING, n, steps=2).step_s
            assert K.step(cal, None, RING, hosts(rate), n) == pytest.approx(expected, rel=1e-12)


def test_a_summed_compressor_pays_below_the_rate_where_its_encoding_equals_the_bytes_saved():
    """N = 4, one bucket of S bytes, no compute or latency: uncompressed 2(N-1)/N S/B; a cast to half the
    bytes costing E to encode and D to decode: E + D + 2(N-1)/N (S/2)/B. They meet at B* = 0.75 S / (E + D)."""
    S, E, D = 2**24, 0.010, 0.006
    cal = profile([S])
    half = cost((("sum",),), ((S // 2,),), ((E,),), (D,))
    star = 0.75 * S / (E + D)
    cross = K.crossover(cal, half, RING, hosts(1e9), 4)
    assert cross == pytest.approx(star, rel=1e-9)
    for rate, pays in ((star / 1.01, True), (star * 1.01, False)):
        comp, unc = K.step(cal, half, RING, hosts(rate), 4), K.step(cal, None, RING, hosts(rate), 4)
        assert comp == pytest.approx(E + D + 1.5 * (S / 2) / rate, rel=1e-12)
        assert unc == pytest.approx(1.5 * S / rate, rel=1e-12)
        assert (comp < unc) is pays
    assert K.bytes_per_step(half, 4) == 2 * 3 * (S // 2) // 4
    slower = Topology(1, 1e8, 1e15, compute_scale=2.0)  # a CPU twice as slow: encoding and decoding too
    assert K.step(cal, half, RING, slower, 4) == pytest.approx(2 * (E + D) + 1.5 * (S / 2) / 1e8, rel=1e-12)


def test_a_worker_sharing_its_core_takes_at_least_its_cpu_time_over_its_share():
    """One bucket of S bytes, fwd F, bwd W, encode E, decode D, optimizer O, at N = 2 on a link of rate B (commlab's
    swap: S'/B for S' bytes). With a core each the compressed step is the path F + W + E + S'/B + D + O; with
    a share s of a core while all compute it is max(that, (F + W + E + D + O) / s). The uncompressed step
    (F + W + S/B + O: its worker waits on the link most of the time) keeps its path until S/B shrinks below
    the bound; the crossover is where the compressed step, now the bound, equals the uncompressed path."""
    S, P, F, W, E, D, O = 2**26, 2**16, 0.1, 0.2, 0.03, 0.05, 0.02
    cal = profile([S], fwd=F, bwd=W, opt=O / S)
    low = cost((("sum",),), ((P,),), ((E,),), (D,))
    cal = cal.with_compressors(low)
    cpu = F + W + E + D + O
    assert K.step_cpu_s(cal, low, 2) == pytest.approx(cpu) and K.step_cpu_s(cal, None, 2) == pytest.approx(F + W + O)
    assert K.step_cpu_s(cal, low, 2, compute_scale=2.0) == pytest.approx(2 * (cpu - O) + O)
    for rate, share in ((1.25e7, 1.0), (1.25e7, 0.5), (1.25e8, 0.25), (1.25e9, 0.4)):
        topo = Topology(1, rate, 1e15, cpu_share=share)
        path = F + W + E + P / rate + D + O
        assert K.step(cal, low, RING, topo, 2) == pytest.approx(max(path, cpu / share), rel=1e-12)
        assert K.step(cal, None, RING, topo, 2) == pytest.approx(max(F + W + S / rate + O, (F + W + O) / share),
                                                                 rel=1e-12)
    share = 0.25  # compressed: cpu / share = 1.6 s (its path is shorter), uncompressed: F + W + S/B + O (its bound 1.28 s)
    star = S / (cpu / share - F - W - O)
    cross = K.crossover(cal, low, RING, Topology(1, 1e8, 1e15, cpu_share=share), 2)
    assert cross == pytest.approx(star, rel=1e-9)
    p = K.predict(cal, "hand", star / 2, 2, cpu_share=share)
    assert p["step_s"] == pytest.approx(cpu / share) and p["pays"]


def test_a_runs_step_overhead_is_its_step_less_wait_beyond_the_calibrated_compute_and_moves_no_crossover():
    cal = profile([2**20], fwd=0.001, bwd=0.002, opt=1e-8)  # 96 ms forward + backward at batch 32, 10.5 ms opt
    assert K.step_overhead(cal, 0.096 + 2**20 * 1e-8 + 0.05, 32) == pytest.approx(0.05)
    assert K.step_overhead(cal, 2 * 0.096 + 2**20 * 1e-8, 32, compute_scale=2.0) == pytest.approx(0.0)
    cal = cal.with_compressors(cost((("sum",),), ((2**18,),), ((0.01,),), (0.0,)))
    plain, more = (K.predict(cal, "hand", "100mbit", 2, batch=32, overhead_s=o) for o in (0.0, 0.05))
    assert more["step_s"] == pytest.approx(plain["step_s"] + 0.05)
    assert more["uncompressed_step_s"] == pytest.approx(plain["uncompressed_step_s"] + 0.05)
    assert more["crossover_bps"] == plain["crossover_bps"]


def test_a_gathered_compressor_sends_n_minus_1_payloads_and_decodes_n():
    """Gather-only at N = 4: E + D x 4/2 + (N-1) P/B against 1.5 S/B, so B* = (1.5 S - 3 P) / (E + 2 D)."""
    S, P, E, D = 2**24, 2**18, 0.004, 0.003
    cal = profile([S])
    gathered = cost((("gather",),), ((P,),), ((E,),), (D,), world=2)
    assert K.step(cal, gathered, RING, hosts(1e8), 4) == pytest.approx(E + 2 * D + 3 * P / 1e8, rel=1e-12)
    assert K.crossover(cal, gathered, RING, hosts(1e9), 4) == pytest.approx((1.5 * S - 3 * P) / (E + 2 * D), rel=1e-9)
    assert K.bytes_per_step(gathered, 4) == 3 * P


def test_two_rounds_pay_the_latency_twice_so_compression_stops_paying_on_fast_links():
    """PowerSGD-like, N = 4, latency a, nothing to encode: rounds of P0 and P1 bytes cost 6(a + P0/4/B) and
    6(a + P1/4/B) against 6(a + S/4/B): B* = 1.5 (S - P0 - P1) / (6 a)."""
    S, P0, P1, a = 2**24, 2**12, 2**14, 1e-4
    cal = profile([S], alpha=a)
    two = cost((("sum", "sum"),), ((P0, P1),), ((0.0, 0.0),), (0.0,))
    assert K.step(cal, two, RING, hosts(1e7), 4) == pytest.approx(6 * (a + P0 / 4 / 1e7) + 6 * (a + P1 / 4 / 1e7))
    assert K.crossover(cal, two, RING, hosts(1e9), 4) == pytest.approx(1.5 * (S - P0 - P1) / (6 * a), rel=1e-9)


def test_round_two_waits_for_backward_and_round_zero_overlaps_it():
    """Two buckets: round 0 of the first is sent during backward; a second round only after backward."""
    S, P = 2**22, 2**12
    cal = profile([S, S], fwd=0.0, bwd=1.0, fracs=[0.5, 1.0])
    one = cost((("sum",), ("sum",)), ((P,), (P,)), ((0.0,), (0.0,)), (0.0, 0.0))
    two = cost((("sum", "sum"), ("sum", "sum")), ((P, P), (P, P)), ((0.0, 0.0), (0.0, 0.0)), (0.0, 0.0))
    rate, n = 1e6, 4
    t = 1.5 * P / rate  # one round of P bytes at N = 4
    assert K.step(cal, one, RING, hosts(rate), n) == pytest.approx(1.0 + t)  # bucket 0's round hid in backward
    assert K.step(cal, two, RING, hosts(rate), n) == pytest.approx(1.0 + 3 * t)  # b1 r0, then b0 r1, b1 r1


def test_a_compressor_that_saves_no_bytes_never_pays_and_one_that_costs_nothing_always_does():
    S = 2**24
    cal = profile([S], beta=1e-9)
    assert K.crossover(cal, cost((("sum",),), ((S,),), ((1e-3,),), (0.0,)), RING, hosts(1e9), 2) == 0.0
    assert K.crossover(cal, cost((("sum",),), ((S // 8,),), ((0.0,),), (0.0,)), RING, hosts(1e9), 2) == math.inf


def test_predict_needs_the_compressor_measured_and_names_what_it_has():
    cal = profile([2**20])
    with pytest.raises(ConfigError, match=r"compress=topk:0.01 \(ef=1\) is not in this calibration"):
        K.predict(cal, "topk:0.01", "100mbit", 2)
    p = K.predict(cal.with_compressors(cost((("sum",),), ((2**18,),), ((0.0,),), (0.0,))), "hand", "1gbit", 2)
    assert p["bytes_ratio"] == 0.25 and p["pays"] and p["crossover_bps"] == math.inf
    assert K.predict(cal, "none", 1e6, 2)["step_s"] == pytest.approx(2**20 / 1e6)


def test_measured_compressors_round_trip_through_the_calibration_json(tmp_path, compute):
    cal = Calibration({}, 0.0, 0.0, compute).with_compressors(K.measure(compute, "powersgd:2", reps=1),
                                                             K.measure(compute, "topk:0.1", ef=False, reps=1))
    assert set(cal.compressors) == {"powersgd:2", "topk:0.1 (ef=0)"}
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal


# ----- the command ----------------------------------------------------------------------------------------
def test_plan_shows_the_compression_table_and_recommends_only_what_pays(tmp_path, compute):
    # a link so slow that every byte counts, at N = 2 on two hosts
    cal = Calibration({"ring": Transport(0.0, 1e-12, "test")}, 0.0, 0.0, compute)
    cal.save(tmp_path / "cal.json")
    out = tmp_path / "plan"
    rc = plan_main(["--calibration", str(tmp_path / "cal.json"), "--workers", "2", "--workers-per-host", "1",
                    "--link", "10kbit", "--regimes", "ring://", "--compress", "powersgd:2,start_iter=0", "fp16",
                    "--out", str(out)])
    assert rc == 0
    text = (out / "plan.md").read_text()
    assert "### Compression (ring://)" in text and "| 2 | powersgd:2,start_iter=0 |" in text and "| 2 | fp16 |" in text
    data = json.loads((out / "plan.json").read_text())["compression"]["by_workers"]["2"]
    assert set(data) == {"none", "powersgd:2,start_iter=0", "fp16"}
    rec = text.split("### Recommendation (compression)")[1]
    assert data["powersgd:2,start_iter=0"]["pays"] and "compress=powersgd:2,start_iter=0" in rec
    for spec, x in data.items():
        assert x["step_s"] > 0 and (x["pays"] is (x["step_s"] < data["none"]["step_s"]))
        assert (spec in rec) is (spec != "none" and x["pays"])


@pytest.mark.parametrize("spec,match", [("zip", "names no compressor"), ("powersgd:0", "R=0 must be >= 1"),
                                        ("topk:1.5", "outside"), ("powersgd:2,bogus=1", "unknown setting")])
def test_a_bad_compress_spec_is_one_line_naming_the_option_and_exit_2(spec, match, capsys, tmp_path):
    rc = plan_main(["--compress", spec, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(f"commlab plan: --compress {spec}: ")
    assert match in err
    assert not any(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.parametrize("share", ["0", "1.5", "half", "-0.2"])
def test_a_bad_cpu_share_is_one_line_naming_the_option_and_exit_2(share, capsys, tmp_path):
    rc = plan_main(["--cpu-share", share, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("commlab plan: --cpu-share: ")
    assert not any(tmp_path.iterdir())


def test_cpu_share_is_a_share_and_refuses_bad_settings():
    """Processes computing in lockstep give a share of a core in (0, 1] (its value depends on the machine's
    load: not checked)."""
    assert 0 < C.cpu_share(2, seconds=0.05, step_cpu_s=0.005, syncs=2) <= 1
    for kw, match in (({"procs": 0}, "procs must be >= 1"), ({"procs": 1, "seconds": 0}, "seconds must be > 0"),
                      ({"procs": 1, "syncs": 0}, "syncs must be >= 1"),
                      ({"procs": 1, "step_cpu_s": -1}, "step_cpu_s must be > 0")):
        with pytest.raises(ConfigError, match=match):
            C.cpu_share(**kw)


def test_the_bench_predicts_by_its_entries_urls(compute):
    """An entry's URL names the regime, the compressor and ef; options the planner does not model are left out."""
    url = "ring://?compress=topk:0.1&ef=0&timeout=30"
    assert K.parse_url(url) == (RING, "topk:0.1", False)
    assert K.parse_url("allreduce://?backend=gloo&compress=fp16")[0] == parse_regime("allreduce://?backend=gloo")
    assert K.parse_url("ring://?transport=tcp&host=auto&insecure=1")[0] == parse_regime("ring://?transport=tcp")
    assert K.parse_url("ps://?shards=2&mode=ssp&timeout=9")[0] == parse_regime("ps://?shards=2&mode=ssp")
    cal = K.with_urls(Calibration({}, 0.0, 0.0, compute), [url, "ring://"], reps=1)
    assert set(cal.compressors) == {"topk:0.1 (ef=0)"}
    assert K.predict_url(cal, url, "1gbit", 3) == K.predict(cal, "topk:0.1", "1gbit", 3, RING, ef=False)
    assert K.predict_url(cal, "ring://", 1e6, 2)["spec"] == "none"


def test_validation_checks_the_crossover_against_what_the_measured_medians_say():
    from bench.plan_validate import crossover_check
    from bench.regimes import with_query
    assert with_query("ring://?transport=torch", "compress=powersgd:4,start_iter=2") == \
        "ring://?transport=torch&compress=powersgd:4,start_iter=2"
    assert with_query("ring://", "compress=sign") == "ring://?compress=sign" and with_query("ring://", "") == "ring://"
    point = lambda rate, spec, median, cross=None: {"rate": rate, "workers": 2, "base": "ring", "ok": True,
                                                   "compress": spec, "regime": f"ring {spec or ''}".strip(),
                                                   "median": median, "crossover_bps": cross, "link_bps": 1e8}
    points = [point("100mbit", None, 8.0), point("100mbit", "powersgd:4", 0.5, 2e8),  # paid, predicted to: agree
              point("100mbit", "fp16", 4.0, 5e7),  # paid, predicted not to: a miss
              point("1gbit", "sign", 1.0, 5e7)]  # no uncompressed point at 1gbit: not checked
    assert crossover_check(points) == (2, 1, ["100mbit N=2 ring fp16"])
