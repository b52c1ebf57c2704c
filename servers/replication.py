"""Replicated shards (``ps://?replicas=2``, ``commlab server --replica-of ENDPOINT``): primary-backup.

One shard lives on two processes: the *primary*, which the workers talk to, and a *backup* attached to it.
The backup is a client of the primary (it connects, proves the job's secret or its CURVE key as any client
must, and says ``attach``). From then on:

* **State transfer, then the stream.** At the first moment none of the primary's key spaces has a step half
  gathered (between two steps: nothing is lost by waiting for it), the primary sends its whole state
  (:meth:`servers.server.ParameterServer.state_dict` of every key space and a few fields a checkpoint does not
  keep, :func:`commlab.transport.wire.pack_state` bytes: a msgpack tree and raw tensor bytes, nothing pickled),
  then every request it serves afterwards, in the order it serves them, numbered (``seq``): the request's own
  header and raw frames (a push that came through shared memory is sent with its payload in frames).
* **The backup applies the same requests in the same order** through the same code (:meth:`ShardServer.handle`,
  its replies dropped), so it holds the same state bit for bit: every update is deterministic given its inputs
  and their order (one torch thread; a sync step's sum is folded in the order the primary received the
  pushes, which is the stream's). It acknowledges what it received (``ack`` with the highest ``seq``) before
  applying it: it holds it, since a backup applies everything it received before it serves anyone.
* **A synchronous step's average once, not every push** (:func:`elides`: ``mode=sync`` where the shard
  applies the step, update=server or an outer step, uncompressed, without keep-going). Such a push goes as its
  header alone (``ELIDED``); each key's average goes (``SUMS``, op ``sum``) the moment it is final, while the
  rest of the step arrives, and the step's end (op ``gathered``) once every push is in. The backup folds zeros
  in place of the elided data (:class:`Zeros`: the books, who pushed and the step gathered, kept by the same
  code) and takes each average and the report from the stream. The replies made while serving such a push, and
  those of the request that gathered the step, wait for the ack of the step's end, so a backup promoted
  without it drops the half step (:meth:`Replication._drop_elided_step`) knowing no push of it was answered:
  every worker sends its push again. Everything else goes whole: there the backup receives the workers'
  gradients.
* **A log and fresh copies, not the arithmetic** (``--replica-log R``, ``ps://?replica_log=R``, default 4):
  applying every request costs the backup the primary's CPU, which on a machine the workers share is the
  replication's whole price. So the backup keeps what it received (the frames as they came) without applying
  it, and the primary sends a fresh copy of its state in the stream (``SNAPSHOT`` at the ``seq`` it has served
  through, at the first step boundary) once it streamed ``R`` times the state's bytes since the last one; the
  backup then drops the log up to there. It applies (*catches up*: the newest copy, then the log after it, in
  order, through the same code as above) before it serves anyone, when a key space is freed (the job's last
  ``bye``, or its connections gone for the peer timeout), when the log outgrows
  :data:`LOG_LIMIT` copies' worth (a key space with ``compress=``, which a copy cannot carry, gets none), and
  before it writes checkpoints or answers a digest. A copy is the state a new backup takes, so what the backup
  holds after catching up is what it would hold having applied each request: the same state, bit for bit. The
  state a new backup takes when it attaches is such a copy too: kept as it came, loaded at the first catch-up (the
  primary's replies, which wait for the backup's acks of what follows it, do not wait for the load).
  ``R = 0``: it applies every request as it arrives (and loads the state it attaches with at once).
* **Output commit.** Every reply the primary makes while serving request ``seq`` (its ack, and the pulls that
  request made answerable) is held until the backup acknowledged ``seq`` (an elided push's: its step's end). So whatever a worker has seen, the
  backup holds. A held reply that reads the shard's tensors zero-copy counts as a send in flight: the
  optimizer writes such a tensor only after giving it fresh storage (copy on write, as for a slow socket).
* **Failover.** A worker whose primary's connection closes (or times out) connects to the next server of the
  shard's list and says hello again, then sends every request not yet answered again (what ``retries`` already
  did for a restarted shard). A backup serves a worker only once its link to the primary is gone (closed, or
  silent past the heartbeat); it then becomes the primary (it first applies whatever of the stream it had
  received). Requests it had applied come back as duplicates, which the shard recognises as it did for a
  restarted shard ((worker, step) pushes, commits of an applied step, ...), so nothing is lost or applied
  twice. While its primary lives it refuses workers with ``not_primary``.
* **Keep-going's losses** (``min_workers=``): a worker's connection closes on the primary's socket only, so the
  primary streams the loss (``LOST``: key space, rank, why) at the point it happens, before applying it, and holds
  what the loss answered until the backup's ack (:meth:`Replication.losing`); the backup takes the rank out at
  the same point (:meth:`servers.server.ParameterServer.lose`), so its membership, and the steps completed over
  the ranks left, are the primary's.
* **The primary without a backup** (its connection closed: killed) goes on alone and releases what it held;
  a new backup can attach at any time (``commlab server --replica-of`` the live one).

Consistency, what a partition does: see docs/ps.md ("Replicated shards").
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass

import zmq

from commlab.base.errors import CommError, ConfigError, ProtocolError
from commlab.core.optim import warm_up
from commlab.transport import psproto, sockets as transport, wire
from servers.modes import Sync

CTRL = struct.Struct("<4sBQH")  # magic, kind, seq, length of the worker identity that follows
MAGIC = b"CLRP"
SNAPSHOT, REQUEST, FREE, LOST, ELIDED, SUMS = 1, 2, 3, 4, 5, 6
KINDS = (SNAPSHOT, REQUEST, FREE, LOST, ELIDED, SUMS)
SHM_KEYS = ("shm", "shm_host", "shm_reply")  # what a request through shared memory carries; the backup has none
HEARTBEAT_MS = (1000, 10000)  # the link's zmq heartbeat: interval, and silence after which it is taken as gone
ATTACH_TIMEOUT = 120.0  # a new backup waits this long for the primary's state
LOG_BASIS = 1 << 20  # a shard's state counts as at least this many bytes (before rank 0's init it is tiny)
LOG_LIMIT = 4  # a backup catches up once its log holds this many times R x the state's bytes


def ctrl(kind: int, seq: int, ident: bytes = b"") -> bytes:
    return CTRL.pack(MAGIC, kind, seq, len(ident)) + ident


def parse_ctrl(frame: bytes) -> tuple[int, int, bytes]:
    if len(frame) < CTRL.size:
        raise ProtocolError(f"replication frame of {len(frame)} bytes")
    magic, kind, seq, n = CTRL.unpack_from(frame)
    if magic != MAGIC or kind not in KINDS or len(frame) != CTRL.size + n:
        raise ProtocolError("not a replication frame")
    return kind, seq, frame[CTRL.size:]


def relayed(body: list, h: wire.Header, data: list) -> list:
    """The request as the backup receives it: verbatim, or (shared memory) with its payload in frames, sent
    zero-copy from the worker's segment: the worker writes that place again only after its ack, which waits for
    the backup's, which comes after the backup received every byte (and a closed link's mapping stays until
    zmq lets go of it, :meth:`commlab.transport.psshm.Region.close`)."""
    if not any(k in h.meta for k in SHM_KEYS):
        return list(body)
    meta = {k: v for k, v in h.meta.items() if k not in SHM_KEYS}
    parts = [(spec, wire.frame_tensor(spec, frame)) for spec, frame in zip(h.frames, data)]
    return wire.encode(h.op, h.sender, h.step, parts, meta)


def elides(space, step: int) -> bool:
    """Whether the backup need not receive the data of step ``step``'s pushes to ``space``: a synchronous step the
    shard applies itself (update=server, or an outer step of update=outer after its warm-up), uncompressed, without
    keep-going. Each key's average goes to the backup once, when it is final (``SUMS``), instead of every worker's
    gradient; the pushes' headers still go, so the backup keeps the same books."""
    if space is None or space.placement is None or space.units is not None or space.members.on \
            or not isinstance(space.mode, Sync) or not space.placement.spec.shards_step:
        return False
    # a warm-up step's average is published, not committed
    return space.placement.spec.name != "outer" or step >= int((space.optim_desc or {}).get("outer", {}).get("warmup", 0))


