"""Hostile input to a parameter server: thousands of crafted messages, and the server keeps serving.

One sync server process (world 2) holds ``nn.Linear(3, 2)``'s weight and bias. A legitimate
client attaches as rank 0; the fuzzer says a correct hello as rank 1, so its crafted requests
reach the deep checks (keys, dtypes, coverage, NaN, steps, base versions), not only "who are you".
Every crafted message has at least one defect and must get exactly one ``error`` reply, in
order (the server is one thread). Afterwards: nothing was applied (version 0, parameters
bit-identical to before), the server's counters match what was sent, and one valid sync step
from both ranks lands exactly on its closed form.

Every test runs twice: over tcp (payloads in zmq frames), and with ``transport=shm``, where
rank 0's client and the fuzzer both hold a shared-memory link to the server; the fuzzer then
also sends pushes whose data it claims lies in the segment at crafted offsets (outside it,
misaligned, negative, too few, beside real frames, deep defects at valid offsets).
"""

from __future__ import annotations

import hashlib
import random
import re
import threading

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import commlab
from commlab.transport import auth, psproto, psshm, shm, sockets as transport, wire
from commlab.core.manifest import describe_optimizer, model_manifest
from commlab.transport.rendezvous import RankInfo

from faultkit import Procs, Raw, setup_beside_raw

pytestmark = pytest.mark.multiproc

SEED = 20240601
CASES = 6000  # crafted messages from the seeded generator
BATCH = 200  # sent back to back, then their replies counted
OPT = commlab.OptimizerSpec("sgd", lr=0.5)
KEYS = {"weight": 6, "bias": 2}  # nn.Linear(3, 2): the shard's pieces, float32
_LINEAR = nn.Linear(3, 2)
OPTIM = describe_optimizer(OPT.build(list(_LINEAR.parameters())), _LINEAR)  # what the client's hello says


@pytest.fixture(scope="module", params=["tcp", "shm"])
def rig(tmp_path_factory, request):
    """The server, rank 0 attached through the real client, rank 1 as a raw DEALER after hello
    (with ``shm``: both hold a shared-memory link; ``raw.link`` is the fuzzer's, else None)."""
    procs = Procs(tmp_path_factory.mktemp("fuzz"))
    try:
        server = procs.server("--mode", "sync")
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        ex = commlab.connect(f"ps://{server.address}?timeout=30&transport={request.param}",
                             RankInfo(0, 2, 0, "127.0.0.1", 0, "flags"))
        raw = Raw(server.endpoint, "rank1")
        manifest = [[n, list(s), d] for n, s, d in model_manifest(model)]
        pieces = psproto.assign_shards(model_manifest(model), 1, 16 * 2**20)[0]
        extra = {"shm_host": shm.host_identity()} if request.param == "shm" else {}
        hello = setup_beside_raw(ex, model, OPT, raw, **extra)
        if request.param == "shm":
            assert ex.facts()["transport"]["payloads"] == {ex.shards[0].endpoint: "shm"}
            raw.link = psshm.Link.attach(hello.meta["shm_link"], [(p.key, p.dtype, p.count) for p in pieces])
            assert server.stats()["shm_links"] == 2
        yield server, ex, model, raw, manifest
        raw.close()
        if raw.link is not None:
            raw.link.close()
        ex.close()
    finally:
        procs.close()


def checksum(raw: Raw) -> str:
    """SHA-256 of the shard's parameter bytes, pulled as rank 1 (after_step -1: served at once)."""
    raw.id += 1
    raw.send(wire.encode("pull", raw.sender, -1, (), {"id": raw.id, "after_step": -1}))
    h, data = raw.reply()
    assert h.op == "params" and [f.key for f in h.frames] == list(KEYS)
    return hashlib.sha256(b"".join(bytes(f.buffer) for f in data)).hexdigest()


# ----- the seeded generator of crafted cases ---------------------------------------------------------

def _pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _header(op="push", step=0, frames=(), **meta) -> dict:
    return {"v": 1, "op": op, "from": "rank1", "step": step, "frames": list(frames),
            "meta": {"id": 7, "base": 0, "absent": [], **meta}}


