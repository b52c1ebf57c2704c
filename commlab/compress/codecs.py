"""The one-round compressors: fp16/bf16 casts, top-k, random-k and scaled sign.

Payload sizes for a bucket of ``n`` float32 gradients (what :mod:`commlab.compress.seam` moves, without
the bucket's presence flags), with ``k = ceil(F * n)`` (at least 1), F read exactly as written:

============  =========================  ==========================================
spec          payload                    bytes
============  =========================  ==========================================
fp16, bf16    the cast values            2n
topk:F        k values, k int32 indices  8k (int64 indices, 12k, past 2**31 elements)
randomk:F     k values                   4k (indices: drawn from a seed every rank shares)
sign          ceil(n/8) bit bytes, scale ceil(n/8) + 4
============  =========================  ==========================================
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from commlab.compress.base import Compressor, no_arg, no_more, register, take
from commlab.base.errors import ConfigError


def fraction(arg: str | None) -> Fraction:
    """F of ``topk:F`` / ``randomk:F``, exactly as written, in (0, 1]."""
    if arg is None:
        raise ConfigError("needs a fraction F in (0, 1], e.g. topk:0.01")
    try:
        f = Fraction(arg)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"F={arg!r} is not a number") from None
    if not 0 < f <= 1:
        raise ConfigError(f"F={arg} is outside (0, 1]")
    return f


def kept(f: Fraction, n: int) -> int:
    """How many of ``n`` elements a fraction ``f`` keeps: ceil(f * n), at least 1 (0 of 0)."""
    return min(n, max(1, math.ceil(f * n))) if n else 0


def index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


class OwnDecoding(Compressor):
    """A compressor whose aggregate is the sum of every rank's own decoding: its share is its decoding."""

    decodes_alone = True

    def __init__(self):
        super().__init__()
        self._own: dict[int, tuple] = {}  # key -> what share() needs to decode this rank's payload

    def share(self, key):
        return self._decode_own(key, *self._own[key])

    def _decode_own(self, key, *own) -> torch.Tensor:
        raise NotImplementedError

    def aggregate(self, key, shapes, sums, meta, out):
        out.zero_()
        self.decode_add(key, sums[0], out.numel(), meta, out)


def fits(payload, sizes: list[int], what: str) -> None:
    """A payload from the wire has ``len(sizes)`` tensors of these element counts, or ValueError."""
    got = [t.numel() for t in payload]
    if got != sizes:
        raise ValueError(f"{what}: payload of {got} elements, expected {sizes}")


class Cast(OwnDecoding):
    """fp16 / bf16 on the wire; the regime adds them in float32 (or wider: the bucket's dtype)."""

    summable = True

    def __init__(self, name: str, dtype: torch.dtype):
        super().__init__()
        self.name, self.dtype = name, dtype

    def start(self, key, x, shapes):
        wire = x.to(self.dtype)
        self._own[key] = (wire, x.dtype)
        return [wire]

    def finish(self, key, combined, out):
        self.aggregate(key, (), [combined], {}, out)

    def aggregate(self, key, shapes, sums, meta, out):
        out.copy_(sums[0][0])

    def decode_add(self, key, payload, n, meta, out):
        fits(payload, [n], self.name)
        out.add_(payload[0])

    def payload_nbytes(self, shapes, itemsize=4):
        return (numel(shapes) * self.dtype.itemsize,)

    def _decode_own(self, key, wire, dtype):
        return wire.to(dtype)


@register("fp16", "fp16")
def _fp16(arg, settings):
    no_arg(arg)
    no_more(settings)
    return Cast("fp16", torch.float16)


@register("bf16", "bf16")
def _bf16(arg, settings):
    no_arg(arg)
    no_more(settings)
    return Cast("bf16", torch.bfloat16)


