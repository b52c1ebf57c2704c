"""One parameter-server shard: named flat tensors, a consistency mode, a sum or an optimizer, on the CPU.

The server knows nothing of models. The first worker's ``hello`` tells it
which pieces (named flat tensors) and buffers it holds, where the update runs
(``update``: the workers' optimizers on the averaged gradient, or the shard's
own copy of the optimizer, built from the worker's class name and param groups
as data), and the consistency mode the worker expects; every later worker must
say the same (manifest, pieces, optimizer, world size, shard index), or is
refused by name. The protocol is described in :mod:`commlab.transport.psproto`, the
modes (one object each) in :mod:`servers.modes`.

One thread runs everything: it receives on a ROUTER socket, validates each
header with :func:`commlab.transport.wire.decode` before touching bytes, adds gradient
frames straight from the received zmq frames into the reduction buffers, acks
a push as soon as it is folded in, lets the mode decide what the push does,
and answers the pulls that were waiting. A request it cannot serve (garbage,
unknown op or key, wrong dtype or length, a mismatched model, a push for the
wrong step) is answered with ``error`` and changes nothing.

Hostile input (see docs/faults.md): libzmq drops a peer that sends a frame
above the transport's limit; a message of more frames than the shard can need
is read frame by frame, discarded and refused; a header is checked against its
frames before any byte is used, and sizes are checked against what the shard
holds, so nothing is allocated because a header says so. NaN and Inf: in sync
mode they are summed (so every worker sees the non-finite average and every
GradScaler skips the step); in async and ssp a push carrying one is refused
and counted (``nonfinite``): one bad worker must not poison every worker's
parameters. A pull may only ask for a step its worker could have pushed, and
each worker has a bounded number of pulls waiting.

Pulls go out zero-copy from the parameter tensors themselves. zmq tracks each
such send; before the optimizer writes a tensor that a send still reads, the
tensor gets fresh storage (``p.data = p.data.clone()``) and the old buffer is
freed when the send lets go of it. Sums (update=worker) go out from buffers
that are never written again (each step gets fresh ones).

Keep-going (``min_workers=``): each key space keeps a membership (:mod:`servers.membership`); a closed
connection of a member makes its rank leave (:meth:`ParameterServer.lose`), every request but hello is
checked against it first (:meth:`ParameterServer.admit`), and a replacement enters with ``enter``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import msgpack
import torch
import zmq

from commlab.base import trace
from commlab.transport import auth, psproto, psshm, shm, sockets as transport, wire
from commlab.base.config import check_number
from commlab.base.errors import ConfigError, ProtocolError
from commlab.core.manifest import manifest_difference, optimizer_difference
from commlab.core.optim import OptimizerSpec, check_hyper
from servers.compressed import Units
from servers.metrics import StatsProbe
from servers.membership import Membership
from servers.modes import MODES, Partial, Placement, Refused, hyper_from_wire
from servers.relay import Relays
from servers.replication import Replication


_MIN_FRAMES = 16  # data frames a message may carry before any hello fixed the shard's pieces


def _finite(spec: wire.FrameSpec, frame) -> bool:
    """No NaN or Inf in a floating frame: one summing pass (a NaN or Inf makes the sum non-finite;
    half types are summed in float32 so that large finite values do not overflow it)."""
    t = wire.frame_tensor(spec, frame)
    if not t.is_floating_point() or t.numel() == 0:
        return True
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    return bool(torch.isfinite(total))


def _travel(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A pulled floating tensor as it goes on the wire: cast to ``dtype`` (a local-steps worker's anchor_dtype=)
    unless it is None, the tensor is not floating, or a finite value would not survive the cast (float16 holds
    at most 65504): then as it is, and the worker reads the dtype from the frame."""
    if dtype is None or not value.is_floating_point() or value.dtype == dtype:
        return value
    cast = value.to(dtype)
    return cast if bool(torch.isfinite(cast).all()) or not bool(torch.isfinite(value).all()) else value


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
    secret: auth.JobSecret | None = None  # the job's: only processes that prove it are served (None: anyone)
    peer_timeout: float = 60.0  # a key space whose connections are all gone this long is freed
    replica_of: str | None = None  # a backup: the primary's endpoint (servers.replication)
    replica_curve: transport.CurveKeys | None = None  # with CURVE: the backup's client key pair for that link
    replica_log: float = 4.0  # a primary's backup logs the stream; a fresh state every this many times its size

    def __post_init__(self):
        if self.mode not in psproto.MODES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {list(psproto.MODES)}")
        check_number("staleness", self.staleness, ge=0)
        check_number("log_every", self.log_every, ge=0)
        check_number("checkpoint_every", self.checkpoint_every, ge=0)
        check_number("io_threads", self.io_threads, ge=1, le=64)
        check_number("--replica-log", self.replica_log, ge=0, le=1024)
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard}/{self.shards}: the index must be in [0, {self.shards})")
        if not 0 < self.peer_timeout < 2**31 / 1000:  # (NaN fails too)
            raise ValueError(f"peer timeout must be a positive number of seconds, got {self.peer_timeout}")

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
    nonfinite: int = 0  # pushes refused for NaN/Inf (async, ssp)
    skipped: int = 0  # sync steps dropped because their summed gradient was not finite
    replaced: int = 0  # ranks' pushes of a step a dead attempt left unapplied, dropped when the job restarted
    resized: int = 0  # restarts whose attempt had another number of workers than the one before
    lost_pushes: int = 0  # keep-going: partial steps of ranks that left the membership, taken out unapplied
    bytes_in: int = 0
    bytes_out: int = 0
    copies_on_write: int = 0
    staleness: Counter = field(default_factory=Counter)
    # async/ssp: per applied update, the pushing worker's clock (the step it pushed) minus the slowest
    # active worker's clock (the step that one is on): SSP's bound S caps it at S
    clock_gap: Counter = field(default_factory=Counter)