def _floats(n: int, rng: random.Random) -> bytes:
    return torch.tensor([rng.uniform(-1, 1) for _ in range(n)], dtype=torch.float32).numpy().tobytes()


def _full_push(rng: random.Random) -> tuple[list, list]:
    """The frames of a correct full push of step 0 (callers then break it)."""
    specs = [[k, "float32", 0, n] for k, n in KEYS.items()]
    return specs, [_floats(n, rng) for n in KEYS.values()]


SHM_AT = [0, 64]  # where weight and bias lie in a link's segments (psshm.layout: 64-byte aligned)
SHM_SIZE = 128


def crafted(rng: random.Random, link: psshm.Link | None = None):
    """Yield ``(kind, frames, expected reason fragment or None)``; every case has a defect. With a
    shared-memory ``link``, also pushes whose data is said to lie in its inbound segment."""
    kinds = ["bytes", "truncated", "trailing", "not_map", "version", "op", "sender", "step_type", "frames_type",
             "spec_shape", "dtype_unknown", "dtype_lie", "count_lie", "huge", "offset", "fewer_frames",
             "extra_frames", "many_frames", "key_unknown", "key_len", "wrong_step", "coverage",
             "absent_junk", "base", "meta_type", "pull_bad", "pull_future", "hello_bad", "stranger"]
    if link is None:
        kinds += ["shm_no_link", "shm_reply_no_link"]
    else:
        assert link.inbound.size == SHM_SIZE
        kinds += ["shm_outside", "shm_misaligned", "shm_count", "shm_type", "shm_with_frames", "shm_deep"]
    while True:
        kind = rng.choice(kinds)
        specs, data = _full_push(rng)
        if kind.startswith("shm_") and link is not None:  # valid bytes in place; the defect is in the header
            link.inbound.write(SHM_AT[0], torch.frombuffer(bytearray(data[0]), dtype=torch.float32))
            link.inbound.write(SHM_AT[1], torch.frombuffer(bytearray(data[1]), dtype=torch.float32))
        if kind == "shm_no_link":
            yield kind, [_pack(_header(frames=specs, shm=SHM_AT))], "has no shared-memory link"
        elif kind == "shm_reply_no_link":
            yield kind, [_pack({"v": 1, "op": "pull", "from": "rank1", "step": 0, "frames": [],
                                "meta": {"id": 7, "after_step": -1, "shm_reply": True}})], "has no link"
        elif kind == "shm_outside":  # past the end, or so far that offset + length overflows 64 bits
            at = list(SHM_AT)
            at[rng.randrange(2)] = rng.choice([SHM_SIZE - 4, SHM_SIZE, 4096, 2**40, 2**63, 2**64 - 8])
            yield kind, [_pack(_header(frames=specs, shm=at))], "outside the shared region"
        elif kind == "shm_misaligned":
            at = list(SHM_AT)
            at[rng.randrange(2)] = rng.choice([1, 2, 3, 66, -4, -2**40, True, 1.5, "0", None])
            yield kind, [_pack(_header(frames=specs, shm=at))], "is not a non-negative multiple"
        elif kind == "shm_count":
            yield kind, [_pack(_header(frames=specs, shm=rng.choice([[0], [0, 64, 96], []])))], \
                "one offset per frame spec"
        elif kind == "shm_type":
            yield kind, [_pack(_header(frames=specs, shm=rng.choice([0, "0,64", {"weight": 0}, True])))], \
                "one offset per frame spec"
        elif kind == "shm_with_frames":
            yield kind, [_pack(_header(frames=specs, shm=SHM_AT)), *data[:rng.randrange(1, 3)]], \
                "data frame\\(s\\) arrived too"
        elif kind == "shm_deep":  # in bounds and aligned: the same checks as for frames still refuse it
            choice = rng.randrange(3)
            if choice == 0:
                specs = [["weight", "float32", 0, 3], ["weight", "float32", 4, 2]]
                yield kind, [_pack(_header(frames=specs, shm=[0, 16]))], "do not cover"
            elif choice == 1:
                specs[0] = ["weight", "float64", 0, 3]
                yield kind, [_pack(_header(frames=specs, shm=SHM_AT))], "weight is float32 on shard 0/1"
            else:
                yield kind, [_pack(_header(frames=specs, shm=SHM_AT, base=7))], "bad base version"
        elif kind == "bytes":
            yield kind, [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randrange(1, 5))], None
        elif kind == "truncated":
            raw = _pack(_header(frames=specs))
            yield kind, [raw[:rng.randrange(0, len(raw))], *data], "not msgpack"
        elif kind == "trailing":
            yield kind, [_pack(_header(frames=specs)) + rng.randbytes(rng.randrange(1, 9)), *data], "not msgpack"
        elif kind == "not_map":
            yield kind, [_pack(rng.choice([[1, 2], 3, "push", None, 1.5, b"x"]))], "not a map"
        elif kind == "version":
            h = _header(frames=specs)
            h["v"] = rng.choice([0, 2, 99, "1", None, -1])
            yield kind, [_pack(h), *data], "protocol version"
        elif kind == "op":
            h = _header(frames=specs)
            h["op"] = rng.choice(["steal", "PUSH", "", "pushx", "ok", "error", "params"])
            yield kind, [_pack(h), *data], "unknown op"
        elif kind == "sender":
            h = _header(frames=specs)
            h["from"] = rng.choice([None, True, 1.5, [1], {"a": 1}])
            yield kind, [_pack(h), *data], "no sender"
        elif kind == "step_type":
            h = _header(frames=specs)
            h["step"] = rng.choice([-2, -10**9, True, "3", 1.5, None])
            yield kind, [_pack(h), *data], "bad step"
        elif kind == "frames_type":
            h = _header()
            h["frames"] = rng.choice([{"weight": 1}, 3, "weight", None])
            yield kind, [_pack(h)], "'frames' is not a list"
        elif kind == "spec_shape":
            specs[0] = rng.choice([specs[0][:3], specs[0] + [1], "weight", 5])
            yield kind, [_pack(_header(frames=specs)), *data], "is not \\[key, dtype, offset, count\\]"
        elif kind == "dtype_unknown":
            specs[0][1] = rng.choice(["complex64", "float8", "", "object"])
            yield kind, [_pack(_header(frames=specs)), *data], "unknown dtype"
        elif kind == "dtype_lie":  # a frame whose length matches the declared (wrong) dtype
            dt = rng.choice(["float16", "float64", "int64", "uint8", "bfloat16"])
            n = KEYS["weight"]
            specs[0] = ["weight", dt, 0, n]
            data[0] = rng.randbytes(n * wire.DTYPES[dt].itemsize)
            yield kind, [_pack(_header(frames=specs)), *data], \
                f"weight is float32 on shard 0/1, frame is {dt}|carries 56 bytes, limit 32"
        elif kind == "count_lie":  # the header claims more or fewer elements than the frame holds
            specs[0][3] += rng.choice([-5, -1, 1, 3, 1000])
            yield kind, [_pack(_header(frames=specs)), *data], "has 24 bytes, header declares|limit"
        elif kind == "huge":  # sizes no one should ever allocate
            specs[rng.randrange(2)][3] = rng.choice([2**31, 2**40, 2**62, 2**64 - 1])
            yield kind, [_pack(_header(frames=specs)), *data], "declares \\d+ bytes, limit"
        elif kind == "offset":
            specs[0][2] = rng.choice([1, 3, 2**40, 2**63])
            yield kind, [_pack(_header(frames=specs)), *data], "do not cover|has 6 elements"
        elif kind == "fewer_frames":
            yield kind, [_pack(_header(frames=specs)), *data[:rng.randrange(0, 2)]], "data frame\\(s\\) but"
        elif kind == "extra_frames":
            extra = [rng.randbytes(rng.randrange(0, 30)) for _ in range(rng.randrange(1, 4))]
            yield kind, [_pack(_header(frames=specs)), *data, *extra], "data frame\\(s\\) but"
        elif kind == "many_frames":  # more frames than any request to this shard can need
            n = rng.randrange(20, 400)
            yield kind, [_pack(_header(frames=[["bias", "float32", 0, 0]] * n)), *([b""] * n)], "takes at most"
        elif kind == "key_unknown":
            specs[0][0] = rng.choice(["nope", "weight#0", "Weight", "bias "])
            yield kind, [_pack(_header(frames=specs)), *data], "holds no key"
        elif kind == "key_len":
            specs[0][0] = rng.choice(["", "w" * 257, 5, None])
            yield kind, [_pack(_header(frames=specs)), *data], "bad key"
        elif kind == "wrong_step":  # a correct push for a step this shard does not gather
            yield kind, [_pack(_header(step=rng.choice([1, 2, 7, 10**6, 2**62]), frames=specs)), *data], \
                "expects step 0"
        elif kind == "coverage":  # a key cut into frames that leave a hole
            specs = [["weight", "float32", 0, 3], ["weight", "float32", 4, 2]]
            yield kind, [_pack(_header(frames=specs)), _floats(3, rng), _floats(2, rng)], "do not cover"
        elif kind == "absent_junk":
            yield kind, [_pack(_header(frames=specs, absent=rng.choice([["nope"], "bias", [1], {"a": 1}]))),
                         *data], "'absent' names keys"
        elif kind == "base":  # computed on a version the server never had
            yield kind, [_pack(_header(frames=specs, base=rng.choice([1, 10**9, "0", None, 1.5]))), *data], \
                "bad base version"
        elif kind == "meta_type":
            h = _header(frames=specs)
            h["meta"] = rng.choice([[1, 2], "id", 3])
            yield kind, [_pack(h), *data], "'meta' is not a map"
        elif kind == "pull_bad":
            meta = rng.choice([{"after_step": "0"}, {"after_step": None}, {"after_step": -1, "keys": []},
                               {"after_step": -1, "keys": ["nope"]}, {"after_step": -1, "keys": "weight"},
                               {"after_step": -1, "as": "int8"}, {"after_step": -1, "as": ["float16"]},
                               {"after_step": -1, "what": "buffers", "as": "float16"}])
            yield kind, [_pack({"v": 1, "op": "pull", "from": "rank1", "step": 0, "frames": [],
                                "meta": dict(meta, id=7)})], "pull from rank1"
        elif kind == "pull_future":  # would wait forever: refused
            yield kind, [_pack({"v": 1, "op": "pull", "from": "rank1", "step": 0, "frames": [],
                                "meta": {"id": 7, "after_step": rng.choice([1, 5, 2**40])}})], "has not pushed it"
        elif kind == "hello_bad":
            good = {"rank": 1, "world": 2, "mode": "sync", "shard": [0, 1], "optim": OPTIM,
                    "manifest": MANIFEST, "pieces": [[k, "float32", n] for k, n in KEYS.items()]}
            field, value = rng.choice([("rank", 2), ("rank", -1), ("world", 3), ("mode", "async"),
                                       ("shard", [1, 2]), ("optim", {"name": "lbfgs"}), ("manifest", "x"),
                                       ("manifest", [["weight", [2, 4], "float32"], ["bias", [2], "float32"]]),
                                       ("pieces", [["weight", "float32", 7]]), ("rank", "1")])
            good[field] = value
            yield kind, [_pack({"v": 1, "op": "hello", "from": "rank1", "step": -1, "frames": [],
                                "meta": dict(good, id=7)})], None
        elif kind == "stranger":  # a sender that never said hello
            h = _header(frames=specs)
            h["from"] = rng.choice(["rank7", "observer", 3])
            yield kind, [_pack(h), *data], "before hello"


