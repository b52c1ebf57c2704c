"""``ps://HOST:PORT[,HOST:PORT...]?mode=sync|async|ssp``: CPU parameter servers, one shard each.

Workers push each bucket's gradients to the shards that hold its pieces as
soon as backward fills it (one communication thread and one DEALER socket per
shard, so all shards are fed in parallel), then pull the updated parameters
before the next forward. The servers reduce, apply the optimizer and enforce
the consistency mode; see :mod:`commlab.psproto` for the protocol and the
modes, and :mod:`servers` for the server.

``commlab train --exchanger 'ps://?shards=K&mode=...'`` starts K servers on
loopback itself (:meth:`PSExchanger.plan_local`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
import zmq

from commlab import psproto, transport, wire
from commlab.config import CommonOptions, ExchangerURL, option, parse_options
from commlab.errors import CommTimeout, ConfigError, ModelMismatch, PeerLost, RemoteError
from commlab.exchanger import BucketedExchanger, PlansServers
from commlab.manifest import model_manifest
from commlab.optim import OptimizerSpec
from commlab.handles import DoneHandle, FutureHandle, GroupHandle, Handle


@dataclass(frozen=True)
class PSOptions(CommonOptions):
    mode: str = option("", "consistency mode this worker expects; the server's rules (empty: accept it)",
                       choices=("",) + psproto.MODES)
    staleness: int = option(-1, "ssp: the bound this worker expects (-1: accept the server's)")
    shards: int = option(0, "commlab train starts this many servers on loopback (0: the URL lists them)")
    transport: str = option("tcp", "servers commlab train starts listen on tcp or ipc", choices=("tcp", "ipc"))
    endpoints: str = option("", "comma-separated zmq endpoints, instead of HOST:PORT in the URL (e.g. ipc://...)")
    piece_mb: float = option(16.0, "parameters are cut into pieces of at most this many MiB, each reduced, "
                                   "updated and returned on its own (pipelining); every worker must agree")
    retries: int = option(1, "a push not acknowledged within timeout is sent again this many times, "
                             "on a fresh connection (the server applies each (worker, step) once)")
    keys: str = option("", "folder made by 'commlab keys' (CURVE: server.key and KEY_NAME.key_secret)")
    key_name: str = option("worker", "with keys=: which client key pair in that folder is this worker's")
    curve_secret: str = option("", "this worker's CURVE secret key file")
    server_key: str = option("", "the servers' CURVE public key file")

    def __post_init__(self):
        super().__post_init__()
        if self.shards < 0 or self.retries < 0:
            raise ConfigError("shards and retries must be >= 0")
        if self.piece_mb <= 0:
            raise ConfigError(f"piece_mb must be > 0, got {self.piece_mb}")
        if self.staleness < -1:
            raise ConfigError(f"staleness must be >= 0, got {self.staleness}")

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
        self.name = f"shard {index}/{count} at {endpoint}"
        self.tp, self.sender, self.timeout, self.retries, self.rank = tp, sender, timeout, retries, rank
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

    def submit(self, fn, *args) -> cf.Future:
        return self.pool.submit(fn, *args)

    # ----- on the shard's thread --------------------------------------------------------------
    def post(self, op: str, step: int, parts=(), meta: dict | None = None, what: str = "") -> _Request:
        """Send a request without waiting; :meth:`answer` or :meth:`collect` gets its reply.
        Zero-copy: ``parts`` must not be written until the reply came."""
        req = _Request(self.next_id, op, step, list(parts), dict(meta or {}), what or f"{op} of step {step}")
        self.next_id += 1
        self._transmit(req)
        self.outstanding.append(req)
        if op == "push":
            self.unsettled.append(req)
        return req

    def _transmit(self, req: _Request) -> None:
        if self.sock is None:
            self.sock = self.tp.connect(zmq.DEALER, self.endpoint)
        frames = wire.encode(req.op, self.sender, req.step, req.parts, dict(req.meta, id=req.rid))
        transport.send(self.sock, frames, timeout=self.timeout, who=self.name)

    def answer(self, req: _Request) -> tuple:
        """Wait (at most ``timeout``) for ``req``'s reply: ``(header, data frames)``; raise its error."""
        deadline = time.monotonic() + self.timeout
        while req.rid not in self.inbox:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise CommTimeout("")
                if self.sock is None:
                    raise PeerLost(f"{self.name}: the connection is closed")
                msg = transport.recv(self.sock, left, self.name)
            except CommTimeout:
                raise CommTimeout(f"{self.name} did not answer {req.what} within {self.timeout:g}s") from None
            h = wire.decode(msg, ops=psproto.REPLIES, max_bytes=self.max_reply)
            rid = h.meta.get("id")
            if isinstance(rid, int) and any(r.rid == rid for r in self.outstanding):  # else: for a request given up on at a reconnect
                self.inbox[rid] = (h, msg[1:])
        h, data = self.inbox.pop(req.rid)
        self.outstanding.remove(req)
        if h.op == "error":
            raise RemoteError(f"{self.name} refused {req.what}: {h.meta.get('reason')}")
        return h, data

    def request(self, op: str, step: int, parts=(), meta: dict | None = None, what: str = "") -> tuple:
        return self.answer(self.post(op, step, parts, meta, what))

    def hello(self, meta: dict) -> dict:
        self.hello_meta = meta
        reply = self.request("hello", -1, meta=meta, what="hello")[0].meta
        self.boot = reply.get("boot", "")
        return reply

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
            except CommTimeout as exc:
                state = self.probe()
                if state is not None and state.get("boot") == self.boot:
                    stalled = [r for r in state.get("waiting_for", []) if r != self.rank]
                    if stalled:
                        raise CommTimeout(f"{exc}: the shard is up and its step {state.get('sync_step')} waits for "
                                          f"rank(s) {stalled} (dead or stalled?)") from None
                if attempts >= self.retries:
                    if state is None:
                        seen = "no answer to a probe either"
                    elif state.get("boot") != self.boot:
                        seen = "the shard restarted"
                    else:
                        seen = f"the shard is up, {len(self.outstanding)} request(s) unanswered, its stats: {state}"
                    raise CommTimeout(f"{exc} ({seen}; gave up after {attempts} reconnect(s))") from None
                attempts += 1
                self._reconnect_and_resend()
                continue
            if req.op == "pull":
                received += self._take(h, data)
        self.unsettled.clear()  # every pull of the step is in: its pushes are applied
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
        pending = {r.rid: r for r in [*self.unsettled, *self.outstanding]}
        self.outstanding = []
        self.inbox.clear()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.hello(self.hello_meta)
        for rid in sorted(pending):  # in the order first sent: pushes before the pulls that need them
            self._transmit(pending[rid])
            self.outstanding.append(pending[rid])

    def _take(self, h: wire.Header, data) -> int:
        """Put a pull reply's values into the parameters."""
        for spec, frame in zip(h.frames, data):
            param, start, count = self.targets.get(spec.key, (None, 0, 0))
            if param is None or spec.offset + spec.count > count:
                raise ModelMismatch(f"{self.name} sent {spec.key}[{spec.offset}:{spec.offset + spec.count}], "
                                    f"which this worker does not hold")
            values = wire.frame_tensor(spec, frame)
            if spec.count == param.numel():
                # the whole parameter in one received frame: adopt its (writable) buffer, no copy
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

    def push_then_pull(self, step: int, parts: list, meta: dict, what: str) -> int:
        """Push and pull back to back (the pull goes out before the push is acknowledged)."""
        self.post("push", step, parts, meta, what)
        return self.pull(step)

    def close(self, bye: bool) -> None:
        if self.sock is not None:
            if bye:
                try:
                    self.timeout = min(self.timeout, 2.0)
                    self.request("bye", -1, what="bye")
                except Exception:  # best effort: the server may be gone already
                    pass
            self.sock.close(linger=0)
            self.sock = None