class Zeros:
    """Stand-ins for an elided push's data frames on the backup: views of one zeroed buffer, grown as needed. The
    fold adds them in (zeros), and each key's ``SUMS`` then sets the average the primary made."""

    def __init__(self):
        self.buf = bytearray(0)

    def frames(self, header: bytes) -> list[memoryview]:
        specs = wire.decode([header], header_only=True).frames
        need = max((sp.nbytes for sp in specs), default=0)
        if len(self.buf) < need:
            self.buf = bytearray(need)
        view = memoryview(self.buf)
        return [view[:sp.nbytes] for sp in specs]


FAULT_ENV = "COMMLAB_SERVER_FAULT"
FAULT_POINTS = ("recv", "unsent", "unacked", "acked")


@dataclass(frozen=True)
class Fault:
    """A fault the tests and the chaos benchmark inject (``$COMMLAB_SERVER_FAULT=AT:OP:RANK:STEP[:SHARD]``): a
    primary started as one (not a backup, nor one promoted) kills itself (SIGKILL) at the first request ``OP``
    of step ``STEP`` from rank ``RANK`` (of shard ``SHARD``, any when not given), at point ``AT``:

    * ``recv``: on its arrival, before anything is done with it;
    * ``unsent``: after serving it, never streamed to the backup (as if lost on the way);
    * ``unacked``: after serving it, streamed, before the backup's ack is read (the backup may hold it);
    * ``acked``: once the backup acknowledged it and its replies went out (an elided push's replies wait for its
      step's average: it dies once the backup acknowledged the push's header, holding the push without it)."""

    at: str
    op: str
    rank: int
    step: int
    shard: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Fault":
        parts = text.split(":")
        try:
            if len(parts) not in (4, 5) or parts[0] not in FAULT_POINTS or parts[1] not in psproto.REQUESTS:
                raise ValueError
            return cls(parts[0], parts[1], int(parts[2]), int(parts[3]), int(parts[4]) if len(parts) == 5 else None)
        except ValueError:
            raise ConfigError(f"${FAULT_ENV}={text!r}: expected AT:OP:RANK:STEP[:SHARD], AT one of "
                              f"{', '.join(FAULT_POINTS)}, OP a request (push, commit, ...)") from None

    def matches(self, h: wire.Header, shard: int) -> bool:
        return (h.op == self.op and h.sender == f"rank{self.rank}" and h.step == self.step
                and self.shard in (None, shard))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Refused(Exception):
    """The server asked to be the primary refused the attach."""


