"""The wire: frames round-trip exactly, big tensors split at the frame limit, lying headers are refused."""

import re

import msgpack
import pytest
import torch

from commlab.transport import wire
from commlab.base.errors import ProtocolError


def roundtrip(parts, **kw):
    frames = wire.encode("push", "rank0", 3, parts, {"note": 1})
    as_bytes = [bytes(f) for f in frames]
    h = wire.decode(as_bytes, **kw)
    return h, [wire.frame_tensor(s, bytearray(f)) for s, f in zip(h.frames, as_bytes[1:])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_roundtrip_exact(dtype, n):
    t = (torch.arange(n, dtype=torch.float64) * 1.5 - 3).to(dtype)
    h, views = roundtrip(wire.split("w", t, max_frame=256))
    assert h.op == "push" and h.sender == "rank0" and h.step == 3 and h.meta == {"note": 1}
    got = torch.cat(views) if views else torch.empty(0, dtype=dtype)
    assert torch.equal(got, t)
    assert all(s.nbytes <= 256 for s in h.frames)
    assert [s.offset for s in h.frames] == list(range(0, n, 256 // t.element_size()))


def test_default_frames_at_most_16_mib():
    t = torch.zeros(5 * 2**20)  # 20 MiB of float32
    parts = wire.split("big", t)
    assert [s.count for s, _ in parts] == [4 * 2**20, 2**20]
    assert max(s.nbytes for s, _ in parts) == 16 * 2**20


def test_split_with_offset_addresses_the_whole_tensor():
    parts = wire.split("w", torch.ones(10), offset=100, max_frame=16)
    assert [(s.offset, s.count) for s, _ in parts] == [(100, 4), (104, 4), (108, 2)]


def header(**over):
    h = {"v": 1, "op": "push", "from": "r", "step": 0, "frames": [["w", "float32", 0, 2]], "meta": {}}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize("frames, message", [
    ([], "empty message"),
    ([b"\xc1garbage"], "header is not msgpack"),
    ([msgpack.packb([1, 2])], "not a map"),
    ([header(v=2), bytes(8)], r"protocol version 2; this build speaks 1"),
    ([header(op="explode"), bytes(8)], r"unknown op 'explode'; known: \['pull', 'push'\]"),
    ([header(), bytes(8), bytes(8)], r"declares 1 data frame\(s\) but 2 arrived"),
    ([header()], r"declares 1 data frame\(s\) but 0 arrived"),
    ([header(), bytes(7)], r"frame 0 \(w\) has 7 bytes, header declares 8"),
    ([header(frames=[["w", "complex64", 0, 2]]), bytes(8)], "unknown dtype 'complex64'"),
    ([header(frames=[["w", "float32", -1, 2]]), bytes(8)], "non-negative"),
    ([header(frames=[["w", "float32", 0, 2**40]]), bytes(8)], r"declares 4398046511104 bytes, limit"),
    ([header(frames=[["w", "float32", 0]]), bytes(8)], r"not \[key, dtype, offset, count\]"),
    ([header(frames=[["", "float32", 0, 2]]), bytes(8)], "bad key"),
    ([header(step="x"), bytes(8)], "bad step"),
    ([header(meta=[1]), bytes(8)], "'meta' is not a map"),
])
def test_lying_headers_are_refused(frames, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode(frames, ops={"push", "pull"})


def test_total_size_limit():
    frames = wire.encode("push", "r", 0, wire.split("w", torch.zeros(100)))
    with pytest.raises(ProtocolError, match="carries 400 bytes, limit 399"):
        wire.decode([bytes(f) for f in frames], max_bytes=399)


def test_describe_is_one_line():
    h, _ = roundtrip(wire.split("layer.weight", torch.zeros(2**20), max_frame=2**20))
    text = wire.describe(h)
    assert "\n" not in text
    assert text.startswith("push from rank0 step 3: 4 frames, 4.0 MiB [layer.weight:float32[0:262144]")
    assert wire.describe(b"junk") == "<undecoded message: bytes>"


def test_unsupported_dtype_is_a_caller_error():
    with pytest.raises(ValueError, match="cannot travel on the wire"):
        wire.split("c", torch.zeros(2, dtype=torch.complex64))


def test_data_in_a_shared_region_is_bounded_by_it():
    """``meta["shm"]``: one byte offset per frame spec into a region the connection maps; a run that
    ends exactly at the region's end is inside, one byte past is not, and only a connection given a
    region may name one."""
    region = bytearray(128)
    torch.frombuffer(region, dtype=torch.float32)[16:18] = torch.tensor([1.5, -2.0])
    parts = wire.split("b", torch.zeros(2))
    msg = wire.encode("push", "rank0", 0, parts, {}, at=[64])
    assert len(msg) == 1  # the header alone
    h = wire.decode(msg, region=len(region))
    data = wire.region_frames(h, memoryview(region))
    assert wire.frame_tensor(h.frames[0], data[0]).tolist() == [1.5, -2.0]
    assert wire.decode(wire.encode("push", "rank0", 0, parts, {}, at=[120]), region=128).meta["shm"] == [120]
    for at, reason in [([124], "outside the shared region"), ([2**64 - 4], "outside the shared region"),
                       ([2], "not a non-negative multiple"), ([-8], "not a non-negative multiple"),
                       ([True], "not a non-negative multiple")]:
        with pytest.raises(ProtocolError, match=reason):
            wire.decode([msgpack.packb({"v": 1, "op": "push", "from": "r", "step": 0, "frames": [["b", "float32", 0, 2]],
                                        "meta": {"shm": at}})], region=128)
    with pytest.raises(ProtocolError, match="no shared-memory link"):
        wire.decode(msg)
    with pytest.raises(ProtocolError, match="arrived too"):
        wire.decode([*msg, b"\0" * 8], region=128)
    with pytest.raises(ProtocolError, match="one offset per frame spec"):
        wire.decode([msgpack.packb({"v": 1, "op": "push", "from": "r", "step": 0, "frames": [["b", "float32", 0, 2]],
                                    "meta": {"shm": [0, 64]}})], region=128)


def test_committed_state_round_trips_without_pickle():
    """ex.commit_state's bytes: a scheduler's and a scaler's state dicts, tensors of every state dtype (0-d,
    empty, 2-d), tuples, int keys and inf come back equal, and the bytes are a msgpack header plus the tensors'
    raw bytes, nothing else."""
    import collections
    import math
    import struct

    tensors = {name: (torch.arange(6) % 2).to(getattr(torch, name)).view(2, 3) for name in wire.STATE_DTYPES}
    state = {"sched": collections.OrderedDict(base_lrs=[0.1, 0.2], last_epoch=3, _last_lr=(0.1, 0.05), fn=None),
             "scaler": {"scale": 65536.0, "_growth_tracker": 0, "enabled": True}, 7: tensors,
             "zero_d": torch.tensor(1.5, dtype=torch.bfloat16), "empty": torch.empty(0, 4), "nested": ((1, 2), [3]),
             "inf": math.inf}
    raw = wire.pack_state(state)
    # the layout, read without commlab: magic, header length, a msgpack header whose tensors are references,
    # then exactly the tensors' raw bytes in order (nothing else: no pickle stream anywhere)
    n = len(wire.STATE_MAGIC)
    assert raw[:n] == wire.STATE_MAGIC
    (size,) = struct.unpack("<I", raw[n:n + 4])
    refs: list = []
    msgpack.unpackb(raw[n + 4:n + 4 + size], strict_map_key=False,
                    ext_hook=lambda code, data: refs.append(msgpack.unpackb(data)) if code == 1 else None)
    flat = [t for t in tensors.values()] + [state["zero_d"], state["empty"]]
    assert sorted(r[3] for r in refs) == sorted(t.numel() * t.element_size() for t in flat)
    assert len(raw) == n + 4 + size + sum(r[3] for r in refs)
    back = wire.unpack_state(raw)
    assert back["sched"] == dict(state["sched"]) and back["scaler"] == state["scaler"]
    assert back["nested"] == ((1, 2), [3]) and back["inf"] == math.inf
    for name, t in tensors.items():
        assert back[7][name].dtype == t.dtype and torch.equal(back[7][name], t), name
    assert back["zero_d"].shape == () and back["zero_d"].item() == 1.5 and back["empty"].shape == (0, 4)


@pytest.mark.parametrize("state, said", [({"a": [1, print]}, "state['a'][1] is a builtin_function_or_method"),
                                         ({(1, 2): 3}, "state has a key (1, 2)"),
                                         ({"c": torch.zeros(2, dtype=torch.complex64)}, "state['c'] is a torch.complex64")])
def test_committed_state_refuses_what_it_cannot_carry_naming_where(state, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        wire.pack_state(state)


def test_a_committed_state_not_packed_by_commlab_is_refused():
    import io

    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    with pytest.raises(ProtocolError, match="not made by commlab.transport.wire.pack_state"):
        wire.unpack_state(buf.getvalue())


def test_a_states_top_level_scalars_are_read_from_its_head_alone():
    """wire.state_top: what a new backup reads of its primary's state at the attach (servers/replication.py) without
    loading it: the top-level scalars and each container's length, from the first part alone (the tensors' bytes
    not given); a head cut short or not commlab's is refused."""
    state = {"seq": 12, "log": 4.0, "spaces": [{"w": torch.ones(3)}, {"w": torch.zeros(2)}], "name": "s", "none": None}
    parts = wire.pack_state_parts(state)
    assert len(parts) == 3  # the head, then each tensor's bytes
    assert wire.state_top(parts[0]) == {"seq": 12, "log": 4.0, "spaces": 2, "name": "s", "none": None}
    with pytest.raises(ProtocolError, match="runs past"):
        wire.state_top(parts[0][:-1])
    with pytest.raises(ProtocolError, match="not made by commlab"):
        wire.state_top(b"not a state at all")
    with pytest.raises(ProtocolError, match="is not a dict"):
        wire.state_top(wire.pack_state_parts([1, 2])[0])
