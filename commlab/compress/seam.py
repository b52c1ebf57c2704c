"""Between a bucket and a transport: one bucket's compressed exchange, round by round.

A regime supplies a :class:`Mover` (sum a tensor over ranks, gather one tensor from every rank, and say
which dtypes its sums add without rounding below float32), keeps one :class:`CompressState` (the
compressor and the step's exchanges, passed explicitly, as torch's PowerSGD hook state is) and calls
:func:`start_compressed` with it from its ``_start_bucket``; a DDP comm hook calls
:meth:`CompressState.start` with DDP's buckets. How each round travels follows from the compressor's
declaration and the mover's abilities, never from the compressor's name:

* summable, and every payload dtype one the mover sums exactly (float32, float64) or per hop (a ring's
  float16/bfloat16: :meth:`Mover.sums_per_hop`): the round's tensors of each dtype are concatenated into
  one flat tensor and summed (one all-reduce per dtype, in order of first appearance: the same on every
  rank; one in all when the payload and the presence flags share a dtype);
* summable but narrower on the wire than the mover can add (fp16/bf16 over gloo, whose all-reduce adds
  in the tensor's own dtype, rounding every partial sum): the payloads are gathered and added here, in
  float32 (or the bucket's wider dtype), in rank order, so every rank gets the same bits;
* gather-only (top-k, sign): every rank's payload is gathered and handed to the compressor as a list.

A gathered payload travels as one byte tensor (the payload's tensors' bytes back to back: no pickle);
every rank's has the same layout, since payload shapes depend only on the bucket and the step. The
bucket's presence flags ride in round 0 uncompressed and are summed exactly. An empty round (PowerSGD's
round 1 during its uncompressed warm-up, the same on every rank) moves nothing.

Round 0 starts in the backward hook. Later rounds start when the end of backward waits for the buckets,
in index order: waiting for bucket i first brings every bucket from i on to its last round (waiting each
one's earlier rounds), so PowerSGD's Q all-reduces of all buckets are in flight together, issued in the
same order on every rank, whatever the timing. Every wait is under the one deadline.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from commlab.compress.base import Compressor
from commlab.base.handles import DoneHandle, GroupHandle, Handle


class Mover(Protocol):
    world_size: int

    def allreduce_async(self, tensor: torch.Tensor, what: str = ...) -> Handle:
        """Sum ``tensor`` in place over every rank."""

    def allgather_async(self, tensor: torch.Tensor, what: str = ...) -> Handle:
        """Every rank's ``tensor`` (same size everywhere); the handle's result is the list, in rank order."""

    def sums_exactly(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`allreduce_async` sends ``dtype`` at its own width and adds it without rounding partial
        sums below float32."""

    def sums_per_hop(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`allreduce_per_hop_async` can sum ``dtype`` (asked only of a dtype not summed exactly;
        ``Collective`` regimes say False unless they override it)."""

    def allreduce_per_hop_async(self, tensor: torch.Tensor, what: str = ...) -> Handle:
        """Sum ``tensor`` in place over every rank, sent at its own width, added in float32 at every hop, each
        partial sum rounded once to ``tensor``'s dtype before it travels on (a ring): every rank gets the same
        bits, not those of a sum in rank order."""


def nbytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def pack(payload) -> torch.Tensor:
    """The payload's tensors' bytes back to back, as one uint8 tensor."""
    if not payload:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in payload])


def unpack(data: torch.Tensor, like) -> list[torch.Tensor]:
    """Inverse of :func:`pack`, given tensors of the same dtypes and shapes (this rank's own payload)."""
    out, offset = [], 0
    for t in like:
        size = t.numel() * t.element_size()
        out.append(data[offset:offset + size].clone().view(t.dtype).view(t.shape))
        offset += size
    return out


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def summed(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Elementwise sums over ranks, in rank order, in at least float32."""
    sums = [t.to(accumulation_dtype(t.dtype)).clone() for t in per_rank[0]]
    for payload in per_rank[1:]:
        for s, t in zip(sums, payload):
            s.add_(t)
    return sums


def how(comp: Compressor, payload, mover: Mover) -> str:
    """``'sum'`` or ``'gather'``: how one round of ``comp`` travels over ``mover``."""
    dtypes = {t.dtype for t in payload}
    if comp.summable and all(mover.sums_exactly(d) or mover.sums_per_hop(d) for d in dtypes):
        return "sum"
    return "gather"


def by_dtype(tensors) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


class CompressedExchange(Handle):
    """One bucket's exchange through a compressor; ``wait`` runs the rounds after the first and decodes
    into ``out``. The presence flags (``flags``, or None) are summed exactly alongside round 0."""

    def __init__(self, comp: Compressor, key: int, x: torch.Tensor, shapes, flags: torch.Tensor | None,
                 mover: Mover, what: str, train: list | None = None, trace=None):
        self.comp, self.key, self.out, self.flags, self.mover, self.what = comp, key, x, flags, mover, what
        self.trace = trace  # the timeline's recorder ($COMMLAB_TRACE), else None
        self.train = train if train is not None else [self]  # this step's exchanges, in bucket order
        self.round = 0
        self._handle: Handle
        self._flat: torch.Tensor | None  # gathered: this rank's packed payload; None: nothing moved
        self._sums: list[tuple[list[int], torch.Tensor]] = []  # summed: (indices into the round's tensors, flat)
        t0 = trace.now() if trace is not None else 0
        payload = comp.start(key, x, shapes)
        if trace is not None:
            trace.span("encode", "bucket", t0, args={"bucket": key, "compressor": comp.name})
        extra = [flags] if flags is not None and flags.numel() else []
        self._send(payload, extra)

    def _send(self, payload: list[torch.Tensor], extra: list[torch.Tensor]) -> None:
        what = f"{self.what}, {self.comp.name} round {self.round}"
        self._extra = len(extra)
        tensors = list(payload) + extra
        self._like = tensors
        self._how = how(self.comp, tensors, self.mover)
        self._sums = []
        if not tensors or sum(t.numel() for t in tensors) == 0:
            self._handle, self._flat = DoneHandle(what=what), None
        elif self._how == "sum":
            self._flat, handles = None, []
            for group in by_dtype(tensors):
                flat = torch.cat([tensors[i].detach().reshape(-1) for i in group])
                exact = self.mover.sums_exactly(flat.dtype)
                handles.append(self.mover.allreduce_async(flat, what) if exact else
                               self.mover.allreduce_per_hop_async(flat, what))
                self._sums.append((group, flat))
            self._handle = handles[0] if len(handles) == 1 else GroupHandle(handles, what)
        else:
            self._flat = pack(tensors)
            self._handle = self.mover.allgather_async(self._flat, what)

    def _received(self, result) -> tuple[Any, list[torch.Tensor]]:
        """(what the compressor gets, the summed extra tensors) from the finished round."""
        like, k = self._like, self._extra
        if self._how == "sum" and self._sums:
            parts: list = [None] * len(like)
            for group, flat in self._sums:
                flat = flat.to(accumulation_dtype(flat.dtype))  # a per-hop sum arrives narrow: at least float32
                offset = 0
                for i in group:
                    parts[i] = flat[offset:offset + like[i].numel()].view(like[i].shape)
                    offset += like[i].numel()
            return parts[:len(like) - k], parts[len(like) - k:]
        if self._flat is None:
            combined: list = [[] for _ in range(self.mover.world_size)] if not self.comp.summable else []
            return combined, []
        per_rank = [unpack(data, like) for data in result]
        extra = summed([p[len(like) - k:] for p in per_rank]) if k else []
        payloads = [p[:len(like) - k] for p in per_rank]
        return (summed(payloads) if self.comp.summable else payloads), extra

    def done(self) -> bool:
        return self._outcome is not None

    def _take(self, deadline: float):
        """Wait for the round in flight; the presence flags come with round 0. Returns the combined payload."""
        combined, extra = self._received(self._handle.wait(max(1e-3, deadline - time.monotonic())))
        if extra and self.flags is not None:
            self.flags.copy_(extra[0])
        return combined

    def _to_last_round(self, deadline: float) -> None:
        while self.round + 1 < self.comp.rounds:
            combined = self._take(deadline)
            self.round += 1
            self._send(self.comp.advance(self.key, self.round, combined), [])

    def _wait(self, timeout: float):
        deadline = time.monotonic() + timeout
        later = self.train[next(i for i, h in enumerate(self.train) if h is self):]
        for h in later:  # this bucket and every later one, in bucket order: the same issue order on every rank
            h._to_last_round(deadline)
        combined = self._take(deadline)
        t0 = self.trace.now() if self.trace is not None else 0
        self.comp.finish(self.key, combined, self.out)
        if self.trace is not None:
            self.trace.span("decode", "bucket", t0, args={"bucket": self.key, "compressor": self.comp.name})
        return None


class CompressState:
    """One exchanger's (or DDP hook's) compression state, handed to every bucket's start: the compressor (which
    keeps its own state per bucket key: PowerSGD's warm-start Q, error feedback's residuals) and this step's
    exchanges in bucket order, so that waiting for one bucket brings every later one to its last round in the
    same order on every rank (see the module's text). Not thread-safe: one training thread starts buckets."""

    def __init__(self, comp: Compressor):
        self.comp = comp
        self.train: list[CompressedExchange] = []  # this step's exchanges, in the order they started
        self.trace: Any = None  # the timeline's recorder, when the exchanger traces (encode and decode spans)

    def start(self, key: int, x: torch.Tensor, shapes, flags: torch.Tensor | None, mover: Mover, what: str,
              first: bool) -> CompressedExchange:
        """Begin one bucket's exchange of ``x`` (decoded back into it by ``wait``) under compressor key ``key``;
        ``first``: the step's first bucket, which starts the step's train. Does not block."""
        if first:
            self.train = []
        handle = CompressedExchange(self.comp, key, x, shapes, flags, mover, what, self.train, self.trace)
        self.train.append(handle)
        return handle


def start_compressed(state: CompressState, bucket, mover: Mover, what: str, carry_presence: bool) -> Handle:
    """Begin ``bucket``'s compressed exchange (its gradients and presence flags are filled in). Buckets start in
    index order every step (bucket 0 first), as the shared mechanics start them."""
    shapes = tuple(p.shape for p in bucket.params)
    return state.start(bucket.index, bucket.grads, shapes, bucket.flags if carry_presence else None, mover, what,
                       first=bucket.index == 0)