class ParameterServer:
    """One key space of a shard: one model's pieces, buffers, mode and optimizer (ps-lite's
    "application"). Its requests reach it through the :class:`ShardServer` that owns the socket."""

    def __init__(self, cfg: ServerConfig, host: "ShardServer", space: str = ""):
        self.cfg = cfg
        self.host = host
        self.space = space  # the name workers give it ("" : a job's first exchanger)
        self.stats = Stats()
        self.mode = MODES[cfg.mode](self)
        # what the first hello fixed
        self.manifest: list | None = None
        self.pieces: dict[str, tuple[str, int]] = {}  # key -> (dtype, numel), in hello order
        self.piece_param: dict[str, str] = {}  # key -> the parameter it is a range of
        self.buffer_keys: dict[str, tuple[str, int]] = {}  # module buffers this shard carries
        self.optim_desc: dict | None = None
        self.placement: Placement | None = None  # where the update runs (servers.modes.PLACEMENTS), from hello
        self.world: int | None = None
        self.units: Units | None = None  # compress= (servers.compressed): the compressed units and their sums
        self.compress_fixed = False  # a hello fixed compress= (or its absence)
        # state
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.buf_round = -1  # the last step whose buffers are complete
        self.buf_acc: dict[int, tuple[str, bool, dict]] = {}  # round -> (how, joining, rank -> key -> its buffer)
        self.optimizer: torch.optim.Optimizer | None = None
        self.initialized = False
        # the start gate: a worker's first pull ("start") is answered once rank 0 initialised the shard and
        # every rank of the job asked, so no worker can push before every worker holds the same start
        self.starters: set[int] = set()
        self.started = False
        self.version = 0
        self.senders: dict[str, int] = {}  # wire sender -> rank
        self.detached: set[int] = set()
        self.gone: set[int] = set()  # ranks that said bye (closed their exchanger)
        self.joined: dict[int, tuple[int, bool]] = {}  # rank -> (first step it did not push, divide by N): ex.join()
        self.terminated: int | None = None  # the rank that joined with throw_on_early_termination: pushes refused
        # the parameters of the last joiner so far (the largest (step, rank)), which become the shard's when every
        # worker has joined: not before, since under local steps the shard's parameters are the anchor the workers
        # still training sync against
        self.kept: dict[str, torch.Tensor] = {}
        self.waiting: list[tuple[bytes, wire.Header]] = []  # deferred pulls
        self.trackers: dict[str, list] = {}  # key -> zmq trackers of sends reading it
        self._since_checkpoint = 0
        self.boot = host.boot  # the process's incarnation: a worker that sees it change resends
        self.max_parts = 2 + _MIN_FRAMES  # identity + header + data frames; grows with the pieces at hello
        self.max_bytes = 0  # data bytes a request may carry: the whole shard, once the pieces are known
        # transport=shm: per worker connection (zmq identity), two segments its payloads cross through
        self.links: dict[bytes, psshm.Link] = {}
        self.link_of: dict[str, bytes] = {}  # sender -> the identity its link belongs to (one link per sender)
        self.shm_run = host.shm_run
        self.attempt = 0  # the job's restarts so far (TORCHELASTIC_RESTART_COUNT, from hello)
        self.blobs: dict[int, tuple[int, torch.Tensor]] = {}  # rank -> (step, bytes): ex.commit_state
        self.members = Membership(cfg.name)  # keep-going (min_workers=): who is in, the epoch, the quorum
        self.relays = Relays(self)  # keep-going under update=worker: replacements' state from a live peer

    @property
    def last_step(self) -> dict[int, int]:
        """rank -> last step applied (-1: none): the mode's bookkeeping (:attr:`servers.modes.Mode.last_step`)."""
        return self.mode.last_step

    @property
    def update(self) -> str | None:
        """The placement's name (``update=``), None before the first hello."""
        return self.placement.spec.name if self.placement is not None else None

    @property
    def sock(self) -> zmq.Socket:
        return self.host.sock

    def _close_links(self) -> None:
        for ident in list(self.links):
            self._drop_link(ident)

    def _drop_link(self, ident: bytes) -> None:
        link = self.links.pop(ident, None)
        if link is None:
            return
        for sender, owner in list(self.link_of.items()):
            if owner == ident:
                del self.link_of[sender]
        link.close()

    def stats_dict(self) -> dict:
        s = self.stats
        return {"space": self.space, "shard": self.cfg.shard, "shards": self.cfg.shards, "mode": self.cfg.mode, "update": self.update,
                "version": self.version, "updates": s.updates, "pushes": s.pushes, "duplicates": s.duplicates,
                "pulls": s.pulls, "refused": s.refused, "dropped": s.dropped, "nonfinite": s.nonfinite,
                "skipped": s.skipped, "replaced": s.replaced, "resized": s.resized, "world": self.world,
                "lost_pushes": s.lost_pushes, "members": self.members.stats(), "relays": self.relays.stats(),
                "attempt": self.attempt, "boot": self.boot, "sync_step": self.mode.gathering,
                "waiting_for": self._waiting_for(), "gate": self._gate(), "whole": self.mode.whole(),
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "queue": len(self.waiting),
                "copies_on_write": s.copies_on_write, "workers": sorted(self.senders.values()),
                "shm_links": len(self.links),
                "last_step": {str(r): t for r, t in sorted(self.last_step.items())},
                "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
                "max_staleness": max(s.staleness, default=0),
                "clock_gap": {str(k): v for k, v in sorted(s.clock_gap.items())}}

    def _gate(self) -> str:
        """What the start pulls wait for ("" once the start gate is open)."""
        if self.started or not self.world:
            return ""
        if not self.initialized:
            return "the initial parameters from rank 0"
        return "every rank's setup"

    def _waiting_for(self) -> list[int]:
        if not self.world:
            return []
        if not self.started and any(w.meta.get("start") for _, w in self.waiting):
            return [0] if not self.initialized else sorted(set(range(self.world)) - self.starters)
        return self.mode.waiting_for() if self.waiting else []

    def _reply(self, ident: bytes, op: str, req_id, meta: dict | None = None, parts=(), step: int = -1,
               tracked: bool = True, payloads: psshm.Payloads = psshm.FRAMES) -> None:
        t0 = self.host._trace.now() if self.host._trace is not None else 0
        at = payloads.place(list(parts))  # through a link: copied into the worker's outbound segment
        meta = dict(meta or {}, id=req_id, **self.host.repl.reply_fields())  # (replicated: the shard's servers)
        frames = [ident, *wire.encode(op, f"server{self.cfg.shard}", step, parts, meta, at)]
        # data frames zmq may still read from the shard's tensors: tracked (a header alone carries no bytes of
        # them: its payload, if any, is in the worker's segment)
        track = bool(parts) and at is None
        self.host.emit(frames, [spec.key for spec, _ in parts] if track and tracked else [], self, track)
        self.stats.bytes_out += sum(spec.nbytes for spec, _ in parts)
        if self.host._trace is not None:
            self.host._trace_reply(ident, req_id, op, sum(spec.nbytes for spec, _ in parts), t0)

    def _rank_of(self, h: wire.Header) -> int:
        rank = self.senders.get(h.sender)
        if rank is None:
            raise Refused(f"{h.sender} sent {h.op} before hello")
        return rank

    # ----- ops -------------------------------------------------------------------------------
    def _op_hello(self, ident, h, _data):
        m = h.meta
        rank, world = m.get("rank"), m.get("world")
        self.mode.check_hello(m, h.sender)
        placement = self.mode.placement(m.get("update"), h.sender)
        update = placement.spec.name
        if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
            raise Refused(f"hello from {h.sender}: bad rank/world {rank!r}/{world!r}")
        if m.get("shard") != [self.cfg.shard, self.cfg.shards]:
            raise Refused(f"worker {h.sender} thinks this is shard {m.get('shard')}, but it is {self.cfg.name}: "
                          f"list the servers in shard order")
        try:
            manifest = [(str(n), tuple(int(x) for x in s), str(d)) for n, s, d in m.get("manifest")]
            rows = [list(row) for row in m.get("pieces")]
            pieces = {str(r[0]): (str(r[1]), int(r[2])) for r in rows}
            owner = {str(r[0]): str(r[3]) if len(r) > 3 else str(r[0]) for r in rows}
            buffers = {str(k): (str(d), int(n)) for k, d, n in m.get("buffers") or []}
            if any(d not in wire.DTYPES or n < 0 for d, n in [*pieces.values(), *buffers.values()]):
                raise ValueError("bad dtype or size")
            optim = m.get("optim")
            if not (isinstance(optim, dict) and isinstance(optim.get("class"), str)
                    and isinstance(optim.get("groups"), list)
                    and all(isinstance(g, dict) and isinstance(g.get("params"), list) and isinstance(g.get("hyper"), dict)
                            for g in optim["groups"])):
                raise ValueError("the optimizer is not {class, groups: [{params, hyper}]}")
            for i, g in enumerate(optim["groups"]):  # numbers where numbers belong, before anything is fixed
                check_hyper(optim["class"], g["hyper"], f"param group {i}")
        except Exception as exc:
            raise Refused(f"hello from {h.sender}: unreadable manifest, pieces or optimizer ({exc})") from None
        placement.check(optim)  # refused by name before anything is fixed
        attempt = m.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < self.attempt:
            raise Refused(f"hello from {h.sender} of attempt {attempt!r}: the job on {self.cfg.name} is at attempt "
                          f"{self.attempt} (a process of an earlier attempt, or a store that forgot the job's rounds)")
        new_round = attempt > self.attempt  # a restarted job, possibly of another size (torchrun --nnodes MIN:MAX)
        if self.manifest is None:
            if self.world is not None and world != self.world and not new_round:  # resumed state fixes the world
                raise Refused(f"worker {h.sender} says {world} workers; the resumed shard had {self.world}")
            if self.update is not None and update != self.update:
                raise Refused(f"worker {h.sender} asks for update={update}; the resumed shard ran update={self.update}")
            self.manifest, self.pieces, self.piece_param, self.buffer_keys = manifest, pieces, owner, buffers
            self.optim_desc, self.world = optim, world
            if self.placement is None:
                self.placement = placement
            self._fix_limits()
        else:
            diff = manifest_difference(self.manifest, manifest, f"worker {h.sender}")
            if diff:
                raise Refused(f"model mismatch on {self.cfg.name}: {diff}")
            if pieces != self.pieces or buffers != self.buffer_keys:
                raise Refused(f"worker {h.sender} assigned different pieces to {self.cfg.name}")
            if update != self.update:
                raise Refused(f"worker {h.sender} asks for update={update}, the shard runs update={self.update}")
            diff = optimizer_difference(self.optim_desc, optim, f"worker {h.sender}")
            if diff and self.initialized:
                # once training started a scheduler may have moved hyperparameters (a worker that joins or
                # reconnects later): then only the class and the groups' parameters must agree
                same = optim["class"] == self.optim_desc["class"] and \
                    [g["params"] for g in optim["groups"]] == [g["params"] for g in self.optim_desc["groups"]]
                diff = None if same else diff
            if diff:
                raise Refused(f"optimizer mismatch on {self.cfg.name}: {diff}")
            if world != self.world and not new_round:
                raise Refused(f"worker {h.sender} says {world} workers, the first worker said {self.world}")
        if new_round:
            self._new_attempt(attempt, world)
        self._agree_compress(h.sender, m.get("compress"))
        self.members.fix(m.get("min_workers"), h.sender, world)
        entering = self.members.hello(rank, ident, m)  # refuses a stale process of a lost rank
        self.senders[h.sender] = rank
        self.detached.discard(rank)
        self.gone.discard(rank)
        self.last_step.setdefault(rank, self.mode.start_step() - 1)
        reply = {"initialized": self.initialized, "next_step": self.mode.expected_step(rank), "boot": self.boot,
                 "version": self.version, "mode": self.cfg.mode, "staleness": self.cfg.staleness,
                 "update": self.update, "attempt": self.attempt, "epoch": self.members.epoch}
        if entering:  # a replacement: the soonest step it may enter at (the enter request fixes it)
            reply["enter"] = self.mode.entry_step(rank)
        if "shm_host" in m:
            reply["shm_link"] = self._open_link(ident, h.sender, m["shm_host"])
        self._reply(ident, "ok", m.get("id"), reply)

    def _new_attempt(self, attempt: int, world: int) -> None:
        """The first hello of a restarted job (every rank was stopped and starts again, torchrun's
        restart): what the dead attempt left half-done goes, so that the new attempt's pushes replace it
        and every step is applied once (the mode's :meth:`~servers.modes.Mode.restart`); its pulls, joins
        and byes go with it, and the start gate closes again, so every rank of the new attempt starts from
        the same parameters. What the servers applied stays: update=server resumes from it. Under
        update=worker the shard holds no trained parameters (only sums), so rank 0 initialises it again
        from its own (its checkpoint).

        ``world``: the new attempt's size, which replaces the old one's membership (torchrun's elastic
        rendezvous renumbers the ranks 0..world-1): a sync step averages over the new N, SSP's bound counts
        the new ranks, and the departed ranks' clocks, connections and links go."""
        self.attempt = attempt
        self.members.reset()
        self.relays = Relays(self)
        if self.world is not None and world != self.world:
            self.stats.resized += 1
            for sender, rank in list(self.senders.items()):
                if rank >= world:
                    del self.senders[sender]
                    old = self.link_of.get(sender)
                    if old is not None:
                        self._drop_link(old)
            for rank in [r for r in self.last_step if r >= world]:
                del self.last_step[rank]
            if self.units is not None:  # compress=: a rank's share of a summed aggregate is now 1/world
                self.units.comp.bind(world)
        self.world = world
        self.stats.replaced += self.mode.restart()
        self.waiting = []  # the dead processes' pulls
        self.starters.clear()
        self.started = False
        self.joined.clear()
        self.kept = {}
        self.terminated = None
        self.detached.clear()
        self.gone.clear()
        self.buf_acc.clear()
        if self.placement is not None and not self.placement.spec.shards_step:
            self.initialized = False  # the shard holds sums only: rank 0 initialises it again from its checkpoint

    # ----- membership (keep-going: servers.membership) ----------------------------------------
    def pushers(self, t: int) -> list[int]:
        """The ranks whose pushes step ``t`` takes: not joined by then, not lost, entered by then."""
        out = self.members.out()
        return [r for r in self.active_at(t) if r not in out and self.mode.enters.get(r, t) <= t]

    def admit(self, ident: bytes, h: wire.Header) -> None:
        """Before a request (not hello): refused when the job lost its quorum or it comes from a lost rank's
        process (:meth:`servers.membership.Membership.check`)."""
        self.members.check(self.senders.get(h.sender), ident, h.op, h.sender)

    def connection_closed(self, ident: bytes) -> None:
        """A connection closed: under keep-going, its rank (if it had not said bye) leaves the membership (and, where
        a backup is attached, the loss goes in its stream: :meth:`servers.replication.Replication.losing`)."""
        rank = self.members.closed(ident)
        if rank is not None and rank not in self.gone:
            self.host.repl.losing(self.space, rank, "its connection closed")  # replicated: the backup loses it too
            try:
                self.lose(rank, "its connection closed")
            finally:
                self.host.repl.done()  # what the loss answered waits for the backup's ack

    def lose(self, rank: int, why: str) -> None:
        """``rank`` leaves: its partial step is taken out (counted in ``lost_pushes``), the step in flight
        completes over the ranks left, and the waiting pulls it held are answered; below the quorum every
        waiting pull gets the line that names the ranks lost."""
        # the first step gathered without it: the one in flight, or the next where its whole push is in (kept)
        step = self.mode.gathering if self.mode.gathering is not None else self.mode.expected_step(rank)
        if self.mode.gathering is not None and self.mode.step_in(rank):
            step += 1
        ended = self.members.ended
        dropped = self.mode.lose(rank) if self.initialized else 0
        self.members.lose(rank, step, why, self.world_size())
        self.relays.lose(rank, why)
        self.stats.lost_pushes += dropped
        print(f"commlab server {self.cfg.name}: rank {rank} left the job at step {step} ({why}); membership epoch "
              f"{self.members.epoch}, {self.world_size() - len(self.members.lost)} of {self.world_size()} ranks left"
              + (f", its partial step dropped" if dropped > 0 else ""), file=sys.stderr, flush=True)
        if self.members.ended:
            if not ended:
                print(f"commlab server {self.cfg.name}: {self.members.ended}", file=sys.stderr, flush=True)
            for ident, w in self.waiting:
                self.stats.refused += 1
                self._reply(ident, "error", w.meta.get("id"), {"reason": self.members.ended})
            self.waiting = []
            return
        self.mode.settle()
        for t in sorted(self.buf_acc):  # a buffers round may have waited for this rank alone
            self._finish_buffers(t)
        self._serve_waiting()
        self._open_gate()

    def _op_live(self, ident, h, _data):
        """heartbeat_s=: this connection is the rank's heartbeat, silent but for zmq's PINGs; its closing (the
        TTL ran out: the worker froze) counts as the rank's."""
        self.members.heartbeat(self.senders.get(h.sender), ident, h.sender)
        self._reply(ident, "ok", h.meta.get("id"))

    def _op_enter(self, ident, h, _data):
        """A replacement for a lost rank enters at step ``h.step`` (the largest its shards offered at hello), or
        hears the soonest step this shard can take it at now (the survivors went on meanwhile)."""
        rank = self._rank_of(h)
        moving = rank not in self.members.pending
        if moving and not self.mode.entry_open(rank):
            raise Refused(f"enter from {h.sender}: rank {rank} is no replacement waiting to enter {self.cfg.name}")
        if not self.placement.spec.shards_step and self.units is not None:
            raise Refused(f"enter from {h.sender}: a replacement under update={self.update} with compress= is not "
                          f"built (it would need the compressor's shared state): use update=server, or commlab run "
                          f"--max-restarts")
        soonest = self.mode.entry_step(rank)
        if h.step < soonest:
            self._reply(ident, "ok", h.meta.get("id"), {"entered": False, "enter": soonest})
            return
        self.mode.enter(rank, h.step)
        if not self.placement.spec.shards_step:  # the shards hold sums only: a live peer's state is relayed
            self.relays.enter(rank, h.step)
        if not moving:
            self.members.entered(rank)
        print(f"commlab server {self.cfg.name}: rank {rank} entered at step {h.step} (a replacement); membership "
              f"epoch {self.members.epoch}", file=sys.stderr, flush=True)
        self._reply(ident, "ok", h.meta.get("id"), {"entered": True, "epoch": self.members.epoch})
        if moving:  # a step that owed its push may be complete without it now
            self.mode.settle()
            self._serve_waiting()

    def _open_link(self, ident: bytes, sender: str, where) -> dict:
        """transport=shm: two segments for this connection's payloads (see :mod:`commlab.transport.psshm`), or
        ``{"refused": why}``. One link per sender (a reconnect's hello replaces it), at most
        ``2 * world + 2`` in all: each costs twice the shard's bytes of memory."""
        if not isinstance(where, str) or where != shm.host_identity():
            return {"refused": f"{self.cfg.name} runs on another host or network namespace (its boot id and "
                               f"namespace differ from the worker's)"}
        old = self.link_of.get(sender)
        if old is not None:
            self._drop_link(old)
        self._drop_link(ident)
        limit = 2 * self.world_size() + 2
        if len(self.links) >= limit:
            return {"refused": f"{self.cfg.name} holds {len(self.links)} shared-memory links already (limit {limit})"}
        pieces = [(k, d, n) for k, (d, n) in self.pieces.items()]
        try:
            link = psshm.Link.create(self.shm_run, f"s{self.cfg.shard}-{self.host.links_made}", pieces)
        except OSError as exc:
            return {"refused": f"{self.cfg.name} cannot create shared memory: {exc}"}
        self.host.links_made += 1
        self.links[ident] = link
        self.link_of[sender] = ident
        return link.describe()

    def _agree_compress(self, sender: str, desc) -> None:
        """``compress=`` (:mod:`servers.compressed`): the first hello fixes it (or its absence), every later
        one must say the same."""
        if desc is not None and not isinstance(desc, dict):
            raise Refused(f"hello from {sender}: 'compress' must be a map")
        if desc is not None:
            desc = {"spec": desc.get("spec"), "ef": bool(desc.get("ef")), "units": desc.get("units")}
        if not self.compress_fixed:
            self.units = Units(desc, self.pieces, self.world_size()) if desc is not None else None
            self.compress_fixed = True
            self._fix_limits()
            return
        mine = self.units.desc if self.units is not None else None
        if desc != mine:
            said = lambda d: "no compress=" if d is None else f"compress={d['spec']}&ef={int(d['ef'])}"
            what = " (the same spec, other units)" if said(desc) == said(mine) else ""
            raise Refused(f"worker {sender} asks for {said(desc)}, the first worker of {self.cfg.name} for "
                          f"{said(mine)}{what}: every rank must compress alike")

    def _fix_limits(self) -> None:
        """Most frames and data bytes a request can need: every piece and buffer of the shard, in frames of
        at most MAX_FRAME. Fixed once the pieces are (hello, or resumed state), not recomputed per message."""
        held = [*self.pieces.values(), *self.buffer_keys.values()]
        self.max_bytes = sum(wire.DTYPES[d].itemsize * n for d, n in held)
        need = sum(max(1, -(-wire.DTYPES[d].itemsize * n // wire.MAX_FRAME)) for d, n in held)
        if self.units is not None:  # a compressed push: a few payload tensors per unit (top-k at F=1: 2x the bytes)
            self.max_bytes = max(self.max_bytes, self.units.max_bytes)
            need += 2 * sum(2 + u.n * 8 // wire.MAX_FRAME for u in self.units.units.values())
        self.max_parts = 2 + max(_MIN_FRAMES, need)

    def _op_init(self, ident, h, data):
        if self._rank_of(h) != 0:  # a fresh job starts from rank 0's parameters and buffers, as under DDP
            raise Refused(f"init from {h.sender}: only rank 0 initialises {self.cfg.name}")
        if self.initialized:
            self._reply(ident, "ok", h.meta.get("id"), {"ignored": True})
            return
        params = self._check_frames(h, data, require_all=True)
        buffers = self._check_frames(h, data, require_all=True, table=self.buffer_keys)
        self.params = {key: self._gather(key, parts, self.pieces) for key, parts in params.items()}
        self.buffers = {key: self._gather(key, parts, self.buffer_keys) for key, parts in buffers.items()}
        self._build_optimizer()
        self.initialized = True
        self._reply(ident, "ok", h.meta.get("id"))
        self._serve_waiting()
        self._open_gate()

    @staticmethod
    def _gather(key: str, parts: list, table: dict) -> torch.Tensor:
        dtype, numel = table[key]
        t = torch.empty(numel, dtype=wire.DTYPES[dtype])
        for spec, frame in parts:
            t[spec.offset:spec.offset + spec.count].copy_(wire.frame_tensor(spec, frame))
        return t

    def world_size(self) -> int:
        if self.world is None:
            raise Refused("no worker has said hello yet: the world size is unknown")
        return self.world

    def new_buffer(self, key: str) -> torch.Tensor:
        dtype, numel = self.pieces[key]
        return torch.empty(numel, dtype=wire.DTYPES[dtype])

    def _build_optimizer(self) -> None:
        """What the placement steps the pieces with (:meth:`servers.modes.Placement.build_optimizer`)."""
        self.params = {k: self.params[k] for k in self.pieces}  # hello order, on every shard the same
        if self.placement is None:
            raise Refused("no placement yet: a worker must say hello first")
        self.optimizer = self.placement.build_optimizer(self)

    def check_hyper(self, hyper) -> None:
        """Refuse group hyperparameters from the wire (a push's or commit's) that :meth:`set_hyper` could not
        set: one dict per group, numbers where the optimizer's are (:func:`commlab.core.optim.check_hyper`)."""
        if hyper is None or self.optimizer is None:
            return
        if not isinstance(hyper, list) or len(hyper) != len(self.optimizer.param_groups) \
                or not all(isinstance(h, dict) for h in hyper):
            raise Refused(f"hyperparameters for {len(hyper) if isinstance(hyper, list) else '?'} group(s); "
                          f"the optimizer has {len(self.optimizer.param_groups)}")
        try:
            for i, values in enumerate(hyper):
                check_hyper(self.optim_desc["class"] if self.optim_desc else "", values, f"param group {i}")
        except ConfigError as exc:
            raise Refused(f"hyperparameters: {exc}") from None

    def set_hyper(self, hyper) -> None:
        """A scheduler's (or the user's) change of group hyperparameters, carried by a push or commit."""
        self.check_hyper(hyper)  # every group's values before any is set
        if hyper is None or self.optimizer is None:
            return
        for group, values in zip(self.optimizer.param_groups, hyper):
            for k, v in hyper_from_wire(values).items():
                if k != "params":
                    group[k] = v

    def _op_push(self, ident, h, data):
        rank = self._rank_of(h)
        if not self.initialized:
            raise Refused(f"push from {h.sender} before any worker initialised {self.cfg.name}")
        t = h.step
        self.stats.pushes += 1
        if self.terminated is not None:
            raise Refused(f"rank {self.terminated} exhausted all inputs (join with throw_on_early_termination)")
        if h.meta.get("attempt", 0) != self.attempt:  # queued before its process died; the new attempt redoes it
            raise Refused(f"push of step {t} from {h.sender} of attempt {h.meta.get('attempt', 0)!r}: the job is at "
                          f"attempt {self.attempt}")
        if t <= self.last_step[rank]:  # sent again after a reconnect: applied once already
            self.stats.duplicates += 1
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        expected = self.mode.expected_step(rank)
        if t != expected:
            raise Refused(f"push of step {t} from {h.sender}, but {self.cfg.name} expects step {expected} from it")
        if self.mode.step_in(rank):  # sync: its step is in, the others' are not yet
            self.stats.duplicates += 1
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        part = self.mode.partial_step(rank, t)
        if "unit" in h.meta:
            self._push_unit(ident, h, data, rank, t, part)
            return
        frames = self._check_frames(h, data, require_all=False)
        if self.mode.refuses_nonfinite:
            bad = next((spec.key for parts in frames.values() for spec, frame in parts if not _finite(spec, frame)),
                       None)
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
        if "shm" in h.meta:  # acknowledged once read: the worker may write the place again after the ack
            self.mode.fold(rank, t, part, frames, absent, {"base": base, "hyper": h.meta.get("hyper")})
            self._reply(ident, "ok", h.meta.get("id"), step=t)
        else:
            self._reply(ident, "ok", h.meta.get("id"), step=t)  # acknowledged on arrival
            self.mode.fold(rank, t, part, frames, absent, {"base": base, "hyper": h.meta.get("hyper")})
        self._serve_waiting()

    def _push_unit(self, ident, h, data, rank: int, t: int, part: Partial) -> None:
        """A compressed push (:mod:`servers.compressed`): one unit's payload of one round; folded, then
        acknowledged (its frames were checked against the unit, not against the pieces)."""
        if self.units is None:
            raise Refused(f"push of a compressed unit from {h.sender}, but its hello said no compress=")
        unit, r = self.units.unit(h)
        payload = self.units.payload(h, data, unit)
        absent, cmeta, base = h.meta.get("absent", []), h.meta.get("cmeta", {}), h.meta.get("base")
        skipped = self.units.skipped(unit, absent) if isinstance(absent, list) else None
        if not isinstance(cmeta, dict) or skipped is None or (absent and r):
            raise Refused(f"push from {h.sender}: 'cmeta' must be a map, 'absent' keys of unit {unit.key} or of "
                          f"whole other units (round 0)")
        if not isinstance(base, int) or base > self.version:
            raise Refused(f"push from {h.sender}: bad base version {base!r} (server is at {self.version})")
        done = part.rounds.get(unit.key, -1)
        if r <= done:  # sent again after a reconnect
            self.stats.duplicates += 1
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        if r != done + 1:
            raise Refused(f"push of unit {unit.key} round {r} from {h.sender}, which has not pushed round {done + 1}")
        self.mode.fold_unit(rank, t, part, self.units, unit, r, payload, absent,
                            {"base": base, "hyper": h.meta.get("hyper"), "cmeta": cmeta, "skipped": skipped})
        self._reply(ident, "ok", h.meta.get("id"), step=t)
        self._serve_waiting()

    def _op_commit(self, ident, h, _data):
        """update=server, sync: this worker's optimizer.step() (factor, hyperparameters), or a skip."""
        rank = self._rank_of(h)
        reply = self.mode.commit(rank, h.step, h.meta)
        self._reply(ident, "ok", h.meta.get("id"), reply, step=h.step)
        self._serve_waiting()

    def step_optimizer(self, grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step over the keys in ``grads`` (the others get no gradient: torch skips them)."""
        if self.optimizer is None:
            raise Refused(f"{self.cfg.name} holds no optimizer (update={self.update})")
        for key, p in self.params.items():
            g = grads.get(key)
            if g is not None:
                self._writable(key)
            p.grad = g
        if grads:
            self.optimizer.step()
        for p in self.params.values():
            p.grad = None

    def _writable(self, key: str) -> None:
        """Before ``self.params[key]`` is written: fresh storage if a pull still reads it."""
        if any(not tr.done for tr in self.trackers.get(key, ())):
            p = self.params[key]
            p.data = p.data.clone()
            self.stats.copies_on_write += 1
        self.trackers.pop(key, None)

    def summed(self, key: str) -> None:
        """Sync: ``key``'s average for the step in flight is final (every worker's push of it is in): a replicated
        shard sends it to its backup now, while the rest of the step arrives (:mod:`servers.replication`)."""
        self.host.repl.summed(self, key)

    def count_update(self, staleness: list[int]) -> None:
        self.version += 1
        self.stats.updates += 1
        if self.host._trace is not None and staleness:
            self.host._trace.counter(f"staleness {self.space or 'space0'}", {"max": max(staleness)})
        for s in staleness:
            self.stats.staleness[s] += 1
        self._since_checkpoint += 1
        if self.cfg.checkpoint_every and self._since_checkpoint >= self.cfg.checkpoint_every:
            self.checkpoint()

    def _check_frames(self, h: wire.Header, data, require_all: bool, table: dict | None = None) -> dict[str, list]:
        """Frames grouped by key; each key's frames must cover it exactly, in order, in its dtype.

        ``table``: the keys to take (default the pieces); frames of the other table (buffers, or pieces)
        are skipped, any other key is refused."""
        table = self.pieces if table is None else table
        known = {**self.pieces, **self.buffer_keys}
        frames: dict[str, list] = {}
        for spec, frame in zip(h.frames, data):
            if spec.key not in known:
                raise Refused(f"{h.op} from {h.sender}: {self.cfg.name} holds no key {spec.key!r}")
            if spec.key in table:
                frames.setdefault(spec.key, []).append((spec, frame))
        for key, parts in frames.items():
            dtype, numel = table[key]
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
        if require_all and set(frames) != set(table):
            missing = sorted(set(table) - set(frames))
            raise Refused(f"{h.op} from {h.sender} lacks key(s) {missing[:3]}")
        return frames

    # ----- pulls -----------------------------------------------------------------------------
    PULLS = ("params", "sum", "report", "buffers", "final", "csum", "heal")
    STEP_PULLS = frozenset({"sum", "report", "csum"})  # the mode serves these (servers.modes.Mode.step_pulls)

    def _op_pull(self, ident, h, _data):
        rank = self._rank_of(h)
        after, keys, what = h.meta.get("after_step"), h.meta.get("keys"), h.meta.get("what", "params")
        if not isinstance(after, int):
            raise Refused(f"pull from {h.sender} without an integer after_step")
        if what not in self.PULLS:
            raise Refused(f"pull from {h.sender}: 'what' must be one of {list(self.PULLS)}")
        if keys is not None and (not isinstance(keys, list) or not keys or
                                 any(not isinstance(k, str) or k not in self.pieces for k in keys)):
            raise Refused(f"pull from {h.sender}: 'keys' must list keys {self.cfg.name} holds")
        if "as" in h.meta and (not isinstance(h.meta["as"], str) or h.meta["as"] not in self.PULL_DTYPES
                               or what != "params"):
            raise Refused(f"pull from {h.sender}: 'as' must be one of {sorted(self.PULL_DTYPES)}, on a pull of "
                          f"params (got {h.meta['as']!r} on {what})")
        if what in self.STEP_PULLS and what not in self.mode.step_pulls():
            raise Refused(f"pull of {what} from {h.sender}: {self.cfg.name} runs {self.mode.name} with "
                          f"update={self.update} {'with' if self.units is not None else 'without'} compress=")
        if what == "csum" and self.units is not None:
            self.units.unit(h)
        # A worker pulls after pushing on the same connection: the push is here already. A pull for a
        # later step could only wait forever, so it is refused, and so is a flood of waiting pulls.
        latest = self.mode.latest_pull(rank)
        if after > latest:
            raise Refused(f"pull after step {after} from {h.sender}, which has not pushed it ({self.cfg.name} "
                          f"is at step {latest} for it)")
        if what in ("sum", "csum") and after < latest - 1:
            raise Refused(f"pull of the sum of step {after} from {h.sender}: {self.cfg.name} keeps only step "
                          f"{latest - 1}'s")
        if sum(1 for _, w in self.waiting if w.sender == h.sender) >= len(self.pieces) + 4:
            raise Refused(f"pull from {h.sender}: {len(self.pieces) + 4} of its pulls wait already")
        if h.meta.get("start") is True:
            self.starters.add(rank)
        if self._ready(h):
            self._send(ident, h)
        else:
            self.waiting.append((ident, h))
        self._open_gate()

    def _open_gate(self) -> None:
        """Open the start gate once the shard is initialised and every rank sent its start pull."""
        if not self.started and self.initialized and self.world and \
                self.starters | self.members.out() >= set(range(self.world)):  # (keep-going: the lost are not waited for)
            self.started = True
            self._serve_waiting()

    def _ready(self, h: wire.Header) -> bool:
        if not self.initialized:
            return False
        if h.meta.get("start") is True and not self.started:
            return False
        rank, after, what = self.senders[h.sender], h.meta["after_step"], h.meta.get("what", "params")
        if what == "heal":  # a replacement (update=worker): a live peer's state, once all of it is here
            return self.relays.ready(rank)
        if what == "final":  # a joined worker: every worker has joined, or the model moved on since it asked
            return len(self.joined) == self.world_size() or self.version != h.meta.get("version")
        if after < 0:
            return True
        if what == "buffers":
            return not self.mode.buffers_wait or self.buf_round >= after
        return self.mode.ready(rank, after, what, h.meta)

    def _serve_waiting(self) -> None:
        still = []
        for ident, h in self.waiting:
            if self._ready(h):
                self._send(ident, h)
            else:
                still.append((ident, h))
        self.waiting = still

    PULL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # a pull's 'as' (local steps' anchor)

    def _send(self, ident, h) -> None:
        what, rid = h.meta.get("what", "params"), h.meta.get("id")
        self.stats.pulls += 1
        payloads = self.links.get(ident) if h.meta.get("shm_reply") else psshm.FRAMES
        if payloads is None:
            self.stats.refused += 1
            self._reply(ident, "error", rid, {"reason": f"pull from {h.sender} asks for a reply in shared memory, "
                                                        f"but its connection has no link to {self.cfg.name}"})
            return
        if what in self.STEP_PULLS:  # _op_pull let through only what the mode serves
            op, meta, parts, linked = self.mode.answer(what, h)
            if what == "sum":  # keep-going, update=worker: the donor of a replacement's state is asked here
                meta.update(self.relays.ask(self.senders[h.sender], h.meta["after_step"]))
            self._reply(ident, op, rid, meta, parts, step=h.step, tracked=False,
                        payloads=payloads if linked else psshm.FRAMES)
            return
        if what == "heal":
            op, meta, parts = self.relays.answer(self.senders[h.sender])
            self.stats.refused += op == "error"
            self._reply(ident, op, rid, meta, parts, step=h.step, tracked=False)
            return
        if what == "buffers":
            parts = [part for k, v in self.buffers.items() for part in wire.split(k, v)]
            self._reply(ident, "params", rid, {"version": self.version}, parts, step=h.step, tracked=False)
            return
        if what == "final" and len(self.joined) < self.world_size():
            self._reply(ident, "ok", rid, {"version": self.version, "final": False}, step=h.step)
            return
        keys = h.meta.get("keys") or self.params
        cast = self.PULL_DTYPES.get(h.meta.get("as", ""))
        parts = [part for key in keys for part in wire.split(key, _travel(self.params[key].detach(), cast))]
        if h.meta.get("with_buffers") is True and self.buffers:  # a start pull: the buffers of the same moment
            parts += [part for k, v in self.buffers.items() for part in wire.split(k, v)]
            payloads = psshm.FRAMES
        self._reply(ident, "params", rid, {"version": self.version}, parts, step=h.step, payloads=payloads)

    # ----- buffers, optimizer state ----------------------------------------------------------
    def _op_buffers(self, ident, h, data):
        """Module buffers of step ``h.step``: ``broadcast`` takes one rank's (rank 0's; keeping going, the lowest rank
        in the step, so every rank sends them then), ``average`` the mean of the floating buffers of every rank in
        the step, added in rank order (integer ones, such as BatchNorm's counter, the lowest rank's). Inside
        ex.join() the ranks still training count and the highest one's is taken (DDP's)."""
        rank = self._rank_of(h)
        how = h.meta.get("how")
        if how not in ("broadcast", "average"):
            raise Refused(f"buffers from {h.sender}: 'how' must be broadcast or average")
        frames = self._check_frames(h, data, require_all=True, table=self.buffer_keys)
        t = h.step
        self._reply(ident, "ok", h.meta.get("id"), step=t)
        if t <= self.buf_round:
            return  # sent again after a reconnect, or a rank the round did not wait for
        _, _, got = self.buf_acc.setdefault(t, (how, bool(h.meta.get("joining")), {}))
        if rank not in got:  # (a resend after a reconnect: the first stands)
            got[rank] = {k: self._gather(k, parts, self.buffer_keys) for k, parts in frames.items()}
        self._finish_buffers(t)
        self._serve_waiting()

    def _finish_buffers(self, t: int) -> None:
        """Round ``t`` of the buffers, if every rank it needs sent them: the ranks in step ``t`` (keeping going: those
        left; a loss re-checks the rounds open, :meth:`lose`)."""
        how, joining, got = self.buf_acc[t]
        ranks = self.pushers(t) if joining or self.members.on else list(range(self.world_size()))
        if not ranks:
            return
        source = max(ranks) if joining else min(ranks)
        if any(r not in got for r in (ranks if how == "average" else [source])):
            return
        if how == "broadcast":
            self.buffers = got[source]
        else:
            mean = {}
            for k, v in got[source].items():
                if v.is_floating_point():
                    mean[k] = got[ranks[0]][k].mul(1.0 / len(ranks))
                    for r in ranks[1:]:
                        mean[k].add_(got[r][k], alpha=1.0 / len(ranks))
                else:
                    mean[k] = v
            self.buffers = mean
        self.buf_round = t
        del self.buf_acc[t]

    def _op_state(self, ident, h, _data):
        """update=server: the optimizer's state, one frame per (piece, state tensor): ``key/name``."""
        self._rank_of(h)
        if self.optimizer is None:
            raise Refused(f"{self.cfg.name} holds no optimizer state (update={self.update})")
        index = {id(p): k for k, p in self.params.items()}
        parts, shapes, scalars = [], {}, {}
        for p, st in self.optimizer.state.items():
            for name, v in st.items():
                tag = f"{index[id(p)]}/{name}"
                if isinstance(v, torch.Tensor):
                    shapes[tag] = list(v.shape)
                    parts += wire.split(tag, v.detach().reshape(-1).contiguous())
                else:
                    scalars[tag] = v
        self._reply(ident, "params", h.meta.get("id"), {"shapes": shapes, "scalars": scalars}, parts,
                    step=h.step, tracked=False)

    def _op_load(self, ident, h, data):
        """update=server: replace parameters (frames named by key) and optimizer state (``key/name``)."""
        self._rank_of(h)
        if not self.initialized or self.optimizer is None:
            raise Refused(f"load on {self.cfg.name}, which holds no optimizer (update={self.update})")
        shapes, scalars = h.meta.get("shapes", {}), h.meta.get("scalars", {})
        if not isinstance(shapes, dict) or not isinstance(scalars, dict):
            raise Refused(f"load from {h.sender}: 'shapes' and 'scalars' must be maps")
        state: dict[str, dict] = {}
        params: dict[str, list] = {}
        for spec, frame in zip(h.frames, data):
            key, _, name = spec.key.partition("/")
            if key not in self.pieces:
                raise Refused(f"load from {h.sender}: {self.cfg.name} holds no key {key!r}")
            if name:
                shape = shapes.get(spec.key)
                if not isinstance(shape, list) or spec.offset != 0:
                    raise Refused(f"load from {h.sender}: {spec.key} needs a shape and one frame")
                t = wire.frame_tensor(spec, frame).clone()
                try:
                    state.setdefault(key, {})[name] = t.view(shape)
                except RuntimeError:
                    raise Refused(f"load from {h.sender}: {spec.key} does not fit the shape {shape}") from None
            else:
                params.setdefault(key, []).append((spec, frame))
        for tag, v in scalars.items():
            key, _, name = str(tag).partition("/")
            if key not in self.pieces or not name:
                raise Refused(f"load from {h.sender}: {tag!r} names no state of {self.cfg.name}")
            state.setdefault(key, {})[name] = v
        if params:
            checked = self._check_frames(wire.Header(h.op, h.sender, h.step, tuple(s for s, _ in sum(params.values(), [])),
                                                     h.meta), [f for parts in params.values() for _, f in parts],
                                         require_all=True)
            for key, parts in checked.items():
                self._writable(key)
                self.params[key].copy_(self._gather(key, parts, self.pieces))
        for key, values in state.items():
            self.optimizer.state[self.params[key]].update(values)
        self._reply(ident, "ok", h.meta.get("id"))

    def on_the_clock(self) -> list[int]:
        """async, ssp: the ranks whose clocks count (not said bye, not joined: a reconnect's hello keeps it off;
        not lost, not a replacement still entering)."""
        out = self.members.out()
        return [r for r in range(self.world_size()) if r not in self.detached and r not in self.joined
                and r not in out]

    def active_at(self, t: int) -> list[int]:
        """The ranks that push step ``t``: those that had not joined (left their loop under ex.join()) by then."""
        return [r for r in range(self.world_size()) if self.joined.get(r, (t + 1,))[0] > t]

    def _op_join(self, ident, h, data):
        """ex.join(): the worker's loop ended before step ``h.step``. It pushes no more: sync counts it as
        zeros from that step on, async and ssp stop waiting for its clock. update=worker: the parameters it
        sends are every worker's at the end when it is the last to join (the highest rank among the last)."""
        rank = self._rank_of(h)
        t = h.step
        if rank in self.joined:
            self._reply(ident, "ok", h.meta.get("id"), {"duplicate": True}, step=t)
            return
        frames = self._check_frames(h, data, require_all=True) if data else {}
        self.mode.join(rank, t)  # may refuse (sync: a step other than the one gathered)
        self.joined[rank] = (t, bool(h.meta.get("divide", True)))
        self.detached.add(rank)
        training = self.world_size() - len(self.joined)
        if h.meta.get("throw") and training and self.terminated is None:
            self.terminated = rank
        if frames and (t, rank) == max((s, r) for r, (s, _) in self.joined.items()):
            self.kept = {key: self._gather(key, parts, self.pieces) for key, parts in frames.items()}  # fresh tensors
        if self.kept and not training:  # the last join: the last joiner's parameters are every worker's final ones
            for key, value in self.kept.items():
                self._writable(key)
                self.params[key].copy_(value)
            self.kept = {}
        self._reply(ident, "ok", h.meta.get("id"), {"training": training}, step=t)
        self.mode.settle()
        self._serve_waiting()

    def _op_bye(self, ident, h, _data):
        rank = self._rank_of(h)
        self.detached.add(rank)
        self.gone.add(rank)
        self._reply(ident, "ok", h.meta.get("id"))
        self._drop_link(ident)
        self._serve_waiting()  # ssp: the slowest worker may just have left

    @property
    def closed(self) -> bool:
        """Every rank of the job said bye: the exchanger was closed everywhere, the space can go."""
        return self.world is not None and self.gone | set(self.members.lost) >= set(range(self.world))

    def _op_donate(self, ident, h, data):
        """Keep-going under update=worker: the donor's range of a replacement's state (:mod:`servers.relay`)."""
        meta = self.relays.donate(self._rank_of(h), h, data)
        self._reply(ident, "ok", h.meta.get("id"), meta, step=h.step)
        self._serve_waiting()

    def _op_blob(self, ident, h, data):
        """ex.commit_state / ex.restored_state: ``put`` keeps the rank's one frame of opaque bytes (never
        read here) with the step it was committed at, replacing the last; otherwise the kept one comes back."""
        rank = self._rank_of(h)
        if h.meta.get("put"):
            if len(h.frames) != 1 or h.frames[0].dtype != "uint8" or h.frames[0].offset != 0:
                raise Refused(f"blob from {h.sender}: one uint8 frame expected")
            self.blobs[rank] = (h.step, wire.frame_tensor(h.frames[0], data[0]).clone())
            self._reply(ident, "ok", h.meta.get("id"), step=h.step)
            return
        kept = self.blobs.get(rank)
        if kept is None:
            self._reply(ident, "ok", h.meta.get("id"), {"none": True})
            return
        self._reply(ident, "params", h.meta.get("id"), {}, wire.split("blob", kept[1]), step=kept[0], tracked=False)

    # ----- durability ------------------------------------------------------------------------
    def _checkpoint_name(self) -> str:
        return checkpoint_name(self.cfg, self.space)

    def checkpoint(self) -> Path | None:
        """Write the shard atomically (temp file + os.replace). Nothing to write before init."""
        self._since_checkpoint = 0
        if not self.initialized:
            return None
        target = self.cfg.checkpoint_dir or self.cfg.resume
        if target is None:
            return None
        folder = Path(target)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self._checkpoint_name()
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        return path

    def digest(self) -> str:
        """sha256 of :meth:`state_dict` (every tensor's bytes included): equal on two processes holding the
        same state."""
        import hashlib
        return hashlib.sha256(wire.pack_state(self.state_dict())).hexdigest() if self.manifest is not None else ""

    def state_dict(self, clone: bool = True) -> dict:
        """What a checkpoint holds (and a new backup receives first, :mod:`servers.replication`). ``clone=False``:
        the parameters and buffers as they are, for a caller that copies them before anything changes them."""
        own = (lambda t: t.detach().clone()) if clone else (lambda t: t.detach())
        return {"format": 2, "space": self.space, "mode": self.cfg.mode, "shard": [self.cfg.shard, self.cfg.shards],
                 "version": self.version, "last_step": dict(self.last_step), "mode_state": self.mode.state(),
                 "world": self.world, "senders": dict(self.senders), "manifest": self.manifest,
                 "pieces": self.pieces, "piece_param": self.piece_param, "buffer_keys": self.buffer_keys,
                 "optim": self.optim_desc, "update": self.update,
                 "params": {k: own(v) for k, v in self.params.items()},
                 "buffers": {k: own(v) for k, v in self.buffers.items()}, "buf_round": self.buf_round,
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                 "updates": self.stats.updates, "staleness": dict(self.stats.staleness),
                 "attempt": self.attempt, "started": self.started, "joined": dict(self.joined),
                 "terminated": self.terminated, "blobs": dict(self.blobs), "kept": {k: own(v) for k, v in self.kept.items()},
                 "members": self.members.state(), "enters": dict(self.mode.enters)}

    def _load(self, path: Path) -> None:
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint {path} for {self.cfg.name}")
        state = torch.load(path, weights_only=True)
        if state.get("format") != 2:
            raise ValueError(f"{path} is a checkpoint of format {state.get('format')}; this server reads format 2")
        if state["mode"] != self.cfg.mode or list(state["shard"]) != [self.cfg.shard, self.cfg.shards]:
            raise ValueError(f"{path} holds {state['mode']} shard {state['shard']}, "
                             f"this is {self.cfg.mode} {self.cfg.name}")
        self.load_state(state, f"the checkpoint {path}")

    def load_state(self, state: dict, where: str) -> None:
        """Take :meth:`state_dict`'s state (``where``: what it came from, for errors)."""
        self.version, self.world = state["version"], state["world"]
        self.placement = self.mode.placement(state["update"], where)
        self.mode.load(state["mode_state"], {int(r): int(t) for r, t in state["last_step"].items()})
        self.manifest = [(n, tuple(s), d) for n, s, d in state["manifest"]]
        self.pieces = {k: (d, int(n)) for k, (d, n) in state["pieces"].items()}
        self.piece_param = dict(state["piece_param"])
        self.buffer_keys = {k: (d, int(n)) for k, (d, n) in state["buffer_keys"].items()}
        self._fix_limits()
        # requests queued in workers' sockets while this shard was down arrive before their new hello
        self.senders = {str(k): int(v) for k, v in state.get("senders", {}).items()}
        self.optim_desc = state["optim"]
        self.params = dict(state["params"])
        self.buffers = dict(state["buffers"])
        self.buf_round = int(state["buf_round"])
        if set(self.params) == set(self.pieces):  # (a new backup's state may come before rank 0's init)
            self._build_optimizer()
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
        self.initialized = True
        self.stats.updates = state["updates"]
        self.stats.staleness.update({int(k): v for k, v in state["staleness"].items()})
        # a resumed shard neither re-gates workers that passed its start nor forgets who joined or what they kept
        self.attempt, self.started = int(state.get("attempt", 0)), bool(state.get("started", False))
        self.joined = {int(r): (int(t), bool(d)) for r, (t, d) in state.get("joined", {}).items()}
        self.detached |= set(self.joined)
        self.terminated = state.get("terminated")
        self.kept = dict(state.get("kept", {}))
        self.blobs = {int(r): (int(t), b) for r, (t, b) in state.get("blobs", {}).items()}
        self.members.load(state.get("members", {}))
        self.mode.enters = {int(r): int(t) for r, t in state.get("enters", {}).items()}


SPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def checkpoint_name(cfg: ServerConfig, space: str) -> str:
    """A key space's checkpoint file: ``shard-I-of-K.pt`` for a job's first (unnamed) space."""
    return f"shard-{cfg.shard}-of-{cfg.shards}{'.' + space if space else ''}.pt"


class ShardServer:
    """One shard process: the ROUTER socket and the loop that serves every key space on it.

    Each exchanger of a job gets a key space of its own (ps-lite's "applications"): a model set up
    after another one closed, two models at once, the replica groups of a hybrid-parallel job. A
    request names its space in the header's ``space`` (none: ``""``, a job's first exchanger);
    a hello makes the space, the last ``bye`` of its job frees it (after writing its checkpoint
    where the shard keeps them). Counters survive the space: ``stats`` adds up every space the
    process served, and lists the live ones."""

    MAX_SPACES = 64

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        curve = transport.CurveKeys.load(cfg.curve_secret) if cfg.curve_secret else None
        self.transport = transport.Transport(io_threads=cfg.io_threads, curve=curve)
        self.sock = self.transport.bind(zmq.ROUTER, cfg.bind, insecure=cfg.insecure, authorized=cfg.authorized)
        # zmq pings every peer; one silent for half the peer timeout (its host died) is disconnected
        self.sock.heartbeat_ivl = max(1, int(cfg.peer_timeout * 250))
        self.sock.heartbeat_timeout = max(1, int(cfg.peer_timeout * 500))
        self.admission = Admission(cfg, self.sock)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.boot = os.urandom(6).hex()  # this process's incarnation: a worker that sees it change resends
        self.shm_run = shm.new_run_id()
        self.links_made = 0
        self.spaces: dict[str, ParameterServer] = {}
        self.retired: dict[str, dict] = {}  # freed spaces' last stats
        self.stats = Stats()  # what no space could be charged with (unreadable or oversized messages)
        self._stop = False
        # the timeline (commlab.base.trace): None unless $COMMLAB_TRACE is set
        self._trace = trace.recorder("shard", cfg.shard)
        self._tr_flows: dict[tuple[bytes, Any], tuple[int, dict]] = {}  # (connection, request id) -> reply's flow
        self.probe: StatsProbe | None = None  # while a metrics endpoint is served (--metrics-port)
        if cfg.resume:
            self._resume(Path(cfg.resume))
        self.repl = Replication(self)  # a primary (alone until a backup attaches), or with replica_of a backup
        # torch's first optimizer pays seconds of lazy imports: pay them now, not while workers wait
        OptimizerSpec().build([torch.zeros(1)])

    def _resume(self, folder: Path) -> None:
        first = folder / checkpoint_name(self.cfg, "")
        if not first.exists():
            raise FileNotFoundError(f"--resume: no checkpoint {first} for {self.cfg.name}")
        prefix = checkpoint_name(self.cfg, "")[:-len(".pt")]
        for path in sorted(folder.glob(prefix + "*.pt")):
            space = path.name[len(prefix):-len(".pt")].removeprefix(".")
            if path.name != checkpoint_name(self.cfg, space):
                continue  # another shard's (shard-1-of-10 beside shard-1-of-1)
            self.spaces[space] = ParameterServer(self.cfg, self, space)
            self.spaces[space]._load(path)

    # ----- main loop -------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until SIGTERM/SIGINT; then write the checkpoints (if configured) and return."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        shm.sweep_stale()  # segments of servers and workers killed before they could remove them
        print(f"commlab server {self.cfg.name} mode={self.cfg.mode} listening on {self.endpoint}", flush=True)
        next_log = time.monotonic() + self.cfg.log_every if self.cfg.log_every > 0 else float("inf")
        if self.cfg.secret is None:
            auth.warn_unauthenticated(f"commlab server {self.cfg.name}")
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            self._reap()
            self.repl.pump(poller)  # a backup: what its primary streamed (poller: the link's socket too)
            if self.sock in dict(poller.poll(100)):
                limit = self.max_parts
                frames, count = transport.recv_bounded(self.sock, limit)
                # closed connections first: a descriptor the kernel reuses must not be taken for the old one's
                self._reap()
                if not self.admission.admits(frames):
                    continue
                if count > len(frames):
                    self.stats.refused += 1
                    self._answer(frames[0].bytes, None, "error", {"reason": f"message of {count} frames; "
                                                                            f"{self.cfg.name} takes at most {limit}"})
                else:
                    self.handle(frames)
            if self.probe is not None:
                self.probe.answer(self.metrics_snapshot)
            if time.monotonic() >= next_log:
                self.log()
                next_log = time.monotonic() + self.cfg.log_every
        self.repl.catch_up()  # a backup: what it logged, before its checkpoints and last stats
        if self.cfg.checkpoint_dir or self.cfg.resume:
            for space in self.spaces.values():
                space.checkpoint()
        self.log()
        for space in self.spaces.values():
            space._close_links()

    def _reap(self) -> None:
        """Forget closed connections (their shared-memory links go now) and free the key spaces whose
        connections have all been gone for the peer timeout (:class:`Admission`)."""
        for ident in self.admission.gone():
            self.repl.gone(ident)  # the backup's link: the primary goes on alone
            for sp in self.spaces.values():
                if self.repl.role == "primary":  # (a backup's members are its primary's connections, whose
                    # identities its own socket may reuse for a stranger: their losses come in the stream)
                    sp.connection_closed(ident)  # keep-going: its rank leaves (its partial step read from its link)
                sp._drop_link(ident)  # its segments are of no use to a connection that is gone
        for space in self.admission.orphans(self.spaces):
            print(f"commlab server {self.cfg.name}: every connection of key space {space.space or '(the first)'!r} "
                  f"closed {self.cfg.peer_timeout:g}s ago without bye: freed", file=sys.stderr, flush=True)
            self._free(space)

    @property
    def max_parts(self) -> int:
        return max([2 + _MIN_FRAMES, *(sp.max_parts for sp in self.spaces.values())])

    @property
    def max_bytes(self) -> int:
        return max([0, *(sp.max_bytes for sp in self.spaces.values())])

    def close(self) -> None:
        if self._trace is not None:
            self._trace.write()
        for space in self.spaces.values():
            space._close_links()
        self.admission.close()
        self.repl.close()
        self.sock.close(linger=0)
        self.transport.close()

    def _on_signal(self, *_):
        self._stop = True

    def log(self) -> None:
        s = self.stats_dict()
        print(f"commlab server {self.cfg.name}: " + json.dumps(s, sort_keys=True), file=sys.stderr, flush=True)

    COUNTERS = ("updates", "pushes", "duplicates", "pulls", "refused", "dropped", "nonfinite", "skipped", "replaced",
                "resized", "lost_pushes", "bytes_in", "bytes_out", "copies_on_write")

    def space_stats(self) -> dict[str, dict]:
        """Every key space this process served, live (``live``: True) or freed, -> its stats."""
        every = {name: dict(sp.stats_dict(), live=True) for name, sp in self.spaces.items()}
        every.update({name: dict(st, live=False) for name, st in self.retired.items() if name not in every})
        return every

    def metrics_snapshot(self) -> dict:
        """What a metrics scrape shows (:mod:`servers.metrics`): ``total`` (the ``stats`` reply), ``spaces``
        (each space's stats) and ``unattributed`` (the counters no space could be charged with)."""
        return {"total": self.stats_dict(), "spaces": self.space_stats(),
                "unattributed": {key: getattr(self.stats, key) for key in self.COUNTERS}}

    def stats_dict(self, space: str | None = None) -> dict:
        """One space's stats (``space``; by default the job's first, else the newest) with the counters
        added up over every space this process served, and ``spaces``: each live and freed space's."""
        every = self.space_stats()
        if space is None:
            space = "" if "" in every else next(reversed(every), "")
        base = dict(every.get(space) or ParameterServer(self.cfg, self, space).stats_dict())  # (none yet: empty)
        base.pop("live", None)
        for key in self.COUNTERS:
            base[key] = getattr(self.stats, key) + sum(st[key] for st in every.values())
        base["boot"] = self.boot
        base["shm_links"] = sum(len(sp.links) for sp in self.spaces.values())
        base["auth"] = self.admission.stats()
        base["replica"] = self.repl.stats()
        base["spaces"] = {name: {"live": name in self.spaces, "updates": st["updates"], "version": st["version"],
                                 "workers": st["workers"], "update": st["update"]} for name, st in every.items()}
        base["elsewhere"] = self._elsewhere(space)
        return base

    def _elsewhere(self, space: str) -> dict[str, str]:
        """The ranks this space's start gate waits for that wait at another space's gate here: rank -> that
        space. Two ranks at the start of different spaces of the same servers wait for each other until
        their timeouts; the worker's error says which space each is in (a ``space=`` misnamed, or processes
        that set up different numbers of exchangers on these servers)."""
        sp = self.spaces.get(space)
        if sp is None or not sp._gate():
            return {}
        return {str(r): name for r in sp._waiting_for() for name, other in self.spaces.items()
                if name != space and not other.started and r in other.starters}

    # ----- dispatch --------------------------------------------------------------------------
    def _payloads(self, ident: bytes) -> psshm.Payloads:
        """How this connection's payloads travel: through its shared-memory link, if a space made one."""
        for sp in self.spaces.values():
            link = sp.links.get(ident)
            if link is not None:
                return link
        return psshm.FRAMES

    def handle(self, frames: list) -> None:
        if len(frames) < 2:
            self.stats.dropped += 1  # an identity with nothing after it: nothing to answer
            return
        ident, body = frames[0].bytes, frames[1:]
        req_id = None
        payloads = self._payloads(ident)
        space = None
        t0 = self._trace.now() if self._trace is not None else 0
        try:
            limit = self.max_bytes
            h = wire.decode(body, ops=psproto.REQUESTS | psproto.REPLICATION, max_bytes=max(limit, psproto.BLOB_MAX),
                            region=payloads.rx_size)
            req_id = h.meta.get("id")
            if h.data_bytes > limit and h.op != "blob":  # only a committed state may be larger than the shard
                raise ProtocolError(f"message carries {h.data_bytes} bytes, limit {limit}")
            if h.op == "stats":
                if h.meta.get("digest") is True:  # tests: is a backup's state the primary's, bit for bit?
                    self.repl.catch_up()  # (first: the counts beside the digests are of the same state)
                meta: dict[str, Any] = {"stats": self.stats_dict(self._space_name(h))}
                if h.meta.get("digest") is True:
                    meta["stats"]["digests"] = {name: sp.digest() for name, sp in self.spaces.items()}
                if self._trace is not None:  # a worker measuring this shard's trace clock
                    meta["clock_ns"] = self._trace.now()
                self._answer(ident, req_id, "ok", meta)
                return
            if h.op in psproto.REPLICATION or not self.repl.serves(ident, req_id):
                if h.op in psproto.REPLICATION:
                    self.repl.control(ident, h, body)
                return
            data = payloads.take(h, body[1:])  # (decode refuses offsets from a connection without a link)
            self.repl.arrived(h)
            self.repl.forward(ident, body, h, data)  # to the backup, before anything it does is answered
            space = self._space(h)
            if h.op in ("hello", "live"):  # (live: a member's heartbeat connection, Membership.heartbeat)
                if not self.repl.muted:  # (a backup replaying its primary's stream admits nobody)
                    self.admission.joined(ident, space.space, body[0])
            else:
                space.admit(ident, h)
            space.stats.bytes_in += h.data_bytes
            t1 = self._trace_received(ident, h, space, t0) if self._trace is not None else 0
            getattr(space, "_op_" + h.op)(ident, h, data)
            if self._trace is not None:
                self._trace_applied(h, space, t0, t1)
            if h.op == "bye" and space.closed:
                self._free(space)
        except (ProtocolError, Refused) as exc:
            (space.stats if space is not None else self.stats).refused += 1
            self.repl.refused()
            self._answer(ident, req_id, "error", {"reason": str(exc)})
        except Exception as exc:  # a bug here must not take every worker's shard down with it
            traceback.print_exc()
            (space.stats if space is not None else self.stats).refused += 1
            self.repl.refused()
            self._answer(ident, req_id, "error", {"reason": f"internal error on {self.cfg.name}: {exc!r}"})
        finally:
            self.repl.done()  # the request's replies wait for the backup's ack from here on

    def _space_name(self, h: wire.Header) -> str:
        name = h.meta.get("space", "")
        if not isinstance(name, str) or (name and not SPACE.fullmatch(name)):
            raise Refused(f"{h.op} from {h.sender}: a key space is named by 1-64 of [A-Za-z0-9_.-], not {name!r}")
        return name

    def _space(self, h: wire.Header) -> ParameterServer:
        """The request's key space; a hello makes it."""
        name = self._space_name(h)
        space = self.spaces.get(name)
        if space is None:
            if h.op != "hello":
                raise Refused(f"{h.op} from {h.sender} for key space {name or '(the first)'!r}, which "
                              f"{self.cfg.name} does not hold (no hello, or every rank closed it)")
            if len(self.spaces) >= self.MAX_SPACES:
                raise Refused(f"{self.cfg.name} holds {len(self.spaces)} key spaces already (limit {self.MAX_SPACES})")
            space = self.spaces[name] = ParameterServer(self.cfg, self, name)
            self.retired.pop(name, None)
        return space

    def _free(self, space: ParameterServer) -> None:
        """Every rank closed the exchanger: keep its checkpoint (where the shard keeps them) and counters."""
        if self.cfg.checkpoint_dir or self.cfg.resume:
            space.checkpoint()
        space._close_links()
        self.retired[space.space] = space.stats_dict()
        del self.spaces[space.space]
        self.repl.freed(space.space)

    # ----- the timeline: a request's receive, apply and reply, and the flows from and to its worker -----
    def _trace_received(self, ident: bytes, h: wire.Header, space: ParameterServer, t0: int) -> int:
        rec = self._trace
        assert rec is not None
        args = {"rank": h.sender, "space": space.space, "step": h.step, "op": h.op, "bytes": h.data_bytes}
        t1 = rec.now()
        if h.meta.get("trace"):  # the worker traces: its send's arrow ends here, our reply's starts at the reply
            rid = h.meta.get("id")
            rec.flow("f", trace.flow_id(h.sender, self.cfg.shard, space.space, rid, 0), "request", t0)
            self._tr_flows[(ident, rid)] = (trace.flow_id(h.sender, self.cfg.shard, space.space, rid, 1), args)
        rec.span("receive", "server", t0, t1, args)
        return t1

    def _trace_applied(self, h: wire.Header, space: ParameterServer, t0: int, t1: int) -> None:
        rec = self._trace
        assert rec is not None
        args = {"rank": h.sender, "space": space.space, "step": h.step, "op": h.op, "bytes": h.data_bytes}
        t2 = rec.span("apply", "server", t1, args=args)
        rec.span(h.op, "request", t0, t2, args)
        rec.counter("queue depth", {"waiting pulls": sum(len(sp.waiting) for sp in self.spaces.values())}, t2)

    def _trace_reply(self, ident: bytes, req_id, op: str, nbytes: int, t0: int) -> None:
        """A reply went out since ``t0``: its span, and the arrow to the worker's receive if its request was traced."""
        rec = self._trace
        assert rec is not None
        fid, args = self._tr_flows.pop((ident, req_id), (None, {}))
        t1 = rec.span("reply", "server", t0, args=dict(args, reply=op, bytes=nbytes))
        if fid is not None:
            rec.flow("s", fid, "reply", t0)

    def _answer(self, ident: bytes, req_id, op: str, meta: dict) -> None:
        """A reply no space sends: an error before a space was found, or the stats."""
        t0 = self._trace.now() if self._trace is not None else 0
        self.emit([ident, *wire.encode(op, f"server{self.cfg.shard}", -1, (), dict(meta, id=req_id))])
        if self._trace is not None and op == "error":
            self._trace_reply(ident, req_id, op, 0, t0)

    def emit(self, frames: list, keys: Sequence[str] = (), space: ParameterServer | None = None,
             track: bool = False) -> None:
        """Send a reply now, or, while a backup must first hold the request it answers, once it acked that
        request (:class:`servers.replication.Replication`); a backup replaying its primary's stream sends none.
        ``track``: its data frames may go zero-copy from ``space``'s tensors ``keys`` (copy on write)."""
        if not self.repl.hold(frames, keys, space, track):
            self.send_now(frames, keys, space, track)

    def send_now(self, frames: list, keys=(), space: ParameterServer | None = None, track: bool = False) -> list:
        """Send one reply; the trackers of its zero-copy data frames (registered under ``space``'s ``keys``)."""
        try:
            if track:
                _, trackers = transport.send_tracked(self.sock, frames, timeout=5.0, who="a worker")
                trackers = trackers[2:]  # after identity and header
                for key, tr in zip(keys, trackers):
                    if tr is not None and space is not None:
                        space.trackers.setdefault(key, []).append(tr)
                return trackers
            transport.send(self.sock, frames, timeout=5.0, who="a worker")
        except Exception as exc:  # a worker that went away must not take the server with it
            print(f"commlab server {self.cfg.name}: reply dropped: {exc}", file=sys.stderr, flush=True)
        return []


class Admission:
    """Who the shard serves, and which connections are still there (one per shard, on its thread).

    With the job's secret (``cfg.secret``), a connection (a ROUTER identity) is served only once it
    proved the secret in its first messages (:class:`commlab.transport.auth.Responder`; the client side is
    :func:`commlab.transport.sockets.handshake`). Until then its messages are dropped and counted (``refused``),
    answered with one error that says why, never read as a request: a stranger's hello makes no key
    space and no shared memory. Handshakes under way are bounded (``PENDING``; the oldest goes first).

    Liveness: a monitor tells which connections closed (zmq's heartbeats close one whose host died
    within half the peer timeout); a message's source descriptor (``SRCFD``) ties identities to
    connections. A closed connection's shared-memory links go at once; a key space none of whose
    connections is left is freed once ``peer_timeout`` passed without a new hello (a restarted job's
    ranks say hello again well within it)."""

    PENDING = 256

    def __init__(self, cfg: ServerConfig, sock: zmq.Socket):
        from collections import OrderedDict
        self.cfg, self.sock, self.secret = cfg, sock, cfg.secret
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.pending: OrderedDict[bytes, auth.Responder] = OrderedDict()
        self.peers: dict[bytes, str] = {}  # identity -> the name it proved the secret as
        self.fd: dict[bytes, int] = {}  # identity -> its connection's descriptor
        self.spaces: dict[bytes, set[str]] = {}  # identity -> the key spaces it said hello to
        self.orphaned: dict[str, float] = {}  # key space -> when its last connection closed
        self.counts: Counter[str] = Counter()

    def stats(self) -> dict:
        return {"required": self.secret is not None, "peers": len(self.peers), "handshaking": len(self.pending),
                "handshakes": self.counts["handshakes"], "failed_handshakes": self.counts["failed"],
                "refused_messages": self.counts["refused"], "connections_closed": self.counts["closed"],
                "spaces_freed": self.counts["freed"]}

    def admits(self, frames: list) -> bool:
        """Whether to serve this message; a handshake message is answered here, anything else from a
        connection that has not proved the secret is dropped (counted, answered with an error)."""
        ident = frames[0].bytes
        if self.secret is None or ident in self.peers:
            return True
        body = frames[1:]
        if len(body) == 1 and auth.is_handshake(body[0].bytes):
            self._handshake(ident, body[0])
            return False
        self.counts["refused"] += 1
        reason = (f"{self.cfg.name} serves only its job's processes: prove the job's secret first (give the "
                  f"worker ${auth.SECRET_FILE_ENV} or ${auth.SECRET_ENV}, as the server has)")
        self._send(ident, wire.encode("error", f"server{self.cfg.shard}", -1, (),
                                      {"reason": reason, "id": _request_id(body), "unproven": True}))
        return False

    def _handshake(self, ident: bytes, frame) -> None:
        side = self.pending.pop(ident, None)
        try:
            if side is None:
                if len(self.pending) >= self.PENDING:  # a flood of half-done handshakes: the oldest goes
                    self.pending.popitem(last=False)
                    self.counts["failed"] += 1
                assert self.secret is not None  # (admits() serves everyone without one)
                side = auth.Responder(self.secret, f"server{self.cfg.shard}")
                reply = side.challenge(frame.bytes)
                self.pending[ident] = side
            else:
                reply = side.check(frame.bytes)
                self.peers[ident] = side.peer_name
                self.counts["handshakes"] += 1
            self._track(ident, frame)
        except auth.AuthError as exc:
            self.counts["failed"] += 1
            reply = auth.refusal(str(exc))
        self._send(ident, [reply])

    def _send(self, ident: bytes, frames: list) -> None:
        try:
            transport.send(self.sock, [ident, *frames], timeout=1.0, who="a peer")
        except Exception:  # gone already: nothing to tell it
            pass

    def _track(self, ident: bytes, frame) -> None:
        try:
            self.fd[ident] = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            pass

    def joined(self, ident: bytes, space: str, frame) -> None:
        """``ident`` said hello to ``space`` (whatever the answer): its closing counts against the space."""
        self._track(ident, frame)
        self.spaces.setdefault(ident, set()).add(space)
        self.orphaned.pop(space, None)

    def gone(self) -> list[bytes]:
        """The identities whose connections closed since the last call (their state dropped here)."""
        from zmq.utils.monitor import recv_monitor_message
        closed = []
        while self.monitor.poll(0):
            fd = recv_monitor_message(self.monitor)["value"]
            closed += [i for i, f in self.fd.items() if f == fd]
        now = time.monotonic()
        for ident in closed:
            self.counts["closed"] += 1
            self.fd.pop(ident, None)
            self.peers.pop(ident, None)
            self.pending.pop(ident, None)
            for space in self.spaces.pop(ident, ()):
                if not any(space in names for names in self.spaces.values()):
                    self.orphaned[space] = now
        return closed

    def orphans(self, spaces: dict) -> list:
        """The live key spaces whose connections have all been gone for ``peer_timeout``."""
        now = time.monotonic()
        due = [name for name, since in self.orphaned.items() if now - since >= self.cfg.peer_timeout]
        for name in due:
            del self.orphaned[name]
        self.counts["freed"] += sum(1 for name in due if name in spaces)
        return [spaces[name] for name in due if name in spaces]

    def close(self) -> None:
        transport.stop_monitor(self.sock, self.monitor)  # (the socket is the server's, closed with it)


def _request_id(body: list):
    """The ``id`` a request's header carries (for an error reply it can be matched to), or None."""
    try:
        meta = msgpack.unpackb(body[0].bytes, raw=False, max_bin_len=0, max_str_len=256, max_array_len=64,
                               max_map_len=64).get("meta")
        rid = meta.get("id")
        return rid if isinstance(rid, int) else None
    except Exception:
        return None
