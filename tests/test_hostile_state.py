"""A rank's committed state (``ex.commit_state``, ``ex.restored_state``) as bytes a stranger may have written.

``wire.pack_state``/``wire.unpack_state`` round-trip every nesting of containers and every state dtype
byte for byte (hypothesis); ``pack_state`` refuses what ``unpack_state`` would; and every blob
``pack_state`` could not have made (nested 10^5 deep, lengths that lie, tensors past the end, at
negative or fractional offsets, of a shape that does not match their bytes, bytes left over) is a
``ProtocolError`` naming where it sits. The hostile blobs are read in a child process, so a crash
(the SIGSEGV a 200-deep tuple once caused) fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import re
import struct
import sys

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlab.transport import wire
from commlab.base.errors import ProtocolError
from conftest import child_env, run_group

DEPTH = wire.MAX_STATE_DEPTH


# ----- round trips ---------------------------------------------------------------------------------------

@st.composite
def tensors(draw):
    name = draw(st.sampled_from(wire.STATE_DTYPES))
    dtype = getattr(torch, name)
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    numel = 1
    for d in shape:
        numel *= d
    raw = bytearray(draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize)))
    if dtype is torch.bool:  # a bool is a byte 0 or 1; any other byte is not a bool torch can hold
        raw = bytearray(b & 1 for b in raw)
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
    if t.dim() == 2 and draw(st.booleans()):
        t = t.t()  # not contiguous: packed as its values, read back contiguous
    return t


leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
          | st.floats(allow_nan=False) | st.text(max_size=8) | tensors())
states = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                      | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4),
                      max_leaves=24)


def same(a, b) -> bool:
    """Equal values of equal types all the way down (a tuple is not a list; tensors bit for bit)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                         b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states)
def test_state_round_trips_every_nesting_and_dtype(state):
    raw = wire.pack_state(state)
    back = wire.unpack_state(raw)
    assert same(back, state)
    assert wire.pack_state(back) == raw  # one way to write a state: what was read writes the same bytes


def nest(kind: str, depth: int):
    """``depth`` containers of ``kind``, one inside the other, around a tensor."""
    obj: object = torch.arange(3.0)
    for _ in range(depth):
        obj = {"k": obj} if kind == "dict" else [obj] if kind == "list" else (obj,)
    return obj


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_nesting_up_to_the_limit_round_trips_and_one_more_is_refused_by_pack_state(kind):
    assert same(wire.unpack_state(wire.pack_state(nest(kind, DEPTH))), nest(kind, DEPTH))
    where = "state" + ("['k']" if kind == "dict" else "[0]") * DEPTH
    with pytest.raises(ValueError, match="^" + re.escape(f"{where} nests containers {DEPTH + 1} deep: a state may "
                                                         f"nest at most {DEPTH}")):
        wire.pack_state(nest(kind, DEPTH + 1))


def test_pack_state_refuses_a_tensor_of_more_dimensions_than_unpack_state_reads():
    with pytest.raises(ValueError, match=r"state\['t'\] is a tensor of 65 dimensions: .* at most 64"):
        wire.pack_state({"t": torch.zeros([1] * 65)})


# ----- hostile blobs ---------------------------------------------------------------------------------------

def blob(header: bytes, body: bytes = b"") -> bytes:
    return wire.STATE_MAGIC + struct.pack("<I", len(header)) + header + body


def ref(*fields) -> msgpack.ExtType:
    """A tensor reference ``[dtype, shape, offset, nbytes]`` as pack_state writes one (fields free)."""
    return msgpack.ExtType(1, msgpack.packb(list(fields)))


def tensor_blob(*fields, body: bytes = b"\0" * 8) -> bytes:
    return blob(msgpack.packb({"t": ref(*fields)}), body)


def deep_tuples(depth: int) -> bytes:
    """A header of ``depth`` tuples, each the one item of the one around it, around None, written by hand
    (the 32-bit extension form at every level): O(depth) bytes, built in O(depth)."""
    sizes = [2]  # the innermost tuple's payload: [None]
    for _ in range(depth - 1):
        sizes.append(sizes[-1] + 7)  # fixarray(1) + ext32 header (6 bytes) + the inner payload
    opened = [b"\xc9" + struct.pack(">I", n) + b"\x02" + b"\x91" for n in reversed(sizes)]
    return b"".join(opened) + b"\xc0"


def test_the_hand_built_deep_tuples_are_what_they_say():
    assert wire.unpack_state(blob(deep_tuples(3))) == (((None,),),)