class _Held:
    """A held reply's stand-in among a key's send trackers: not done until the reply went and zmq let go."""

    def __init__(self):
        self.sent = False
        self.tracker = None

    @property
    def done(self) -> bool:
        return self.sent and (self.tracker is None or self.tracker.done)


def quiescent(space) -> bool:
    """No step half in, no replacement's state half relayed (servers/relay.py): nothing a state transfer would
    have to carry beside the applied state."""
    mode = space.mode
    if mode.partial or space.buf_acc or getattr(mode, "complete", None) or getattr(mode, "contributed", None) \
            or getattr(mode, "gathered", False) or space.relays.by_rank:
        return False
    return True


def space_state(space) -> dict:
    """A key space's whole state for a new backup: its checkpoint's, and what a checkpoint leaves out."""
    if space.units is not None:
        raise ConfigError(f"{space.cfg.name}: a new backup cannot take over a key space with compress= "
                          f"(its held payloads are not transferred); start the backup before the job")
    state = space.state_dict(clone=False) if space.manifest is not None else {}  # (pack_state copies)
    state.update(space=space.space, has_model=space.manifest is not None, initialized=space.initialized,
                 starters=sorted(space.starters), started=space.started, gone=sorted(space.gone),
                 detached=sorted(space.detached), compress_fixed=space.compress_fixed,
                 placement=space.update, world=space.world,
                 updates=space.stats.updates, staleness=dict(space.stats.staleness))
    if space.optimizer is None:
        state["optimizer"] = None
    return state


def load_space(space, state: dict) -> None:
    if state["has_model"]:
        space.load_state(state, "the primary's state")
    elif state["placement"] is not None:
        space.placement = space.mode.placement(state["placement"], "the primary's state")
    space.world = state["world"]
    space.initialized = state["initialized"]
    space.starters = set(state["starters"])
    space.started = state["started"]
    space.gone = set(state["gone"])
    space.detached = set(state["detached"])
    space.compress_fixed = state["compress_fixed"]
    space.stats.updates = state["updates"]
    space.stats.staleness = Counter({int(k): v for k, v in state["staleness"].items()})


