"""``ps://HOST:PORT[,HOST:PORT...]?mode=sync|async|ssp&update=worker|server``: CPU parameter servers.

Workers push each bucket's gradients to the shards that hold its pieces as
soon as backward fills it (one communication thread and one DEALER socket per
shard, so all shards are fed in parallel). Where the update runs:

* ``update=worker`` (sync only, its default; BytePS's summation service): the
  shards only average. Each worker asks for a bucket's average right after
  pushing it and receives it into the bucket (``p.grad``) before backward
  returns; the user's own optimizer steps, as under all-reduce.
* ``update=server`` (the only placement of async and ssp, and their default):
  each shard runs the user's optimizer class, with the same param groups and
  hyperparameters, over its pieces. ``p.grad`` after backward is this worker's
  own gradient; ``optimizer.step()`` is taken over and becomes "commit (the
  groups' hyperparameters, one factor) and pull the new parameters";
  ``optimizer.state_dict()`` gathers the shards' state into an ordinary torch
  state_dict and ``load_state_dict`` scatters one. See docs/ps.md for AMP and
  ``clip_norm``.

``compress=SPEC&ef=0|1`` (:mod:`commlab.compress`): each bucket's pieces on a shard go through the
compressor, and the shard sums or decodes the payloads as the compressor declares
(:mod:`commlab.regimes.ps_compress`, :mod:`servers.compressed`).

See :mod:`commlab.transport.psproto` for the protocol and :mod:`servers` for the server.

``commlab train --exchanger 'ps://?shards=K&mode=...'`` starts K servers on
loopback itself (:meth:`PSExchanger.plan_local`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import os
import re
import sys
import time
import types
import warnings
from dataclasses import dataclass
from typing import Callable, cast

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from commlab import compress
from commlab.base import trace
from commlab.transport import auth, psproto, psshm, rendezvous, shm, sockets as transport, wire
from commlab.base.config import MAX_MB, ExchangerURL, option, parse_options
from commlab.base.errors import CommError, CommTimeout, ConfigError, ModelMismatch, PeerLost, ProtocolError, RemoteError
from commlab.core.localsteps import LocalSteps, LocalStepsOptions, Outer, async_outer_refusal, parse_outer
from commlab.core.exchanger import AveragesSteps, BucketedExchanger, Join, JoinOptions, PlansServers
from commlab.core.keepgoing import heal_tensors, pack_heal, unpack_heal
from commlab.core.manifest import describe_optimizer, model_manifest
from commlab.base.handles import DoneHandle, FutureHandle, GroupHandle, Handle
from commlab.regimes.ps_compress import CompressedPushes
from commlab.regimes.ps_steps import ShardsOuter, StepPlacement, for_servers
from commlab.transport.rendezvous import RankInfo, group_key
from commlab.core.staging import HostStaging


MAX_SHARDS = 64  # servers commlab train starts on one host (ps://?shards=K): each is a process with its own heap
FAILOVER_PAUSE_S = 0.1  # a replicated shard whose servers all failed lately: the pause before asking the next again


@dataclass(frozen=True)
class PSOptions(LocalStepsOptions):
    mode: str = option("", "consistency mode this worker expects; the server's rules (empty: accept it)",
                       choices=("",) + psproto.MODES)
    staleness: int = option(-1, "ssp: the bound this worker expects (-1: accept the server's)", ge=-1)
    shards: int = option(0, "commlab train starts this many servers on loopback (0: the URL lists them)", ge=0,
                         le=MAX_SHARDS, why="each is a server process on this host; list more servers in the URL")
    transport: str = option("auto", "auto: payloads through shared memory with each server on this host and in this "
                                    "network namespace, zmq frames with the others (servers commlab train starts "
                                    "listen on loopback tcp); tcp or ipc: payloads in zmq frames (servers commlab "
                                    "train starts listen so); shm: shared memory only (every server on this host; "
                                    "ipc sockets carry the headers)",
                            choices=("tcp", "ipc", "shm", "auto"))
    endpoints: str = option("", "comma-separated zmq endpoints, instead of HOST:PORT in the URL (e.g. ipc://...)")
    piece_mb: float = option(16.0, "parameters are cut into pieces of at most this many MiB, each reduced, "
                                   "updated and returned on its own (pipelining); every worker must agree",
                             gt=0, le=MAX_MB)
    retries: int = option(1, "a push not acknowledged within timeout is sent again this many times, "
                             "on a fresh connection (the server applies each (worker, step) once)", ge=0, le=100,
                        why="each waits up to timeout")
    keys: str = option("", "folder made by 'commlab keys' (CURVE: server.key and KEY_NAME.key_secret)")
    key_name: str = option("worker", "with keys=: which client key pair in that folder is this worker's")
    curve_secret: str = option("", "this worker's CURVE secret key file")
    server_key: str = option("", "the servers' CURVE public key file")
    update: str = option("", "where the optimizer runs: worker (the servers average gradients; sync's default) or "
                             "server (the servers run the optimizer; the only choice for async and ssp)",
                         choices=("", "worker", "server"))
    clip_norm: float = option(0.0, "update=server, sync: the servers clip the averaged gradient to this global "
                                   "L2 norm, as clip_grad_norm_ would (0: off)", ge=0)
    min_workers: int = option(0, "keep going (docs/faults.md): a worker that dies leaves the job, the step in flight "
                                 "completes over the others, and the job ends once fewer than this many are left "
                                 "(0: off, a dead worker is waited for; commlab run --replace and --spares make "
                                 "it 1)", ge=0, le=1 << 20)
    heartbeat_s: float = option(0.0, "keep going: a worker silent this long (frozen, partitioned; zmq heartbeats, "
                                     "answered by its I/O thread) leaves the job too (0: only a closed connection)",
                                ge=0, le=6553, why="zmq's heartbeat TTL is at most 6553 s")
    replicas: int = option(1, "servers per shard (primary-backup): 2 keeps each shard on two processes, an update "
                              "acknowledged once both hold it; a worker fails over to the backup when its primary "
                              "dies. commlab run/train start the backups; a URL that lists servers names each "
                              "shard's replicas one after the other (docs/ps.md)", ge=1, le=2,
                           why="one backup per shard (a backup of a backup is not built)")
    replica_log: float = option(4.0, "replicas=2: a backup logs the requests its primary streams instead of "
                                     "applying each, and takes a fresh copy of the shard's state once the log "
                                     "holds this many times the state's bytes; a failover applies the log first "
                                     "(0: the backup applies every request as it arrives, doubling the shard's "
                                     "CPU)", ge=0, le=1024)
    space: str = option("", "this exchanger's key space on the servers (1-64 of A-Za-z0-9_.-). Empty: the job's "
                            "first exchanger on these servers gets the first space, each later one in the same "
                            "process (a second model, a new head) the next (model2, model3, ...), in the order "
                            "every rank sets them up")
    anchor_dtype: str = option("float32", "with sync_every: the dtype the new anchor is pulled back in at each sync "
                                          "(float16, bfloat16: half the pull's bytes; the worker's copy stays "
                                          "float32, the shards' anchor exact; a piece float16 cannot hold travels "
                                          "in float32)", choices=("float32", "float16", "bfloat16"))

    def __post_init__(self):
        super().__post_init__()
        asked = self.placement  # refuses update=worker under a mode that updates on the servers only
        gathers = self.consistency.gathers if self.consistency is not None else True  # (or the servers refuse it)
        if self.clip_norm and not (self.update and asked is not None and asked.shards_step and gathers):
            raise ConfigError("clip_norm= needs update=server and mode=sync (with update=worker, clip in your "
                              "loop: torch.nn.utils.clip_grad_norm_ sees the averaged gradient)")
        if 0 < self.heartbeat_s < 0.1:
            raise ConfigError(f"option 'heartbeat_s': at least 0.1 (zmq's TTL counts deciseconds), got {self.heartbeat_s}")
        if self.space and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.space):
            raise ConfigError(f"space must be 1-64 of A-Za-z0-9_.-, got {self.space!r}")
        if self.consistency is not None and not self.consistency.gathers:  # powersgd: refused before anything starts
            compress.check_fits(compress.build(self.compress, self.ef), "ps", False)
        if self.anchor_dtype != "float32" and not self.sync_every:
            raise ConfigError("anchor_dtype= needs sync_every=H (local steps: the anchor pulled at each sync)")
        if self.sync_every:  # local steps on the shards (the outer placement): what it does not build, refused
            if self.clip_norm:
                raise ConfigError("ps:// sync_every= does not take clip_norm= (docs/localsteps.md)")
            if self.fragment_by != "tensors":
                raise ConfigError("ps:// sync_every= takes fragment_by=tensors only (the shards keep whole tensors "
                                  "by name; slices: allreduce:// or ring://)")
            comp = compress.build(self.compress, self.ef)
            if comp is not None:  # the pseudo-gradient through the shards' compressed units (one push per shard)
                if self.warmup > 0:
                    raise ConfigError("ps:// sync_every= with compress= takes no warmup= (not built: "
                                      "docs/localsteps.md)")
                if not comp.decodes_alone:
                    raise ConfigError(f"option 'compress': ps:// sync_every= takes a compressor whose payloads decode "
                                      f"alone (casts, top-k, random-k, sign, int8, int4, fp4, fp8), not {self.compress}")
            if self.warmup and self.consistency is not None and not self.consistency.gathers:
                raise ConfigError("ps:// sync_every= with warmup= needs mode=sync (the warm-up steps are synchronous)")
            if self.consistency is not None and not self.consistency.gathers:
                why = async_outer_refusal(*parse_outer(self.outer))
                if why:
                    raise ConfigError(why)

    @property
    def asked_update(self) -> str | None:
        """The placement hello asks the servers for (None: theirs)."""
        return psproto.OUTER.name if self.sync_every else (self.update or None)

    def outer_desc(self) -> dict:
        """Local steps: the outer optimizer as data for the shards (hello's ``optim["outer"]``); else nothing."""
        if not self.sync_every:
            return {}
        cls, kwargs = parse_outer(self.outer)
        return {"outer": {"class": f"{cls.__module__}.{cls.__qualname__}", "kwargs": kwargs, "warmup": self.warmup}}

    @property
    def consistency(self) -> psproto.Consistency | None:
        """The mode this worker asks for (None: whichever the servers run)."""
        return psproto.consistency(self.mode) if self.mode else None

    @property
    def placement(self) -> psproto.Placement | None:
        """The placement this worker asks for (update=, else its mode's default; None: the servers')."""
        if self.sync_every:
            if self.update == "worker":
                raise ConfigError("ps:// sync_every= needs update=server (the shards own the anchor and the outer "
                                  "optimizer); update=worker is not built")
            if self.consistency is not None and psproto.OUTER not in self.consistency.placements:
                raise ConfigError(f"ps:// sync_every= runs under mode=sync or mode=async, not mode={self.mode}")
            return psproto.OUTER
        if self.consistency is None:
            return psproto.PLACEMENTS[self.update] if self.update else None
        try:
            return self.consistency.placement(self.update)
        except ValueError as exc:
            raise ConfigError(f"ps:// {exc}: drop update={self.update} (or use mode=sync)") from None

    @property
    def endpoint_list(self) -> list[str]:
        return [transport.tcp_endpoint(e) for e in self.endpoints.split(",") if e]


@dataclass
class _Request:
    rid: int
    op: str
    step: int
    parts: list
    meta: dict
    what: str
    take: Callable | None = None  # what to do with the reply: (header, frames) -> bytes received
    max_bytes: int = 0  # a reply may carry this much (0: the shard's pieces)


class _Shard:
    """One server shard as a worker sees it: a DEALER socket owned by one thread.

    Every method but :meth:`submit` runs on that thread (a one-thread executor),
    so each shard's requests go out in order while shards run in parallel.
    Requests are *posted* (sent, reply awaited later) so that a step's pushes
    and pulls stream out during backward; :meth:`collect` then waits for every
    reply. Replies may come back out of order (a sync pull waits on the server
    for the other workers): each is matched to its request by id.
    """

    PROBE_S = 5.0  # longest a timed-out shard is given to answer "are you there, and who do you wait for?"

    def __init__(self, index: int, count: int, endpoint: str, tp: transport.Transport, sender: str,
                 timeout: float, retries: int, rank: int | None = None):
        self.index, self.count, self.endpoint = index, count, endpoint
        self.endpoints = [endpoint]  # the shard's servers (replicas=2: primary, then backup); failover rotates
        self._failed: dict[str, float] = {}  # endpoint -> when its connection was lost (failover skips it a while)
        self._failover_until: float | None = None  # a failover in progress gives up at this time
        self.failovers = 0
        self.monitor: zmq.Socket | None = None  # replicated: tells at once that the connection closed
        self.name = f"shard {index}/{count} at {endpoint}"
        self.peer = f"shard {index}"  # what errors carry as their ``peer`` field (CommError)
        self.tp, self.sender, self.timeout, self.retries, self.rank = tp, sender, timeout, retries, rank
        self.space = ""  # the exchanger's key space on the server ("": the first)
        self.members: tuple[int, ...] = ()  # connect(group=): the global ranks of the positions servers count
        self.attempt = 0  # the job's restarts so far: every request says it (a dead attempt's pushes are refused)
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"ps-shard{index}")
        self.sock: zmq.Socket | None = None
        self.next_id = 0
        self.outstanding: list[_Request] = []  # posted, not yet answered, in order
        self.unsettled: list[_Request] = []  # pushes since the last collect completed: resent after a restart
        self.boot = ""  # the server process's incarnation, from hello
        self.inbox: dict[int, tuple] = {}  # replies that came before the one awaited
        self.version = 0  # of the parameters last pulled from this shard
        self.hello_meta: dict = {}
        self.targets: dict[str, tuple[torch.nn.Parameter, int, int]] = {}  # key -> (param, start, count)
        self.max_reply = 0
        # transport=shm|auto (see commlab.transport.psshm): payloads through two segments the server made for this connection
        self.shm_want = ""  # "", "shm" or "auto"
        self.shm_pieces: list[tuple[str, str, int]] = []  # (key, dtype, numel) in hello order: the layout
        self.link: psshm.Payloads = psshm.FRAMES  # after hello: a psshm.Link where the shard gave one
        self.shm_note = ""  # auto: why not shm
        # update=server: a key's place in the outbound segment is written only by pulls of that key's
        # parameters, so a whole parameter may live there (no copy out); update=worker reuses the place
        # for averages, which must not land in a parameter
        self.adopt_shm = False
        # CUDA parameters (HostStaging): key, offset, values -> True when the exchanger took the values
        self.put_staged: Callable[[str, int, torch.Tensor], bool] | None = None
        self.secret: auth.JobSecret | None = None  # the job's: each connection proves it first (None: no handshake)
        self.trace: trace.Recorder | None = None  # the timeline's ($COMMLAB_TRACE), else None
        self.in_flight = 0  # traced: bytes sent whose request is not answered yet
        self.heartbeat_s = 0.0  # keep-going: the shard closes this connection when it stays silent this long
        self.live: zmq.Socket | None = None  # heartbeat_s=: the connection that carries only zmq's PINGs
        self.live_monitor: zmq.Socket | None = None  # replicated: its monitor (closed with it)
        self.hellos = 0  # said on this shard by this process: the first is ``fresh`` (a replacement's is)
        self.epoch = 0  # the shard's membership epoch at the last hello (keep-going)

    def submit(self, fn, *args) -> cf.Future:
        return self.pool.submit(fn, *args)

    # ----- on the shard's thread --------------------------------------------------------------
    def post(self, op: str, step: int, parts=(), meta: dict | None = None, what: str = "",
             take: Callable | None = None, max_bytes: int = 0) -> _Request:
        """Send a request without waiting; :meth:`answer` or :meth:`collect` gets its reply (``take``
        handles a reply's data; a pull without one puts parameters in). Zero-copy: ``parts`` must not
        be written until the reply came."""
        req = _Request(self.next_id, op, step, list(parts), dict(meta or {}), what or f"{op} of step {step}",
                       take, max_bytes)
        self.next_id += 1
        self._transmit(req)
        self.outstanding.append(req)
        if op == "push":
            self.unsettled.append(req)
        return req

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        """A fresh connection to the shard and (replicated) its monitor; with the job's secret, each side has proved
        it to the other before this returns (:func:`commlab.transport.sockets.handshake`, bounded by ``timeout``)."""
        watched: list[zmq.Socket] = []

        def watch(sock: zmq.Socket) -> None:  # a server that is gone (refused, closed): the shard's next one at once
            watched.append(sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
                                                   | zmq.EVENT_DISCONNECTED))

        sock = self.tp.connect(zmq.DEALER, self.endpoint, heartbeat_s=self.heartbeat_s,
                               before=watch if self.replicated else None)
        monitor = watched[0] if watched else None
        try:
            if monitor is not None:
                self._connected(monitor)
            if self.secret is not None:
                try:
                    transport.handshake(sock, self.secret, self.sender, self.name, self.timeout, peer=self.peer)
                except CommTimeout:  # the first part of every hello (and of a stats probe)
                    raise CommTimeout(f"{self.name} did not answer hello within {self.timeout:g}s (its handshake, "
                                      f"which proves the job's secret)", peer=self.peer, op="receive") from None
        except BaseException:
            transport.close_monitored(sock, monitor)
            raise
        return sock, monitor

    def _transmit(self, req: _Request) -> None:
        if self.sock is None:
            self.sock, self.monitor = self._open()
        t0 = self.trace.now() if self.trace is not None else 0
        meta, at = dict(req.meta, id=req.rid), None
        if self.trace is not None:
            meta["trace"] = 1  # the shard draws the arrows from this send and to its reply's receive
        if self.space:
            meta["space"] = self.space
        if self.attempt:
            meta["attempt"] = self.attempt
        if "unit" not in meta:  # (a compressed unit's payload travels in frames)
            if req.op == "push":  # through a link: one copy in, the server reads it there
                at = self.link.place(req.parts)
            elif req.op == "pull" and meta.get("what", "params") in ("params", "sum"):
                meta.update(self.link.reply_meta())
        frames = wire.encode(req.op, self.sender, req.step, req.parts, meta, at)
        transport.send(self.sock, frames, timeout=self.timeout, who=self.name, peer=self.peer)
        if self.trace is not None:
            self._trace_sent(req, t0)

    # ----- the timeline: each send and receive, the arrows to and from the shard, the bytes in flight -----
    def _trace_sent(self, req: _Request, t0: int) -> None:
        rec = self.trace
        assert rec is not None
        nbytes = sum(spec.nbytes for spec, _ in req.parts)
        t1 = rec.span("send", "comm", t0, args={"peer": f"shard{self.index}", "op": req.op, "bytes": nbytes,
                                                 "step": req.step, "id": req.rid, "space": self.space})
        if req.op != "stats":  # (answered before any key space: no arrow)
            # an arrow starts where its span starts (before the bytes left) and ends where they had arrived
            rec.flow("s", trace.flow_id(self.sender, self.index, self.space, req.rid, 0), "request", t0)
        self.in_flight += nbytes
        rec.counter(f"in flight {self.sender}->shard{self.index}", {"bytes": self.in_flight}, t1)

    def _trace_received(self, req: _Request, h: wire.Header, t0: int) -> None:
        rec = self.trace
        assert rec is not None
        t1 = rec.span("recv", "comm", t0, args={"peer": f"shard{self.index}", "op": req.op, "reply": h.op,
                                                 "bytes": h.data_bytes, "step": req.step, "id": req.rid})
        if req.op != "stats":
            rec.flow("f", trace.flow_id(self.sender, self.index, self.space, req.rid, 1), "reply", max(t0, t1 - 1))
        self.in_flight = max(0, self.in_flight - sum(spec.nbytes for spec, _ in req.parts))
        rec.counter(f"in flight {self.sender}->shard{self.index}", {"bytes": self.in_flight}, t1)

    def answer(self, req: _Request) -> tuple:
        """Wait (at most ``timeout``) for ``req``'s reply: ``(header, data frames)``; raise its error."""
        t0 = self.trace.now() if self.trace is not None else 0
        deadline = time.monotonic() + self.timeout
        while req.rid not in self.inbox:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise CommTimeout("")
                if self.sock is None:
                    raise PeerLost(f"{self.name}: the connection is closed", peer=self.peer, op="receive")
                msg = self._recv(left)
            except CommTimeout:
                raise CommTimeout(f"{self.name} did not answer {req.what} within {self.timeout:g}s", peer=self.peer,
                                  op="receive") from None
            limit = max([self.max_reply, *(r.max_bytes for r in self.outstanding)])
            try:
                h = wire.decode(msg, ops=psproto.REPLIES, max_bytes=limit, region=self.link.rx_size)
            except ProtocolError as exc:
                raise ProtocolError(f"{self.name} sent a reply that breaks the protocol: {exc}", peer=self.peer,
                                    op="receive") from None
            rid = h.meta.get("id")
            if "replicas" in h.meta:  # a replicated shard's servers: a backup attached later (after a failover)
                self._learn(h.meta["replicas"])
            if isinstance(rid, int) and any(r.rid == rid for r in self.outstanding):  # else: for a request given up on at a reconnect
                self.inbox[rid] = (h, self.link.take(h, msg[1:]))  # (decode refuses offsets without a link)
        h, data = self.inbox.pop(req.rid)
        self.outstanding.remove(req)
        if self.trace is not None:
            self._trace_received(req, h, t0)
        if h.op == "error" and h.meta.get("not_primary") and self.replicated:
            raise NotPrimary(f"{self.name} is a backup whose primary is alive: {h.meta.get('reason')}",
                             peer=self.peer, op="receive")
        if h.op == "error" and h.meta.get("unproven"):
            # zmq reconnected this socket by itself to a restarted shard, which serves only a connection that
            # proved the job's secret: as a lost reply, so that collect() reconnects (a proving one) and resends
            raise CommTimeout(f"{self.name} did not answer {req.what}: a restarted shard on an unproven connection",
                              peer=self.peer, op="receive")
        if h.op == "error":
            raise RemoteError(f"{self.name} refused {req.what}: {h.meta.get('reason')}", peer=self.peer)
        return h, data

    def request(self, op: str, step: int, parts=(), meta: dict | None = None, what: str = "",
                max_bytes: int = 0) -> tuple:
        return self.answer(self.post(op, step, parts, meta, what, max_bytes=max_bytes))

    @property
    def replicated(self) -> bool:
        return len(self.endpoints) > 1

    def _recv(self, left: float) -> list:
        """One message within ``left`` seconds; replicated, PeerLost as soon as the connection closes."""
        sock, monitor = self.sock, self.monitor
        assert sock is not None
        if monitor is None:
            return transport.recv(sock, left, self.name, self.peer)
        deadline = time.monotonic() + left
        while True:
            if sock.poll(int(min(0.05, max(0.0, deadline - time.monotonic())) * 1000), zmq.POLLIN):
                return transport.recv(sock, 0, self.name, self.peer)
            if monitor.poll(0) and recv_monitor_message(monitor)["event"] != zmq.EVENT_CONNECTED:
                raise PeerLost(f"{self.name}: its connection closed (the server died?)", peer=self.peer, op="receive")
            if time.monotonic() >= deadline:
                raise CommTimeout(f"no message from {self.name} within {left:g}s", peer=self.peer, op="receive")

    def _connected(self, monitor: zmq.Socket) -> None:
        """Replicated: wait (at most ``timeout``) until the connection is made; PeerLost if it is refused."""
        if not monitor.poll(int(self.timeout * 1000)):
            raise CommTimeout(f"{self.name}: no connection within {self.timeout:g}s", peer=self.peer, op="connect")
        if recv_monitor_message(monitor)["event"] != zmq.EVENT_CONNECTED:
            raise PeerLost(f"{self.name}: connection refused (the server is gone?)", peer=self.peer, op="connect")

    def hello(self, meta: dict) -> dict:
        self.hello_meta = meta
        if meta.get("min_workers"):  # keep-going: a process's first hello is fresh; later ones say their epoch
            meta = dict(meta, fresh=self.hellos == 0, epoch=self.epoch)
        while True:
            self._drop_link()
            req = None
            try:
                req = self.post("hello", -1, meta=dict(meta, shm_host=shm.host_identity()) if self.shm_want else meta,
                                what="hello")
                reply = self.answer(req)[0].meta
                break
            except (CommTimeout, PeerLost, NotPrimary) as exc:
                if req in self.outstanding:
                    self.outstanding.remove(req)
                if not self._fail_over(exc):
                    raise
        self.hellos += 1
        self.epoch = reply.get("epoch", 0)
        self.boot = reply.get("boot", "")
        self._failover_until = None
        if self.heartbeat_s and meta.get("min_workers"):
            self._beat()
        if self.shm_want:
            self._take_link(reply.get("shm_link"))
        return reply

    def _beat(self) -> None:
        """heartbeat_s=: a second connection that says ``live`` once and then carries only zmq's PINGs, whose
        TTL the shard counts from the last one: this connection's data never resets it, so a frozen process
        is noticed within ``heartbeat_s`` whatever it sent last."""
        transport.close_monitored(self.live, self.live_monitor)
        self.live = self.live_monitor = None
        self.live, self.live_monitor = self._open()
        meta = {"id": -1, **({"space": self.space} if self.space else {}), **({"attempt": self.attempt} if self.attempt else {})}
        transport.send(self.live, wire.encode("live", self.sender, -1, (), meta), timeout=self.timeout, who=self.name,
                       peer=self.peer)
        h = wire.decode(transport.recv(self.live, self.timeout, self.name, self.peer), ops=psproto.REPLIES, max_bytes=0)
        if h.op == "error":
            raise RemoteError(f"{self.name} refused the heartbeat connection: {h.meta.get('reason')}", peer=self.peer)
        # the shard times this connection out only once a ping told it the TTL: let the first one go before this
        # process goes on (frozen before it, the shard's own heartbeat would take peer_timeout / 2 to notice)
        time.sleep(1.5 * transport.ping_interval(self.heartbeat_s))

    def _learn(self, endpoints) -> None:
        """Servers of this shard a reply named (a backup attached later, ``commlab server --replica-of``)."""
        if isinstance(endpoints, list):
            for ep in endpoints:
                if isinstance(ep, str) and ep not in self.endpoints and "://0.0.0.0:" not in ep and len(ep) < 512 \
                        and len(self.endpoints) < 16:
                    self.endpoints.append(ep)

    def _fail_over(self, exc: BaseException) -> bool:
        """Replicated: leave this server for the shard's next one (not one whose connection was lost lately;
        a backup that says its primary lives is asked again shortly: it may not have noticed yet; when every
        server failed lately, the next is tried after :data:`FAILOVER_PAUSE_S`). False when
        the shard has one server, or the failover has taken longer than ``timeout`` x (1 + retries)."""
        if not self.replicated:
            return False
        now = time.monotonic()
        if self._failover_until is None:
            self._failover_until = now + self.timeout * (1 + self.retries)
        if now > self._failover_until:
            return False
        if isinstance(exc, NotPrimary):
            time.sleep(0.1)
        else:
            self._failed[self.endpoint] = now
        at = self.endpoints.index(self.endpoint)
        order = self.endpoints[at + 1:] + self.endpoints[:at + 1]
        fresh = [e for e in order if now - self._failed.get(e, -math.inf) > self.timeout]
        if not fresh:  # every server of the shard failed lately: ask again at a bounded rate, not in a spin
            time.sleep(FAILOVER_PAUSE_S)
        self.endpoint = (fresh or order)[0]
        self.name = f"shard {self.index}/{self.count} at {self.endpoint}"
        self.failovers += 1
        self.inbox.clear()
        self._close_sock()
        return True

    def _close_sock(self) -> None:
        transport.close_monitored(self.sock, self.monitor)
        self.sock = self.monitor = None

    def _take_link(self, offer) -> None:
        """Map the segments the server made for this connection (transport=shm), or say why not (auto)."""
        why, link = "", None
        if not isinstance(offer, dict):
            why = f"{self.name} offered no shared memory (an older server?)"
        elif "refused" in offer:
            why = str(offer["refused"])
        else:
            try:
                link = psshm.Link.attach(offer, self.shm_pieces)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                why = f"this worker cannot map {self.name}'s shared memory: {exc}"
                for path in (offer.get("in"), offer.get("out")):  # the server's files: do not strand them
                    if isinstance(path, str) and shm.NAME.fullmatch(os.path.basename(path)):
                        try:
                            os.unlink(path)
                        except OSError:
                            pass
        if link is not None:
            self.link, self.shm_note = link, ""
            return
        if self.shm_want == "shm":
            raise ConfigError(f"ps:// transport=shm: {why}; use transport=auto (shm where it can, zmq frames "
                              f"elsewhere) or tcp")
        self.shm_note = why

    def _drop_link(self) -> None:
        self.link.close()
        self.link = psshm.FRAMES

    def collect(self) -> int:
        """Wait for every posted request's reply, in order; copy pulled parameters in; bytes received.

        A reply missing for ``timeout`` seconds: ask the shard (:meth:`probe`) what is going on.
        Alive, the same process, and holding the pull back for other workers: raise now, naming
        the ranks it waits for (a dead or stalled worker; resending would not help). Otherwise
        (no answer, or a restarted shard): reconnect, hello again, and resend this step's pushes
        and every unanswered request, up to ``retries`` times. The server applies each (worker,
        step, key) once, so a push it had already folded in is acknowledged as a duplicate, and
        a restarted shard (``--resume``, checkpointing every update) gets back what it lost."""
        received, attempts = 0, 0
        while self.outstanding:
            req = self.outstanding[0]
            try:
                h, data = self.answer(req)
            except (CommTimeout, PeerLost, NotPrimary) as exc:
                if self.replicated:  # the next server of the shard; what is unanswered goes there again
                    if not self._fail_over(exc):
                        raise CommTimeout(f"{exc} (every server of shard {self.index} failed: "
                                          f"{', '.join(self.endpoints)})", peer=self.peer, op="receive") from None
                    self._resend()
                    continue
                if not isinstance(exc, CommTimeout):
                    raise
                state = self.probe()
                if state is not None and state.get("boot") == self.boot:
                    stalled = [self.members[r] if self.members else r for r in state.get("waiting_for", [])
                               if r != self.rank]
                    if stalled:  # the culprit is a rank: the field names it when there is one
                        waits = (f"its start waits for {state['gate']}, from rank(s) {stalled} (not yet at "
                                 f"ex.setup, dead or stalled?)" if state.get("gate") else
                                 f"its step {state.get('sync_step')} waits for rank(s) {stalled} (dead or stalled?)")
                        elsewhere = state.get("elsewhere") or {}
                        if elsewhere:  # the waited rank is at the start of another key space on this shard
                            waits = (f"its start (key space {self.space!r}) waits for rank(s) {stalled}, which are "
                                     f"at the start of key space(s) " + ", ".join(
                                         f"{space!r} (rank {self.members[int(r)] if self.members else r})"
                                         for r, space in sorted(elsewhere.items())) +
                                     ": the ranks must set up the same spaces in the same order (ps://?space= "
                                     "names one; unnamed, each process counts the exchangers it set up on "
                                     "these servers)")
                        raise CommTimeout(f"{exc}: the shard is up and {waits}",
                                          peer=stalled[0] if len(stalled) == 1 else None, op="receive") from None
                if attempts >= self.retries:
                    if state is None:
                        seen = "no answer to a probe either"
                    elif state.get("boot") != self.boot:
                        seen = "the shard restarted"
                    else:
                        seen = f"the shard is up, {len(self.outstanding)} request(s) unanswered, its stats: {state}"
                    raise CommTimeout(f"{exc} ({seen}; gave up after {attempts} reconnect(s))", peer=self.peer,
                                      op="receive") from None
                attempts += 1
                self._reconnect_and_resend()
                continue
            if req.take is not None:
                received += req.take(h, data)
            elif req.op == "pull":
                received += self._take(h, data)
        self.unsettled.clear()  # every pull of the step is in: its pushes are applied
        self._failover_until = None
        return received

    def probe(self) -> dict | None:
        """The shard's stats, or None when it does not answer within :attr:`PROBE_S` seconds."""
        if self.sock is None:
            return None
        req = self.post("stats", -1, what="stats probe")
        saved, self.timeout = self.timeout, min(self.timeout, self.PROBE_S)
        try:
            return self.answer(req)[0].meta.get("stats")
        except (CommTimeout, RemoteError):
            return None
        finally:
            self.timeout = saved
            if req in self.outstanding:
                self.outstanding.remove(req)

    def _reconnect_and_resend(self) -> None:
        self._close_sock()
        self._resend()

    def _resend(self) -> None:
        """Hello again (on a fresh connection) and send this step's pushes and every unanswered request."""
        pending = {r.rid: r for r in [*self.unsettled, *self.outstanding]}
        self.outstanding = []
        self.inbox.clear()
        self.hello(self.hello_meta)
        for rid in sorted(pending):  # in the order first sent: pushes before the pulls that need them
            self._transmit(pending[rid])
            self.outstanding.append(pending[rid])

    def _take(self, h: wire.Header, data, pairs: list | None = None) -> int:
        """Put a pull reply's values into the parameters (``pairs``: only these (spec, frame) of it)."""
        for spec, frame in (zip(h.frames, data) if pairs is None else pairs):
            param, start, count = self.targets.get(spec.key, (None, 0, 0))
            if param is None or spec.offset + spec.count > count:
                raise ModelMismatch(f"{self.name} sent {spec.key}[{spec.offset}:{spec.offset + spec.count}], "
                                    f"which this worker does not hold")
            values = wire.frame_tensor(spec, frame)
            if self.put_staged is not None and self.put_staged(spec.key, spec.offset, values):
                continue  # a CUDA parameter: through its bucket's pinned mirror, copied up on the copy stream
            shared = isinstance(frame, memoryview)  # a view of the outbound segment (transport=shm)
            if spec.count == param.numel() and (not shared or self.adopt_shm):
                # the whole parameter in one received frame, or in its place in the segment, which the
                # server writes again only when this worker next pulls it: adopt the buffer, no copy
                if param.data.data_ptr() != values.data_ptr():
                    param.data = values.view(param.shape)
            else:
                param.data.view(-1)[start + spec.offset:start + spec.offset + spec.count].copy_(values)
        self.version = max(self.version, h.meta["version"])
        return h.data_bytes

    def pull(self, after_step: int) -> int:
        """Fetch every key as the mode allows after ``after_step`` (and collect what is posted)."""
        self.post("pull", after_step, meta={"after_step": after_step},
                  what=f"pull after step {after_step} (keys {', '.join(list(self.targets)[:3])}...)")
        return self.collect()

    def start(self, after_step: int, buffers: dict[str, torch.Tensor] | None = None) -> int:
        """The first pull of setup: answered once the shard is initialised and every rank made this call.
        ``buffers`` (the shard that holds the module's buffers): they come in the same reply, as of the same
        moment (a separate pull after it could see a buffers round of a rank already training, under async)."""
        take = None
        if buffers:
            def take(h, data):
                pairs = list(zip(h.frames, data))
                take_buffers(self.name, buffers, [(sp, fr) for sp, fr in pairs if sp.key in buffers])
                return self._take(h, data, [(sp, fr) for sp, fr in pairs if sp.key not in buffers])
        self.post("pull", after_step, meta={"after_step": after_step, "start": True,
                                            **({"with_buffers": True} if buffers else {})},
                  what=f"start pull (rank 0's initial parameters; every rank must reach setup)", take=take)
        return self.collect()

    def push_then_pull(self, step: int, parts: list, meta: dict, what: str, commit: dict | None = None,
                       keys: list[str] | None = None, take: Callable | None = None, as_dtype: str = "") -> int:
        """Push and pull back to back (the pull goes out before the push is acknowledged). With
        ``commit`` (update=server, sync), the step is committed in between, as ``optimizer.step()`` does:
        the shard's report is read once every worker's push is in, then the commit goes out. ``keys``: pull
        only those; ``take``: what to do with the pulled values (default: into the parameters); ``as_dtype``:
        the floating dtype the pulled values travel in (the shard's own when empty)."""
        self.post("push", step, parts, meta, what)
        if commit is not None:
            self.post("pull", step, meta={"after_step": step, "what": "report"}, what=f"report of step {step}",
                      take=lambda h, _data: 0)
            self.collect()
            self.post("commit", step, meta=commit, what=f"commit of step {step}")
        if keys is None and take is None:
            return self.pull(step)
        self.post("pull", step, meta={"after_step": step, **({"keys": keys} if keys else {}),
                                      **({"as": as_dtype} if as_dtype else {})},
                  what=f"pull after step {step} ({what})", take=take)
        return self.collect()

    def close(self, bye: bool) -> None:
        if self.sock is not None:
            if bye:
                try:
                    self.timeout = min(self.timeout, 2.0)
                    self.request("bye", -1, what="bye")
                except Exception:  # best effort: the server may be gone already
                    pass
            self._close_sock()
        transport.close_monitored(self.live, self.live_monitor)
        self.live = self.live_monitor = None
        self._drop_link()


