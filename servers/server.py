"""One parameter-server shard: named flat tensors, a consistency mode, an optimizer, on the CPU.

The server knows nothing of models. The first worker's ``hello`` tells it
which pieces (named flat tensors) it holds and which optimizer to run over
them; every later worker must say the same (manifest, pieces, optimizer,
world size, shard index), or is refused by name. The protocol and the modes
are described in :mod:`commlab.psproto`.

One thread runs everything: it receives on a ROUTER socket, validates each
header with :func:`commlab.wire.decode` before touching bytes, adds gradient
frames straight from the received zmq frames into the reduction buffers, acks
a push as soon as it is folded in, applies the optimizer, and answers the
pulls that were waiting. A request it cannot serve (garbage, unknown op or
key, wrong dtype or length, a mismatched model, a push for the wrong step) is
answered with ``error`` and changes nothing.

Hostile input (see docs/faults.md): libzmq drops a peer that sends a frame
above the transport's limit; a message of more frames than the shard can need
is read frame by frame, discarded and refused; a header is checked against its
frames before any byte is used, and sizes are checked against what the shard
holds, so nothing is allocated because a header says so. A push carrying a NaN
or an infinity (or finite values whose float32 sum overflows) is refused with
an error and counted (``nonfinite``): one bad worker must not poison every
worker's parameters. A pull may only ask for a step its worker could have
pushed, and each worker has a bounded number of pulls waiting.

Pulls go out zero-copy from the parameter tensors themselves. zmq tracks each
such send; before the optimizer writes a tensor that a send still reads, the
tensor gets fresh storage (``p.data = p.data.clone()``) and the old buffer is
freed when the send lets go of it. In sync mode every send has finished
before the next update (the workers received it before they pushed again), so
nothing is ever copied there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from commlab import psproto, transport, wire
from commlab.errors import ProtocolError
from commlab.exchanger import manifest_difference
from commlab.optim import OptimizerSpec


_MIN_FRAMES = 16  # data frames a message may carry before any hello fixed the shard's pieces


def _finite(spec: wire.FrameSpec, frame) -> bool:
    """No NaN or Inf in a floating frame: one summing pass (a NaN or Inf makes the sum non-finite;
    half types are summed in float32 so that large finite values do not overflow it)."""
    t = wire.frame_tensor(spec, frame)
    if not t.is_floating_point() or t.numel() == 0:
        return True
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    return bool(torch.isfinite(total))


class Refused(Exception):
    """A request this server will not serve; the message goes back to the worker."""


@dataclass(frozen=True)
class ServerConfig:
    bind: str
    mode: str = "sync"
    staleness: int = 2
    shard: int = 0
    shards: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # updates; 0: only when stopped
    resume: str | None = None
    log_every: float = 10.0
    io_threads: int = 2
    insecure: bool = False
    curve_secret: str | None = None
    authorized: str | None = None

    def __post_init__(self):
        if self.mode not in psproto.MODES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {list(psproto.MODES)}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard}/{self.shards}: the index must be in [0, {self.shards})")

    @property
    def name(self) -> str:
        return f"shard {self.shard}/{self.shards}"


@dataclass
class Stats:
    updates: int = 0
    pushes: int = 0
    duplicates: int = 0
    pulls: int = 0
    refused: int = 0
    dropped: int = 0  # messages with nothing to answer (an identity frame alone)
    nonfinite: int = 0  # pushes refused for NaN/Inf
    bytes_in: int = 0
    bytes_out: int = 0
    copies_on_write: int = 0
    staleness: Counter = field(default_factory=Counter)
    # async/ssp: per applied update, the pushing worker's clock (the step it pushed) minus the slowest
    # active worker's clock (the step that one is on): SSP's bound S caps it at S
    clock_gap: Counter = field(default_factory=Counter)


@dataclass
class Partial:
    """What one worker has sent of one step so far."""

    step: int
    seen: set = field(default_factory=set)
    absent: set = field(default_factory=set)
    base: int | None = None  # oldest version its gradients were computed on


class ParameterServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        curve = transport.CurveKeys.load(cfg.curve_secret) if cfg.curve_secret else None
        self.transport = transport.Transport(io_threads=cfg.io_threads, curve=curve)
        self.sock = self.transport.bind(zmq.ROUTER, cfg.bind, insecure=cfg.insecure, authorized=cfg.authorized)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stats = Stats()
        # what the first hello fixed
        self.manifest: list | None = None
        self.pieces: dict[str, tuple[str, int]] = {}  # key -> (dtype, numel), in hello order
        self.optim_spec: dict | None = None
        self.world: int | None = None
        # state
        self.params: dict[str, torch.Tensor] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0
        self.last_step: dict[int, int] = {}  # rank -> last step applied (-1: none)
        self.sync_step = 0  # sync: the step being gathered
        self.senders: dict[str, int] = {}  # wire sender -> rank
        self.detached: set[int] = set()
        self.partial: dict[int, Partial] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # rank -> key -> buffer (async/ssp); -1: sync sum
        self.present: Counter = Counter()  # sync: key -> workers that sent it this step
        self.complete: set[int] = set()  # sync: ranks whose step is in
        self.contributed: Counter = Counter()  # sync: key -> workers that sent it or said it is absent
        self.applied: set[str] = set()  # sync: keys already updated in this step
        self.waiting: list[tuple[bytes, wire.Header]] = []  # deferred pulls
        self.trackers: dict[str, list] = {}  # key -> zmq trackers of sends reading it
        self._stop = False
        self._since_checkpoint = 0
        self.boot = os.urandom(6).hex()  # this process's incarnation: a worker that sees it change resends
        self.max_parts = 2 + _MIN_FRAMES  # identity + header + data frames; grows with the pieces at hello
        self.max_bytes = 0  # data bytes a request may carry: the whole shard, once the pieces are known
        if cfg.resume:
            self._load(Path(cfg.resume) / self._checkpoint_name())
        # torch's first optimizer pays seconds of lazy imports: pay them now, not while workers wait
        OptimizerSpec().build([torch.zeros(1)])

    # ----- main loop -------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until SIGTERM/SIGINT; then write a checkpoint (if configured) and return."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        print(f"commlab server {self.cfg.name} mode={self.cfg.mode} listening on {self.endpoint}", flush=True)
        next_log = time.monotonic() + self.cfg.log_every if self.cfg.log_every > 0 else float("inf")
        while not self._stop:
            if self.sock.poll(100, zmq.POLLIN):
                frames, count = transport.recv_bounded(self.sock, self.max_parts)
                if count > len(frames):
                    self.stats.refused += 1
                    self._reply(frames[0].bytes, "error", None, {"reason": f"message of {count} frames; "
                                                                           f"{self.cfg.name} takes at most {self.max_parts}"})
                else:
                    self.handle(frames)
            if time.monotonic() >= next_log:
                self.log()
                next_log = time.monotonic() + self.cfg.log_every
        if self.cfg.checkpoint_dir or self.cfg.resume:
            self.checkpoint()
        self.log()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.transport.close()

    def _on_signal(self, *_):
        self._stop = True

    def log(self) -> None:
        s = self.stats_dict()
        print(f"commlab server {self.cfg.name}: " + json.dumps(s, sort_keys=True), file=sys.stderr, flush=True)

    def stats_dict(self) -> dict:
        s = self.stats
        return {"shard": self.cfg.shard, "shards": self.cfg.shards, "mode": self.cfg.mode, "version": self.version,
                "updates": s.updates, "pushes": s.pushes, "duplicates": s.duplicates, "pulls": s.pulls,
                "refused": s.refused, "dropped": s.dropped, "nonfinite": s.nonfinite, "boot": self.boot,
                "sync_step": self.sync_step, "waiting_for": self._waiting_for(), "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "queue": len(self.waiting),
                "copies_on_write": s.copies_on_write, "workers": sorted(self.senders.values()),
                "last_step": {str(r): t for r, t in sorted(self.last_step.items())},
                "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
                "max_staleness": max(s.staleness, default=0),
                "clock_gap": {str(k): v for k, v in sorted(s.clock_gap.items())}}

    def _waiting_for(self) -> list[int]:
        """The ranks that pulls waiting here wait for (sync: not yet in for this step; ssp: the slowest)."""
        if not self.waiting or self.world is None:
            return []
        if self.cfg.mode == "sync":
            return [r for r in range(self.world) if r not in self.complete]
        if self.cfg.mode == "ssp":
            active = {r: self.last_step.get(r, -1) for r in range(self.world) if r not in self.detached}
            slowest = min(active.values(), default=0)
            return [r for r, t in active.items() if t == slowest]
        return []

    # ----- dispatch --------------------------------------------------------------------------
    def handle(self, frames: list) -> None:
        if len(frames) < 2:
            self.stats.dropped += 1  # an identity with nothing after it: nothing to answer
            return
        ident, body = frames[0].bytes, frames[1:]
        req_id = None
        try:
            h = wire.decode(body, ops=psproto.REQUESTS, max_bytes=self.max_bytes)
            req_id = h.meta.get("id")
            self.stats.bytes_in += h.data_bytes
            getattr(self, "_op_" + h.op)(ident, h, body[1:])
        except (ProtocolError, Refused) as exc:
            self.stats.refused += 1
            self._reply(ident, "error", req_id, {"reason": str(exc)})
        except Exception as exc:  # a bug here must not take every worker's shard down with it
            traceback.print_exc()
            self.stats.refused += 1
            self._reply(ident, "error", req_id, {"reason": f"internal error on {self.cfg.name}: {exc!r}"})

    def _reply(self, ident: bytes, op: str, req_id, meta: dict | None = None, parts=(), step: int = -1) -> None:
        frames = [ident, *wire.encode(op, f"server{self.cfg.shard}", step, parts, dict(meta or {}, id=req_id))]
        try:
            if parts:
                _, trackers = transport.send_tracked(self.sock, frames, timeout=5.0, who="a worker")
                for (spec, _), tr in zip(parts, trackers[2:]):  # after identity and header
                    if tr is not None:
                        self.trackers.setdefault(spec.key, []).append(tr)
            else:
                transport.send(self.sock, frames, timeout=5.0, who="a worker")
        except Exception as exc:  # a worker that went away must not take the server with it
            print(f"commlab server {self.cfg.name}: reply dropped: {exc}", file=sys.stderr, flush=True)
        self.stats.bytes_out += sum(spec.nbytes for spec, _ in parts)

    def _rank_of(self, h: wire.Header) -> int:
        rank = self.senders.get(h.sender)
        if rank is None:
            raise Refused(f"{h.sender} sent {h.op} before hello")
        return rank

    # ----- ops -------------------------------------------------------------------------------
    def _op_hello(self, ident, h, _data):
        m = h.meta
        mode, rank, world = m.get("mode"), m.get("rank"), m.get("world")
        if mode and mode != self.cfg.mode:
            raise Refused(f"{self.cfg.name} runs mode {self.cfg.mode!r}, worker {h.sender} asked for {mode!r}")
        if mode == "ssp" and m.get("staleness") not in (None, self.cfg.staleness):
            raise Refused(f"{self.cfg.name} runs ssp with staleness {self.cfg.staleness}, worker {h.sender} asked "
                          f"for {m.get('staleness')}")
        if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
            raise Refused(f"hello from {h.sender}: bad rank/world {rank!r}/{world!r}")
        if m.get("shard") != [self.cfg.shard, self.cfg.shards]:
            raise Refused(f"worker {h.sender} thinks this is shard {m.get('shard')}, but it is {self.cfg.name}: "
                          f"list the servers in shard order")
        manifest, pieces, optim = m.get("manifest"), m.get("pieces"), m.get("optim")
        try:
            manifest = [(str(n), tuple(int(x) for x in s), str(d)) for n, s, d in manifest]
            pieces = {str(k): (str(d), int(n)) for k, d, n in pieces}
            if any(d not in wire.DTYPES or n < 0 for d, n in pieces.values()):
                raise ValueError("bad dtype or size")
            OptimizerSpec.from_dict(optim)
        except Exception as exc:
            raise Refused(f"hello from {h.sender}: unreadable manifest, pieces or optimizer ({exc})") from None
        if self.manifest is None:
            if self.world is not None and world != self.world:  # resumed state fixes the world size
                raise Refused(f"worker {h.sender} says {world} workers; the resumed shard had {self.world}")
            self.manifest, self.pieces, self.optim_spec, self.world = manifest, pieces, optim, world
            self._fix_limits()
        else:
            diff = manifest_difference(self.manifest, manifest, f"worker {h.sender}")
            if diff:
                raise Refused(f"model mismatch on {self.cfg.name}: {diff}")
            if pieces != self.pieces:
                raise Refused(f"worker {h.sender} assigned different pieces to {self.cfg.name}")
            if optim != self.optim_spec:
                raise Refused(f"worker {h.sender} asks for optimizer {optim}, the shard runs {self.optim_spec}")
            if world != self.world:
                raise Refused(f"worker {h.sender} says {world} workers, the first worker said {self.world}")
        self.senders[h.sender] = rank
        self.detached.discard(rank)
        self.last_step.setdefault(rank, self._resume_step() - 1)
        next_step = self.sync_step if self.cfg.mode == "sync" else self.last_step[rank] + 1
        self._reply(ident, "ok", m.get("id"), {"initialized": self.optimizer is not None, "next_step": next_step,
                                                "boot": self.boot,
                                                "version": self.version, "mode": self.cfg.mode,
                                                "staleness": self.cfg.staleness})

    def _fix_limits(self) -> None:
        """Most frames and data bytes a request can need: every piece of the shard, in frames of at most
        MAX_FRAME. Fixed once the pieces are (hello, or resumed state), not recomputed per message."""
        self.max_bytes = sum(wire.DTYPES[d].itemsize * n for d, n in self.pieces.values())
        need = sum(max(1, -(-wire.DTYPES[d].itemsize * n // wire.MAX_FRAME)) for d, n in self.pieces.values())
        self.max_parts = 2 + max(_MIN_FRAMES, need)

    def _resume_step(self) -> int:
        """The step a rank the shard never saw starts at: sync, the step being gathered; async and
        ssp, 0. (Not "where the others stand": a worker that joins shards at different moments
        would get a different start from each, and a pull after a step it never pushes there.)"""
        if self.cfg.mode == "sync":
            return self.sync_step
        return 0

    def _op_init(self, ident, h, data):
        self._rank_of(h)
        if self.optimizer is not None:
            self._reply(ident, "ok", h.meta.get("id"), {"ignored": True})
            return
        frames = self._check_frames(h, data, require_all=True)
        for key, parts in frames.items():
            dtype, numel = self.pieces[key]
            t = torch.empty(numel, dtype=wire.DTYPES[dtype])
            for spec, frame in parts:
                t[spec.offset:spec.offset + spec.count].copy_(wire.frame_tensor(spec, frame))
            self.params[key] = t
        self._build_optimizer()
        self._reply(ident, "ok", h.meta.get("id"))
        self._serve_waiting()

    def _world(self) -> int:
        if self.world is None:
            raise Refused("no worker has said hello yet: the world size is unknown")
        return self.world

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise Refused("the shard holds no parameters yet: a worker must init it first")
        return self.optimizer

    def _build_optimizer(self) -> None:
        self.params = {k: self.params[k] for k in self.pieces}  # hello order, on every shard the same
        if self.optim_spec is None:
            raise Refused("no optimizer spec yet: a worker must say hello first")
        self.optimizer = OptimizerSpec.from_dict(self.optim_spec).build(list(self.params.values()))

    def _op_push(self, ident, h, data):
        rank = self._rank_of(h)
        if self.optimizer is None:
            raise Refused(f"push from {h.sender} before any worker initialised {self.cfg.name}")
        t = h.step
        self.stats.pushes += 1
        if t <= self.last_step[rank]:  # sent again after a reconnect: applied once already
            self.stats.duplicates += 1
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        expected = self.sync_step if self.cfg.mode == "sync" else self.last_step[rank] + 1
        if t != expected:
            raise Refused(f"push of step {t} from {h.sender}, but {self.cfg.name} expects step {expected} from it")
        if rank in self.complete:  # sync: its step is in, the others' are not yet
            self.stats.duplicates += 1
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        part = self.partial.get(rank)
        if part is None or part.step != t:
            part = self.partial[rank] = Partial(t)
        frames = self._check_frames(h, data, require_all=False)
        bad = next((spec.key for parts in frames.values() for spec, frame in parts if not _finite(spec, frame)), None)
        if bad is not None:
            self.stats.nonfinite += 1
            raise Refused(f"push of step {t} from {h.sender}: {bad} holds NaN or Inf; refused, nothing applied")
        absent = h.meta.get("absent", [])
        if not isinstance(absent, list) or any(not isinstance(k, str) or k not in self.pieces for k in absent):
            raise Refused(f"push from {h.sender}: 'absent' names keys this shard does not hold")
        again = (set(frames) | set(absent)) & (part.seen | part.absent)
        if again and again == set(frames) | set(absent):  # this push was sent again after a reconnect
            self.stats.duplicates += 1
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        if again or set(frames) & set(absent):
            raise Refused(f"push of step {t} from {h.sender} repeats key(s) {sorted(again)[:3]}")
        base = h.meta.get("base")
        if not isinstance(base, int) or base > self.version:
            raise Refused(f"push from {h.sender}: bad base version {base!r} (server is at {self.version})")
        # -- validated: fold it in
        self._reply(ident, "ok", h.meta.get("id"), step=t)  # acknowledged on arrival
        if self.cfg.mode == "sync":
            self._fold_sync(rank, t, part, frames, absent)
        else:
            self._fold_async(rank, t, part, frames, absent, base)
        self._serve_waiting()

    def _fold_sync(self, rank: int, t: int, part: Partial, frames: dict, absent: list) -> None:
        """Add this push into the step's mean; a key whose N contributions are in is updated at once.

        Each key's optimizer state is its own (SGD momentum, Adam moments and step count), so
        updating keys one by one as their last gradient lands gives exactly the step that all
        keys at once would, and the work overlaps with receiving the later buckets. The step
        (version, pulls) completes when every key is done."""
        buffers = self.grads.setdefault(-1, {})
        scale = 1.0 / self._world()
        ready = []
        for key in [*frames, *absent]:
            if key in self.applied:  # updated before a restart (see checkpoint): nothing to add
                continue
            if key in frames:
                buf = buffers.get(key)
                if buf is None:
                    dtype, numel = self.pieces[key]
                    buf = buffers[key] = torch.empty(numel, dtype=wire.DTYPES[dtype])
                first = self.present[key] == 0
                for spec, frame in frames[key]:  # straight from the received frame into the mean
                    src, dst = wire.frame_tensor(spec, frame), buf[spec.offset:spec.offset + spec.count]
                    torch.mul(src, scale, out=dst) if first else dst.add_(src, alpha=scale)
                self.present[key] += 1
            self.contributed[key] += 1
            if self.contributed[key] == self.world:
                ready.append(key)
        part.seen |= set(frames)
        part.absent |= set(absent)
        if ready:
            self._step_optimizer({k: buffers[k] for k in ready if self.present[k]})
            self.applied.update(ready)
        if len(part.seen) + len(part.absent) == len(self.pieces):
            del self.partial[rank]
            self.complete.add(rank)
        if len(self.complete) == self.world:
            for r in self.complete:
                self.last_step[r] = t
            self.complete.clear()
            self.present.clear()
            self.contributed.clear()
            self.applied.clear()
            self.sync_step = t + 1
            self._count_update([0])

    def _fold_async(self, rank: int, t: int, part: Partial, frames: dict, absent: list, base: int) -> None:
        """Keep this worker's gradients until its step is complete on this shard, then apply them."""
        part.base = base if part.base is None else min(part.base, base)
        whole = len(frames) + len(absent) == len(self.pieces) and not part.seen and not part.absent
        if whole and all(len(parts) == 1 for parts in frames.values()):
            grads = {key: wire.frame_tensor(*parts[0]) for key, parts in frames.items()}  # no copy at all
        else:
            buffers = self.grads.setdefault(rank, {})
            for key, parts in frames.items():
                buf = buffers.get(key)
                if buf is None:
                    dtype, numel = self.pieces[key]
                    buf = buffers[key] = torch.empty(numel, dtype=wire.DTYPES[dtype])
                for spec, frame in parts:
                    buf[spec.offset:spec.offset + spec.count].copy_(wire.frame_tensor(spec, frame))
            part.seen |= set(frames)
            part.absent |= set(absent)
            if len(part.seen) + len(part.absent) < len(self.pieces):
                return
            grads = {k: buffers[k] for k in part.seen}
        del self.partial[rank]
        self._step_optimizer(grads)
        clocks = [self.last_step.get(r, -1) + 1 for r in range(self._world()) if r not in self.detached]
        self.stats.clock_gap[t - min(clocks, default=t)] += 1
        self.last_step[rank] = t
        self._count_update([self.version - part.base])

    def _step_optimizer(self, grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step over the keys in ``grads`` (the others get no gradient: torch skips them)."""
        for key, p in self.params.items():
            g = grads.get(key)
            if g is not None:
                if any(not tr.done for tr in self.trackers.get(key, ())):
                    p.data = p.data.clone()  # a pull still reads this buffer: fresh storage for the new version
                    self.stats.copies_on_write += 1
                self.trackers.pop(key, None)
            p.grad = g
        if grads:
            self._optimizer().step()
        for p in self.params.values():
            p.grad = None

    def _count_update(self, staleness: list[int]) -> None:
        self.version += 1
        self.stats.updates += 1
        for s in staleness:
            self.stats.staleness[s] += 1
        self._since_checkpoint += 1
        if self.cfg.checkpoint_every and self._since_checkpoint >= self.cfg.checkpoint_every:
            self.checkpoint()

    def _check_frames(self, h: wire.Header, data, require_all: bool) -> dict[str, list]:
        """Frames grouped by key; each key's frames must cover it exactly, in order, in its dtype."""
        frames: dict[str, list] = {}
        for spec, frame in zip(h.frames, data):
            if spec.key not in self.pieces:
                raise Refused(f"{h.op} from {h.sender}: {self.cfg.name} holds no key {spec.key!r}")
            frames.setdefault(spec.key, []).append((spec, frame))
        for key, parts in frames.items():
            dtype, numel = self.pieces[key]
            at = 0
            for spec, _ in parts:
                if spec.dtype != dtype:
                    raise Refused(f"{h.op} from {h.sender}: {key} is {dtype} on {self.cfg.name}, frame is {spec.dtype}")
                if spec.offset != at:
                    raise Refused(f"{h.op} from {h.sender}: {key} frames do not cover [0, {numel}) in order "
                                  f"(frame at {spec.offset}, expected {at})")
                at += spec.count
            if at != numel:
                raise Refused(f"{h.op} from {h.sender}: {key} has {numel} elements on {self.cfg.name}, "
                              f"the frames carry {at}")
        if require_all and set(frames) != set(self.pieces):
            missing = sorted(set(self.pieces) - set(frames))
            raise Refused(f"{h.op} from {h.sender} lacks key(s) {missing[:3]}")
        return frames

    def _op_pull(self, ident, h, _data):
        self._rank_of(h)
        after, keys = h.meta.get("after_step"), h.meta.get("keys")
        if not isinstance(after, int):
            raise Refused(f"pull from {h.sender} without an integer after_step")
        if keys is not None and (not isinstance(keys, list) or not keys or
                                 any(not isinstance(k, str) or k not in self.pieces for k in keys)):
            raise Refused(f"pull from {h.sender}: 'keys' must list keys {self.cfg.name} holds")
        rank = self.senders[h.sender]
        # A worker pulls after pushing on the same connection: the push is here already. A pull for a
        # later step could only wait forever, so it is refused, and so is a flood of waiting pulls.
        latest = self.sync_step if self.cfg.mode == "sync" else self.last_step[rank] + 1
        if after > latest:
            raise Refused(f"pull after step {after} from {h.sender}, which has not pushed it ({self.cfg.name} "
                          f"is at step {latest} for it)")
        if sum(1 for _, w in self.waiting if w.sender == h.sender) >= len(self.pieces) + 4:
            raise Refused(f"pull from {h.sender}: {len(self.pieces) + 4} of its pulls wait already")
        if self._ready(h):
            self._send_params(ident, h)
        else:
            self.waiting.append((ident, h))

    def _ready(self, h: wire.Header) -> bool:
        if self.optimizer is None:
            return False
        rank, after = self.senders[h.sender], h.meta["after_step"]
        if after < 0:
            return True
        if self.cfg.mode == "sync":
            keys = h.meta.get("keys")  # some keys can be ready before the whole step
            return self.sync_step > after or (self.sync_step == after and bool(keys) and self.applied.issuperset(keys or ()))
        if self.last_step[rank] < after:
            return False
        if self.cfg.mode == "ssp":
            active = [self.last_step.get(r, -1) + 1 for r in range(self._world()) if r not in self.detached]
            slowest = min(active, default=after + 1)
            return after + 1 - slowest <= self.cfg.staleness
        return True

    def _serve_waiting(self) -> None:
        still = []
        for ident, h in self.waiting:
            if self._ready(h):
                self._send_params(ident, h)
            else:
                still.append((ident, h))
        self.waiting = still

    def _send_params(self, ident, h) -> None:
        keys = h.meta.get("keys") or self.params
        parts = [part for key in keys for part in wire.split(key, self.params[key].detach())]
        self.stats.pulls += 1
        self._reply(ident, "params", h.meta.get("id"), {"version": self.version}, parts, step=h.step)

    def _op_stats(self, ident, h, _data):
        self._reply(ident, "ok", h.meta.get("id"), {"stats": self.stats_dict()})

    def _op_bye(self, ident, h, _data):
        rank = self._rank_of(h)
        self.detached.add(rank)
        self._reply(ident, "ok", h.meta.get("id"))
        self._serve_waiting()  # ssp: the slowest worker may just have left

    # ----- durability ------------------------------------------------------------------------
    def _checkpoint_name(self) -> str:
        return f"shard-{self.cfg.shard}-of-{self.cfg.shards}.pt"

    def checkpoint(self) -> Path | None:
        """Write the shard atomically (temp file + os.replace). Nothing to write before init."""
        self._since_checkpoint = 0
        if self.optimizer is None:
            return None
        target = self.cfg.checkpoint_dir or self.cfg.resume
        if target is None:
            return None
        folder = Path(target)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self._checkpoint_name()
        state = {"format": 1, "mode": self.cfg.mode, "shard": [self.cfg.shard, self.cfg.shards],
                 "version": self.version, "sync_step": self.sync_step, "last_step": dict(self.last_step),
                 "applied": sorted(self.applied),
                 "world": self.world, "senders": dict(self.senders), "manifest": self.manifest, "pieces": self.pieces, "optim": self.optim_spec,
                 "params": {k: v.detach().clone() for k, v in self.params.items()},
                 "optimizer": self.optimizer.state_dict(), "updates": self.stats.updates,
                 "staleness": dict(self.stats.staleness)}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def _load(self, path: Path) -> None:
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint {path} for {self.cfg.name}")
        state = torch.load(path, weights_only=True)
        if state["mode"] != self.cfg.mode or list(state["shard"]) != [self.cfg.shard, self.cfg.shards]:
            raise ValueError(f"{path} holds {state['mode']} shard {state['shard']}, "
                             f"this is {self.cfg.mode} {self.cfg.name}")
        self.version, self.sync_step, self.world = state["version"], state["sync_step"], state["world"]
        self.applied = set(state["applied"])
        self.last_step = {int(r): int(t) for r, t in state["last_step"].items()}
        self.manifest = [(n, tuple(s), d) for n, s, d in state["manifest"]]
        self.pieces = {k: (d, int(n)) for k, (d, n) in state["pieces"].items()}
        self._fix_limits()
        # requests queued in workers' sockets while this shard was down arrive before their new hello
        self.senders = {str(k): int(v) for k, v in state.get("senders", {}).items()}
        self.optim_spec = state["optim"]
        self.params = dict(state["params"])
        self._build_optimizer()
        self._optimizer().load_state_dict(state["optimizer"])
        self.stats.updates = state["updates"]
        self.stats.staleness.update({int(k): v for k, v in state["staleness"].items()})
