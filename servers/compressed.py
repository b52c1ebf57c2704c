"""A shard's side of ``ps://?compress=SPEC``: compressed units, summed or decoded as the compressor declares.

A worker with a compressor compresses per *unit*: the pieces of one of its buckets that this shard holds,
in bucket order (:class:`commlab.regimes.ps_compress.CompressedPushes`). Its first hello names the
compressor (``spec``, ``ef``) and the units (key, piece keys, the shapes the compressor sees); every later
hello must name the same. A push of a unit carries ``unit``, ``round`` and the compressor's ``cmeta``
(:meth:`~commlab.compress.base.Compressor.wire_meta`), its payload tensors as frames keyed ``U/i``.
What the shard does with it follows from the compressor's declaration, never its name:

* sync: per (unit, round), once every worker's payload is in, they are added in rank order (so the sum
  does not depend on which worker was faster, and equals :mod:`commlab.compress.simulate`'s), in float32:
  summable ones elementwise (fp16/bf16 casts, random-k values, PowerSGD's P and Q), the others (top-k,
  sign) each decoded alone into a dense float32 sum. Until then the shard holds each worker's payload
  (compressed: a fraction of the unit's float32 bytes, fp16/bf16 half of them). ``pull what=csum`` of a (unit, round) is answered with that sum
  (float32) once every worker's payload is in. update=server: once a unit's last round is in, the shard
  writes its aggregate (:meth:`~commlab.compress.base.Compressor.aggregate`, the workers' own code: P
  orthonormalised, P Q^T) into the step's averaged gradient, and the step goes on as an uncompressed one
  (report, commit, one optimizer step).
* keep-going (``min_workers=``, docs/faults.md): a sum is the mean over the ranks that count (x N / them once
  a rank left). A rank lost before its step was whole here: its payloads not summed yet go; where the workers
  pull the sums (update=worker, PowerSGD) one already summed keeps its part (it may have gone out); under
  update=server with payloads that decode alone the shard keeps each such rank's payloads until its step is
  whole, and subtracts them from the sums again.
* a push may name other units wholly absent (:meth:`Units.skipped`; local steps with ``fragments=``, one
  fragment a sync): the step is whole without their rounds, and their pieces are absent from it.
* async, ssp (``decodes_alone`` compressors only; PowerSGD is refused by the worker): each push is decoded
  alone into a dense float32 gradient and applied as an uncompressed push is.

Payloads come as zmq frames, also on a shared-memory link (its places are laid out for the pieces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from commlab.transport import wire
from commlab.compress import Compressor, build
from commlab.compress.seam import summed
from commlab.base.errors import ConfigError
from servers.modes import Refused


@dataclass
class Unit:
    key: int
    keys: list[str]  # piece keys, in the order the worker lays them out
    shapes: list[tuple[int, ...]]  # what the compressor sees of each piece
    slices: dict[str, tuple[int, int]]  # piece key -> (offset, count) in the unit
    n: int


@dataclass
class Acc:
    """One (unit, round) of a sync step: each worker's payload, their sum once all are in, the compressor's
    meta of the step."""

    payloads: dict = field(default_factory=dict)  # rank -> payload
    total: list | None = None  # summable: elementwise sums; else one dense float32 tensor
    meta: dict | None = None
    reply: tuple | None = None  # (frames, meta) of a pull of the sum, made once


class Units:
    """The compressed units one key space holds, and the sync step's sums (see the module's docstring)."""

    def __init__(self, desc, pieces: dict[str, tuple[str, int]], world: int):
        try:
            spec, ef, rows = str(desc["spec"]), bool(desc["ef"]), list(desc["units"])
            comp = build(spec, False)
            units = [(int(k), [str(x) for x in keys], [tuple(int(d) for d in s) for s in shapes])
                     for k, keys, shapes in rows]
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise Refused(f"unreadable compress= description ({exc})") from None
        if comp is None:
            raise Refused("compress= names no compressor")
        self.comp: Compressor = comp
        self.comp.bind(world)
        self.desc = {"spec": spec, "ef": ef, "units": rows}
        self.units: dict[int, Unit] = {}
        seen: set[str] = set()
        for key, keys, shapes in units:
            if key in self.units or len(keys) != len(shapes) or not keys:
                raise Refused(f"compress= unit {key}: repeated, or its keys and shapes differ in number")
            slices, at = {}, 0
            for k, shape in zip(keys, shapes):
                if k not in pieces or k in seen or math.prod(shape) != pieces[k][1] or pieces[k][0] != "float32":
                    raise Refused(f"compress= unit {key}: piece {k!r} is not a float32 piece of this shard shaped "
                                  f"{list(shape)}, or is in two units")
                seen.add(k)
                slices[k] = (at, pieces[k][1])
                at += pieces[k][1]
            self.units[key] = Unit(key, keys, shapes, slices, at)
        if seen != set(pieces):
            raise Refused(f"compress= units leave out piece(s) {sorted(set(pieces) - seen)[:3]}")
        self.acc: dict[tuple[int, int], Acc] = {}
        self.last: dict[tuple[int, int], Acc] = {}  # the last completed sync step's, for pulls answered late

    @property
    def max_bytes(self) -> int:
        """Most payload bytes one push may carry: top-k at F=1 sends 8 bytes an element (values, indices)."""
        return max([0, *(8 * u.n + 64 for u in self.units.values())])

    def skipped(self, unit: Unit, absent: list) -> list[Unit] | None:
        """The other units a round-0 push of ``unit`` names wholly absent (local steps with ``fragments=``: a sync
        of one fragment carries its unit, the shard's other fragments' pieces absent), or None when ``absent``
        names a piece that is neither the unit's nor one of a whole other unit."""
        outside = {k for k in absent if k not in unit.slices}
        if not outside:
            return []
        out = [u for u in self.units.values() if u.key != unit.key and outside & set(u.keys)]
        if any(not set(u.keys) <= outside for u in out) or outside != {k for u in out for k in u.keys}:
            return None
        return out

    def unit(self, h: wire.Header) -> tuple[Unit, int]:
        u, r = h.meta.get("unit"), h.meta.get("round")
        if not isinstance(u, int) or u not in self.units or not isinstance(r, int) or not 0 <= r < self.comp.rounds:
            raise Refused(f"{h.op} from {h.sender}: no compressed unit {u!r} round {r!r} here "
                          f"({self.comp.name} has {self.comp.rounds} round(s))")
        return self.units[u], r

    @staticmethod
    def payload(h: wire.Header, data, unit: Unit) -> list[torch.Tensor]:
        """The push's payload tensors (frames keyed ``U/0``, ``U/1``, ... each covering its tensor in order)."""
        out: list[list] = []
        for spec, frame in zip(h.frames, data):
            name, _, i = spec.key.partition("/")
            if name != str(unit.key) or not i.isdigit() or int(i) > len(out):
                raise Refused(f"push from {h.sender}: frame {spec.key!r} is not the next of unit {unit.key}'s payload")
            if int(i) == len(out):
                out.append([])
            parts = out[int(i)]
            if spec.offset != sum(s.count for s, _ in parts):
                raise Refused(f"push from {h.sender}: {spec.key} frames do not cover it in order")
            parts.append((spec, frame))
        tensors = []
        for parts in out:
            if len({s.dtype for s, _ in parts}) != 1:
                raise Refused(f"push from {h.sender}: {parts[0][0].key} mixes dtypes")
            ts = [wire.frame_tensor(s, f) for s, f in parts]
            tensors.append(ts[0] if len(ts) == 1 else torch.cat(ts))
        return tensors

    def decoded(self, unit: Unit, payload, meta: dict) -> torch.Tensor:
        """One rank's payload decoded alone: a dense float32 tensor of the unit's length (async, ssp)."""
        out = torch.zeros(unit.n)
        try:
            self.comp.decode_add(unit.key, payload, unit.n, meta, out)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise Refused(f"unit {unit.key}: {exc}") from None
        return out

    def add(self, rank: int, unit: Unit, r: int, payload, meta: dict) -> Acc:
        """Sync: hold ``rank``'s payload of (unit, round) until every worker's is in (then :meth:`total`)."""
        acc = self.acc.setdefault((unit.key, r), Acc())
        first = next(iter(acc.payloads.values()), None)
        if first is None:
            acc.meta = meta
        elif acc.meta != meta or [(t.dtype, t.numel()) for t in payload] != [(t.dtype, t.numel()) for t in first]:
            raise Refused(f"unit {unit.key} round {r}: rank {rank} sent {[t.numel() for t in payload]} elements "
                          f"compressed with {meta}, another rank {[t.numel() for t in first]} with {acc.meta} "
                          f"(every rank must be at the same compressor step)")
        acc.payloads[rank] = payload
        return acc

    def total(self, unit: Unit, r: int, factor: float = 1.0, keep=()) -> Acc:
        """Sync: every worker's payload of (unit, round) is in: add them in rank order, then x ``factor``
        (keep-going: N / the ranks that count, so that the sum is their mean). The payloads of the ranks in
        ``keep`` stay (keep-going: a rank lost before its step was in is taken out again, :meth:`take_out`);
        of the others only who was in is kept."""
        acc = self.acc[(unit.key, r)]
        ordered = [acc.payloads[k] for k in sorted(acc.payloads)]
        if not self.comp.summable:
            acc.total = [torch.zeros(unit.n)]
            for k, p in zip(sorted(acc.payloads), ordered):
                try:
                    self.comp.decode_add(unit.key, p, unit.n, acc.meta or {}, acc.total[0])
                except (ValueError, RuntimeError, KeyError, TypeError) as exc:
                    raise Refused(f"unit {unit.key} from rank {k}: {exc}") from None
        else:
            acc.total = summed(ordered) if ordered[0] else []
        if factor != 1.0:
            for t in acc.total:
                t.mul_(factor)
        acc.payloads = {k: (p if k in keep else None) for k, p in acc.payloads.items()}
        return acc

    def release(self, rank: int) -> None:
        """``rank``'s step is whole here: the payloads kept to take it out again go."""
        for acc in self.acc.values():
            if acc.payloads.get(rank) is not None and acc.total is not None:
                acc.payloads[rank] = None

    def take_out(self, unit: Unit, r: int, rank: int) -> bool:
        """Keep-going: ``rank`` left before its step was whole here. Its payload of (unit, round) goes from the
        payloads held (no sum yet), or is subtracted from the sum (unscaled) where :meth:`total` kept it for
        this. False where it is not taken out: it sent none, or the sum holds it for good (it may have gone out)."""
        acc = self.acc.get((unit.key, r))
        payload = acc.payloads.get(rank) if acc is not None else None
        if acc is None or payload is None:
            return False
        del acc.payloads[rank]
        if acc.total is None:
            return True
        if self.comp.summable:
            for s, t in zip(acc.total, payload):
                s.sub_(t)
        else:
            own = torch.zeros(unit.n)
            self.comp.decode_add(unit.key, payload, unit.n, acc.meta or {}, own)  # decoded once already: it fits
            acc.total[0].sub_(own)
        acc.reply = None
        return True

    def aggregate(self, unit: Unit) -> torch.Tensor:
        """The unit's aggregate (the average gradient, as every worker rebuilds it) once its last round is in."""
        if not self.comp.summable:  # a copy: a commit's factor scales the step's gradient in place
            return (self.acc[(unit.key, 0)].total or [])[0].clone()
        out = torch.zeros(unit.n)
        sums = [self.acc[(unit.key, r)].total or [] for r in range(self.comp.rounds)]
        try:
            self.comp.aggregate(unit.key, unit.shapes, sums, self.acc[(unit.key, 0)].meta or {}, out)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise Refused(f"unit {unit.key}: {exc}") from None
        return out

    def ready(self, u: int, r: int) -> bool:
        acc = self.acc.get((u, r))
        return acc is not None and acc.total is not None

    def next_step(self) -> None:
        self.last, self.acc = self.acc, {}

    def drop_step(self) -> None:
        """The step in flight is dropped (a new attempt of the job pushes it again)."""
        self.acc = {}

    def sums(self, u: int, r: int, current: bool) -> tuple[list, dict]:
        """The frames of a (unit, round)'s sum, of this step's (``current``) or of the last one's, and what the
        reply's header says of them: ``{"sparse": n}`` when a gather-only compressor's dense sum goes as its
        nonzero values (``U/0``, float32) and their indices (``U/1``, int32), which is smaller while fewer than
        half of the n elements are nonzero (top-k: at most N k). Lossless either way."""
        acc = (self.acc if current else self.last).get((u, r))
        if acc is None or acc.total is None:
            raise Refused(f"no sum of unit {u} round {r} is kept")
        if acc.reply is None:
            total, meta = acc.total, {}
            if not self.comp.summable:
                idx = total[0].nonzero().view(-1)
                if 2 * idx.numel() < total[0].numel():
                    total, meta = [total[0][idx], idx.to(torch.int32)], {"sparse": total[0].numel()}
            acc.reply = [part for i, t in enumerate(total) for part in wire.split(f"{u}/{i}", t.reshape(-1))], meta
        return acc.reply
