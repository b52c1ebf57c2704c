"""Block quantizers: ``int8``, ``int4``, ``fp4`` (e2m1) and ``fp8`` (e4m3), each with one scale per block.

What DiLoCo-family systems send their outer gradients in (INTELLECT-1: int8; Streaming DiLoCo: 4-bit floats;
torchft: fp8 where it has CUDA). A bucket of ``n`` elements is cut into ``ceil(n/B)`` blocks of ``B``
consecutive elements (the last one shorter); each block ``b`` gets the scale ``s_b = max|x_b| / Q`` (in the
bucket's dtype; 0 for an all-zero block) and each element the code of ``x / s_b`` on the format's grid:

=========  =====================================  ==========  ===========================  =================
spec       grid of ``x / s`` (Q: its largest)     rounding    bound on ``|x - q(x)|``      bytes (B default)
=========  =====================================  ==========  ===========================  =================
int8       integers -127 .. 127 (Q = 127)         nearest,    s/2                          n + 4 ceil(n/B)
                                                  ties even                                (B = 256)
int4       integers -7 .. 7 (Q = 7), two a byte   as int8     s/2                          ceil(n/2) + 4 ceil(n/B)
                                                                                           (B = 64)
fp4        e2m1: 0, .5, 1, 1.5, 2, 3, 4, 6        nearest,    s/4 below 2s, else |x|/4     ceil(n/2) + 4 ceil(n/B)
           with a sign (Q = 6), two a byte        ties down   (half the grid's gap there)  (B = 64)
fp8        e4m3 (torch.float8_e4m3fn, Q = 448)    torch's,    max(|x| 2^-4, s 2^-10)       n + 4 ceil(n/B)
                                                  nearest     (3 mantissa bits; subnormals  (B = 256)
                                                  even        below 2^-6 s)
=========  =====================================  ==========  ===========================  =================

(``4`` is the scale's itemsize for float32 gradients: ``itemsize`` in general.) ``block=B`` sets the block
(``int8,block=64``). Since ``|x| <= Q s`` in its block, each bound is also at most ``Q s / 2^k``-sized: int8's
``s/2`` is ``max|x_b| / 254``.

**Not summable.** Every rank's scales are its own, so codes of different ranks mean different values and
cannot be added on the way: the payload (codes as bytes, then the scales) is gathered and each rank's is
decoded alone and added in rank order (:attr:`decodes_alone`, as top-k and sign are), so every rank gets the
same bits and a parameter server may decode each push as it arrives. A summable int8 would need one shared
scale per block (a round of max over ranks first) and a sum in a wider integer; the gather is cheaper at
two ranks and no less exact. Error feedback (the default) keeps what rounding lost: a rank's share is its
own decoding.

Codes travel as uint8 (fp8's are ``float8_e4m3fn`` bits viewed as bytes, int4's two's-complement nibbles,
fp4's sign-magnitude e2m1 nibbles; the element at an even index in the low nibble).
"""

from __future__ import annotations

import math

import torch

from commlab.compress.base import no_arg, no_more, register, take
from commlab.compress.codecs import OwnDecoding, fits, numel


