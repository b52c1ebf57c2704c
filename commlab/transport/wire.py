"""The wire protocol of the pyzmq regimes: one msgpack header frame, then raw tensor frames.

::

    frame 0   msgpack header  {"v": 1, "op": "push", "from": "rank1", "step": 7,
                               "frames": [[key, dtype, offset, count], ...], "meta": {...}}
    frame 1   raw bytes of frames[0]: count elements of dtype, little-endian
    frame 2   raw bytes of frames[1]
    ...

Every data frame is a 1-D run ``[offset, offset+count)`` of the flat tensor
named ``key``. A tensor larger than ``MAX_FRAME`` bytes travels as several
frames, because pyzmq messages above 32 MiB fall to about a third of the speed
on this machine (a fresh mapping per message). Nothing is ever pickled:
msgpack carries only the header, tensors travel as their own bytes.

A receiver calls :func:`decode` before it touches any tensor bytes: version,
op, types, dtypes, frame count and every frame's length are checked against
the header and the limits, and a lying header is a :class:`ProtocolError`,
never an allocation. :func:`frame_tensor` then views a frame's bytes as a
tensor without copying (the caller adds it into its own reused buffer).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import msgpack
import torch

from commlab.base.errors import ProtocolError

VERSION = 1
MAX_FRAME = 16 * 2**20  # bytes per data frame
MAX_HEADER = 2**20  # bytes of msgpack header (unpacked, a crafted one can grow ~70x: keep it small)
COPY_THRESHOLD = 2**20  # frames up to this size are copied into the message; larger ones go zero-copy

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire; supported: {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class FrameSpec:
    key: str
    dtype: str
    offset: int  # in elements of the flat tensor ``key``
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Header:
    op: str
    sender: str
    step: int
    frames: tuple[FrameSpec, ...] = ()
    meta: dict = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return sum(f.nbytes for f in self.frames)


def split(key: str, flat: torch.Tensor, offset: int = 0, max_frame: int = MAX_FRAME) -> list[tuple[FrameSpec, torch.Tensor]]:
    """Cut a 1-D contiguous tensor into frames of at most ``max_frame`` bytes.

    ``offset`` is where ``flat`` starts inside the tensor ``key`` (for shards
    and ring chunks). A tensor of zero elements gives no frames.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{key}: only flat contiguous tensors travel, got shape {list(flat.shape)}")
    name = dtype_name(flat.dtype)
    per = max(1, max_frame // flat.element_size())
    return [(FrameSpec(key, name, offset + s, min(per, flat.numel() - s)), flat[s:s + per])
            for s in range(0, flat.numel(), per)]


def encode(op: str, sender: str, step: int, parts: Sequence[tuple[FrameSpec, torch.Tensor]] = (),
           meta: dict | None = None, at: Sequence[int] | None = None) -> list:
    """The frames of one message: header bytes, then each part's raw bytes (no copy here).

    ``at``: the parts' bytes are already in a region both ends map (shared memory), at these byte
    offsets, one per part; the message is the header alone, its ``meta["shm"]`` the offsets."""
    if at is not None:
        if len(at) != len(parts):
            raise ValueError(f"{len(at)} offsets for {len(parts)} parts")
        meta = dict(meta or {}, shm=list(at))
    header = {"v": VERSION, "op": op, "from": sender, "step": step,
              "frames": [[s.key, s.dtype, s.offset, s.count] for s, _ in parts], "meta": meta or {}}
    out: list = [msgpack.packb(header, use_bin_type=True)]
    if at is not None:
        return out
    for spec, t in parts:
        if t.numel() != spec.count or t.is_cuda:
            raise ValueError(f"{spec.key}: frame holds {t.numel()} elements on {t.device}, header says {spec.count} on cpu")
        out.append(t.view(torch.uint8).numpy().data)  # the tensor's own bytes, any dtype, no copy
    return out


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(what)


def decode(frames: Sequence, ops: Iterable[str] | None = None, max_frame: int = MAX_FRAME,
           max_bytes: int | None = None, region: int | None = None, header_only: bool = False) -> Header:
    """Validate a received message's header against its frames; raise :class:`ProtocolError` on any lie.

    ``frames`` are bytes or zmq Frames, header first. ``ops`` restricts the op;
    ``max_bytes`` bounds the total data the message may carry. ``region``: the size in bytes of
    the shared region this connection may name instead of data frames (None: it has none). A
    message with ``meta["shm"]`` is its header alone and names one byte offset per frame spec;
    each run ``[offset, offset + nbytes)`` must lie inside the region, aligned to its dtype's size
    (then :func:`region_frames` views it). ``header_only``: the message is its header alone, its data left out
    on purpose (a replicated shard's elided push, :mod:`servers.replication`): the specs are checked, no frames.
    """
    _expect(len(frames) >= 1, "empty message")
    raw = _bytes(frames[0])
    _expect(len(raw) <= MAX_HEADER, f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    _expect(isinstance(h, dict), f"header is a {type(h).__name__}, not a map")
    version = h.get("v")
    _expect(version == VERSION, f"protocol version {version!r}; this build speaks {VERSION}")
    op, sender, step, specs, meta = h.get("op"), h.get("from"), h.get("step"), h.get("frames"), h.get("meta", {})
    _expect(isinstance(op, str), "header has no op")
    if ops is not None:
        known = sorted(ops)
        _expect(op in known, f"unknown op {op!r}; known: {known}")
    _expect(isinstance(sender, (str, int)) and not isinstance(sender, bool), "header has no sender")
    _expect(isinstance(step, int) and not isinstance(step, bool) and step >= -1, f"bad step {step!r}")
    _expect(isinstance(specs, list), "header 'frames' is not a list")
    _expect(isinstance(meta, dict), "header 'meta' is not a map")
    at = meta.get("shm")
    if header_only:
        _expect(len(frames) == 1 and at is None, "a header-only message carries no data and names no shared memory")
    elif at is None:
        _expect(len(frames) == len(specs) + 1,
                f"header declares {len(specs)} data frame(s) but {len(frames) - 1} arrived")
    else:
        _expect(region is not None, "data said to be in shared memory, but this connection has no shared-memory link")
        _expect(len(frames) == 1, f"data in shared memory, yet {len(frames) - 1} data frame(s) arrived too")
        _expect(isinstance(at, list) and len(at) == len(specs),
                f"meta 'shm' must list one offset per frame spec ({len(specs)})")
    out, total = [], 0
    for i, s in enumerate(specs):
        _expect(isinstance(s, list) and len(s) == 4, f"frame spec {i} is not [key, dtype, offset, count]")
        key, dt, off, cnt = s
        _expect(isinstance(key, str) and 0 < len(key) <= 256, f"frame {i}: bad key {key!r}")
        _expect(dt in DTYPES, f"frame {i} ({key}): unknown dtype {dt!r}")
        _expect(all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, cnt)),
                f"frame {i} ({key}): offset/count must be non-negative integers")
        spec = FrameSpec(key, dt, off, cnt)
        _expect(spec.nbytes <= max_frame, f"frame {i} ({key}) declares {spec.nbytes} bytes, limit {max_frame}")
        if header_only:
            got = spec.nbytes
        elif at is None:
            got = _nbytes(frames[i + 1])
            _expect(got == spec.nbytes, f"frame {i} ({key}) has {got} bytes, header declares {spec.nbytes}")
        else:
            o = at[i]
            _expect(isinstance(o, int) and not isinstance(o, bool) and o >= 0 and o % DTYPES[dt].itemsize == 0,
                    f"frame {i} ({key}): shared-memory offset {o!r} is not a non-negative multiple of its item size")
            assert region is not None
            _expect(o + spec.nbytes <= region, f"frame {i} ({key}): bytes [{o}, {o + spec.nbytes}) lie outside the "
                                               f"shared region of {region} bytes")
            got = spec.nbytes
        total += got
        out.append(spec)
    if max_bytes is not None:
        _expect(total <= max_bytes, f"message carries {total} bytes, limit {max_bytes}")
    return Header(op, str(sender), step, tuple(out), meta)