class NotPrimary(CommError):
    """A backup shard answered: its primary is alive (replicas=2; the worker asks the next server)."""


class _ServerJoin(Join):
    """join() on a parameter server: the shards count the workers that joined (no vote among the workers), so a
    rank still training does nothing extra per exchange; a joined one tells the shards and waits
    (:meth:`PSExchanger._wait_out_join`)."""

    def __init__(self, ex: "PSExchanger", options: JoinOptions):
        super().__init__(options)
        self.ex, self.opts = ex, options

    def wait_out(self) -> None:
        self.ex._wait_out_join(self.opts)


class FramePushes:
    """The uncompressed step of one :class:`PSExchanger`: each bucket's pieces as raw frames, grouped up to one
    frame's size per message, pushed to the shards that hold them. It has the methods of
    :class:`~commlab.regimes.ps_compress.CompressedPushes`, which takes its place under ``compress=``
    (chosen once at setup, from the exchanger's :class:`~commlab.compress.seam.CompressState`): the step
    path does not know which one moves the bucket."""

    joins = True  # ex.join(): the shards count a joined worker's pushes as zeros
    raw = True  # push_pull_async() pushes a tensor as it is

    def __init__(self, ex: "PSExchanger"):
        self.ex = ex

    def hello(self, shard: int) -> dict:
        """What each shard's hello says of the pushes (nothing: raw frames)."""
        return {}

    def connected(self) -> None:
        """After hello: the servers' mode and placement are known."""

    def start_bucket(self, bucket, step: int, extra: dict) -> Handle:
        """In the backward hook: push the bucket's pieces to their shards (``extra``: what every push of the
        step carries besides). Does not block."""
        ex = self.ex
        # the bucket itself, or its host mirror, whose copy from the GPU starts now (each shard's thread waits for it)
        src, _ = ex._staging.to_host_async(bucket.index)
        handles = []
        for k, items in ex._plan[bucket.index].items():
            shard = ex.shards[k]
            messages: list[tuple] = []  # (parts, absent keys, keys): pieces grouped up to one frame's size per message
            size = wire.MAX_FRAME
            for pc, slot in items:
                if size + pc.nbytes > wire.MAX_FRAME:
                    messages.append(([], [], []))
                    size = 0
                parts, absent, keys = messages[-1]
                keys.append(pc.key)
                size += pc.nbytes
                if not bucket.present[slot]:
                    absent.append(pc.key)
                    continue
                at = bucket.offsets[slot] + pc.start
                parts += wire.split(pc.key, src[at:at + pc.count])
                ex.stats.bytes_sent += pc.nbytes
            what = f"push of bucket {bucket.index} at step {step} to {shard.name}"
            handles.append(FutureHandle(shard.submit(self._post, shard, step, messages, extra, bucket.index),
                                        what))
        if not handles:
            return DoneHandle(what=f"bucket {bucket.index}")
        return handles[0] if len(handles) == 1 else GroupHandle(handles, f"push of bucket {bucket.index}")

    def _post(self, shard: _Shard, step: int, messages: list, extra: dict, bucket: int) -> None:
        """On the shard's thread: send the pushes, each followed by what the placement asks for at once
        (update=worker: those keys' averages, which the server sends as soon as every worker's gradient for
        them is in, while backward is still busy with earlier layers). The parts are read from ``bucket``'s
        host mirror (the bucket itself unless it is staged), ready once its copy from the GPU is."""
        ex, steps = self.ex, self.ex.steps
        assert steps is not None  # setup
        ex._staging.wait(bucket, ex.options.timeout)
        for parts, absent, keys in messages:
            shown = ", ".join(keys[:3]) + ("..." if len(keys) > 3 else "")
            shard.post("push", step, parts, {"base": shard.version, "absent": absent, **extra},
                       f"push of {shown} at step {step}")
            steps.after_push(shard, step, keys, shown)

    def finish(self, step: int, replies: bool) -> int:
        """At the end of backward: collect the replies the placement asked for during backward (``replies``);
        the bytes received."""
        if not replies:
            return 0
        return sum(self.ex._on_all(lambda s: s.collect(), f"replies of step {step}"))