MANIFEST = [["weight", [2, 3], "float32"], ["bias", [2], "float32"]]


def test_thousands_of_crafted_messages_get_errors_and_change_nothing(rig):
    server, ex, model, raw, manifest = rig
    assert manifest == MANIFEST
    before = checksum(raw)
    s0 = server.stats()
    rss0 = server.rss_kib()
    gen = crafted(random.Random(SEED), raw.link)
    kinds: dict[str, int] = {}
    sent = 0
    while sent < CASES:
        batch = [next(gen) for _ in range(min(BATCH, CASES - sent))]
        for _, frames, _ in batch:
            raw.send(frames)
        for kind, frames, expect in batch:
            h, _ = raw.reply(timeout=30)
            assert h.op == "error", f"{kind} case was accepted: {frames[:1]!r} -> {h.meta}"
            reason = h.meta["reason"]
            assert expect is None or re.search(expect, reason), f"{kind}: {reason!r} does not match {expect!r}"
            kinds[kind] = kinds.get(kind, 0) + 1
        sent += len(batch)
    assert raw.sock.poll(200, zmq.POLLIN) == 0  # exactly one reply per message
    s1 = server.stats()
    assert s1["refused"] - s0["refused"] == CASES
    assert s1["updates"] == 0 and s1["version"] == 0 and s1["pushes"] - s0["pushes"] >= kinds["wrong_step"]
    assert checksum(raw) == before
    growth = server.rss_kib() - rss0
    print(f"fuzz: {CASES} crafted cases in {len(kinds)} kinds, all refused; server RSS grew {growth} KiB")
    assert growth < 64 * 1024  # no allocation a header asked for: the largest lie asked for 2**64 bytes