def top_magnitudes(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest magnitudes of ``x`` (flat), in no particular order: the set ``torch.topk``
    keeps, up to which of equal magnitudes at the k-th place. On a big bucket a threshold from a strided
    sample first cuts the candidates to about twice k, and ``torch.topk`` runs on those: selecting from all
    of them is what top-k costs otherwise (55 ms for 1% of 1.9M float32 here, against ~10). Exact: the
    candidates are every element at or above the threshold, so when there are at least k of them they hold
    the k largest; when there are fewer (a threshold drawn too high), the whole is searched."""
    a = x.abs()
    n = a.numel()
    if n < 1 << 17 or 16 * k > n:
        return torch.topk(a, k, sorted=False).indices
    sample = a[:: n // 65536]
    j = min(sample.numel(), 2 * k * sample.numel() // n + 1)
    threshold = torch.topk(sample, j, sorted=False).values.min()
    candidates = torch.nonzero(a >= threshold).squeeze(1) if torch.isfinite(threshold) else a[:0].long()
    if candidates.numel() < k:
        return torch.topk(a, k, sorted=False).indices
    return candidates[torch.topk(a[candidates], k, sorted=False).indices]


class TopK(OwnDecoding):
    """The k largest magnitudes of the bucket, with their indices (gather-only: indices differ by rank)."""

    summable = False

    def __init__(self, f: Fraction):
        super().__init__()
        self.f, self.name = f, f"topk:{float(f):g}"

    def start(self, key, x, shapes):
        k = kept(self.f, x.numel())
        idx = top_magnitudes(x, k)
        values = x[idx]
        self._own[key] = (values, idx, x.numel())
        return [values, idx.to(index_dtype(x.numel()))]

    def finish(self, key, combined, out):
        out.zero_()
        for payload in combined:  # rank order: the same sum on every rank
            self.decode_add(key, payload, out.numel(), {}, out)

    def decode_add(self, key, payload, n, meta, out):
        k = kept(self.f, n)
        fits(payload, [k, k], self.name)
        values, idx = payload
        idx = idx.long()
        if k and not (0 <= int(idx.min()) and int(idx.max()) < n):
            raise ValueError(f"{self.name}: an index outside [0, {n})")
        out.index_add_(0, idx, values.to(out.dtype))

    def payload_nbytes(self, shapes, itemsize=4):
        n = numel(shapes)
        return (kept(self.f, n) * (itemsize + index_dtype(n).itemsize),)

    def _decode_own(self, key, values, idx, n):
        return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, idx, values)


@register("topk", "topk:F")
def _topk(arg, settings):
    no_more(settings)
    return TopK(fraction(arg))


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64's finaliser): the same on every rank, different per input."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def distinct(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``k`` distinct indices below ``n``, every k-subset equally likely, drawn from ``g`` alone (the same on
    every rank that seeds it alike). For k well below n: draw with replacement, keep the distinct ones (a
    uniform subset of their number, by symmetry), draw more while fewer than k, then a uniform k of them;
    a permutation of all n (what it costs otherwise: about 1 s for 25M) only when k is a large part of n."""
    if 4 * k > n:
        return torch.randperm(n, generator=g)[:k]
    have = torch.empty(0, dtype=torch.long)
    while have.numel() < k:
        more = torch.randint(n, (k + k // 8 + 16,), generator=g)
        have = torch.unique(torch.cat([have, more]))
    return have[torch.randperm(have.numel(), generator=g)[:k]]


class RandomK(OwnDecoding):
    """k random indices, drawn alike on every rank from (seed, bucket, step): the k values are summed densely.

    Values are sent as they are (not scaled by 1/F): with error feedback nothing is lost, only delayed."""

    summable = True

    def __init__(self, f: Fraction, seed: int):
        super().__init__()
        self.f, self.seed, self.name = f, seed, f"randomk:{float(f):g}"
        self.steps: dict[int, int] = {}

    def indices(self, key: int, n: int, device, draw: int | None = None) -> torch.Tensor:
        """Draw ``draw``'s indices for bucket ``key`` (default: this step's; the same on every rank); advances
        nothing."""
        draw = self.steps.get(key, 0) if draw is None else draw
        g = torch.Generator().manual_seed(mix(self.seed, key, draw))
        return distinct(n, kept(self.f, n), g).to(device)

    def wire_meta(self, key):
        return {"draw": self.steps[key] - 1}

    def _draw(self, key, n, meta, out) -> torch.Tensor:
        draw = meta.get("draw")
        if not isinstance(draw, int) or isinstance(draw, bool) or draw < 0:
            raise ValueError(f"{self.name}: 'draw' must be an integer >= 0, got {draw!r}")
        return self.indices(key, n, out.device, draw)

    def aggregate(self, key, shapes, sums, meta, out):
        idx = self._draw(key, out.numel(), meta, out)
        fits(sums[0], [idx.numel()], self.name)
        out.zero_()
        out[idx] = sums[0][0].to(out.dtype)

    def decode_add(self, key, payload, n, meta, out):
        idx = self._draw(key, n, meta, out)
        fits(payload, [idx.numel()], self.name)
        out.index_add_(0, idx, payload[0].to(out.dtype))

    def start(self, key, x, shapes):
        idx = self.indices(key, x.numel(), x.device)
        self.steps[key] = self.steps.get(key, 0) + 1
        values = x[idx]
        self._own[key] = (values, idx, x.numel())
        return [values]

    def finish(self, key, combined, out):
        _, idx, _ = self._own[key]
        out.zero_()
        out[idx] = combined[0].to(out.dtype)

    def payload_nbytes(self, shapes, itemsize=4):
        return (kept(self.f, numel(shapes)) * itemsize,)

    def _decode_own(self, key, values, idx, n):
        out = torch.zeros(n, dtype=values.dtype, device=values.device)
        out[idx] = values
        return out

    def state_dict(self):
        return {"seed": self.seed, "steps": dict(self.steps)}

    def load_state_dict(self, state):
        self.seed = int(state.get("seed", self.seed))
        self.steps = {int(k): int(v) for k, v in state.get("steps", {}).items()}


@register("randomk", "randomk:F")
def _randomk(arg, settings):
    f = fraction(arg)
    seed = take(settings, "seed", int, 0)
    no_more(settings)
    return RandomK(f, seed)


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, 8 to a byte, most significant bit first (zero-padded)."""
    n = bits.numel()
    padded = torch.zeros(8 * math.ceil(n / 8), dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return (packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)).ne(0).reshape(-1)[:n]


class Sign(OwnDecoding):
    """One bit per element (x >= 0) and one scale, mean |x|: decodes to scale * (+1 or -1). Gather-only."""

    summable = False
    name = "sign"

    def start(self, key, x, shapes):
        scale = x.abs().mean().reshape(1) if x.numel() else x.new_zeros(1)
        bits = pack_bits(x >= 0)
        self._own[key] = (bits, scale, x.numel())
        return [bits, scale]

    def finish(self, key, combined, out):
        out.zero_()
        for payload in combined:
            self.decode_add(key, payload, out.numel(), {}, out)

    def decode_add(self, key, payload, n, meta, out):
        fits(payload, [math.ceil(n / 8), 1], self.name)
        bits, scale = payload
        out.add_(self._decode_own(key, bits, scale.to(out.dtype), n))

    def payload_nbytes(self, shapes, itemsize=4):
        return (math.ceil(numel(shapes) / 8) + itemsize,)

    def _decode_own(self, key, bits, scale, n):
        return unpack_bits(bits, n).to(scale.dtype).mul_(2).sub_(1).mul_(scale)


@register("sign", "sign")
def _sign(arg, settings):
    no_arg(arg)
    no_more(settings)
    return Sign()
