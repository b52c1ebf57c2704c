"""The compressor contract, error feedback as a wrapper, and the registry that turns a spec into one.

A compressor turns one bucket's flat gradient into the payload of each communication round and the
combined payloads back into the aggregate. It declares what its payloads allow, and a regime picks the
way to move them from that declaration alone, never from the compressor's name:

``summable``
    Payloads of different ranks may be added elementwise on their way (fp16/bf16 casts, PowerSGD's P
    and Q, random-k values at indices every rank drew from the same seed). The regime sums them (an
    all-reduce, a ring, a server's sum); the compressor then sees one summed payload, in at least
    float32. A regime whose transport cannot add a narrow wire dtype in float32 may instead gather
    the payloads and add them itself: the compressor cannot tell the difference.
``not summable`` (gather-only)
    Each rank's payload must arrive as it was sent (top-k values with their indices, sign bits with a
    scale): the regime gathers them, and the compressor decodes and adds them in rank order.
``rounds``
    How many communication rounds a step takes; round ``r + 1``'s payload is computed from round
    ``r``'s combined result (PowerSGD: 2, P then Q).
``sync_only``
    Needs every rank's payload at every step (PowerSGD's shared P and warm-started Q): a regime that
    lets ranks run ahead of each other must refuse it.
``decodes_alone``
    Each rank's payload decodes on its own (:meth:`Compressor.decode_add`) and the aggregate is the sum of
    those decodings (casts, top-k, random-k, sign): a parameter server may add each push into a dense
    float32 sum as it arrives, or apply it alone (async), and a rank's share is its own decoding.

A decoder that holds only payloads (a parameter server) uses :meth:`Compressor.wire_meta` (what a step's
payloads need besides themselves, plain data that travels in a header), :meth:`Compressor.decode_add` and
:meth:`Compressor.aggregate`, the same code as :meth:`Compressor.finish`.

One step of one bucket ``key`` (a bucket index; buckets are the same on every rank), in this order::

    payload = c.start(key, x, shapes)          # round 0; x is this rank's flat gradient (left untouched
    for r in 1 .. c.rounds - 1:                #   until finish), shapes those of its parameters
        payload = c.advance(key, r, combined)  # combined: round r - 1's summed payload, or the list of
    c.finish(key, combined, out)               #   every rank's payloads (gather-only); out: the aggregate
    c.share(key)                               # this rank's part of that aggregate (for error feedback)

Payload tensors belong to the regime once returned (it may add into them in place or copy them).
Gradients enter their bucket scaled by ``1/N``, so the aggregate is the average. Every piece of state
(residuals, PowerSGD's Q, step counters, seeds) is in :meth:`Compressor.state_dict`.

Specs (``compress=`` in an exchanger URL): ``fp16``, ``bf16``, ``powersgd:R``, ``topk:F``,
``randomk:F``, ``sign``, ``int8``, ``int4``, ``fp4``, ``fp8`` (:mod:`commlab.compress.quant`), each optionally followed by ``,key=value`` settings (``powersgd:4,start_iter=10``);
error feedback (``ef=1``, the default) wraps whichever was named (:class:`ErrorFeedback`).
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from commlab.base.errors import ConfigError

Payload = list  # of tensors


class Compressor(abc.ABC):
    """One compressor, with its own state, for every bucket of one exchanger (keyed by bucket index)."""

    name: str
    summable: bool
    rounds: int = 1
    sync_only: bool = False
    decodes_alone: bool = False
    keeps_residuals: bool = False  # what a rank did not get across waits for its next step (:class:`ErrorFeedback`)

    def __init__(self) -> None:
        self.world_size = 1

    def bind(self, world_size: int) -> None:
        """The number of ranks whose payloads are combined (a rank's share of a summed aggregate is 1/N)."""
        self.world_size = world_size

    @abc.abstractmethod
    def start(self, key: int, x: torch.Tensor, shapes: tuple[torch.Size, ...]) -> Payload:
        """Round 0's payload for ``x`` (1-D, its parameters' shapes in order); ``x`` stays untouched until
        :meth:`finish` returns."""

    def advance(self, key: int, rnd: int, combined) -> Payload:
        """Round ``rnd``'s payload (1 <= rnd < rounds) from round ``rnd - 1``'s combined payload."""
        raise NotImplementedError(f"{self.name} has one round")

    @abc.abstractmethod
    def finish(self, key: int, combined, out: torch.Tensor) -> None:
        """Write the aggregate (sum over ranks of what they sent) into ``out`` (``x``'s shape; may be ``x``)."""

    @abc.abstractmethod
    def share(self, key: int) -> torch.Tensor:
        """This rank's part of the aggregate :meth:`finish` last wrote for ``key``: what it effectively sent."""

    def subtract_share(self, key: int, residual: torch.Tensor) -> None:
        """``residual -= share(key)``, in place; a compressor may do it without making the share (a bucket-sized
        temporary), rounding as it does."""
        residual.sub_(self.share(key))

    @abc.abstractmethod
    def payload_nbytes(self, shapes: tuple[torch.Size, ...], itemsize: int = 4) -> tuple[int, ...]:
        """Bytes of each round's payload for a bucket of parameters of ``shapes`` (gradients of ``itemsize``
        bytes each), once past :attr:`warmup_steps`: the closed form of what :meth:`start` and
        :meth:`advance` return (the planner's byte counts; tests check it against the payloads)."""

    @property
    def warmup_steps(self) -> int:
        """Steps each bucket first travels uncompressed (PowerSGD's ``start_iter``; 0 for the others)."""
        return 0

    def take_residual(self, key: int) -> torch.Tensor | None:
        """Where :attr:`keeps_residuals`: remove and return ``key``'s residual (flat, what its bucket has not got
        across yet), None if it has none; for a caller that regroups buckets (DDP rebuilds its own). Not while
        ``key`` is in flight (between :meth:`start` and :meth:`finish`)."""
        return None

    def put_residual(self, key: int, residual: torch.Tensor) -> None:
        """Where :attr:`keeps_residuals`: ``key``'s next :meth:`start` adds ``residual`` (flat, the bucket's size)."""
        raise ConfigError(f"{self.describe()} keeps no residual (compress= without error feedback)")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def shared_state_dict(self) -> dict:
        """The part of :meth:`state_dict` that is the same on every rank (PowerSGD's warm-start Q, a seed, step
        counts), which a rank joining a running job takes from a live one; a rank's own part (error feedback's
        residuals: what its own gradients have not got across) is left out, as a new rank has none."""
        return self.state_dict()

    def describe(self) -> str:
        return self.name

    # ----- for a decoder that holds payloads only (a parameter server) -----------------------------
    def wire_meta(self, key: int) -> dict:
        """After :meth:`start`: what this step's payloads of ``key`` need to be decoded besides themselves (plain
        data for a header: random-k's draw, PowerSGD's warm-up flag); the same on every rank in a synchronous step."""
        return {}

    def decode_add(self, key: int, payload: Payload, n: int, meta: dict, out: torch.Tensor) -> None:
        """Add one rank's round-0 payload, decoded alone, into ``out`` (``n`` elements, float32 or wider).
        Only where :attr:`decodes_alone`; raises ValueError for a payload that does not fit ``n``. Stateless."""
        raise NotImplementedError(f"{self.name}'s payloads decode only together")

    def aggregate(self, key: int, shapes, sums: list[Payload], meta: dict, out: torch.Tensor) -> None:
        """Summable compressors: write the aggregate into ``out`` from each round's summed payloads (flat
        tensors, round by round), as :meth:`finish` computes it on a rank: what a server holding only the sums
        applies. Raises ValueError for sums that do not fit ``shapes``. Stateless."""
        raise NotImplementedError(f"{self.name}'s aggregate needs every rank's payload")


class ErrorFeedback(Compressor):
    """Error feedback around any compressor: what a rank did not get across is added to its next input.

    ``start`` compresses ``x + e`` instead of ``x``; after ``finish``, ``e = (x + e) - share``, where
    ``share`` is this rank's part of the aggregate. Summed over steps: what was sent plus the last residual
    equals the sum of the inputs, on every rank. For a compressor whose aggregate is a sum of per-rank
    decodings (casts, top-k, random-k, sign) the share is this rank's own decoding (the classic EF-SGD
    residual); for PowerSGD, whose approximation exists only for the aggregate, it is the aggregate over N
    (torch's PowerSGD hook keeps input minus aggregated approximation, in its unscaled units).
    """

    keeps_residuals = True

    def __init__(self, inner: Compressor):
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.summable, self.rounds, self.sync_only = inner.summable, inner.rounds, inner.sync_only
        self.decodes_alone = inner.decodes_alone
        self.residuals: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}

    def bind(self, world_size: int) -> None:
        super().bind(world_size)
        self.inner.bind(world_size)

    def start(self, key, x, shapes):
        e = self.residuals.pop(key, None)  # in flight, x + e is made in its place: back in finish, as the new residual
        corrected = x.clone() if e is None else e.add_(x)
        self._inputs[key] = corrected
        return self.inner.start(key, corrected, shapes)

    def advance(self, key, rnd, combined):
        return self.inner.advance(key, rnd, combined)

    def finish(self, key, combined, out):
        self.inner.finish(key, combined, out)
        corrected = self._inputs.pop(key)
        self.inner.subtract_share(key, corrected)
        self.residuals[key] = corrected

    def share(self, key):
        return self.inner.share(key)

    def take_residual(self, key):
        return self.residuals.pop(key, None)

    def put_residual(self, key, residual):
        self.residuals[key] = residual

    def subtract_share(self, key, residual):
        self.inner.subtract_share(key, residual)

    def payload_nbytes(self, shapes, itemsize=4):
        return self.inner.payload_nbytes(shapes, itemsize)

    @property
    def warmup_steps(self) -> int:
        return self.inner.warmup_steps

    def state_dict(self):
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}, "inner": self.inner.state_dict()}

    def load_state_dict(self, state):
        self.residuals = {int(k): v.clone() for k, v in state.get("residuals", {}).items()}
        self.inner.load_state_dict(state.get("inner", {}))

    def shared_state_dict(self):
        return {"residuals": {}, "inner": self.inner.shared_state_dict()}

    def describe(self) -> str:
        return f"{self.inner.describe()} with error feedback"

    def wire_meta(self, key):
        return self.inner.wire_meta(key)

    def decode_add(self, key, payload, n, meta, out):
        self.inner.decode_add(key, payload, n, meta, out)

    def aggregate(self, key, shapes, sums, meta, out):
        self.inner.aggregate(key, shapes, sums, meta, out)