HOSTILE = {  # name: (blob, the error's `where`, what its message says)
    "lists 10^5 deep": (blob(b"\x91" * 10**5 + b"\xc0"), "state", r"is not msgpack \(StackError"),
    "tuples 10^5 deep": (blob(deep_tuples(10**5)), "state" + "[0]" * DEPTH, rf"nests containers {DEPTH + 1} deep: at most {DEPTH}"),
    "tuples 200 deep": (blob(deep_tuples(200)), "state" + "[0]" * DEPTH, rf"at most {DEPTH}"),
    "lists 65 deep": (blob(b"\x91" * (DEPTH + 1) + b"\xc0"), "state" + "[0]" * DEPTH, rf"at most {DEPTH}"),
    "not ours": (b"PK\x03\x04" + b"\0" * 20, "magic", "not made by commlab.transport.wire.pack_state"),
    "header length past the end": (wire.STATE_MAGIC + struct.pack("<I", 2**32 - 1) + b"\xc0", "header",
                                   r"of 4294967295 bytes runs past"),
    "array of 2^32-1 items declared": (blob(b"\xdd\xff\xff\xff\xff"), "state", r"not msgpack \(ValueError"),
    "string of 2^32-1 bytes declared": (blob(b"\xdb\xff\xff\xff\xff"), "state", r"not msgpack \(ValueError"),
    "header trailing bytes": (blob(b"\xc0\xc0"), "state", r"not msgpack \(ExtraData"),
    "data trailing bytes": (blob(msgpack.packb(None), b"\0"), "data", r"1 bytes after its last tensor"),
    "tensor past the end": (tensor_blob("float32", [4], 0, 16), "state['t']", r"16 bytes at 0, past the data's end at 8"),
    "tensor of 2^60 bytes": (tensor_blob("uint8", [2**60], 0, 2**60), "state['t']", r"past the data's end"),
    "negative offset": (tensor_blob("float32", [2], -8, 8), "state['t']", r"offset -8, not an integer >= 0"),
    "fractional offset": (tensor_blob("float32", [2], 0.5, 8), "state['t']", r"offset 0.5, not an integer >= 0"),
    "negative size": (tensor_blob("float32", [2], 0, -8), "state['t']", r"size -8, not an integer >= 0"),
    "gap before a tensor": (tensor_blob("float32", [1], 4, 4), "state['t']", r"at byte 4 of the data; the tensors before it end at 0"),
    "overlapping tensors": (blob(msgpack.packb([ref("float32", [2], 0, 8), ref("float32", [2], 0, 8)]), b"\0" * 16),
                            "state[1]", r"at byte 0 of the data; the tensors before it end at 8"),
    "shape does not match the bytes": (tensor_blob("float32", [3], 0, 8), "state['t']", r"float32 tensor of shape \[3\] in 8 bytes"),
    "shape [2^62, 2^62]": (tensor_blob("float32", [2**62, 2**62], 0, 8), "state['t']", r"shape \[4611686018427387904, 4611686018427387904\] in 8"),
    "shape [-1]": (tensor_blob("float32", [-1], 0, 8), "state['t']", r"shape \[-1\]: not at most 64 sizes >= 0"),
    "shape of 65 dims": (tensor_blob("uint8", [1] * 65, 0, 0, body=b""), "state['t']", r"not at most 64 sizes"),
    "shape not a list": (tensor_blob("float32", "2", 0, 8), "state['t']", r"shape '2'"),
    "unknown dtype": (tensor_blob("complex64", [1], 0, 8), "state['t']", r"unknown dtype 'complex64'"),
    "bool tensor holding 2": (tensor_blob("bool", [8], 0, 8, body=b"\x02" + b"\0" * 7), "state['t']", r"bytes other than 0 and 1"),
    "reference not a list": (blob(msgpack.packb({"t": msgpack.ExtType(1, msgpack.packb({"a": 1}))})), "state['t']",
                             r"not \[dtype, shape, offset, nbytes\]"),
    "reference not msgpack": (blob(msgpack.packb({"t": msgpack.ExtType(1, b"\xc1")})), "state['t']", r"not msgpack"),
    "unknown extension": (blob(msgpack.packb({"t": msgpack.ExtType(7, b"")})), "state['t']", r"unknown extension 7"),
    "tuple holding a map": (blob(msgpack.packb([msgpack.ExtType(2, msgpack.packb({"a": 1}))])), "state[0]", r"tuple holding a _Pairs"),
    "bytes in the tree": (blob(msgpack.packb({"b": b"raw"}, use_bin_type=True)), "state['b']", r"holds a bytes"),
    "float key": (blob(msgpack.packb({1.5: 1})), "state", r"key 1.5: pack_state writes only str and int keys"),
    "repeated key": (blob(b"\x82\xa1a\x01\xa1a\x02"), "state", r"repeats a key"),
}

READER = """
import json, sys
from pathlib import Path
from commlab.transport import wire
for path in sorted(Path(sys.argv[1]).glob("*.bin")):
    print(json.dumps({"case": path.stem, "started": True}), flush=True)
    try:
        wire.unpack_state(path.read_bytes())
        verdict = {"error": None}
    except Exception as exc:
        verdict = {"error": type(exc).__name__, "where": getattr(exc, "where", None), "message": str(exc)}
    print(json.dumps({"case": path.stem, **verdict}), flush=True)
"""


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> tuple[dict, str]:
    """What a child process said of each hostile blob, read in one child; and how the child ended."""
    folder = tmp_path_factory.mktemp("hostile")
    names = sorted(HOSTILE)
    for i, name in enumerate(names):
        (folder / f"{i:03d}.bin").write_bytes(HOSTILE[name][0])
    done = run_group([sys.executable, "-c", READER, str(folder)], 120, "the hostile-state reader",
                     env=child_env(), capture_output=True, text=True)
    out, last = {}, None
    for line in done.stdout.splitlines():
        row = json.loads(line)
        last = names[int(row.pop("case"))]
        if not row.pop("started", False):
            out[last] = row
    ending = f"the reader exited {done.returncode} while reading {last!r}; stderr: {done.stderr[-1500:]}"
    return out, ending


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_state_is_a_protocol_error_naming_where_never_a_crash(verdicts, name):
    got, ending = verdicts
    assert name in got, ending
    _, where, said = HOSTILE[name]
    assert got[name]["error"] == "ProtocolError", got[name]
    assert got[name]["where"] == where
    assert re.search(said, got[name]["message"]), got[name]["message"]
    assert "\n" not in got[name]["message"]


def test_protocol_error_keeps_where_across_rewording_and_pickling():
    import pickle

    exc = ProtocolError("x", where="state['a']", peer=1)
    assert pickle.loads(pickle.dumps(exc)).where == "state['a']"
    assert exc.reworded("y").fields() == {"peer": 1, "origin": None, "op": None, "where": "state['a']"}