def test_frames_above_the_transport_limit_drop_the_sender_not_the_server(rig):
    server, _, _, raw, _ = rig
    before = checksum(raw)
    for size in (transport.DEFAULT_MAX_FRAME + 1, 24 * 2**20):
        stranger = Raw(server.endpoint, "rank1")
        try:
            big = torch.zeros(size, dtype=torch.uint8).numpy().data
            header = _pack(_header(frames=[["weight", "uint8", 0, size]]))
            stranger.send([header, big])
            assert stranger.sock.poll(1000, zmq.POLLIN) == 0  # libzmq cut the connection: no reply
        finally:
            stranger.close()
    assert checksum(raw) == before and server.stats()["version"] == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_frames_and_headers_get_one_reply_and_apply_nothing(rig, data):
    """Hypothesis: arbitrary bytes, and msgpack headers with arbitrary fields and frame specs
    (never naming the shard's real keys, so no push can be valid); one reply each, no update."""
    server, _, _, raw, _ = rig
    values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() |
                          st.text(max_size=8) | st.binary(max_size=8),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=4), max_leaves=12)
    key = st.text(max_size=6).filter(lambda k: k not in KEYS)
    spec = st.tuples(key, st.sampled_from([*wire.DTYPES, "x"]), st.integers(0, 2**64 - 1),
                     st.integers(0, 2**64 - 1)).map(list)
    header = st.fixed_dictionaries({"v": st.sampled_from([1, 1, 1, 0, 2]),
                                    "op": st.sampled_from(["push", "hello", "init", "zap", "push"]),
                                    "from": st.sampled_from(["rank1", "rank1", "rank5", 1]),
                                    "step": st.integers(-3, 2**40), "frames": st.lists(spec, max_size=4),
                                    "meta": st.dictionaries(st.text(max_size=8), values, max_size=4)})
    if data.draw(st.booleans()):
        frames = data.draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    else:
        h = data.draw(header)
        frames = [_pack(h), *data.draw(st.lists(st.binary(max_size=32), min_size=len(h["frames"]),
                                                max_size=len(h["frames"]) + 1))]
    raw.send(frames)
    h, _ = raw.reply(timeout=30)
    assert h.op in ("error", "ok")
    assert raw.sock.poll(0, zmq.POLLIN) == 0


