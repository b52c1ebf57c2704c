"""``ps://?compress=SPEC&ef=0|1``: a compressor between each bucket and the shards that hold it.

A bucket's pieces on one shard form a *unit* (the bucket itself with one shard), compressed as a whole:
its key is ``bucket * K + shard``, the shapes the compressor sees are the pieces' (a piece that is a run of
whole rows of a matrix keeps its rows; another cut piece is a vector). Every rank has the same units. The
shard moves each round's payload as the compressor declares (:mod:`servers.compressed`); here::

    backward hook, per unit:  x -> comp.start -> push round 0    [+ pull csum round 0]
    end of backward:          for r in 1 .. rounds-1: comp.advance(round r-1's sum) -> push r, pull csum r
                              comp.finish: the aggregate into the bucket (update=worker), or, where the
                              update runs on the servers, into a scratch copy (error feedback's bookkeeping)

What goes in: update=worker, the bucket itself, scaled by 1/N on its way in (the shard's sum is the
average); update=server, sync, a copy scaled by 1/N (``p.grad`` stays this worker's gradient); async and
ssp, a copy, unscaled (each push is applied alone, as uncompressed).

What comes back (``pull what=csum``, always float32): a summable compressor's summed payload, which the
rank decodes with ``finish``; a gather-only one's dense sum of every rank's decoded payload (as its
nonzero values and their indices while that is smaller: top-k), which the rank takes as the aggregate
after closing its own step (its share is its own decoding, the same either way). update=server pulls sums only for a compressor that does not decode alone (PowerSGD: the next
round's Q needs the summed P, its warm start and error feedback the summed Q).

Local steps (``sync_every=H``, the outer placement; one fragment, no warm-up): the units are one per shard, the
shard's pieces in model order, and what a sync pushes through them is the pseudo-gradient
(:meth:`CompressedPushes.outer_push`, from :class:`~commlab.regimes.ps_steps.ShardsOuter`); the shard decodes and
sums the payloads as it does a step's, and that mean is the outer optimizer's gradient; :meth:`CompressedPushes.close`
keeps error feedback's residual once the shards answered.

Bytes: ``bytes_sent`` counts the payloads pushed, ``bytes_uncompressed`` the pieces an uncompressed push
would have sent (the present ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from commlab import compress
from commlab.transport import wire
from commlab.compress.seam import CompressState, nbytes
from commlab.base.errors import ConfigError
from commlab.base.handles import DoneHandle, FutureHandle, GroupHandle, Handle


@dataclass
class Unit:
    key: int
    shard: int
    bucket: int
    keys: list[str]  # piece keys, in bucket order
    slots: list[int]  # each piece's parameter slot in the bucket
    ranges: list[tuple[int, int]]  # each piece's (start, count) in the bucket's flat layout
    shapes: list[tuple[int, ...]]

    @property
    def contiguous(self) -> bool:
        return all(a + c == b for (a, c), (b, _) in zip(self.ranges, self.ranges[1:]))


def piece_shape(shape: torch.Size, start: int, count: int) -> tuple[int, ...]:
    """What the compressor sees of a piece: the parameter's shape when whole, its rows when a run of whole
    rows of a matrix, else a vector."""
    numel = math.prod(shape)
    if count == numel:
        return tuple(shape)
    row = numel // shape[0] if len(shape) >= 2 and shape[0] else 0
    if row and start % row == 0 and count % row == 0:
        return (count // row, *shape[1:])
    return (count,)


class CompressedPushes:
    """The compressed step of one :class:`~commlab.regimes.ps.PSExchanger` (built by its ``_connect`` from the
    exchanger's :class:`~commlab.compress.seam.CompressState`), in place of its raw-frame pushes
    (:class:`~commlab.regimes.ps.FramePushes`, the same methods)."""

    joins = False  # the shards have no way yet to count a joined worker's compressed rounds
    raw = False

    def __init__(self, ex, plan: list[dict[int, list]], state: CompressState, outer: bool = False):
        self.ex, self.comp = ex, state.comp
        k = len(ex.shards)
        self.units: list[list[Unit]] = []  # per bucket (outer: per fragment, a unit per shard holding any of it)
        self.outer = outer
        if outer:
            self.units = self._outer_units()  # per fragment
        for b, by_shard in zip(ex.buckets, plan if not outer else []):
            units = []
            for s, items in sorted(by_shard.items()):
                units.append(Unit(b.index * k + s, s, b.index, [pc.key for pc, _ in items], [slot for _, slot in items],
                                  [(b.offsets[slot] + pc.start, pc.count) for pc, slot in items],
                                  [piece_shape(b.params[slot].shape, pc.start, pc.count) for pc, slot in items]))
            self.units.append(units)
        self._flight: dict[int, dict] = {}  # unit key -> this step's x, payloads per round
        self._got: dict[tuple[int, int], list[torch.Tensor]] = {}  # (unit, round) -> the shard's sum

    def _outer_units(self) -> list[list[Unit]]:
        """Local steps (``sync_every=H``): what a sync compresses is a fragment's pseudo-gradient, not a bucket. Per
        fragment (``fragments=P``, whole tensors by :func:`commlab.core.localsteps.fragment_indices`, the rule the schedule
        uses), a unit per shard holding any of it: the shard's pieces of the fragment in model order, ``ranges``
        their places in the fragment's flat float32 anchor (its parameters in model order, as
        :class:`commlab.core.localsteps.LocalSteps` lays it out). Unit keys: fragment x shards + shard. A sync of
        one fragment names the shard's other units' pieces absent, so the shard's step is whole without them
        (servers.modes). With one fragment and one shard the unit is the whole pseudo-gradient, as the
        collectives compress it."""
        from commlab.core.localsteps import fragment_indices

        ex = self.ex
        named = [(name, p) for name, p in ex.model.named_parameters() if p.requires_grad]
        params, k = dict(named), len(ex.shards)
        groups = []
        for f, idx in enumerate(fragment_indices([p for _, p in named], max(1, ex.options.fragments))):
            at: dict[str, int] = {}
            offset = 0
            for i in idx:
                at[named[i][0]] = offset
                offset += named[i][1].numel()
            units = []
            for s, pieces in enumerate(ex._pieces):
                mine = sorted((pc for pc in pieces if pc.param in at), key=lambda pc: at[pc.param] + pc.start)
                if mine:
                    units.append(Unit(f * k + s, s, -1, [pc.key for pc in mine], [],
                                      [(at[pc.param] + pc.start, pc.count) for pc in mine],
                                      [piece_shape(params[pc.param].shape, pc.start, pc.count) for pc in mine]))
            groups.append(units)
        return groups

    def hello(self, shard: int) -> dict:
        """What ``shard``'s hello says of the pushes: the compressor and this shard's units."""
        o = self.ex.options
        return {"compress": {"spec": o.compress, "ef": bool(o.ef),
                             "units": [[u.key, u.keys, [list(s) for s in u.shapes]] for units in self.units
                                       for u in units if u.shard == shard]}}

    def connected(self) -> None:
        """After hello: the servers' mode and placement are known."""
        ex = self.ex
        gathers = ex.consistency.gathers  # a step is summed over every worker (sync), else each push applied alone
        compress.check_fits(self.comp, "ps", gathers)
        self.in_place = not ex.steps.spec.shards_step  # the workers step on the average: it lands in the bucket
        self.scale = 1.0 / ex.world_size if gathers else 1.0
        self.pulls = gathers and (self.in_place or not self.comp.decodes_alone)
        if self.in_place:
            ex.grad_scale = self.scale  # the bucket is x: the shards' sum of it is the average

    # ----- the step ------------------------------------------------------------------------------
    def start_bucket(self, bucket, step: int, extra: dict) -> Handle:
        """In the backward hook: compress each of the bucket's units and send round 0 to its shard."""
        handles = []
        for u in self.units[bucket.index]:
            if self.in_place and u.contiguous:
                x = bucket.grads[u.ranges[0][0]:u.ranges[0][0] + sum(c for _, c in u.ranges)]
            else:
                x = torch.cat([bucket.grads[a:a + c] for a, c in u.ranges])
                if self.scale != 1.0 and not self.in_place:
                    x.mul_(self.scale)
            absent = [key for key, slot in zip(u.keys, u.slots) if not bucket.present[slot]]
            payload, meta = self._encode(u, x, absent, bucket.grads.element_size())
            handles.append(self._send(u, step, 0, payload, dict(meta, **extra)))  # extra: the placement's
        if not handles:
            return DoneHandle(what=f"bucket {bucket.index}")
        return handles[0] if len(handles) == 1 else GroupHandle(handles, f"push of bucket {bucket.index}")

    def _encode(self, u: Unit, x: torch.Tensor, absent: list[str], itemsize: int) -> tuple[list, dict]:
        """Round 0 of unit ``u`` from ``x`` (error feedback's residual added in): the payload and its push's meta."""
        ex = self.ex
        t0 = ex._trace.now() if ex._trace is not None else 0
        payload = self.comp.start(u.key, x, tuple(torch.Size(s) for s in u.shapes))
        if ex._trace is not None:
            ex._trace.span("encode", "bucket", t0, args={"bucket": u.bucket, "compressor": self.comp.name})
        self._flight[u.key] = {"x": x, "payloads": [payload]}
        ex.stats.bytes_uncompressed += itemsize * sum(c for (_, c), key in zip(u.ranges, u.keys) if key not in absent)
        return payload, {"absent": absent, "cmeta": self.comp.wire_meta(u.key)}

    def outer_push(self, fragment: int, delta: torch.Tensor) -> dict[int, tuple[list, dict]]:
        """Local steps (``sync_every=H``): one sync's compressed push per shard, from this worker's pseudo-gradient
        ``delta`` of ``fragment`` (flat float32, the fragment's order; scratch): each shard's unit of it, scaled as a gradient is (sync:
        1/N, so the shard's sum of the decodings is the mean; async: as it is), through the compressor (error
        feedback's residual is the unit's). Returns shard -> (frames, push meta); the bytes are counted here.
        :meth:`close` closes the step once the shards have answered (the residual: input minus own decoding)."""
        out: dict[int, tuple[list, dict]] = {}
        for u in self.units[fragment]:
            x = torch.cat([delta[a:a + c] for a, c in u.ranges])
            if self.scale != 1.0:
                x.mul_(self.scale)
            payload, meta = self._encode(u, x, [], x.element_size())
            out[u.shard] = (self._frames(u, payload), dict(meta, unit=u.key, round=0))
        return out

    def _frames(self, u: Unit, payload) -> list:
        self.ex.stats.bytes_sent += nbytes(payload)
        return [part for i, t in enumerate(payload)
                for part in wire.split(f"{u.key}/{i}", t.detach().reshape(-1).contiguous().cpu())]

    def _send(self, u: Unit, step: int, r: int, payload, meta: dict) -> Handle:
        """Push round ``r`` of unit ``u`` on its shard's thread (and ask for the round's sum where needed)."""
        ex = self.ex
        shard = ex.shards[u.shard]
        parts = self._frames(u, payload)
        what = f"unit {u.key} (bucket {u.bucket}) round {r} at step {step}"

        def post(s):
            s.post("push", step, parts, dict(meta, base=s.version, unit=u.key, round=r), f"push of {what}")
            if self.pulls:
                s.post("pull", step, meta={"after_step": step, "what": "csum", "unit": u.key, "round": r},
                       what=f"sum of {what}", take=lambda h, data: self._take(u.key, r, h, data))

        return FutureHandle(shard.submit(post, shard), f"push of {what} to {shard.name}")

    def _take(self, key: int, r: int, h: wire.Header, data) -> int:
        """On a shard's thread: a (unit, round)'s sum, float32, one tensor per payload tensor."""
        got: list[list[torch.Tensor]] = []
        for spec, frame in zip(h.frames, data):
            i = int(spec.key.partition("/")[2])
            while len(got) <= i:
                got.append([])
            got[i].append(wire.frame_tensor(spec, frame))  # a view of the frame: copied out once, just below
        tensors = [torch.cat(ts) if len(ts) > 1 else ts[0].clone() for ts in got]
        n = h.meta.get("sparse")
        if n is not None:  # a dense sum's nonzero values and their indices (servers.compressed.Units.sums)
            values, idx = tensors
            tensors = [torch.zeros(n, dtype=values.dtype).index_put_((idx.long(),), values)]
        self._got[(key, r)] = tensors
        self.ex._absent.update(h.meta.get("absent", []))
        return h.data_bytes

    def _combined(self, u: Unit, r: int) -> list[torch.Tensor]:
        """Round ``r``'s sum as the compressor takes it: shaped like this rank's payload, on its device."""
        got = self._got.pop((u.key, r))
        like = self._flight[u.key]["payloads"][r]
        if not self.comp.summable:
            return got  # one dense float32 tensor: every rank's payload, decoded and added
        if [t.numel() for t in got] != [t.numel() for t in like]:
            raise ConfigError(f"shard {u.shard} sent a sum of unit {u.key} round {r} of "
                              f"{[t.numel() for t in got]} elements, expected {[t.numel() for t in like]}")
        return [g.view(t.shape).to(t.device) for g, t in zip(got, like)]

    def _collect(self, step: int) -> int:
        return sum(self.ex._on_all(lambda s: s.collect(), f"compressed exchange of step {step}"))

    def finish(self, step: int, replies: bool) -> int:
        """At the end of backward (every bucket's round 0 is sent): the later rounds, then each unit's
        aggregate (update=worker: into the bucket). Returns the bytes received. (``replies``: whether the
        placement asked for replies during backward; the rounds' own pulls are the compressor's to decide.)"""
        ex, comp = self.ex, self.comp
        units = [u for per_bucket in self.units for u in per_bucket]
        received = 0
        for r in range(1, comp.rounds):
            received += self._collect(step)
            handles = []
            for u in units:
                payload = comp.advance(u.key, r, self._combined(u, r - 1))
                self._flight[u.key]["payloads"].append(payload)
                handles.append(self._send(u, step, r, payload, {}))
            for h in handles:
                h.wait(ex.options.timeout)
        received += self._collect(step)
        self.close(units)
        return received

    def close(self, units: list[Unit]) -> None:
        """Every unit's step closed, once its last round's replies are in: error feedback's residual, and the
        aggregate into ``x`` (update=worker: into the bucket)."""
        ex, comp = self.ex, self.comp
        last = comp.rounds - 1
        t0 = ex._trace.now() if ex._trace is not None else 0
        for u in units:
            x, own = self._flight[u.key]["x"], self._flight[u.key]["payloads"][0]
            if self.pulls and comp.summable:
                comp.finish(u.key, self._combined(u, last), x)
            else:  # this rank's own payload alone closes its step: its share is its own decoding
                comp.finish(u.key, own if comp.summable else [own], x)
                if self.pulls:  # the shard's dense sum of every rank's decoded payload
                    x.copy_(self._got.pop((u.key, last))[0])
            if self.in_place and not u.contiguous:
                bucket, at = ex.buckets[u.bucket], 0
                for a, c in u.ranges:
                    bucket.grads[a:a + c].copy_(x[at:at + c])
                    at += c
        if ex._trace is not None:
            ex._trace.span("decode", "bucket", t0, args={"units": len(units), "compressor": comp.name})
        self._flight.clear()