# ----- the registry ----------------------------------------------------------------------------------
# name -> (factory(arg text or None, settings) -> Compressor, the spec's form for messages)
REGISTRY: dict[str, tuple[Callable[[str | None, dict[str, str]], Compressor], str]] = {}


def register(name: str, form: str):
    """Class or function decorator: ``name`` in a spec builds it via ``factory(arg, settings)``."""

    def put(factory):
        REGISTRY[name] = (factory, form)
        return factory

    return put


def known() -> str:
    return ", ".join(form for _, form in REGISTRY.values())


def _fail(spec: str, why: str) -> ConfigError:
    return ConfigError(f"option 'compress': {spec!r} {why}")


def parse_spec(spec: str) -> tuple[str, str | None, dict[str, str]]:
    """``'powersgd:4,start_iter=10'`` -> ``('powersgd', '4', {'start_iter': '10'})``; unknown names raise."""
    head, *rest = spec.strip().split(",")
    name, _, arg = head.partition(":")
    name = name.strip().lower()
    if name not in REGISTRY:
        raise _fail(spec, f"names no compressor; known: none, {known()}")
    settings = {}
    for item in rest:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise _fail(spec, f"has a setting {item!r} that is not key=value")
        settings[k.strip()] = v.strip()
    return name, (arg.strip() if _ else None), settings