HANDSHAKE_CASES = 1200  # fuzzed handshake messages (with the 6,000 above: the fuzz's 7,200 cases)


def _fuzzed_handshake(rng: random.Random, good: bytes) -> bytes:
    """A handshake message with a defect: bytes, broken msgpack, wrong types or sizes, a proof first."""
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:
        return good[:rng.randrange(0, len(good))]
    if kind == 2:
        return _pack({"auth": 1, "nonce": rng.randbytes(rng.choice([0, 31, 33, 64])), "who": "rank1"})
    if kind == 3:
        return _pack({"auth": 1, "nonce": rng.randbytes(32), "who": rng.choice([None, "", 5, "x" * 300, [1]])})
    if kind == 4:
        return _pack({"auth": rng.choice([0, 2, "1", None]), "nonce": rng.randbytes(32), "who": "rank1"})
    if kind == 5:
        return _pack({"auth": 1, "proof": rng.randbytes(rng.choice([0, 32, 100]))})
    return _pack({"auth": 1, "nonce": rng.randbytes(32), "who": "rank1", "pad": rng.randbytes(2000)})


def test_fuzzed_handshakes_are_refused_and_serve_nothing(rig):
    """Fresh connections that never prove the secret: each fuzzed handshake message gets one answer (a refusal,
    or for a well-formed hello a challenge, which a fuzzed proof then fails), nothing is served, the
    parameters are unchanged."""
    server, _, _, raw, _ = rig
    before = checksum(raw)
    s0 = server.stats()["auth"]
    rng = random.Random(SEED + 1)
    good = auth.Initiator(auth.load(), "rank1", "server").hello()
    strangers = [Raw(server.endpoint, "rank1", secret=None) for _ in range(8)]
    dropped = 0
    try:
        for n in range(HANDSHAKE_CASES):
            s = strangers[n % len(strangers)]
            s.send([_fuzzed_handshake(rng, good)])
            answer = transport.recv(s.sock, 30, "server")
            if b"auth" in answer[0].bytes[:16]:  # a handshake's answer (a refusal, or a challenge)
                assert len(answer) == 1
            else:  # not even a handshake: dropped, said so
                h = wire.decode(answer, ops=psproto.REPLIES)
                assert h.op == "error" and "serves only its job's processes" in h.meta["reason"]
                dropped += 1
        for s in strangers:  # still strangers: a request is refused
            assert "serves only its job's processes" in s.request("pull", -1, after_step=-1).meta["reason"]
    finally:
        for s in strangers:
            s.close()
    s1 = server.stats()["auth"]  # (its own connection proved the secret: the one handshake that succeeded)
    assert s1["handshakes"] - s0["handshakes"] == 1 and s1["refused_messages"] - s0["refused_messages"] == dropped + len(strangers)
    assert checksum(raw) == before