def region_frames(h: Header, region: memoryview) -> list[memoryview]:
    """The data of a message :func:`decode` accepted with ``meta["shm"]``: views of ``region`` (no copy)."""
    return [region[o:o + spec.nbytes] for spec, o in zip(h.frames, h.meta["shm"])]


def frame_tensor(spec: FrameSpec, frame) -> torch.Tensor:
    """A 1-D tensor viewing the frame's bytes (no copy). Valid while the frame lives."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if spec.count == 0:
        return torch.empty(0, dtype=DTYPES[spec.dtype])
    return torch.frombuffer(buf, dtype=DTYPES[spec.dtype], count=spec.count)


def describe(header: Header | Any) -> str:
    """One line for logs: ``push from rank1 step 7: 3 frames, 4.0 MiB [w:float32[0:1048576] ...]``."""
    if not isinstance(header, Header):
        return f"<undecoded message: {type(header).__name__}>"
    shown = " ".join(f"{f.key}:{f.dtype}[{f.offset}:{f.offset + f.count}]" for f in header.frames[:4])
    more = f" +{len(header.frames) - 4} more" if len(header.frames) > 4 else ""
    meta = f" meta={sorted(header.meta)}" if header.meta else ""
    return (f"{header.op} from {header.sender} step {header.step}: {len(header.frames)} frames, "
            f"{header.data_bytes / 2**20:.1f} MiB [{shown}{more}]{meta}")


def _bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _nbytes(frame) -> int:
    if hasattr(frame, "buffer"):
        return frame.buffer.nbytes
    return memoryview(frame).nbytes


# ----- the lean fast path: fixed-size chunk headers for collectives -----------------------------
#
# A ring all-reduce moves thousands of small messages whose every field the receiver can predict
# (sender, collective number, step, offset, count, dtype). For those, a 40-byte struct replaces the
# msgpack header: packing and checking it costs about 1 us instead of about 15 us for pack + decode
# (python -m bench.bandwidth measures both), which is a third of a 4 KiB all-reduce.
# Validation stays strict: the receiver builds the header it expects and compares bytes; any
# difference is a ProtocolError that says which field differs.

INLINE_MAX = 64 * 2**10  # chunks up to this size travel in one frame with their header
CHUNK_MAGIC = b"CR"
CHUNK_HEADER = struct.Struct("<2sBBIIIQQQ")  # magic, version, dtype, sender, step, chunk, seq, offset, count
DTYPE_CODES: dict[str, int] = {name: i for i, name in enumerate(DTYPES)}
_CHUNK_FIELDS = ("magic", "version", "dtype", "sender", "step", "chunk", "collective", "offset", "count")


def chunk_header(sender: int, seq: int, step: int, chunk: int, offset: int, count: int, dtype: torch.dtype) -> bytes:
    """The fixed header of one chunk message: ``count`` elements from ``offset`` of collective ``seq``."""
    return CHUNK_HEADER.pack(CHUNK_MAGIC, VERSION, DTYPE_CODES[dtype_name(dtype)], sender, step, chunk, seq,
                             offset, count)


def check_chunk_header(got: bytes, expected: bytes, who: str, peer: int | str | None = None) -> None:
    """Raise :class:`ProtocolError` naming ``who`` (its ``peer`` field: ``peer``) and the first differing
    field unless ``got == expected``."""
    if got == expected:
        return
    if len(got) != CHUNK_HEADER.size:
        raise ProtocolError(f"{who} sent a {len(got)}-byte chunk header, expected {CHUNK_HEADER.size}", peer=peer,
                            op="receive")
    mine, theirs = CHUNK_HEADER.unpack(expected), CHUNK_HEADER.unpack(got)
    diffs = [f"{name} {b!r} (expected {a!r})" for name, a, b in zip(_CHUNK_FIELDS, mine, theirs) if a != b]
    hint = ""
    if any(d.startswith(("count", "offset")) for d in diffs):
        hint = ": do the ranks' tensors have the same size?"
    elif any(d.startswith("dtype") for d in diffs):
        hint = ": do the ranks' tensors have the same dtype?"
    raise ProtocolError(f"{who} sent chunk with " + ", ".join(diffs) + hint, peer=peer, op="receive")


# ----- a rank's small state as bytes, without pickle (ex.commit_state) --------------------------------
#
# The bytes come back from a server or a checkpoint, so they are read as a stranger's: a blob pack_state could
# not have made is a ProtocolError naming where it sits (``where``), never a crash or an allocation. Nothing
# recurses per nesting level: msgpack unpacks one level at a time (a tuple is an extension whose payload is
# unpacked when the walk reaches it, with lengths bounded by the payload's size) and the tree is rebuilt
# with a stack of our own, so a blob nested 10^5 deep costs a few frames, not the C stack.
STATE_MAGIC = b"CLSTATE1"
STATE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
MAX_STATE_DEPTH = 64  # nested containers (dicts, lists, tuples): optimizer, scheduler and scaler states use < 10
MAX_STATE_DIMS = 64  # of one tensor
_TENSOR, _TUPLE = 1, 2  # msgpack extension codes
_SCALARS = (bool, int, float, str)


def pack_state(state: Any) -> bytes:
    """:func:`pack_state_parts`, joined."""
    return b"".join(pack_state_parts(state))


def pack_state_parts(state: Any) -> list[bytes]:
    """``state`` (dicts with str or int keys, lists, tuples, numbers, strings, bools, None and CPU or GPU
    tensors, nested at most :data:`MAX_STATE_DEPTH` containers deep) as bytes with nothing pickled:
    :data:`STATE_MAGIC`, a 4-byte length, a msgpack tree in which each tensor is a reference
    ``[dtype, shape, offset, nbytes]`` (a msgpack extension) into the tensors' raw bytes, which follow in the
    order the tree names them, each right after the one before. Anything else (what :func:`unpack_state`
    would refuse) raises ValueError naming where it sits (``state['a'][0]``). As a list of parts (the head, then
    each tensor's bytes) whose concatenation is :func:`pack_state`'s: each tensor is copied once, and a sender
    can pass the parts on as frames without joining them."""
    blobs: list[bytes] = []
    offset = 0

    def tree(obj: Any, where: str, depth: int) -> Any:
        nonlocal offset
        if obj is None:
            return obj
        for kind in _SCALARS:  # subclasses too (numpy's float64, an IntEnum), as the plain type
            if isinstance(obj, kind):
                return kind(obj)
        if isinstance(obj, torch.Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name not in STATE_DTYPES or obj.is_sparse:
                raise ValueError(f"{where} is a {obj.dtype} tensor{' (sparse)' if obj.is_sparse else ''}: the state's "
                                 f"tensors may be dense {', '.join(STATE_DTYPES)}")
            if obj.dim() > MAX_STATE_DIMS:
                raise ValueError(f"{where} is a tensor of {obj.dim()} dimensions: a state's may have at most "
                                 f"{MAX_STATE_DIMS}")
            raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            ref = msgpack.packb([name, list(obj.shape), offset, len(raw)])
            blobs.append(raw)
            offset += len(raw)
            return msgpack.ExtType(_TENSOR, ref)
        if isinstance(obj, (tuple, list, dict)) and depth >= MAX_STATE_DEPTH:
            raise ValueError(f"{where} nests containers {depth + 1} deep: a state may nest at most "
                             f"{MAX_STATE_DEPTH} (unpack_state refuses deeper ones)")
        if isinstance(obj, tuple):
            return msgpack.ExtType(_TUPLE, msgpack.packb([tree(v, f"{where}[{i}]", depth + 1)
                                                          for i, v in enumerate(obj)], strict_types=True))
        if isinstance(obj, list):
            return [tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            for k in obj:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise ValueError(f"{where} has a key {k!r}: the state's dict keys may be strings or ints")
            return {k: tree(v, f"{where}[{k!r}]", depth + 1) for k, v in obj.items()}
        raise ValueError(f"{where} is a {type(obj).__name__}: a state may hold only dicts, lists, tuples, numbers, "
                         f"strings, bools, None and tensors (nothing is pickled)")

    header = msgpack.packb(tree(state, "state", 0), strict_types=True)
    if len(header) >= 2**32:
        raise ValueError(f"state: its header takes {len(header)} bytes, more than a 4-byte length says")
    return [STATE_MAGIC + struct.pack("<I", len(header)) + header, *blobs]


def _refuse(where: str, what: str) -> ProtocolError:
    return ProtocolError(f"committed state: {where} {what} (not made by commlab.transport.wire.pack_state)", where=where)


def _unpack_level(raw: bytes, where: str) -> Any:
    """One level of a state's tree: containers as they come, extensions left as ExtType for the walk to
    open (no hook: nothing recurses), dicts as lists of pairs (so a repeated key is seen), every declared
    length bounded by ``raw``'s size. msgpack's own errors (StackError, ExtraData...) are ProtocolErrors."""
    n = len(raw)
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, object_pairs_hook=_Pairs, use_list=True,
                               max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=n)
    except Exception as exc:  # msgpack's StackError, ExtraData, FormatError, ValueError, TypeError...
        raise _refuse(where, f"is not msgpack ({type(exc).__name__}: {exc})") from None


class _Pairs(list):
    """A msgpack map as it came: its (key, value) pairs in order."""


class _Frame:
    """A container being rebuilt: its items still to read as (label, value), what they became, how to finish."""

    __slots__ = ("items", "done", "make", "where")

    def __init__(self, items, make, where: str):
        self.items, self.make, self.where = iter(items), make, where
        self.done: list = []


def _opened(obj: list | msgpack.ExtType, where: str) -> _Frame:
    """The frame that rebuilds the container ``obj`` (a list, a map's pairs or a tuple), its items labelled."""
    if isinstance(obj, msgpack.ExtType) and obj.code == _TUPLE:
        items = _unpack_level(obj.data, where)
        if not isinstance(items, list) or isinstance(items, _Pairs):
            raise _refuse(where, f"is a tuple holding a {type(items).__name__}, not a list of items")
        return _Frame(((f"[{i}]", v) for i, v in enumerate(items)), tuple, where)
    if isinstance(obj, _Pairs):
        keys = [k for k, _ in obj]
        for k in keys:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise _refuse(where, f"has a key {k!r:.40}: pack_state writes only str and int keys")
        if len(set(keys)) != len(keys):
            raise _refuse(where, "repeats a key")
        return _Frame(((f"[{k!r}]", v) for k, v in obj), lambda done: dict(zip(keys, done)), where)
    if isinstance(obj, list):
        return _Frame(((f"[{i}]", v) for i, v in enumerate(obj)), list, where)
    raise _refuse(where, f"is an unknown extension {obj.code}")


def _state_tensor(raw: bytes, body: memoryview, at: int, where: str) -> tuple[torch.Tensor, int]:
    """A tensor reference ``[dtype, shape, offset, nbytes]``, checked against what pack_state writes (its
    bytes start at ``at``, right after the previous tensor's): the tensor, and where the next one starts."""
    ref = _unpack_level(raw, where)
    if not (isinstance(ref, list) and len(ref) == 4):
        raise _refuse(where, f"is a tensor reference {ref!r:.80}, not [dtype, shape, offset, nbytes]")
    name, shape, offset, nbytes = ref
    if name not in STATE_DTYPES:
        raise _refuse(where, f"has a tensor of unknown dtype {name!r:.40}; known: {', '.join(STATE_DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_STATE_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _refuse(where, f"has a tensor shape {shape!r:.80}: not at most {MAX_STATE_DIMS} sizes >= 0")
    for what, v in (("offset", offset), ("size", nbytes)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise _refuse(where, f"has a tensor {what} {v!r:.40}, not an integer >= 0")
    if offset != at:
        raise _refuse(where, f"has a tensor at byte {offset} of the data; the tensors before it end at {at}")
    if nbytes > len(body) - offset:
        raise _refuse(where, f"has a tensor of {nbytes} bytes at {offset}, past the data's end at {len(body)}")
    itemsize = getattr(torch, name).itemsize
    numel = 0 if 0 in shape else 1
    for d in shape:  # stops as soon as it says too much: a shape [2**62, 2**62] costs nothing
        numel *= d
        if numel * itemsize > nbytes:
            break
    if numel * itemsize != nbytes:
        raise _refuse(where, f"has a {name} tensor of shape {shape} in {nbytes} bytes")
    flat = torch.frombuffer(bytearray(body[offset:offset + nbytes]), dtype=torch.uint8) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    if name == "bool" and bool((flat > 1).any()):
        raise _refuse(where, "has a bool tensor holding bytes other than 0 and 1")
    return flat.view(getattr(torch, name)).reshape(shape), offset + nbytes


def _state_header(data: bytes) -> tuple[int, int]:
    """Where a :func:`pack_state` blob's msgpack tree starts and its length, checked against ``data`` (the whole
    blob, or its first part). ProtocolError for bytes it did not make, or a tree that runs past them."""
    n = len(STATE_MAGIC) + 4
    if not (data[:len(STATE_MAGIC)] == STATE_MAGIC and len(data) >= n):
        raise ProtocolError("a committed state not made by commlab.transport.wire.pack_state (an older commlab's "
                            "torch.save bytes are not read)", where="magic")
    (size,) = struct.unpack("<I", data[len(STATE_MAGIC):n])
    if n + size > len(data):
        raise _refuse("header", f"of {size} bytes runs past the blob's {len(data) - n}")
    return n, size


def state_top(head: bytes | memoryview) -> dict:
    """The top-level scalar entries of a :func:`pack_state` blob whose tree is a dict (``{"seq": 3, "log": 4.0,
    ...}``; a container's entry as its length), read from the blob's first bytes without touching its tensors:
    ``head`` must hold the magic, the length and the whole msgpack tree (the first part
    :func:`pack_state_parts` makes). Raises ProtocolError as :func:`unpack_state` does."""
    head = bytes(head)
    n, size = _state_header(head)
    tree = _unpack_level(head[n:n + size], "state")
    if not isinstance(tree, _Pairs):
        raise _refuse("state", "is not a dict")
    return {k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in tree
            if isinstance(k, str) and (v is None or type(v) in _SCALARS or isinstance(v, (list, dict)))}


def unpack_state(data: bytes) -> Any:
    """The state :func:`pack_state` made (tensors on the CPU, tuples as tuples). Raises ProtocolError (its
    ``where``: the place in the state or the part of the blob) for bytes it could not have made: an older
    commlab's ``torch.save`` blob, nesting deeper than :data:`MAX_STATE_DEPTH`, a tensor whose dtype, shape,
    offset or size lies, bytes left over. Reads untrusted bytes safely: bounded memory, no recursion."""
    data = bytes(data)
    n, size = _state_header(data)
    body = memoryview(data)[n + size:]
    at = 0  # where the next tensor's bytes start
    # depth first, in order, as pack_state wrote it (so tensors come in the order of their bytes); the stack
    # holds one frame per open container below a root frame that holds the whole tree
    stack = [_Frame([("", _unpack_level(data[n:n + size], "state"))], lambda done: done[0], "state")]
    while True:
        frame = stack[-1]
        item = next(frame.items, None)
        if item is None:
            stack.pop()
            value = frame.make(frame.done)
            if not stack:
                break
            stack[-1].done.append(value)
            continue
        label, obj = item
        where = frame.where + label
        if obj is None or type(obj) in _SCALARS:
            frame.done.append(obj)
        elif isinstance(obj, msgpack.ExtType) and obj.code == _TENSOR:
            tensor, at = _state_tensor(obj.data, body, at, where)
            frame.done.append(tensor)
        elif isinstance(obj, (list, msgpack.ExtType)):
            if len(stack) > MAX_STATE_DEPTH:
                raise _refuse(where, f"nests containers {len(stack)} deep: at most {MAX_STATE_DEPTH}")
            stack.append(_opened(obj, where))
        else:
            raise _refuse(where, f"holds a {type(obj).__name__}, which pack_state never writes")
    if at != len(body):
        raise _refuse("data", f"has {len(body) - at} bytes after its last tensor")
    return value