class PSExchanger(BucketedExchanger, PlansServers, AveragesSteps):
    scheme = "ps"
    Options = PSOptions
    carry_presence = False  # absent gradients travel as names in the push header

    @classmethod
    def options_from_url(cls, url: ExchangerURL) -> PSOptions:
        return _options(url)

    @classmethod
    def plan_local(cls, url: ExchangerURL, workers: int,
                   scratch: Callable[[], str]) -> tuple[str, list[list[str]]]:
        """For a job on this host: the URL the workers get, and the argv of each server to start.

        A URL that already names servers starts none. Otherwise ``shards`` (default 1) servers
        listen on loopback port 0 (each reports the port it got; the launcher puts it in the
        workers' URL in place of the ``:0`` listed there, in server order), or with
        ``transport=ipc|shm`` on sockets in ``scratch()``, a folder the caller owns and removes (call
        this through :func:`commlab.launch.launcher.server_plan`). ``auto`` listens on loopback tcp, as a plan
        a benchmark moves into network namespaces must (the payloads take shared memory where they can).
        """
        opts = _options(url)
        if opts.endpoint_list:
            return url.text, []
        k = opts.shards or 1
        if opts.transport in ("ipc", "shm"):  # shm: the headers go over ipc, the payloads not at all
            folder = scratch()
            endpoints = [f"ipc://{folder}/shard{i}" for i in range(k)]
        else:
            endpoints = ["tcp://127.0.0.1:0"] * k
        mode = (opts.consistency or psproto.SYNC).name
        argvs = []
        if opts.replicas > 1:  # each shard's primary, then its backup, which attaches to it (launcher.SERVER_REF)
            endpoints = [ep + (f".r{r}" if ep.startswith("ipc://") and r else "") for ep in endpoints
                         for r in range(opts.replicas)]
        for j, ep in enumerate(endpoints):
            i, r = divmod(j, opts.replicas)
            argv = ["--bind", ep, "--mode", mode, "--shard", f"{i}/{k}"]
            if opts.staleness >= 0:
                argv += ["--staleness", str(opts.staleness)]
            if opts.keys:  # the workers will speak CURVE with these keys: so must the servers
                argv += ["--keys", opts.keys]
            if opts.replicas > 1:  # every server: a backup becomes the primary of the next backup
                argv += ["--replica-log", f"{opts.replica_log:g}"]
            if r:
                argv += ["--replica-of", f"{{server:{j - r}}}"]
            argvs.append(argv)
        query = [(key, v) for key, v in url.query if key not in ("shards", "transport", "endpoints", "mode")]
        # the transport always travels: a tcp or ipc plan left without one would get the default (auto)
        query += [("mode", mode), ("endpoints", ",".join(endpoints)), ("transport", opts.transport)]
        return "ps://?" + "&".join(f"{key}={v}" for key, v in query), argvs

    def __init__(self, options, rank):
        super().__init__(options, rank)
        self.shards: list[_Shard] = []
        self.transport: transport.Transport | None = None
        self._base = 0  # wire step = _base + _step (the servers' numbering; see load_state_dict)
        self._plan: list[dict[int, list]] = []  # bucket -> shard -> [(piece, slot in bucket)]
        self._pieces: list[list[psproto.Piece]] = []
        self.space = ""  # this exchanger's key space on the servers (setup names it)
        self._store = None  # connect(group=): the job's store, held from setup to close
        self.consistency: psproto.Consistency | None = None  # the servers' mode (from hello)
        self.steps: StepPlacement | None = None  # the servers' placement, as this client takes part in it (hello)
        # piece key -> (bucket, the parameter's slot there, the piece's first element in the parameter, count)
        self._grad_slots: dict[str, tuple[int, int, int, int]] = {}
        self._absent: set[str] = set()  # update=worker: keys no worker had a gradient for, this step
        self._buffer_targets: dict[str, torch.Tensor] = {}
        self._buffers_fresh = False  # setup pulled the servers' buffers: its own broadcast is not needed
        self._keeping = 0  # keep-going's min_workers (0: off), known at setup
        self._staging: HostStaging = HostStaging([])  # setup: the buckets' (CUDA ones: pinned) host mirrors
        self._pushes: FramePushes | CompressedPushes | None = None  # how a bucket goes to the shards (setup)
        self._secret: auth.JobSecret | None = None  # the job's (setup reads it): proved on every connection
        self.healed: dict | None = None  # a replacement: {step: where it entered, seconds: since the death}
        self._replay_to = 0  # wire steps below this one are replayed (see replaying)
        # keep-going under update=worker: shard -> (entry step, ranks) it asked this rank's state for (_donate)
        self._asks: dict[int, tuple[int, list]] = {}
        self._donations: list[cf.Future] = []  # posting that state, on the shards' threads

    # ----- setup ---------------------------------------------------------------------------
    def _connect(self, model, optimizer):
        endpoints = self.options.endpoint_list
        if not endpoints:
            raise ConfigError("ps:// names no servers: give ps://HOST:PORT[,HOST:PORT...] (servers started with "
                              "'commlab server'), or let the launcher start them with ps://?shards=K: "
                              "'commlab run' for your script, 'commlab train' for the built-in worker")
        replicas = self.options.replicas
        if len(endpoints) % replicas:
            raise ConfigError(f"ps:// replicas={replicas} lists each shard's {replicas} servers one after the other, "
                              f"but the URL names {len(endpoints)} servers")
        groups = [endpoints[i:i + replicas] for i in range(0, len(endpoints), replicas)]
        endpoints = [g[0] for g in groups]
        if self.options.shards and self.options.shards != len(endpoints):
            raise ConfigError(f"ps:// says shards={self.options.shards} but lists {len(endpoints)} servers"
                              + (f" ({len(endpoints) * replicas} with replicas={replicas})" if replicas > 1 else ""))
        desc = describe_optimizer(optimizer, model)
        asked = self.options.placement
        foreign = getattr(torch.optim, type(optimizer).__name__, None) is not type(optimizer)
        if foreign and asked is not None and asked.shards_step:
            raise ConfigError(f"ps:// update=server builds the optimizer on the servers from torch.optim, and "
                              f"{desc['class']} is not one of its classes: use update=worker (mode=sync), where "
                              f"your optimizer steps on the workers")
        manifest = model_manifest(model)
        params = dict(model.named_parameters())
        from torch.distributed.tensor import DTensor
        for name, shape, dtype in manifest:
            if isinstance(params[name], DTensor):
                raise ConfigError(f"ps:// serves whole tensors, and {name} is a DTensor (tensor parallel): exchange "
                                  f"its shards with allreduce:// or ring:// over the data-parallel group")
            if params[name].device.type not in ("cpu", "cuda"):
                raise ConfigError(f"ps:// serves workers whose parameters are on the CPU or a CUDA GPU, and {name} is "
                                  f"on {params[name].device}")
            if not params[name].is_contiguous():
                raise ConfigError(f"ps:// needs contiguous parameters; {name} is not")
        buffers = self.module_buffers if self.options.buffers != "none" else []
        for name, b in buffers:
            if b.device.type not in ("cpu", "cuda") or not b.is_contiguous() or b.dtype not in wire.DTYPE_NAMES:
                raise ConfigError(f"ps:// carries contiguous CPU or CUDA buffers of {sorted(wire.DTYPES)}; {name} is "
                                  f"{b.dtype} on {b.device}: use buffers=none")
        self._buffer_targets = {name: b for name, b in buffers}
        # CUDA buckets through pinned host mirrors: pushes read them, averages and parameters land in them
        self._staging = HostStaging.for_buckets(self.buckets)
        self._pieces = psproto.assign_shards(manifest, len(endpoints), max(1, int(self.options.piece_mb * 2**20)))
        curve = None
        if self.options.keys:
            if self.options.curve_secret or self.options.server_key:
                raise ConfigError("ps:// takes keys=DIR or curve_secret=/server_key=, not both")
            from commlab.transport.keys import client_keys
            curve = client_keys(self.options.keys, self.options.key_name)
        elif self.options.curve_secret:
            curve = transport.CurveKeys.load(self.options.curve_secret, self.options.server_key or None)
        self.transport = transport.Transport(io_threads=1, curve=curve)
        sender = f"rank{self.rank_info.global_rank()}"  # servers' messages name it: the job's rank
        k = len(endpoints)
        self.shards = [_Shard(i, k, ep, self.transport, sender, self.options.timeout, self.options.retries, self.rank)
                       for i, ep in enumerate(endpoints)]
        for shard, group in zip(self.shards, groups):
            shard.endpoints = list(group)
        self._secret = auth.load()
        if self._secret is None:
            auth.warn_unauthenticated(f"ps:// rank {self.rank_info.global_rank()}")
        for shard in self.shards:
            shard.secret, shard.trace = self._secret, self._trace
            shard.heartbeat_s = self.options.heartbeat_s
        keep = self._keeping = self._min_workers()
        # what the servers count attempts by (under torchrun TORCHELASTIC_RESTART_COUNT does not move on a
        # membership change); bounded as the start gate is: the ranks start when they do
        self.attempt_id = rendezvous.job_attempt(self.rank_info, self._setup_bound)
        if self.rank_info.members:  # connect(group=): the members agree on it first; a space per group
            self._check_group()
        self.space = self.options.space or _next_space(self.rank_info, endpoints)
        for shard in self.shards:
            shard.space, shard.members, shard.attempt = self.space, self.rank_info.members, self.attempt_id
        where = {id(p): (b.index, i) for b in self.buckets for i, p in enumerate(b.params)}
        if self.options.transport in ("shm", "auto"):
            shm.sweep_stale()  # what killed runs left behind
        for shard, pieces in zip(self.shards, self._pieces):
            shard.targets = {pc.key: (params[pc.param], pc.start, pc.count) for pc in pieces}
            if self.options.transport in ("shm", "auto"):
                shard.shm_want = self.options.transport
                shard.shm_pieces = [(pc.key, pc.dtype, pc.count) for pc in pieces]
            shard.max_reply = sum(pc.nbytes for pc in pieces) + (self._buffer_bytes() if shard.index == 0 else 0)
            for pc in pieces:
                bi, slot = where[id(params[pc.param])]
                self._grad_slots[pc.key] = (bi, slot, pc.start, pc.count)
            if self._staging.any_staged:
                shard.put_staged = self._put_param
        self._plan = [{} for _ in self.buckets]
        for shard, pieces in zip(self.shards, self._pieces):
            for pc in pieces:
                bi, slot = where[id(params[pc.param])]
                self._plan[bi].setdefault(shard.index, []).append((pc, slot))
        # compress=: through the compressor (the seam's state), else raw frames; the step path asks either alike
        pushes = self._pushes = (CompressedPushes(self, self._plan, self.compress_state, bool(self.options.sync_every))
                                 if self.compress_state is not None else FramePushes(self))
        manifest_wire = [[n, list(s), d] for n, s, d in manifest]
        buffers_wire = [[n, wire.dtype_name(b.dtype), b.numel()] for n, b in buffers]
        replies = self._on_all(lambda s: s.hello({
            "rank": self.rank, "world": self.world_size, "mode": self.options.mode or None,
            "staleness": self.options.staleness if self.options.staleness >= 0 else None,
            "update": self.options.asked_update, "manifest": manifest_wire,
            "pieces": [[pc.key, pc.dtype, pc.count, pc.param] for pc in self._pieces[s.index]],
            "buffers": buffers_wire if s.index == 0 else [],
            "shard": [s.index, k], "optim": {**desc, **self.options.outer_desc()},
            **({"min_workers": keep} if keep else {}), **pushes.hello(s.index)}), "hello")
        self._take_placement(replies[0])
        self.hello_steps = [r["next_step"] for r in replies]  # each shard's next step at hello (a resume checks it)
        self._base = self.steps.resume_step(self.hello_steps)
        if any("enter" in r for r in replies):  # a replacement for a lost rank: in at the next step boundary
            self._base = self.start_step = self._enter(max(r.get("enter", 0) for r in replies))
        pushes.connected()
        fresh = not all(r["initialized"] for r in replies)
        if fresh and self.rank == 0:  # a fresh start takes rank 0's parameters and buffers, as DDP does
            self._on_all(lambda s: None if replies[s.index]["initialized"] else
                         s.request("init", -1, self._parts(s.index, None) + (self._buffer_parts() if s.index == 0 else []),
                                   what="init"), "init")
        self.steps.adopt(optimizer, fresh)  # before the start pull: no push can reach a shard before it
        # the start pull: each shard answers it once rank 0 initialised it and every rank asked, so no
        # worker pushes (async, ssp) before every worker holds the same start
        steps = self.steps
        self._on_all(lambda s: s.start(steps.start_after(self._base, replies[s.index]["next_step"]),
                                       self._buffer_targets if buffers and s.index == 0 else None),
                     "start pull (rank 0's parameters and buffers, once every rank is in setup)")
        if buffers:
            self._buffers_fresh = True  # every rank holds the servers' buffers now, as of its parameters
        if not fresh or self.rank_info.attempt:
            self.restored_state = self._restore_state()
            self._replay_from_state()
        if self.healed is not None:
            who = f"commlab ps:// rank {self.rank_info.global_rank()}"
            if not self.steps.spec.shards_step:  # update=worker: the state is a live peer's
                try:
                    who += f" (healed from rank {self._heal_from_peer()})"
                except BaseException:
                    # leave as a dead rank does (connections closed, no bye): the shards count this rank lost and
                    # the others go on without it, where a bye would leave it owing its step
                    for s in self.shards:
                        s.submit(s.close, False).result(timeout=5)
                    raise
            self.healed = rendezvous.announce_entry(who, self.healed["step"])

    # ----- keep-going under update=worker: a replacement takes a live peer's state through the shards ----------
    def _heal_from_peer(self) -> int:
        """A replacement under update=worker, where the shards hold sums only: each shard relays its range of the
        state (parameters, buffers, optimizer state: :func:`commlab.core.keepgoing.pack_heal`) that the lowest
        rank training held after its optimizer step before this rank's entry (:mod:`servers.relay`); loaded
        before the first step. Returns that rank. A relay that failed (the donor left before all of it arrived)
        raises RemoteError naming the donor and the step."""
        entry = self._base
        got: list = [None] * len(self.shards)

        def fetch(s: _Shard) -> int:
            def take(h: wire.Header, data) -> int:
                got[s.index] = (h.meta, [(spec.offset, wire.frame_tensor(spec, frame).clone())
                                         for spec, frame in zip(h.frames, data)])
                return h.data_bytes

            s.post("pull", entry - 1, meta={"after_step": entry - 1, "what": "heal"}, take=take,
                   max_bytes=psproto.relay_limit(s.max_reply),
                   what=f"the state after step {entry - 1} from the lowest live rank (this replacement enters at "
                        f"step {entry}; update=worker)")
            return s.collect()

        self.stats.bytes_received += sum(self._on_all(fetch, "a live peer's state"))
        metas = [m for m, _ in got]
        said = {(m.get("donor"), m.get("step"), m.get("size")) for m in metas}
        if len(said) != 1 or next(iter(said))[1] != entry:
            raise ProtocolError(f"ps:// rank {self.rank_info.global_rank()} enters at step {entry}, but the shards "
                                f"relayed the state of (donor, step, bytes) {sorted(said, key=str)}: not one peer's")
        donor, _, size = next(iter(said))
        most = sum(psproto.relay_limit(s.max_reply) for s in self.shards)
        if not isinstance(size, int) or not 0 <= size <= most:
            raise ProtocolError(f"ps:// the shards relayed rank {donor}'s state as {size!r:.40} bytes (at most {most})")
        payload, at = torch.empty(size, dtype=torch.uint8), 0
        if not all(isinstance(m.get("range"), list) and len(m["range"]) == 2 for m in metas):
            raise ProtocolError(f"ps:// a shard relayed rank {donor}'s state without its range")
        for meta, frames in sorted(got, key=lambda g: g[0]["range"]):
            lo, hi = meta["range"]
            for off, t in frames:
                if off != at or off + t.numel() > hi or lo > off or t.dtype != torch.uint8:
                    raise ProtocolError(f"ps:// the shards relayed bytes [{off}, {off + t.numel()}) of rank {donor}'s "
                                        f"state where bytes from {at} of [{lo}, {hi}) were due")
                payload[at:at + t.numel()] = t
                at += t.numel()
        if at != size:
            raise ProtocolError(f"ps:// the shards relayed {at} bytes of rank {donor}'s state, which takes {size}")
        tree = unpack_heal(payload, heal_tensors(self), f"rank {donor} (through the shards)")
        assert self.optimizer is not None  # setup
        self.optimizer.load_state_dict(tree["optim"])
        return donor

    def _asked(self, shard: int, ask) -> None:
        """On a shard's thread: ``shard`` asked this rank (the lowest training there) for its state after the step
        before ``ask["step"]``, the entry of the replacements ``ask["ranks"]``."""
        if isinstance(ask, dict) and isinstance(ask.get("step"), int) and isinstance(ask.get("ranks"), list):
            self._asks[shard] = (ask["step"], ask["ranks"])

    def _after_step(self) -> None:
        super()._after_step()
        if self._asks:
            self._donate()

    def _exchange_begins(self) -> None:
        super()._exchange_begins()
        if self._asks:  # a step no optimizer step followed (a GradScaler skipped it): its boundary is now
            self._donate()

    def _donate(self) -> None:
        """At the step boundary the shards asked for (after the optimizer step before a replacement's entry): this
        rank's parameters, buffers and optimizer state, packed once (:func:`commlab.core.keepgoing.pack_heal`),
        each asking shard its byte range (in proportion to its pieces), in messages no larger than its pieces.
        Posted on the shards' threads and not waited for: the replies come with the next step's. What cannot
        travel goes as a refusal, which the replacement says; this rank trains on."""
        step = self._wire_step()
        due = {i: ranks for i, (at, ranks) in self._asks.items() if at == step}
        self._asks = {i: a for i, a in self._asks.items() if a[0] > step}
        if not due:
            return
        assert self.optimizer is not None  # setup
        try:
            payload, refused = pack_heal(heal_tensors(self), {"optim": self.optimizer.state_dict()}), ""
        except ConfigError as exc:
            payload, refused = torch.empty(0, dtype=torch.uint8), str(exc)
        weights = [s.max_reply for s in self.shards]
        bounds = [payload.numel() * sum(weights[:i]) // sum(weights) for i in range(len(weights))] + [payload.numel()]
        over = [i for i in due if bounds[i + 1] - bounds[i] > psproto.relay_limit(weights[i])]
        if over and not refused:
            refused = (f"its state takes {payload.numel()} bytes, more than shard {over[0]} relays "
                       f"({psproto.relay_limit(weights[over[0]])}: 16 times its pieces and 1 MiB)")
        for i, ranks in due.items():
            s = self.shards[i]
            self._donations.append(s.submit(self._send_state, s, step, ranks, payload, bounds[i], bounds[i + 1],
                                            refused))

    @staticmethod
    def _send_state(s: _Shard, step: int, ranks: list, payload: torch.Tensor, lo: int, hi: int, refused: str) -> None:
        """On ``s``'s thread: post bytes ``[lo, hi)`` of ``payload`` (or the refusal) for the replacements
        ``ranks`` entering at ``step``."""
        meta = {"entry": step, "ranks": ranks, "size": payload.numel(), "range": [lo, hi]}
        what = f"this rank's state for rank(s) {ranks} entering at step {step}"
        if refused:
            s.post("donate", step, meta=dict(meta, refused=refused), what=what)
            return
        at, cap = lo, max(1, s.max_reply)
        while True:
            n = min(cap, hi - at)
            s.post("donate", step, wire.split("heal", payload[at:at + n], at), meta, what)
            at += n
            if at >= hi:
                return

    def _min_workers(self) -> int:
        """Keep-going's quorum (min_workers=; 1 under a launcher that replaces dead ranks, 0: off), checked
        against the world."""
        keep = self.options.min_workers or (1 if rendezvous.keep_going() else 0)
        if keep > self.world_size:
            raise ConfigError(f"option 'min_workers': {keep} is more than the job's {self.world_size} workers")
        if self.options.heartbeat_s and not keep:
            raise ConfigError("option 'heartbeat_s': a silent worker leaves the job only when the others keep "
                              "going: give min_workers= too (or run under commlab run --replace)")
        return keep

    def _enter(self, step: int) -> int:
        """A replacement: tell every shard the step it enters at, the largest any offered; a shard that went
        past it meanwhile names a later one, and every shard is told that (bounded: each try is one request).
        Returns the step; the start pull then waits for the parameters after the one before."""
        for _ in range(100):
            got = self._on_all(lambda s: s.request("enter", step, what=f"enter at step {step}")[0].meta,
                               f"enter at step {step}")
            later = [g["enter"] for g in got if not g.get("entered")]
            if not later:
                self.healed = {"step": step}
                return step
            step = max(later)
        raise CommTimeout(f"rank {self.rank_info.global_rank()}: the shards kept moving past the step this "
                          f"replacement asked to enter at (the last: {step})", op="connect")

    def _take_placement(self, reply: dict) -> None:
        """Hello named the servers' mode and placement: the object this client asks at every step."""
        try:
            mode = psproto.consistency(reply["mode"])
            placement = mode.placement(reply["update"])
        except (KeyError, ValueError) as exc:
            raise ProtocolError(f"{self.shards[0].name} answered hello with no mode and placement this client "
                                f"knows ({exc})", peer=self.shards[0].peer) from None
        self.consistency, self.steps = mode, for_servers(self, mode, placement)
        if self.options.clip_norm and not self.steps.clips:
            raise ConfigError(f"ps:// clip_norm= needs mode=sync; the servers run {mode.name}")
        for s in self.shards:  # the shards step: a pull's place in the segment holds parameters, adopted there
            s.adopt_shm = self.steps.updates_remotely  # (not under local steps: the inner optimizer writes them)

    def _trace_clocks(self, rec: trace.Recorder) -> None:
        """Each shard's trace clock, by stats requests on its own thread (a shard that does not trace sends none)."""
        def measure(shard: _Shard) -> None:
            rec.peer_clock(f"shard{shard.index}",
                           lambda: shard.request("stats", -1, what="trace clock")[0].meta.get("clock_ns"))

        for f in [s.submit(measure, s) for s in self.shards]:
            f.result(self.options.timeout * trace.CLOCK_ROUNDS)

    def _make_outer(self, options) -> Outer:
        assert self.steps is not None  # setup's hello chose the placement
        return self.steps.outer()

    @property
    def updates_remotely(self) -> bool:  # type: ignore[override]  # the placement's: the shards step
        return self.steps is not None and self.steps.updates_remotely

    @property
    def mode(self) -> str:
        """The servers' mode's name ("" before setup): for reports and manifests."""
        return self.consistency.name if self.consistency is not None else ""

    @property
    def update(self) -> str:
        """The servers' placement's name ("" before setup): for reports and manifests."""
        return self.steps.spec.name if self.steps is not None else ""

    def check_averages(self) -> None:
        """Before setup the URL's mode= and update= (either may be left to the servers), after it the servers'."""
        placement = self.steps.spec if self.steps is not None else self.options.placement
        mode = self.consistency if self.consistency is not None else self.options.consistency
        if mode is not None and not mode.gathers:  # first: it names the placement it implies
            raise ConfigError(f"option 'mode': ranks step together only under mode=sync, not mode={mode.name}")
        if placement is not None and placement.shards_step:
            raise ConfigError("option 'update': the servers update (update=server), not the caller's optimizer: "
                              "use update=worker")

    # ----- a restarted job's state (ex.commit_state, ex.restored_state) ---------------------------
    @property
    def keeps_state(self) -> bool:
        """update=server: the servers hold the parameters, the optimizer's state and the applied steps."""
        return self.steps is not None and self.steps.keeps_state

    def commit_state(self, state: dict) -> None:
        """Keep ``state`` (this rank's small state: a scheduler's, a GradScaler's, a data position) on the
        servers, replacing what this rank kept before; a restarted job reads it back as
        :attr:`restored_state`. Blocks until shard 0 holds it (its timeout); not collective (each rank
        keeps its own). ``state`` (dicts, lists, tuples, numbers, strings, bools, None and tensors) travels as
        :func:`commlab.transport.wire.pack_state` bytes, nothing pickled, which the servers never read; at most 1 MiB. Anything
        else in it raises ValueError naming where it sits."""
        if not self.shards:
            raise ConfigError("call setup(model, optimizer) before commit_state()")
        if not self.keeps_state:
            super().commit_state(state)  # update=worker: the parameters are the user's checkpoint's, and so is this
        try:
            raw = wire.pack_state(state)
        except ValueError as exc:
            raise ValueError(f"commit_state: {exc}") from None
        if len(raw) > psproto.BLOB_MAX:
            raise ValueError(f"commit_state: the state takes {len(raw)} bytes, more than {psproto.BLOB_MAX}: keep "
                             f"a small state here (a scheduler, a scaler, a data position), the rest in a checkpoint")
        blob = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        first, step = self.shards[0], self._wire_step()
        first.submit(first.request, "blob", step, wire.split("blob", blob), {"put": True},
                     f"commit_state at step {step}").result(timeout=self.options.timeout * 2 + 10)

    def _restore_state(self) -> dict | None:
        """What this rank last kept with :meth:`commit_state` (on shard 0), or None; :attr:`restored_step` the
        step it belongs to (the step the loop was to run next when it was committed)."""
        first = self.shards[0]
        h, data = first.submit(first.request, "blob", -1, (), {}, "restored state", psproto.BLOB_MAX).result(
            timeout=self.options.timeout * 2 + 10)
        if h.op != "params":
            return None
        self.restored_step = h.step
        return wire.unpack_state(wire.frame_tensor(h.frames[0], data[0]).numpy().tobytes())

    def _replay_from_state(self) -> None:
        """The committed state belongs to an earlier step than the servers' (the rank died after its step was
        applied and before ``ex.commit_state``, or a replacement enters steps after its predecessor's last
        commit): the loop resumes at the state's step, and the steps up to the servers' are *replayed*: run
        by the loop (its scheduler, data position and random state move on as they did), pushed nowhere,
        the parameters and optimizer state staying the servers'. So the state and the step agree again.
        A state from a later step than the servers' cannot be rewound: refused, naming both."""
        if self.restored_step is None or not self.keeps_state or self.restored_step == self._base:
            return
        who = f"ps:// rank {self.rank_info.global_rank()}"
        if self.restored_step > self._base:
            raise ModelMismatch(f"{who}: its committed state (ex.commit_state) belongs to step {self.restored_step}, "
                                f"but the servers resume at step {self._base}: a state ahead of the parameters "
                                f"cannot be used (servers restarted from an older checkpoint?)")
        print(f"commlab {who}: its committed state belongs to step {self.restored_step}, the servers are at step "
              f"{self._base}: the loop replays steps {self.restored_step}..{self._base - 1} (nothing pushed; "
              f"ex.start_step = {self.restored_step})", file=sys.stderr, flush=True)
        self._replay_to = self._base
        self._base = self.start_step = self.restored_step

    def _check_group(self) -> None:
        """``connect(group=)``: the group's members name the same group (through the job's store, which stays
        open until close: rank 0 may host it)."""
        self._store = rendezvous.job_store(self.rank_info, self.options.timeout)
        rendezvous.check_group(self._store, self.rank_info, self.options.timeout)

    def _locate(self, key: str, offset: int, n: int, what: str) -> tuple[int, int, int]:
        """(bucket, slot, first element in the bucket's layout) of elements ``[offset, offset + n)`` of piece
        ``key``; ModelMismatch if this worker holds no such range."""
        bi, slot, first, count = self._grad_slots.get(key, (0, 0, 0, -1))
        if count < 0 or offset + n > count:
            raise ModelMismatch(f"a shard sent {what}{key}[{offset}:{offset + n}], which this worker does not hold")
        return bi, slot, self.buckets[bi].offsets[slot] + first + offset

    def _put_param(self, key: str, offset: int, values: torch.Tensor) -> bool:
        """On a shard's thread: pulled values of a staged (CUDA) parameter into its bucket's host mirror, then
        to the parameter on the copy stream (the training stream waits for it). False: not staged."""
        n = values.numel()
        bi, slot, at = self._locate(key, offset, n, "")
        if not self._staging.is_staged(bi):
            return False
        bucket = self.buckets[bi]
        start = at - bucket.offsets[slot]  # in the parameter
        self._staging.host(bi)[at:at + n].copy_(values)
        self._staging.to_device(bi, dst=bucket.params[slot].data.view(-1)[start:start + n], start=at, stop=at + n)
        return True

    def _buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffer_targets.values())

    def _buffer_parts(self) -> list:
        return [part for name, b in self._buffer_targets.items()
                for part in wire.split(name, b.detach().view(-1).cpu())]  # .cpu(): a CUDA buffer's small copy

    def _on_all(self, fn, what: str) -> list:
        """Run ``fn(shard)`` on every shard's thread at once; wait for all (each has its own timeout)."""
        futures = [s.submit(fn, s) for s in self.shards]
        return [FutureHandle(f, f"{what} on {s.name}").wait(self._setup_bound) for f, s in zip(futures, self.shards)]

    @property
    def _setup_bound(self) -> float:
        """The longest a setup wait may take: each try a timeout, a probe, a hello on the fresh connection."""
        return self.options.timeout * (1 + 2 * self.options.retries) + _Shard.PROBE_S * (1 + self.options.retries) + 5

    def _parts(self, shard: int, flat: torch.Tensor | None) -> list:
        """Frames of a shard's pieces, read from the parameters (``flat`` None) or from ``flat``."""
        out = []
        for pc in self._pieces[shard]:
            if flat is not None:
                src = flat
            elif self.model is not None:
                src = self.model.get_parameter(pc.param).detach().view(-1)
                if src.is_cuda:  # init, load: once, not per step
                    src = src.cpu()
            else:
                raise ConfigError("call setup(model, optim) before exchanging parameters")
            out += wire.split(pc.key, src[pc.start:pc.start + pc.count])
        return out

    # ----- the step --------------------------------------------------------------------------
    def _wire_step(self) -> int:
        return self._base + self._step

    @property
    def replaying(self) -> bool:
        """A step the servers applied already, run again by the loop to bring this rank's own state (its
        committed state's step, :attr:`restored_step`) up to the servers': nothing is pushed or pulled."""
        return self._wire_step() < self._replay_to

    def _start_bucket(self, bucket) -> Handle:
        assert self.steps is not None and self._pushes is not None  # setup
        if self.replaying:
            return DoneHandle(what=f"bucket {bucket.index} (a replayed step)")
        return self._pushes.start_bucket(bucket, self._wire_step(), self.steps.push_meta())

    def _finish(self) -> None:
        if self.replaying:
            return  # p.grad: this rank's own gradient, which the servers never see
        while self._donations:  # (posted before this step's pushes, on the same threads: done by now)
            self._donations.pop().result(timeout=self.options.timeout)
        step = self._wire_step()
        assert self.steps is not None  # setup
        assert self._pushes is not None  # setup
        self._absent = set()
        self.stats.bytes_received += self._pushes.finish(step, self.steps.replies_in_backward)
        self.steps.finish(step)

    def _sync_buffers(self, mode: str) -> None:
        """Buffers travel as non-trainable keys on shard 0: ``broadcast``, rank 0 pushes its own (keeping going,
        every rank does: the shard takes the lowest rank left's); ``average``, every rank does; then every rank
        pulls them (sync: once the step's are complete)."""
        if self._buffers_fresh:  # setup: every rank pulled the servers' buffers with the parameters
            self._buffers_fresh = False
            return
        if self.replaying:
            return
        # local steps (sync_every=): the wire step of shard 0's latest sync, one more every H (ShardsOuter)
        step = self._wire_step() + getattr(getattr(self.talk, "outer", None), "buffer_offset", 0)
        first = self.shards[0]

        def run(s: _Shard):
            if self._join.joining:  # every worker still training: the servers take the highest one's
                s.post("buffers", step, self._buffer_parts(), {"how": mode, "joining": True},
                       what=f"buffers of step {step}")
            elif mode == "average" or self.rank == 0 or self._keeping:
                s.post("buffers", step, self._buffer_parts(), {"how": mode}, what=f"buffers of step {step}")
            return self._pull_buffers(s, step)

        received = first.submit(run, first).result(timeout=self.options.timeout * 2 + 10)
        self.stats.bytes_received += received

    def _pull_buffers(self, s: _Shard, step: int) -> int:
        def take(h, data):
            take_buffers(s.name, self._buffer_targets, zip(h.frames, data))
            return h.data_bytes

        s.post("pull", step, meta={"after_step": step, "what": "buffers"}, what=f"buffers after step {step}",
               take=take, max_bytes=self._buffer_bytes())
        return s.collect()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """As :meth:`Exchanger.join`; with ``compress=`` refused when entered (before the loop it would wrap):
        the shards have no way yet to count a joined worker's compressed rounds."""
        if enable and self._pushes is not None and not self._pushes.joins:
            raise ConfigError("ps:// compress=: ex.join() (uneven inputs) is not supported with compression; "
                              "drop compress= or give every rank the same number of steps")
        if enable and self.options.sync_every:  # local steps: what join() is not built for, refused in one line
            if self.options.fragments > 1:
                raise ConfigError("ps:// sync_every= with fragments=: ex.join() (uneven inputs) is not built; use "
                                  "fragments=1 or give every rank the same number of steps")
            if self.consistency is not None and not self.consistency.gathers:
                raise ConfigError(f"ps:// sync_every= under mode={self.consistency.name}: ex.join() (uneven inputs) "
                                  f"is not built; use mode=sync or give every rank the same number of steps")
        return super().join(divide_by_initial_world_size, enable, throw_on_early_termination)

    joins_local_steps = True  # sync_every=: the shards count a joined worker out of each sync (_wait_out_join)

    def _join_hook(self, options: JoinOptions) -> Join:
        return _ServerJoin(self, options)

    def _wait_out_join(self, options: JoinOptions) -> None:
        """ex.join() on a parameter server: tell every shard this worker pushes no more (sync counts it as
        zeros; async and ssp stop waiting for its clock; update=worker: its parameters go along, kept when
        it is the last to join), then wait until every worker has, and take the final parameters and buffers.
        Local steps (``sync_every=``, mode=sync, one fragment; docs/localsteps.md): the syncs in flight land
        first, the join names each shard's next sync, and the shards average each later sync over the workers
        still training (``divide_by_initial_world_size`` does not apply, as on the collectives); this worker's
        parameters go along, and the last joiner's (the highest rank among those that synced most) are every
        worker's at the end."""
        step = self._wire_step()
        meta = {"divide": options.divide_by_initial_world_size, "throw": options.throw_on_early_termination}
        assert self.steps is not None  # setup
        join_parts = self.steps.join_parts
        steps = {s.index: step for s in self.shards}
        outer = getattr(self.talk, "outer", None)
        if isinstance(outer, ShardsOuter):
            cast(LocalSteps, self.talk).leave(self.rank_info.who())  # its syncs in flight land first
            steps = {s.index: outer.next_step(s.index) for s in self.shards}
            meta["divide"] = False  # the outer step takes the mean of the pseudo-gradients pushed
        replies = self._on_all(lambda s: s.request("join", steps[s.index], join_parts(s.index), meta,
                                                   what=f"join before step {steps[s.index]}")[0].meta, "join")
        if options.throw_on_early_termination and any(r.get("training") for r in replies):
            raise RuntimeError(f"Rank {self.rank_info.global_rank()} exhausted all inputs.")

        # each wait is for the shard's next update (at most timeout), not for the others' whole run
        versions: dict[int, int | None] = {s.index: None for s in self.shards}

        def final(s: _Shard) -> int:
            if s.index not in versions:
                return 0

            def take(h: wire.Header, data) -> int:
                if h.op != "params":
                    versions[s.index] = h.meta.get("version")
                    return 0
                del versions[s.index]
                return s._take(h, data)

            # through collect: a shard that holds it back past the timeout is asked whom it waits for
            s.post("pull", -1, meta={"after_step": -1, "what": "final", "version": versions[s.index]},
                   what="the parameters once every worker has joined", take=take)
            return s.collect()

        while versions:
            self.stats.bytes_received += sum(self._on_all(final, "final parameters"))
        if self._buffer_targets:
            first = self.shards[0]
            self.stats.bytes_received += first.submit(self._pull_buffers, first, -1).result(
                timeout=self.options.timeout * 2 + 10)

    def _remote_update(self, timeout: float) -> None:
        assert self.steps is not None  # setup
        if self._wire_step() - 1 < self._replay_to:  # the step just exchanged was a replayed one
            return  # the parameters are the servers' already (pulled at setup; this rank pushes nothing meanwhile)
        self.steps.remote_update(timeout)

    # ----- the optimizer's state lives on the servers (update=server) ---------------------------
    def _take_over_state(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.state_dict()`` gathers the shards' state into a torch state_dict (so a run can
        resume under any regime); ``load_state_dict`` loads the hyperparameters here and sends the
        state (and this rank's parameters, from rank 0) to the shards."""
        ex = self

        def state_dict(opt):
            sd = type(opt).state_dict(opt)
            sd["state"] = ex._gather_state()
            return sd

        def load_state_dict(opt, sd):
            type(opt).load_state_dict(opt, sd)
            opt.state.clear()  # it lives on the servers
            ex._scatter_state(sd["state"])

        optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
        optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]

    def _carry_state(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        """update=server: the state the user's optimizer holds at setup (a checkpoint loaded before
        ``ex.setup``, as DDP scripts do) moves to the shards, where the update runs: rank 0 sends its own
        on a fresh start. Servers that already hold a model (a restarted job) keep theirs, and say so."""
        if fresh:
            if self.rank == 0:
                self._scatter_state(type(optimizer).state_dict(optimizer)["state"])
        elif self.rank == 0:
            warnings.warn("ps:// update=server: the servers already hold this model and its optimizer state; the "
                          "state your optimizer held at setup is not used (call optimizer.load_state_dict after "
                          "ex.setup to replace the servers' state)", stacklevel=4)
        optimizer.state.clear()  # it lives on the servers

    def _param_order(self) -> list[tuple[int, str, torch.nn.Parameter]]:
        assert self.model is not None and self.optimizer is not None  # after setup()
        names = {id(p): n for n, p in self.model.named_parameters()}
        out: list[tuple[int, str, torch.nn.Parameter]] = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                out.append((len(out), names[id(p)], p))
        return out

    def _gather_state(self) -> dict:
        got: dict[str, dict] = {}  # piece key -> state name -> value

        def fetch(s: _Shard):
            h, data = s.request("state", -1, what="optimizer state", max_bytes=64 * (s.max_reply + 2**20))
            for spec, frame in zip(h.frames, data):
                key, _, name = spec.key.partition("/")
                shape = h.meta["shapes"][spec.key]
                got.setdefault(key, {})[name] = wire.frame_tensor(spec, frame).clone().view(shape)
            for tag, v in h.meta.get("scalars", {}).items():
                key, _, name = tag.partition("/")
                got.setdefault(key, {})[name] = v

        self._on_all(fetch, "optimizer state")
        pieces: dict[str, list] = {}
        for shard in self._pieces:
            for pc in shard:
                pieces.setdefault(pc.param, []).append(pc)
        state = {}
        for index, name, p in self._param_order():
            parts = sorted(pieces[name], key=lambda pc: pc.start)
            if parts[0].key not in got:
                continue  # never updated: torch has no state for it either
            entry = {}
            for sname, first in got[parts[0].key].items():
                if isinstance(first, torch.Tensor) and _pieced(first, parts[0]):
                    entry[sname] = torch.cat([got[pc.key][sname] for pc in parts]).view(p.shape)
                else:
                    entry[sname] = first
            state[index] = entry
        return state

    def _scatter_state(self, state: dict) -> None:
        """Rank 0 sends each shard its parameters and its pieces of ``state`` (torch's format)."""
        if self.rank != 0:
            return
        by_name = {name: state.get(index, state.get(str(index))) for index, name, _ in self._param_order()}
        assert self.model is not None
        params = dict(self.model.named_parameters())

        def send(s: _Shard):
            s.request("load", -1, self._parts(s.index, None), what="parameters")
            names = sorted({n for pc in self._pieces[s.index] for n in (by_name.get(pc.param) or {})})
            for sname in names:
                parts, shapes, scalars = [], {}, {}
                for pc in self._pieces[s.index]:
                    v = (by_name.get(pc.param) or {}).get(sname)
                    tag = f"{pc.key}/{sname}"
                    if v is None:
                        continue
                    if not isinstance(v, torch.Tensor):
                        scalars[tag] = v
                        continue
                    v = v.detach().cpu()
                    if v.shape == params[pc.param].shape and v.dim() > 0:
                        flat = v.reshape(-1)[pc.start:pc.start + pc.count].contiguous()
                    else:
                        flat = v.reshape(-1).contiguous()
                    shapes[tag] = [flat.numel()] if v.shape == params[pc.param].shape and v.dim() > 0 else list(v.shape)
                    parts += wire.split(tag, flat)
                s.request("load", -1, parts, {"shapes": shapes, "scalars": scalars}, what=f"optimizer state {sname}")

        self._on_all(send, "optimizer state")

    def state_dict(self) -> dict:
        return dict(super().state_dict(), wire_step=self._wire_step(), update=self.update, mode=self.mode,
                    versions=[s.version for s in self.shards])

    def load_state_dict(self, state: dict) -> None:
        """Resume: the step counters carry over, the wire numbering stays the servers' (which may be
        fresh servers, or the ones the run used). With update=server, rank 0's parameters (loaded from
        the checkpoint before this call) go to the shards."""
        before = self._step
        super().load_state_dict(state)
        self._base += before - self._step
        if self.steps is not None:
            self.steps.loaded()

    # ----- for benchmarks --------------------------------------------------------------------
    def push_pull_async(self, tensor: torch.Tensor) -> Handle:
        """Push ``tensor`` as the gradient of the model's one parameter, then pull that parameter.

        For benchmarks after :meth:`setup` on a model with a single flat parameter (e.g.
        ``nn.ParameterList([nn.Parameter(torch.zeros(n))])``). Does not block; counts as a
        step. ``tensor`` must not be written until the handle is done; the handle returns
        the parameter, updated by the servers.
        """
        if self.model is None:
            raise ConfigError("call setup(model, optim) before push_pull_async()")
        if self._pushes is None or not self._pushes.raw:
            raise ConfigError("push_pull_async() pushes the tensor uncompressed: drop compress=")
        if self.steps is None or not self.steps.updates_remotely:
            raise ConfigError("push_pull_async() pulls the parameter the servers updated: it needs update=server "
                              f"(this client runs update={self.update})")
        params = [p for b in self.buckets for p in b.params]
        if len(params) != 1 or tensor.shape != params[0].shape or tensor.dtype != params[0].dtype:
            raise ValueError(f"push_pull_async needs a model with one parameter shaped like the tensor "
                             f"({list(tensor.shape)} {tensor.dtype})")
        step = self._base + self._step
        flat = tensor.detach().contiguous().view(-1)
        if flat.is_cuda:  # a benchmark's tensor: one copy down; the pull comes back through the staging
            flat = flat.cpu()
        handles = []
        commit = self.steps.bench_commit()
        for s in self.shards:
            parts = self._parts(s.index, flat)
            self.stats.bytes_sent += sum(spec.nbytes for spec, _ in parts)
            meta = {"base": s.version, "absent": []}
            what = f"push+pull of step {step}"
            handles.append(FutureHandle(s.submit(s.push_then_pull, step, parts, meta, what, commit),
                                        f"{what} on {s.name}"))

        def done(received):
            self.stats.bytes_received += sum(received)
            self._step += 1
            return params[0]

        return GroupHandle(handles, f"push+pull of step {step}", then=done)

    def pull_latest(self) -> None:
        """Fetch the servers' current parameters into the model (async, ssp: the newest, with every
        update applied so far, e.g. to evaluate what the job ended with; sync: those after this worker's
        last step). Blocks (each shard's timeout); not collective."""
        if not self.shards:
            raise ConfigError("call setup(model, optimizer) before pull_latest()")
        after = self._wire_step() - 1
        self.stats.bytes_received += sum(self._on_all(lambda s: s.pull(after), f"pull of the latest parameters"))

    def server_stats(self) -> list[dict]:
        """Each shard's ``stats`` reply (updates, bytes, queue depth, staleness histogram)."""
        return self._on_all(lambda s: s.request("stats", -1, what="stats")[0].meta["stats"], "stats")

    def facts(self) -> dict:
        facts = {"scheme": self.scheme, "mode": self.options.mode or "server's",
                 "servers": [s.endpoint for s in self.shards], "staging": self._staging.facts(),
                 "authentication": auth.describe(self._secret),
                 **self._heap_facts()}
        if self.options.transport in ("shm", "auto"):  # what each connection carries its payloads in, and why
            facts["transport"] = {"asked": self.options.transport,
                                  "payloads": {s.endpoint: s.link.kind for s in self.shards},
                                  **({"why_not_shm": {s.endpoint: s.shm_note for s in self.shards if s.shm_note}}
                                     if any(s.shm_note for s in self.shards) else {})}
        if self.healed is not None:
            facts["replacement"] = dict(self.healed)
        return facts

    def close(self) -> None:
        super().close()
        for name in ("state_dict", "load_state_dict"):  # the ones update=server took over
            if self.optimizer is not None and name in vars(self.optimizer):
                delattr(self.optimizer, name)
        for s in self.shards:
            try:
                s.submit(s.close, True).result(timeout=5)
            except Exception:
                pass
            s.pool.shutdown(wait=False, cancel_futures=True)
        self.shards = []
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._store = None


def take_buffers(who: str, buffers: dict[str, torch.Tensor], pairs) -> None:
    """Copy a reply's (spec, frame) pairs into the module buffers they name; ModelMismatch for a buffer this worker
    does not hold, or a range past its end."""
    for spec, frame in pairs:
        b = buffers.get(spec.key)
        if b is None or spec.offset + spec.count > b.numel():
            raise ModelMismatch(f"{who} sent buffer {spec.key}[{spec.offset}:{spec.offset + spec.count}], which this "
                                f"worker does not hold")
        with torch.no_grad():
            b.view(-1)[spec.offset:spec.offset + spec.count].copy_(wire.frame_tensor(spec, frame))


def _next_space(info: RankInfo, endpoints: list[str]) -> str:
    """The key space of this process's next exchanger on these servers: "" for the first, then model2,
    model3, ... Every rank sets its exchangers up in the same order (setup is collective), so the
    names agree; a restarted job's processes count from the start again and find their spaces.
    Over a group (``connect(group=)``) the spaces are the group's: ``g0-2``, then ``g0-2.model2``, ...,
    so groups sharing the servers never share a key."""
    group = group_key(info.members) if info.members else ""
    n = rendezvous.PROCESS.opened((info.global_rank(), group, tuple(endpoints)))  # the process's count (ProcessJobs)
    return ".".join(filter(None, [group, "" if n == 1 else f"model{n}"]))


def _pieced(value: torch.Tensor, piece: psproto.Piece) -> bool:
    """Whether a shard's state tensor is its piece's range of a tensor shaped like the parameter (exp_avg:
    flat, one value per element) rather than one value for the whole parameter (step: 0-d)."""
    return value.dim() == 1 and value.numel() == piece.count


def _options(url: ExchangerURL) -> PSOptions:
    opts = parse_options(PSOptions, url)
    if url.endpoints:
        if opts.endpoints:
            raise ConfigError("ps:// lists servers both as HOST:PORT and in endpoints=; use one")
        opts = dataclasses.replace(opts, endpoints=",".join(url.endpoints))
    return opts


def server_stats(endpoint: str, timeout: float = 10.0) -> dict:
    """Ask one server for its stats without attaching to it (tests, benchmarks, operators)."""
    tp = transport.Transport()
    try:
        shard = _Shard(0, 1, transport.tcp_endpoint(endpoint), tp, "observer", timeout, 0)
        shard.secret = auth.load()
        try:
            return shard.submit(shard.request, "stats", -1, (), None, "stats").result(timeout + 1)[0].meta["stats"]
        finally:
            shard.submit(shard.close, False).result(timeout=5)
            shard.pool.shutdown()
    finally:
        tp.close()