def test_after_the_fuzz_a_valid_step_lands_on_its_closed_form(rig):
    """Run last (file order): rank 0 through the client and rank 1 raw push step 0 together."""
    server, ex, model, raw, _ = rig
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    s = server.stats()
    assert s["version"] == 0 and s["updates"] == 0
    done: list = []
    t = threading.Thread(target=lambda: done.append(_step(ex, model)), daemon=True)
    t.start()
    g1 = {"weight": torch.full((6,), 0.75), "bias": torch.full((2,), -0.5)}
    parts = [p for k, g in g1.items() for p in wire.split(k, g)]
    if raw.link is None:
        assert raw.request("push", 0, parts, base=0, absent=[]).op == "ok"
    else:  # through the fuzzer's segment, as the client would
        at = psshm.place(raw.link.offsets, parts)
        for (_, t_), o in zip(parts, at):
            raw.link.inbound.write(o, t_)
        raw.id += 1
        raw.send(wire.encode("push", raw.sender, 0, parts, {"id": raw.id, "base": 0, "absent": []}, at))
        assert raw.reply()[0].op == "ok"
    t.join(60)
    assert done == [True]
    # rank 0's gradient is 1 everywhere (d/dp of sum of params); mean with rank 1's, lr 0.5
    for k, p in model.named_parameters():
        expected = start[k].view(-1) - 0.5 * (1.0 + g1[k]) / 2
        torch.testing.assert_close(p.detach().view(-1), expected, rtol=0, atol=0)
    assert server.stats()["updates"] == 1
    if raw.link is not None:  # a pull answered through the segment carries what one in frames does
        raw.id += 1
        raw.send(wire.encode("pull", raw.sender, -1, (), {"id": raw.id, "after_step": -1}))
        h, data = raw.reply()
        framed = {spec.key: wire.frame_tensor(spec, f).clone() for spec, f in zip(h.frames, data)}
        raw.id += 1
        raw.send(wire.encode("pull", raw.sender, -1, (), {"id": raw.id, "after_step": -1, "shm_reply": True}))
        h, data = raw.reply()
        assert h.op == "params" and data == [] and len(h.meta["shm"]) == 2
        got = {spec.key: wire.frame_tensor(spec, f).clone()
               for spec, f in zip(h.frames, wire.region_frames(h, raw.link.outbound.view))}
        assert got.keys() == framed.keys() == KEYS.keys()
        for k in KEYS:
            assert torch.equal(got[k], framed[k])


def _step(ex, model) -> bool:
    ex.zero_grad()
    sum(p.sum() for p in model.parameters()).backward()
    ex.step()
    return True