class PSExchanger(BucketedExchanger, PlansServers):
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
        ``transport=ipc`` on sockets in ``scratch()``, a folder the caller owns and removes (call
        this through :func:`commlab.launcher.server_plan`).
        """
        opts = _options(url)
        if opts.endpoint_list:
            return url.text, []
        k = opts.shards or 1
        if opts.transport == "ipc":
            folder = scratch()
            endpoints = [f"ipc://{folder}/shard{i}" for i in range(k)]
        else:
            endpoints = ["tcp://127.0.0.1:0"] * k
        mode = opts.mode or "sync"
        argvs = []
        for i, ep in enumerate(endpoints):
            argv = ["--bind", ep, "--mode", mode, "--shard", f"{i}/{k}"]
            if opts.staleness >= 0:
                argv += ["--staleness", str(opts.staleness)]
            if opts.keys:  # the workers will speak CURVE with these keys: so must the servers
                argv += ["--keys", opts.keys]
            argvs.append(argv)
        query = [(key, v) for key, v in url.query if key not in ("shards", "transport", "endpoints", "mode")]
        query += [("mode", mode), ("endpoints", ",".join(endpoints))]
        return "ps://?" + "&".join(f"{key}={v}" for key, v in query), argvs

    def __init__(self, options, rank):
        super().__init__(options, rank)
        self.shards: list[_Shard] = []
        self.transport: transport.Transport | None = None
        self._base = 0  # wire step of this worker's step 0 (non-zero when servers resumed)
        self._plan: list[dict[int, list]] = []  # bucket -> shard -> [(piece, slot in bucket)]
        self._pieces: list[list[psproto.Piece]] = []
        self.mode = ""  # the servers' (from hello)

    # ----- setup ---------------------------------------------------------------------------
    updates_remotely = True  # the servers apply the optimizer: optimizer.step() pulls their result

    def _connect(self, model, optimizer):
        optim = self.optim_spec or _spec_of(optimizer)
        endpoints = self.options.endpoint_list
        if not endpoints:
            raise ConfigError("ps:// names no servers: give ps://HOST:PORT[,HOST:PORT...] (servers started with "
                              "'commlab server'), or let 'commlab train' start them with ps://?shards=K")
        if self.options.shards and self.options.shards != len(endpoints):
            raise ConfigError(f"ps:// says shards={self.options.shards} but lists {len(endpoints)} servers")
        manifest = model_manifest(model)
        params = dict(model.named_parameters())
        for name, shape, dtype in manifest:
            if params[name].device.type != "cpu":
                raise ConfigError(f"ps:// keeps parameters on the CPU and {name} is on {params[name].device}: train "
                                  f"with --device cpu, or use allreduce:// or ring:// for GPU workers")
            if not params[name].is_contiguous():
                raise ConfigError(f"ps:// needs contiguous parameters; {name} is not")
        self._pieces = psproto.assign_shards(manifest, len(endpoints), max(1, int(self.options.piece_mb * 2**20)))
        curve = None
        if self.options.keys:
            if self.options.curve_secret or self.options.server_key:
                raise ConfigError("ps:// takes keys=DIR or curve_secret=/server_key=, not both")
            from commlab.keys import client_keys
            curve = client_keys(self.options.keys, self.options.key_name)
        elif self.options.curve_secret:
            curve = transport.CurveKeys.load(self.options.curve_secret, self.options.server_key or None)
        self.transport = transport.Transport(io_threads=1, curve=curve)
        sender = f"rank{self.rank}"
        k = len(endpoints)
        self.shards = [_Shard(i, k, ep, self.transport, sender, self.options.timeout, self.options.retries, self.rank)
                       for i, ep in enumerate(endpoints)]
        for shard, pieces in zip(self.shards, self._pieces):
            shard.targets = {pc.key: (params[pc.param], pc.start, pc.count) for pc in pieces}
            shard.max_reply = sum(pc.nbytes for pc in pieces)
        where = {id(p): (b.index, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._plan = [{} for _ in self.buckets]
        for shard, pieces in zip(self.shards, self._pieces):
            for pc in pieces:
                bi, slot = where[id(params[pc.param])]
                self._plan[bi].setdefault(shard.index, []).append((pc, slot))
        manifest_wire = [[n, list(s), d] for n, s, d in manifest]
        replies = self._on_all(lambda s: s.hello({
            "rank": self.rank, "world": self.world_size, "mode": self.options.mode or None,
            "staleness": self.options.staleness if self.options.staleness >= 0 else None,
            "manifest": manifest_wire, "pieces": [[pc.key, pc.dtype, pc.count] for pc in self._pieces[s.index]],
            "shard": [s.index, k], "optim": optim.to_dict()}), "hello")
        self._base = max(r["next_step"] for r in replies)
        self.mode = replies[0]["mode"]
        self._on_all(lambda s: None if replies[s.index]["initialized"] else
                     s.request("init", -1, self._parts(s.index, None), what="init"), "init")
        self._on_all(lambda s: s.pull(self._base - 1), "initial pull")

    def _on_all(self, fn, what: str) -> list:
        """Run ``fn(shard)`` on every shard's thread at once; wait for all (each has its own timeout)."""
        futures = [s.submit(fn, s) for s in self.shards]
        # each attempt: a timeout, a probe, a hello on the fresh connection
        bound = self.options.timeout * (1 + 2 * self.options.retries) + _Shard.PROBE_S * (1 + self.options.retries) + 5
        return [FutureHandle(f, f"{what} on {s.name}").wait(bound) for f, s in zip(futures, self.shards)]

    def _parts(self, shard: int, flat: torch.Tensor | None) -> list:
        """Frames of a shard's pieces, read from the parameters (``flat`` None) or from ``flat``."""
        out = []
        for pc in self._pieces[shard]:
            if flat is not None:
                src = flat
            elif self.model is not None:
                src = self.model.get_parameter(pc.param).detach().view(-1)
            else:
                raise ConfigError("call setup(model, optim) before exchanging parameters")
            out += wire.split(pc.key, src[pc.start:pc.start + pc.count])
        return out

    # ----- the step --------------------------------------------------------------------------
    def _start_bucket(self, bucket) -> Handle:
        step = self._base + self._step
        handles = []
        for k, items in self._plan[bucket.index].items():
            shard = self.shards[k]
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
                parts += wire.split(pc.key, bucket.view(slot).view(-1)[pc.start:pc.start + pc.count])
                self.stats.bytes_sent += pc.nbytes
            what = f"push of bucket {bucket.index} at step {step} to {shard.name}"
            handles.append(FutureHandle(shard.submit(self._post_bucket, shard, step, messages), what))
        if not handles:
            return DoneHandle(what=f"bucket {bucket.index}")
        return handles[0] if len(handles) == 1 else GroupHandle(handles, f"push of bucket {bucket.index}")

    def _post_bucket(self, shard: _Shard, step: int, messages: list) -> None:
        """On the shard's thread: send the pushes; in sync mode also ask at once for those keys' new
        values, which the server sends as soon as every worker's gradient for them is in, while
        backward is still busy with earlier layers."""
        for parts, absent, keys in messages:
            shown = ", ".join(keys[:3]) + ("..." if len(keys) > 3 else "")
            shard.post("push", step, parts, {"base": shard.version, "absent": absent},
                       f"push of {shown} at step {step}")
            if self.mode == "sync":
                shard.post("pull", step, meta={"after_step": step, "keys": keys},
                           what=f"pull of {shown} after step {step}")

    def _finish(self) -> None:
        pass  # the pushes are acknowledged; the servers update when optimizer.step() asks for the result

    def _sync_buffers(self, mode: str) -> None:
        raise ConfigError("ps:// does not carry module buffers (BatchNorm statistics) yet: use buffers=none, "
                          "or allreduce:// or ring://")

    def _remote_update(self, timeout: float) -> None:
        step = self._base + self._step - 1  # the exchange backward just finished
        if self.mode == "sync":  # every key's pull is posted already
            received = self._on_all(lambda s: s.collect(), f"pushes and pulls of step {step}")
        else:
            received = self._on_all(lambda s: s.pull(step), f"pull after step {step}")
        self.stats.bytes_received += sum(received)

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
        params = [p for b in self.buckets for p in b.params]
        if len(params) != 1 or tensor.shape != params[0].shape or tensor.dtype != params[0].dtype:
            raise ValueError(f"push_pull_async needs a model with one parameter shaped like the tensor "
                             f"({list(tensor.shape)} {tensor.dtype})")
        step = self._base + self._step
        flat = tensor.detach().contiguous().view(-1)
        handles = []
        for s in self.shards:
            parts = self._parts(s.index, flat)
            self.stats.bytes_sent += sum(spec.nbytes for spec, _ in parts)
            meta = {"base": s.version, "absent": []}
            what = f"push+pull of step {step}"
            handles.append(FutureHandle(s.submit(s.push_then_pull, step, parts, meta, what), f"{what} on {s.name}"))

        def done(received):
            self.stats.bytes_received += sum(received)
            self._step += 1
            return params[0]

        return GroupHandle(handles, f"push+pull of step {step}", then=done)

    def server_stats(self) -> list[dict]:
        """Each shard's ``stats`` reply (updates, bytes, queue depth, staleness histogram)."""
        return self._on_all(lambda s: s.request("stats", -1, what="stats")[0].meta["stats"], "stats")

    def facts(self) -> dict:
        return {"scheme": self.scheme, "mode": self.options.mode or "server's",
                "servers": [s.endpoint for s in self.shards], **self._heap_facts()}

    def close(self) -> None:
        super().close()
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


def _spec_of(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """The servers build SGD or Adam from a spec: the user's optimizer as one, where it is one."""
    groups = optimizer.param_groups
    g = groups[0]
    if len(groups) == 1 and type(optimizer) is torch.optim.SGD and not g.get("nesterov") \
            and not g.get("dampening") and not g.get("maximize"):
        return OptimizerSpec("sgd", lr=float(g["lr"]), momentum=g["momentum"], weight_decay=g["weight_decay"])
    if len(groups) == 1 and type(optimizer) is torch.optim.Adam and not g.get("amsgrad") and not g.get("maximize"):
        return OptimizerSpec("adam", lr=float(g["lr"]), beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                             weight_decay=g["weight_decay"])
    raise ConfigError(f"ps:// servers run plain SGD or Adam with one param group; {type(optimizer).__name__} "
                      f"with {len(groups)} group(s) is not supported: use allreduce:// or ring://")


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
        try:
            return shard.submit(shard.request, "stats", -1, (), None, "stats").result(timeout + 1)[0].meta["stats"]
        finally:
            shard.submit(shard.close, False).result(timeout=5)
            shard.pool.shutdown()
    finally:
        tp.close()