def blocks(n: int, block: int) -> int:
    return math.ceil(n / block)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values below 16, two to a byte (element 2i low, 2i + 1 high; an odd tail padded with 0)."""
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], 1).reshape(-1)[:n]


class BlockQuantizer(OwnDecoding):
    """One scale per block of ``block`` elements, codes of ``x / scale`` on a grid whose largest value is
    :attr:`top`. Subclasses say how a block-scaled value becomes codes (:meth:`encode`, uint8, one per element
    or packed) and back (:meth:`decode`, float32 values of ``x / scale``) and how many code bytes ``n``
    elements take (:meth:`code_nbytes`)."""

    summable = False
    top: float

    def __init__(self, name: str, block: int):
        super().__init__()
        self.name, self.block = name, block

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, n: int) -> torch.Tensor:
        raise NotImplementedError

    def code_nbytes(self, n: int) -> int:
        raise NotImplementedError

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        head, tail = self._blocked(x)
        parts = [head.abs().amax(1)] if head.numel() else []
        if tail.numel():
            parts.append(tail.abs().amax().reshape(1))
        scale = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else x.new_zeros(0)
        return scale / self.top

    def _blocked(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (flat) as its whole blocks, a (blocks, B) view, and the shorter last block (maybe empty)."""
        whole = x.numel() // self.block * self.block
        return x[:whole].view(-1, self.block), x[whole:]

    def _per_block(self, x: torch.Tensor, scale: torch.Tensor, op: str) -> torch.Tensor:
        """``x`` divided (``op="div"``, into a new tensor) or multiplied in place (``"mul"``) by its block's
        scale: broadcast over the (blocks, B) view, with no per-element copy of the scales."""
        out = torch.empty_like(x) if op == "div" else x
        head, tail = self._blocked(x)
        ohead, otail = self._blocked(out)
        k = head.shape[0]
        f = torch.div if op == "div" else torch.mul
        if k:
            f(head, scale[:k, None], out=ohead)
        if tail.numel():
            f(tail, scale[k:], out=otail)
        return out

    def start(self, key, x, shapes):
        n = x.numel()
        scale = self.scales(x) if n else x.new_zeros(0)
        # an all-zero block (scale 0) codes zeros; clamp: x / (max|x| / top) may round a hair past top
        v = self._per_block(x, scale.masked_fill(scale == 0, 1), "div")
        dead = ~(scale > 0)  # zero, or a scale that underflowed or is NaN: the block codes zeros
        if bool(dead.any()):
            v[dead.repeat_interleave(self.block)[:n]] = 0
        codes = self.encode(v.float().clamp_(-self.top, self.top))
        self._own[key] = (codes, scale, n)
        return [codes, scale]

    def finish(self, key, combined, out):
        out.zero_()
        for payload in combined:  # rank order: the same sum on every rank
            self.decode_add(key, payload, out.numel(), {}, out)

    def decode_add(self, key, payload, n, meta, out):
        fits(payload, [self.code_nbytes(n), blocks(n, self.block)], self.name)
        codes, scale = payload
        out.add_(self._decode_own(key, codes, scale.to(out.dtype), n))

    def _decode_own(self, key, codes, scale, n):
        if codes.dtype != torch.uint8:
            raise ValueError(f"{self.name}: codes of dtype {codes.dtype}, expected torch.uint8")
        return self._per_block(self.decode(codes, n).to(scale.dtype), scale, "mul")

    def payload_nbytes(self, shapes, itemsize=4):
        n = numel(shapes)
        return (self.code_nbytes(n) + itemsize * blocks(n, self.block),)

    def describe(self) -> str:
        return f"{self.name} (blocks of {self.block})"


class Int8(BlockQuantizer):
    top = 127.0

    def encode(self, v):
        return v.round_().to(torch.int8).view(torch.uint8)  # v: the caller's scratch

    def decode(self, codes, n):
        return codes.view(torch.int8).float()

    def code_nbytes(self, n):
        return n


class Int4(BlockQuantizer):
    top = 7.0

    def encode(self, v):
        return pack_nibbles(v.round_().to(torch.int8).view(torch.uint8) & 15)

    def decode(self, codes, n):
        nib = unpack_nibbles(codes, n).to(torch.int16)
        return ((nib ^ 8) - 8).float()  # two's complement of a nibble

    def code_nbytes(self, n):
        return math.ceil(n / 2)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the e2m1 magnitudes, in the order of their bits
E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2


class Fp4(BlockQuantizer):
    """e2m1: 1 sign bit, 2 exponent bits, 1 mantissa bit, no infinities or NaN (the OCP MX element format)."""

    top = 6.0

    def encode(self, v):
        # bucketize (right=False): the index of the first midpoint >= |v|, so a tie rounds to the smaller magnitude
        mag = torch.bucketize(v.abs(), E2M1_MIDPOINTS.to(v.device)).to(torch.uint8)
        return pack_nibbles(mag | ((v < 0).to(torch.uint8) << 3))

    def decode(self, codes, n):
        nib = unpack_nibbles(codes, n).long()
        mag = E2M1.to(codes.device)[nib & 7]
        return torch.where(nib >= 8, -mag, mag)

    def code_nbytes(self, n):
        return math.ceil(n / 2)


class Fp8(BlockQuantizer):
    """e4m3 with torch's ``float8_e4m3fn`` cast (round to nearest even; 448 the largest finite value)."""

    top = 448.0

    def encode(self, v):
        return v.to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, codes, n):
        return codes.view(torch.float8_e4m3fn).float()

    def code_nbytes(self, n):
        return n


def _factory(cls, name: str, block: int):
    def make(arg, settings):
        no_arg(arg)
        b = take(settings, "block", int, block, lambda v: v >= 1, "must be >= 1")
        no_more(settings)
        return cls(name, b)

    return make


register("int8", "int8")(_factory(Int8, "int8", 256))
register("int4", "int4")(_factory(Int4, "int4", 64))
register("fp4", "fp4")(_factory(Fp4, "fp4", 64))
register("fp8", "fp8")(_factory(Fp8, "fp8", 256))