def build(spec: str, ef: bool = True) -> Compressor | None:
    """The compressor a spec names (wrapped in :class:`ErrorFeedback` when ``ef``), or None for ``none``.
    Raises :class:`ConfigError` in one line naming ``compress`` for anything wrong in it."""
    if spec.strip().lower() in ("", "none"):
        return None
    name, arg, settings = parse_spec(spec)
    factory, form = REGISTRY[name]
    try:
        comp = factory(arg, settings)
    except ConfigError as exc:
        raise _fail(spec, f"({form}): {exc}") from None
    return ErrorFeedback(comp) if ef else comp


def take(settings: dict[str, str], key: str, kind: type, default: Any, check: Callable[[Any], bool] = lambda v: True,
         need: str = ""):
    """Pop one ``key=value`` setting, converted, or ``default``; a bad value raises ConfigError."""
    if key not in settings:
        return default
    raw = settings.pop(key)
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {kind.__name__}") from None
    if not check(value):
        raise ConfigError(f"{key}={raw!r}: {need}")
    return value


def no_more(settings: dict[str, str]) -> None:
    if settings:
        raise ConfigError(f"unknown setting(s) {sorted(settings)}")


def no_arg(arg: str | None) -> None:
    if arg is not None:
        raise ConfigError(f"takes no ':' argument, got {arg!r}")


def check_fits(comp: Compressor | None, scheme: str, synchronous: bool) -> None:
    """A regime's check of a compressor's declaration against what it can do."""
    if comp is not None and comp.sync_only and not synchronous:
        raise ConfigError(f"option 'compress': {comp.name} needs every rank's payload at every step; "
                          f"{scheme}:// in this mode lets ranks run apart")