class Replication:
    """A shard's replication, on its thread: its role (``primary`` or ``backup``), the link, held replies."""

    def __init__(self, server):
        self.srv = server
        self.cfg = server.cfg
        self.role = "backup" if self.cfg.replica_of else "primary"
        self.muted = False  # replaying the primary's stream: no replies go out
        self.counts: Counter[str] = Counter()
        # primary
        self.backup: bytes | None = None  # the attached backup's identity on the primary's socket
        self.backup_endpoint = ""
        self.attaching: tuple[bytes, str, object] | None = None  # (identity, endpoint, request id)
        self.seq = 0  # requests streamed
        self.acked = 0  # the highest the backup acknowledged
        self.current: int | None = None  # the request being served was streamed as this seq
        self.ratio = self.cfg.replica_log  # a fresh copy to the backup every ratio x copy_bytes streamed
        self.since = 0  # bytes streamed since the last copy
        self.copy_bytes = LOG_BASIS  # the last state copy's size, sent or received (at least LOG_BASIS)
        self.held: deque = deque()  # (seq, frames, keys, space, track, [_Held per key])
        # an elided push's replies (and those of what it made answerable) wait for its step's SUMS, whose seq is not
        # known until the step is gathered: (key space, step) -> [(frames, space, track, marks)]
        self.pending: dict[tuple[str, int], list] = {}
        self.elided: tuple[str, int] | None = None  # the request being served is an elided push of this step
        # backup
        self.link: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.link_alive = False
        self.applied = 0  # the last seq applied (-1: the state taken at the attach is not loaded yet)
        self.received = 0  # the last seq received (and acknowledged)
        self.stale = False  # the stream had a gap: this backup stopped following its primary
        self.lazy = 0.0  # the primary's --replica-log: log the stream, apply it only when catching up (0: apply it)
        self.log: list[tuple[int, int, bytes, list]] = []  # (kind, seq, identity, frames) received, not applied
        self.log_bytes = 0
        self.copy: tuple[int, list] | None = None  # the newest state copy not yet loaded: (seq, frames)
        self.zeros = Zeros()  # an elided push's stand-in data
        self.ended: dict[str, int] = {}  # key space -> the last elided step whose end (``gathered``) came
        self._polled = False  # its link is in the serve loop's poller (self._poller)
        self._poller: zmq.Poller | None = None
        self.primary = self.cfg.replica_of or ""
        fault = os.environ.get(FAULT_ENV, "")
        self.fault = Fault.parse(fault) if fault and self.role == "primary" else None
        self.dying: str | None = None  # the fault matched the request being served: what happens at its end
        self.die_at: int | None = None  # acked: the seq whose ack kills this process
        if self.role == "backup":
            # the first optimizer's imports, paid before the state comes: the primary holds its replies until this
            # backup acknowledges what follows the state, and loading the state builds the shard's optimizer
            warm_up(autograd=False)
            self._attach()

    # ----- both ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"role": self.role, **self.counts}
        if self.role == "primary":
            out.update(backup=self.backup_endpoint if self.backup is not None else None, seq=self.seq,
                       acked=self.acked, held=len(self.held) + sum(map(len, self.pending.values())))
        else:
            out.update(primary=self.primary, applied=self.applied, received=self.received, logged=len(self.log),
                       link=self.link_alive)
        return out

    def reply_fields(self) -> dict:
        """What every reply to a worker carries while a backup is attached: the shard's servers, so that it can
        fail over to a backup that attached after it was started (a new one, after a failover)."""
        if self.role == "primary" and self.backup is not None:
            return {"replicas": [self.srv.endpoint, self.backup_endpoint]}
        return {}

    def close(self) -> None:
        if self._polled and self.link is not None and self._poller is not None:
            self._poller.unregister(self.link)
            self._polled = False
        transport.close_monitored(self.link, self.monitor)
        self.link = self.monitor = None

    def _say(self, line: str) -> None:
        print(f"commlab server {self.cfg.name}: {line}", file=sys.stderr, flush=True)

    # ----- primary ------------------------------------------------------------------------------
    def serves(self, ident: bytes, req_id) -> bool:
        """Whether this server serves a worker's request now: a primary does; a backup does once its
        primary's link is gone (it takes over first), else it answers ``not_primary``."""
        if self.role == "primary" or self.muted:
            return True
        self.pump(None)  # the stream received so far first, and whether the link still lives
        if self.link_alive:
            self.counts["refused_as_backup"] += 1
            self.srv._answer(ident, req_id, "error", {
                "reason": f"{self.cfg.name} at {self.srv.endpoint} is the backup of {self.primary}, which is "
                          f"alive: ask the primary", "not_primary": True, "primary": self.primary})
            return False
        self._promote()
        return True

    def control(self, ident: bytes, h: wire.Header, body: list) -> None:
        """``attach`` from a new backup, ``ack`` from the attached one."""
        if h.op == "ack":
            if ident == self.backup:
                self.acked = max(self.acked, h.step)
                self._release()
                self._refresh()
            return
        rid = h.meta.get("id")
        m = h.meta
        want = {"mode": self.cfg.mode, "shard": [self.cfg.shard, self.cfg.shards], "staleness": self.cfg.staleness}
        got = {"mode": m.get("mode"), "shard": m.get("shard"), "staleness": m.get("staleness")}
        why = ""
        if self.role != "primary":
            self.pump(None)
            if not self.link_alive:  # its primary is gone, and a new backup (the launcher's) needs a primary
                self._promote()
        if self.role != "primary":
            why = f"{self.cfg.name} is itself the backup of {self.primary}, which is alive"
        elif got != want:
            why = f"the backup runs {got}, this primary {want}"
        elif self.backup is not None or self.attaching is not None:
            why = f"{self.cfg.name} has a backup already ({self.backup_endpoint or 'attaching'}); replicas=2 is one"
        elif not isinstance(m.get("endpoint"), str):
            why = "attach names no endpoint"
        if why:
            self.srv._answer(ident, rid, "error", {"reason": why})
            return
        self.attaching = (ident, m["endpoint"], rid)
        self._say(f"backup {m['endpoint']} attaching; its state goes at the next step boundary")
        self.try_attach()

    def try_attach(self) -> None:
        """Send the waiting backup the whole state, at a moment no key space has a step half gathered."""
        if self.attaching is None or not all(quiescent(sp) for sp in self.srv.spaces.values()):
            return
        ident, endpoint, rid = self.attaching
        self.attaching = None
        try:
            size = self._send_state(ident)
        except (ConfigError, ValueError) as exc:
            self.srv._answer(ident, rid, "error", {"reason": str(exc)})
            return
        except CommError as exc:
            self._say(f"state transfer to the backup {endpoint} failed: {exc}")
            return
        self.backup, self.backup_endpoint, self.acked = ident, endpoint, self.seq
        self.counts["attached"] += 1
        self._say(f"backup {endpoint} attached ({size} bytes of state at seq {self.seq})")

    def _send_state(self, ident: bytes) -> int:
        """The whole state as of ``seq`` (every request served so far applied), in the stream to ``ident``;
        its size. Raises ConfigError (a key space a copy cannot carry), ValueError, CommError."""
        state = {"seq": self.seq, "log": self.ratio, "spaces": [space_state(sp) for sp in self.srv.spaces.values()]}
        step = wire.MAX_FRAME
        chunks = [m[i:i + step] for part in wire.pack_state_parts(state) for m in [memoryview(part)]
                  for i in range(0, len(m), step)]
        transport.send(self.srv.sock, [ident, ctrl(SNAPSHOT, self.seq), *chunks], timeout=30.0, who="the backup")
        self.since = 0
        return self._copied(chunks)

    def _copied(self, frames: list) -> int:
        """A state copy of these frames went or came: its size, kept as the measure of the next one."""
        size = sum(len(f) for f in frames)
        self.copy_bytes = max(size, LOG_BASIS)
        return size

    def _refresh(self) -> None:
        """The attached backup logs the stream: a fresh copy once ``ratio`` x the state's bytes went since the
        last, at a step boundary (the same moment a new backup's state goes) once no reply waits for the backup's
        ack (the copy is not made while workers wait for those)."""
        if self.backup is None or not self.ratio or self.since < self.ratio * self.copy_bytes or self.held \
                or any(sp.units is not None for sp in self.srv.spaces.values()) \
                or not all(quiescent(sp) for sp in self.srv.spaces.values()):
            return
        try:
            self._send_state(self.backup)
        except ValueError as exc:  # a state pack_state cannot carry (compress= spaces are left out above)
            self._say(f"no fresh state copy for the backup: {exc}")
            self.since = 0
            return
        except CommError as exc:
            self._lose(f"the stream to it failed ({exc})")
            return
        self.counts["copies"] += 1

    def arrived(self, h: wire.Header) -> None:
        """A request is about to be served: the injected fault (:class:`Fault`), if it is this one."""
        if self.fault is None or self.muted or not self.fault.matches(h, self.cfg.shard):
            return
        self._say(f"injected fault: {self.fault} (${FAULT_ENV})")
        if self.fault.at == "recv":
            _die()
        self.dying, self.fault = self.fault.at, None

    def forward(self, ident: bytes, body: list, h: wire.Header, data: list) -> None:
        """Stream a request to the backup before serving it; its replies are held until the backup acks."""
        if self.backup is None or self.muted:
            return
        self.seq += 1
        if self.dying == "unsent":  # lost on the way: its replies are held all the same, and this process dies
            self.current, self.elided = self.seq, None
            return
        space = self.srv.spaces.get(h.meta.get("space", ""))
        self.elided = (space.space, h.step) if h.op == "push" and elides(space, h.step) else None
        frames = relayed(body, h, data)
        if self.elided is not None:
            frames = frames[:1]  # the header: the step's average follows once (SUMS)
        try:
            transport.send(self.srv.sock, [self.backup, ctrl(ELIDED if self.elided else REQUEST, self.seq, ident),
                                           *frames], timeout=5.0, who="the backup")
        except CommError as exc:
            self._lose(f"the stream to it failed ({exc})")
            return
        self.current = self.seq
        if not self.elided:
            self.since += h.data_bytes
            self.counts["streamed"] += h.data_bytes

    def freed(self, space: str) -> None:
        """A key space was freed (its peers' connections gone for the peer timeout, or every bye): so on the
        backup (a bye is in the stream already; freeing twice is harmless)."""
        if self.backup is None or self.muted:
            return
        self.seq += 1
        try:
            transport.send(self.srv.sock, [self.backup, ctrl(FREE, self.seq), space.encode()], timeout=5.0,
                           who="the backup")
        except CommError as exc:
            self._lose(f"the stream to it failed ({exc})")

    def losing(self, space: str, rank: int, why: str) -> None:
        """Keep-going: ``rank`` leaves key space ``space`` here (its connection closed on this primary's socket,
        which the backup cannot see). The loss goes in the stream at this point, before it is applied, and the
        replies it makes (the step in flight completed over the ranks left) wait for the backup's ack, as a
        request's do: the backup takes the same rank out at the same point, so it completes the same steps over
        the same ranks, and a replacement's hello finds the rank lost there too. :meth:`done` ends it."""
        if self.backup is None or self.muted:
            return
        self.seq += 1
        try:
            transport.send(self.srv.sock, [self.backup, ctrl(LOST, self.seq), space.encode(), str(rank).encode(),
                                           why.encode()], timeout=5.0, who="the backup")
        except CommError as exc:
            self._lose(f"the stream to it failed ({exc})")
            return
        self.current = self.seq

    def done(self) -> None:
        if self.pending:
            self._settle_pending()
        if self.dying in ("unsent", "unacked"):
            _die()
        if self.dying == "acked":
            self.die_at, self.dying = self.current if self.current is not None else self.seq, None
            self._release()
        self.current, self.elided = None, None
        if self.attaching is not None:
            self.try_attach()
        self._refresh()

    def hold(self, frames: list, keys, space, track: bool) -> bool:
        """Keep a reply made while serving a streamed request until the backup acked it (True), or say it may go
        now (False). A backup replaying the stream sends nothing (True)."""
        if self.muted:
            return True
        if self.current is None:  # not serving a streamed request (stats, a refusal before a request was read)
            return False
        marks = [_Held() for _ in keys]
        for key, mark in zip(keys, marks):
            space.trackers.setdefault(key, []).append(mark)
        if self.elided is not None:
            self.pending.setdefault(self.elided, []).append((frames, space, track, marks))
        else:
            self.held.append((self.current, frames, space, track, marks))
        return True

    def refused(self) -> None:
        """The request being served was refused: nothing of it went into a step, so its answer waits for its own
        header's ack only (the backup refuses it alike)."""
        self.elided = None

    def _settle_pending(self) -> None:
        """After serving a request: an elided step that is gathered now (its keys' averages went as each was made)
        says so to the backup (``gathered``), and its replies, and those this request made, wait for that; one that
        can no longer be gathered (its key space freed) lets its replies wait for this request only."""
        for key in list(self.pending):
            name, t = key
            space = self.srv.spaces.get(name)
            if space is not None and space.mode.step == t and not space.mode.gathered:
                continue  # still gathering
            seq = self.current if self.current is not None else self.seq
            if space is not None and space.mode.step == t and self.backup is not None:
                was, seq = seq, self._send_sums(space, "gathered", t, [])
                self.counts["sums"] += 1
                tail = []  # what this request answered (a join that completed the step: its report) waits too
                while self.held and self.held[-1][0] == was:
                    tail.append(self.held.pop())
                self.held.extend((seq, *entry[1:]) for entry in reversed(tail))
                self.current = seq
            for frames, sp, track, marks in self.pending.pop(key):
                self.held.append((seq, frames, sp, track, marks))
        self._release()

    def summed(self, space, key: str) -> None:
        """``key``'s average for the step in flight is final: to the backup now (its pushes came elided), while the
        rest of the step arrives. A backup replaying sends nothing."""
        mode = space.mode
        if self.role != "primary" or self.backup is None or self.muted \
                or not elides(space, mode.step):
            return
        parts = wire.split(key, mode.sums[key]) if mode.present[key] else []
        size = sum(spec.nbytes for spec, _ in parts)
        self._send_sums(space, "sum", mode.step, parts)
        self.since += size
        self.counts["streamed"] += size

    def _send_sums(self, space, op: str, t: int, parts: list) -> int:
        """A key's average (``sum``), or the end of a gathered step (``gathered``), in the stream; its seq. Zero-copy:
        an average changes only at the commits, which follow the report the step's end releases."""
        msg = wire.encode(op, f"server{self.cfg.shard}", t, parts, {"space": space.space})
        self.seq += 1
        try:
            transport.send(self.srv.sock, [self.backup, ctrl(SUMS, self.seq), *msg], timeout=5.0, who="the backup")
        except CommError as exc:
            self._lose(f"the stream to it failed ({exc})")
        return self.seq

    def _release(self, everything: bool = False) -> None:
        while self.held and (everything or self.held[0][0] <= self.acked):
            _, frames, space, track, marks = self.held.popleft()
            trackers = self.srv.send_now(frames, (), space, track)  # the marks stand for its trackers
            for i, mark in enumerate(marks):
                mark.sent, mark.tracker = True, trackers[i] if i < len(trackers) else None
        if self.die_at is not None and (self.acked >= self.die_at or self.backup is None) \
                and not (self.held and self.held[0][0] <= self.die_at):
            time.sleep(0.2)  # the replies leave the process (zmq's I/O thread) before it dies
            _die()

    def gone(self, ident: bytes) -> None:
        """A connection closed: the backup's means the primary goes on alone."""
        if ident == self.backup:
            self._lose("its connection closed")
        elif self.attaching is not None and self.attaching[0] == ident:
            self.attaching = None

    def _lose(self, why: str) -> None:
        self._say(f"lost its backup {self.backup_endpoint}: {why}; serving alone (start a new one with "
                  f"--replica-of {self.srv.endpoint})")
        self.counts["backups_lost"] += 1
        self.backup, self.backup_endpoint, self.current = None, "", None
        for entries in self.pending.values():
            self.held.extend((self.seq, *entry) for entry in entries)
        self.pending.clear()
        self._release(everything=True)

    # ----- backup -------------------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        sock = self.srv.transport.connect(zmq.DEALER, self.primary, curve=self.cfg.replica_curve)
        sock.heartbeat_ivl, sock.heartbeat_timeout = HEARTBEAT_MS
        sock.rcvhwm = 0
        return sock

    def _attach(self) -> None:
        """Attach to the primary; a server that is itself a backup whose primary lives (it may not have noticed
        its primary's death yet) is asked again, for :data:`ATTACH_TIMEOUT` seconds."""
        deadline = time.monotonic() + ATTACH_TIMEOUT
        while True:
            try:
                return self._attach_once()
            except _Refused as exc:
                self.close()
                if "is itself the backup" not in str(exc) or time.monotonic() > deadline:
                    raise ConfigError(str(exc)) from None
                time.sleep(0.5)

    def _attach_once(self) -> None:
        """Connect to the primary, prove the job's secret, attach, take its state (blocks; raises CommError)."""
        name = f"the primary {self.primary}"
        self.link = self._connect()
        self.monitor = self.link.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        who = f"replica{self.cfg.shard}"
        if self.cfg.secret is not None:
            transport.handshake(self.link, self.cfg.secret, who, name, 30.0)
        meta = {"mode": self.cfg.mode, "shard": [self.cfg.shard, self.cfg.shards], "staleness": self.cfg.staleness,
                "endpoint": self.srv.endpoint, "id": 1}
        transport.send(self.link, wire.encode("attach", who, -1, (), meta), timeout=30.0, who=name)
        msg = transport.recv(self.link, ATTACH_TIMEOUT, name)
        try:
            kind, seq, _ = parse_ctrl(msg[0].bytes)
        except ProtocolError:
            h = wire.decode(msg, ops=psproto.REPLIES)
            raise _Refused(f"{name} refused this backup: {h.meta.get('reason')}") from None
        if kind != SNAPSHOT:
            raise ProtocolError(f"{name} sent no state first")
        try:
            top = wire.state_top(msg[1].buffer)
        except ProtocolError:  # a head longer than a frame (or not a state): loaded whole now, which reads it all
            top = None
        self.received = seq
        self._copied(msg[1:])
        if top is not None and top.get("log"):  # kept as it came, loaded at the first catch-up (the primary's
            self.lazy = float(top["log"])       # replies, waiting for the acks of what follows it, do not wait)
            self.copy, self.applied, spaces = (seq, msg[1:]), -1, top.get("spaces", 0)
        else:
            state = self._load(msg[1:])
            self.lazy, self.applied, spaces = float(state.get("log") or 0), seq, len(state["spaces"])
        self.link_alive = True
        self._say(f"backup of {self.primary}: took its state at seq {seq} ({spaces} key space(s)"
                  f"{'; logs the stream, with a fresh copy every %g x its size' % self.lazy if self.lazy else ''})")

    def _load(self, frames: list) -> dict:
        """Make the key spaces the primary's state copy holds, and only those."""
        from servers.server import ParameterServer  # (the server module imports this one)

        state = wire.unpack_state(b"".join(f.bytes for f in frames))
        self.counts["loaded"] += 1
        for space in self.srv.spaces.values():
            space._close_links()
        self.srv.spaces.clear()
        for s in state["spaces"]:
            space = self.srv.spaces[s["space"]] = ParameterServer(self.cfg, self.srv, s["space"])
            load_space(space, s)
        return state

    def pump(self, poller: zmq.Poller | None) -> None:
        """A backup: take what the primary streamed so far, acknowledge it, then apply it; notice the link's end.

        The ack goes as soon as the requests are here, before they are applied: the backup holds them (it applies
        everything it received before it serves anyone, :meth:`_promote`), and the primary's replies need not
        wait for the backup's update, which runs beside the primary's."""
        if self.link is None:
            return
        if poller is not None and not self._polled:
            poller.register(self.link, zmq.POLLIN)
            self._polled, self._poller = True, poller
        if self.monitor is not None and self.monitor.poll(0):
            self.link_alive = False
        while self.link is not None and self.link.poll(0):
            batch: list[tuple[int, int, bytes, list]] = []
            received = self.received
            while self.link.poll(0) and len(batch) < 64:
                msg = self.link.recv_multipart(copy=False)
                kind, seq, ident = parse_ctrl(msg[0].bytes)
                if kind == SNAPSHOT and seq == received:  # a fresh copy of the state as of the last request
                    batch.append((kind, seq, ident, msg))
                    continue
                if seq != received + 1 or kind == SNAPSHOT:
                    self._say(f"the stream from {self.primary} skipped from seq {received} to {seq}: this backup "
                              f"no longer holds the primary's state and stops following it")
                    self.counts["gaps"] += 1
                    self._drop_link(stale=True)
                    break
                batch.append((kind, seq, ident, msg))
                received = seq
            if batch and self.link is not None:
                self.received = received
                try:
                    transport.send(self.link, wire.encode("ack", f"replica{self.cfg.shard}", received), timeout=5.0,
                                   who=f"the primary {self.primary}")
                except CommError:
                    self.link_alive = False
            for kind, seq, ident, msg in batch:
                if kind == SNAPSHOT:
                    self.copy, self.log, self.log_bytes = (seq, msg[1:]), [], 0
                    self._copied(msg[1:])
                    self.counts["copies"] += 1
                elif self.lazy and kind in (REQUEST, ELIDED, SUMS):
                    self.log.append((kind, seq, ident, msg))
                    self.log_bytes += sum(len(f) for f in msg)
                else:  # applied as it comes; a freed key space: catch up (the job's last bye is in the log)
                    self.catch_up()
                    self._apply(kind, ident, msg)
                    self.applied = seq
            if self.log_bytes > LOG_LIMIT * self.lazy * self.copy_bytes:
                self.catch_up()

    def catch_up(self) -> None:
        """A backup: load the newest state copy, then apply the log after it, in order (see the module's
        docstring); what it holds is then its primary's state as of the last request received."""
        if self.role != "backup":
            return
        if self.copy is not None:
            seq, frames = self.copy
            self.copy = None
            if seq > self.applied:
                self._load(frames)
                self.applied = seq
        log, self.log, self.log_bytes = self.log, [], 0
        for kind, seq, ident, msg in log:
            if seq > self.applied:
                self._apply(kind, ident, msg)
                self.applied = seq

    def _apply(self, kind: int, ident: bytes, msg: list) -> None:
        """One streamed request, served as the primary served it, its replies dropped."""
        self.muted = True
        try:
            if kind == REQUEST:
                self.srv.handle([zmq.Frame(ident), *msg[1:]])
            elif kind == ELIDED:  # a push without its data: the books as the primary kept them, zeros folded in
                self.srv.handle([zmq.Frame(ident), msg[1], *self.zeros.frames(msg[1].bytes)])
            elif kind == SUMS:
                self._take_sums(msg[1:])
            elif kind == FREE:
                space = self.srv.spaces.get(msg[1].bytes.decode())
                if space is not None:
                    self.srv._free(space)
            elif kind == LOST:  # the primary's keep-going loss, at its point in the stream (:meth:`losing`)
                space = self.srv.spaces.get(msg[1].bytes.decode())
                rank = int(msg[2].bytes)
                if space is not None and rank not in space.members.lost:
                    space.lose(rank, msg[3].bytes.decode())
        finally:
            self.muted = False

    def _take_sums(self, msg: list) -> None:
        """A key's average of the step in flight (``sum``: its elided pushes were folded in as zeros), or the end of
        a gathered step (``gathered``: its report, from the averages): the primary's from here on."""
        h = wire.decode(msg, ops=("sum", "gathered"))
        space = self.srv.spaces.get(h.meta.get("space", ""))
        mode = space.mode if space is not None else None
        key = h.frames[0].key if h.frames else None
        fits = mode is not None and mode.step == h.step and (
            mode.gathered if h.op == "gathered" else key is None or key in mode.summed)
        if not fits or mode is None or space is None:
            self._say(f"the primary's {h.op} of step {h.step} ({h.meta.get('space')!r}) does not fit this backup "
                      f"(step {getattr(mode, 'step', None)}): it no longer holds the primary's state and stops "
                      f"following it")
            self.counts["gaps"] += 1
            self._drop_link(stale=True)
            return
        for spec, frame in zip(h.frames, msg[1:]):
            mode.sums[spec.key][spec.offset:spec.offset + spec.count].copy_(wire.frame_tensor(spec, frame))
        if h.op == "gathered":
            mode.report = mode._report()
            self.ended[space.space] = h.step

    def _drop_link(self, stale: bool = False) -> None:
        self.link_alive = False
        if stale:
            self.counts["stale"] += 1
            self.stale = True
        self.close()

    def _drop_elided_step(self, space) -> None:
        """A step whose pushes came elided and whose end (``gathered``) never came: none of those pushes was
        answered, nor its report (they waited for the end), so every worker sends its push again, here; the zeros
        folded in, and any average that came, go. (Gathered here from the headers alone is not enough: some
        key's average may not have come.)"""
        mode = space.mode
        if not elides(space, getattr(mode, "step", 0)) \
                or not (mode.partial or mode.complete or mode.gathered) \
                or (mode.gathered and self.ended.get(space.space) == mode.step):
            return
        mode.partial.clear()
        mode._clear()
        self.counts["elided_dropped"] += 1
        self._say(f"dropped step {mode.step} of {space.space!r}: its pushes came without their average (each worker "
                  f"sends its push again)")

    def _promote(self) -> None:
        """The primary is gone and a worker asks: this server is the primary now."""
        self.pump(None)  # whatever of the stream arrived before the link closed
        self.catch_up()
        self._drop_link()
        for space in self.srv.spaces.values():
            self._drop_elided_step(space)
        self.role = "primary"
        self.counts["promoted"] += 1
        for space in self.srv.spaces.values():
            space.waiting = []  # the old primary's workers' pulls: they ask again, here
            space.members.conn.clear()  # (the old primary's socket's identities: each rank's hello here sets its own)
            space.members.live.clear()
        self._say(f"took over from {self.primary} (its link is gone) at seq {self.applied}")
        if self.stale:
            self._say("warning: this backup had stopped following its primary (a gap in the stream): workers "
                      "will find steps missing and be refused by name")
        self.primary = ""

