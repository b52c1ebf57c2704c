"""``ring://?transport=auto|tcp|ipc|shm|torch&chunk_mb=0[&compress=SPEC&ef=0|1]``: a hand-written ring all-reduce.

Every rank talks only to its two neighbours: it sends to ``right = (r+1) % N`` and
receives from ``left = (r-1) % N``. The tensor (S bytes) is cut into N segments;
the segments travel around the ring twice, first being summed (reduce-scatter),
then being copied (all-gather)::

      rank 0 ──► rank 1          step t (0 <= t < 2N-2), rank r:
        ▲           │              sends    segment (r - t)     mod N  to the right
        │           ▼              receives segment (r - t - 1) mod N  from the left
      rank 3 ◄── rank 2            t <  N-1: adds it in place  (reduce-scatter)
                                   t >= N-1: stores it         (all-gather)

    N = 3, segments a b c, "a:01" = segment a summed over ranks 0 and 1:

      step          rank 0            rank 1            rank 2
      0 (RS)   send a, get c:2   send b, get a:0   send c, get b:1
      1 (RS)   send c:02, get    send a:01, get    send b:12, get
               b:12 -> b DONE    c:02 -> c DONE    a:01 -> a DONE
      2 (AG)   send b, get a     send c, get b     send a, get c
      3 (AG)   send a, get c     send b, get a     send c, get b

Cost: each rank sends and receives 2(N-1)/N x S bytes in 2(N-1) steps, so with
per-message latency a and link bandwidth B one all-reduce takes about
``2(N-1) a + 2(N-1)/N x S/B`` (plus the adds, (N-1)/N x S of reads and writes):
the bandwidth term does not grow with N, which is why rings win on big tensors.

Pipelining: each segment is further cut into chunks of about ``chunk_mb`` (4 MiB;
2 MiB through shared memory); a chunk is forwarded to the right as soon as it has been added (or stored), so the
reduce-scatter of later chunks overlaps the all-gather of earlier ones and zmq's
I/O thread moves bytes while this thread adds. Sends above 1 MiB are zero-copy
(tracked: the collective returns only after zmq let go of the caller's buffer),
smaller ones are copied (cheaper than tracking). Received chunks are added
straight from zmq's frame (reduce-scatter) or written straight into the caller's
tensor (all-gather); small reduce-scatter chunks land in one reused scratch
buffer. Half types (float16, bfloat16) are summed in a float32 copy, sent as
float32, and rounded once at the end. CUDA buckets are staged through pinned
host mirrors for tcp/ipc/shm (:mod:`commlab.core.staging`: the copy to the host
starts in the backward hook on a stream of its own; other CUDA tensors, such as
the initial broadcast, are copied to host memory and back); only
``transport=torch`` with NCCL keeps them on the GPU (GPUDirect RDMA where the
machine has it).

Two ranks: at N = 2 both neighbours are the same rank, and a tensor of up to
``swap_kb`` (4 MiB) takes one step instead of two: each rank sends the whole
tensor and adds what it receives. The bytes are the ring's (S each way, which
is 2(N-1)/N x S at N = 2); the latency is one message instead of two, which is
most of a small all-reduce. Both ranks compute x0 + x1 (addition commutes
exactly), so they hold the same bits. Each rank adds all S instead of S/2,
which is why big tensors keep the ring. When the swap's send went zero-copy,
a chunk is added into only after zmq has let go of it.

The schedule above is written once (:func:`run_schedule`); transports plug in
below it, one per link, as an outbox on the sender and an inbox on the receiver
(:mod:`commlab.regimes.ring_links`, where framing and validation live):
``tcp`` (zmq PUSH/PULL over TCP, ``host`` is where each rank binds; off loopback
only with CURVE ``keys=`` or ``insecure=1``), ``ipc`` (zmq over Unix sockets,
one host), ``shm`` (one host: each chunk copied once into the sender's shared
segment and added or copied straight out of it by the receiver, signals over a
Unix socket), ``auto`` (per link: shm to a neighbour with the same boot id and
network namespace, tcp otherwise; :meth:`RingExchanger.facts` says which),
``torch`` (torch.distributed ``isend``/``irecv`` to the neighbours: gloo for CPU
tensors, NCCL for CUDA ones; the default process group is reused if the
process already has one, and never destroyed by the ring). The zmq paragraph above describes tcp/ipc.
Under a default process group made before the ring (DDP's, a user's), every transport meets in that
group's store.

Failure: every wait is bounded by ``timeout``. A neighbour that dies is noticed
at once (zmq's monitor, or the kernel closing a shared-memory link's socket):
:class:`~commlab.base.errors.PeerLost` with ``peer`` = its rank; one that stalls
gives :class:`~commlab.base.errors.CommTimeout` naming it. The first rank to see a
failure writes it to the rendezvous store (JSON: origin, peer, text) and closes
its links, so ranks further around the ring stop too and relay the same
culprit (``peer``) and who saw it (``origin``). With ``min_workers=M`` (or under
``commlab run --replace``) the survivors keep going instead: the step is discarded on
every rank, the ring re-forms over the survivors (:meth:`RingExchanger._reform_links`,
under ``ring/e<epoch>/``) and the step is exchanged again; a replacement is healed over
the new ring (:mod:`commlab.core.keepgoing`, :mod:`commlab.core.quorum`).

Initial parameters: rank 0's, sent through the ring itself (the other ranks
contribute zeros to one all-reduce per bucket; x + 0 is exact).

Compression (``compress=SPEC&ef=0|1``, :mod:`commlab.compress`): buckets go through the
compressor's seam, for which the ring is a mover over the same schedule and links:
float32 payloads by the all-reduce above; fp16/bf16 by :meth:`RingExchanger.allreduce_per_hop_async`
(sent at 2 bytes an element, each hop adding into a float32 partial that it rounds once
for the next hop: :class:`~commlab.regimes.ring_links.HopCastCollective`); gather-only
payloads (top-k, sign) by :meth:`RingExchanger.allgather_async`, a ring all-gather of
N-1 steps, (N-1) x S sent per rank. docs/compress.md gives the bytes and the rounding.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar, TypeVar

import numpy as np
import torch
import zmq

from commlab import compress
from commlab.transport import auth, rendezvous, shm, wire
from commlab.launch import scratch
from commlab.core.quorum import KeepGoingOptions
from commlab.base.config import option
from commlab.base.errors import AuthError, BackendUnavailable, CommError, CommTimeout, ConfigError, PeerLost
from commlab.core.exchanger import CollectiveExchanger
from commlab.base.handles import FutureHandle, Handle
from commlab.core.heap import keep_freed_memory
from commlab.core.staging import HostStaging
from commlab.regimes.ring_links import (SLOTS, Collective, HopCastCollective, Inbox, Outbox, ShmInbox, ShmOutbox,
                                        Step, TorchInbox, TorchOutbox, ZmqInbox, ZmqOutbox)
from commlab.transport.sockets import Link, Transport, is_loopback

HALF = (torch.float16, torch.bfloat16)
CHUNK_MB = 4.0  # zmq and torch links (docs/ring.md: 1 and 2 MiB were slower at 8-32 MiB over tcp/ipc)
SHM_CHUNK_MB = 2.0  # shared memory: 1 and 2 MiB beat 4 at 1-256 MiB (docs/ring.md, "Shared memory and across hosts")


@dataclass(frozen=True)
class RingOptions(KeepGoingOptions):
    transport: str = option("auto", "how neighbours talk: auto (shm to a neighbour on this host and in this "
                                    "network namespace, tcp to others), tcp, ipc (zmq), shm (shared memory, one "
                                    "host), torch (isend/irecv)", choices=("tcp", "ipc", "shm", "auto", "torch"))
    chunk_mb: float = option(0.0, "pipeline chunk size in MiB: a chunk is forwarded as soon as it is added; 0: the "
                                  f"transport's own ({SHM_CHUNK_MB:g} through shared memory, where a chunk read "
                                  f"back soon is still in cache, also for auto with the whole ring on one host; "
                                  f"{CHUNK_MB:g} otherwise)", ge=0, le=1024,
                             why="a shared-memory link holds several chunks")
    host: str = option("127.0.0.1", "address each rank binds for tcp links; auto: the address this host reaches "
                                    "the rendezvous store from. Anything but loopback needs keys= or insecure=1")
    keys: str = option("", "folder made by 'commlab keys' (CURVE on every zmq link: each rank binds with "
                           "server.key_secret and admits clients/*.key, connects with KEY_NAME.key_secret)")
    key_name: str = option("worker", "with keys=: which client key pair in that folder is this rank's")
    insecure: bool = option(False, "bind a non-loopback host without keys: anyone who reaches it may join")
    backend: str = option("gloo", "torch.distributed backend for transport=torch", choices=("gloo", "nccl"))
    io_threads: int = option(2, "zmq I/O threads for tcp/ipc: 2 gives receiving from the left and sending to the "
                                "right a thread each, 1 makes one thread take turns", choices=(1, 2))
    sndbuf_kb: int = option(512, "kernel send buffer towards a right neighbour on this host (loopback tcp, ipc) in "
                                 "KiB, 0: the system's autotuning (always used towards other hosts): a small one "
                                 "keeps in flight only what the neighbour copies out while it is still in cache",
                              ge=0, le=2**21 - 1, why="the kernel takes the size as an int of bytes")
    swap_kb: int = option(4096, "at N = 2, tensors of up to this many KiB take one step instead of two: each rank "
                              "sends all of it and adds what it receives (0: always the two-step ring)", ge=0)

    def __post_init__(self):
        super().__post_init__()
        if self.host != "auto":
            self.check_bind(self.host)

    def check_keep_going(self) -> None:
        super().check_keep_going()
        if self.transport == "torch":
            raise ConfigError("option 'min_workers' (keep going) needs the ring's own links: transport=auto|tcp|ipc|"
                              "shm, not torch (its process group cannot re-form)")

    @property
    def chunk(self) -> float:
        """The pipeline chunk in MiB: ``chunk_mb``, or the transport's own when it is 0. Decided by the
        option alone, so every rank cuts a collective the same way; ``auto`` starts from tcp's and
        takes shm's at meet() when every rank of the ring is on one host (all ranks see the same)."""
        return self.chunk_mb or (SHM_CHUNK_MB if self.transport == "shm" else CHUNK_MB)

    def check_bind(self, host: str) -> None:
        """Refuse, in one line, a non-loopback address without keys or an explicit ``insecure=1``."""
        if self.transport in ("tcp", "auto") and not self.keys and not self.insecure and \
                not is_loopback(f"tcp://{host}:0"):
            raise ConfigError(f"ring://: refusing to bind {host} without authentication (reachable from other "
                              f"machines): pass keys=DIR (made by 'commlab keys DIR') or insecure=1")


def segment_bounds(n: int, world: int) -> list[int]:
    """Start of each of the ``world`` segments of ``n`` elements, then ``n`` (sizes differ by at most 1)."""
    return [i * n // world for i in range(world + 1)]


def ring_schedule(rank: int, world: int, step: int) -> tuple[int, int]:
    """(segment sent, segment received) by ``rank`` at ``step`` of the ring (see the module's table)."""
    return (rank - step) % world, (rank - step - 1) % world


def ring_steps(rank: int, world: int) -> tuple[Step, ...]:
    """The ring's 2(N-1) steps for ``rank``: N-1 that add (reduce-scatter), N-1 that store (all-gather)."""
    return tuple((*ring_schedule(rank, world, t), t < world - 1) for t in range(2 * world - 2))


def gather_steps(rank: int, world: int) -> tuple[Step, ...]:
    """The ring all-gather's N-1 steps for ``rank`` (segment i: rank i's tensor): it sends its own first, then
    forwards the one it received a step before; every step stores."""
    return tuple(((rank - t) % world, (rank - t - 1) % world, False) for t in range(world - 1))


SWAP_STEPS: tuple[Step, ...] = ((0, 0, True),)  # N = 2, one segment: send it all, add what comes back


def bytes_moved(n: int, itemsize: int, rank: int, world: int) -> tuple[int, int]:
    """Exactly what ``rank`` sends and receives in one all-reduce of ``n`` elements: about 2(N-1)/N x S each."""
    if n == 0 or world == 1:
        return 0, 0
    b = segment_bounds(n, world)
    size = [b[s + 1] - b[s] for s in range(world)]
    plan = [ring_schedule(rank, world, t) for t in range(2 * world - 2)]
    return itemsize * sum(size[s] for s, _ in plan), itemsize * sum(size[g] for _, g in plan)


class RingExchanger(CollectiveExchanger):
    scheme = "ring"
    Options = RingOptions

    def __init__(self, options, rank):
        super().__init__(options, rank)
        self._met = False
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._broken: BaseException | None = None
        self._ring_lock = threading.Lock()  # held by whichever thread runs a collective
        self._order = threading.Lock()  # guards _pending: collectives submitted, not yet finished
        self._pending = 0
        self._seq = 0
        self._plans: dict[tuple[int, int], tuple[list[int], int, tuple[Step, ...]]] = {}  # (numel, itemsize) -> plan()
        self._moved: dict[tuple[int, int], tuple[int, int]] = {}  # (numel, itemsize) -> bytes_moved()
        self._meeting: RingMeeting | None = None  # what the links share until close()
        self._inbox: Inbox | None = None  # from the left neighbour
        self._outbox: Outbox | None = None  # to the right neighbour
        self._kinds: dict[str, str] = {}  # "from_left" / "to_right" -> tcp | ipc | shm | torch, once joined
        self._kind = kind_for(self.options.transport)  # what the ring asks of its links, declared by their kind
        self._chunk_mb = self.options.chunk  # auto: shm's once meet() finds every link of the ring on one host
        self._staging: HostStaging | None = None  # after setup: the buckets' host mirrors (CUDA ones staged)
        self._secret: auth.JobSecret | None = None  # the job's (meet reads it): links and store values prove it
        self._forged = 0  # failure reports in the store not signed with the job's secret (ignored)
        self.left = (self.rank - 1) % self.world_size
        self.right = (self.rank + 1) % self.world_size
        self._ring_steps = ring_steps(self.rank, self.world_size)
        if rank.members and not self._kind.in_groups:
            raise ConfigError(f"ring://?transport={self.options.transport} does not run over a group "
                              f"(connect(group=...)): use allreduce:// there, or transport=shm|tcp|ipc|auto")
        self._gather_steps = gather_steps(self.rank, self.world_size)

    # ----- meeting the neighbours ----------------------------------------------------------
    def meet(self, store=None) -> None:
        """Meet the neighbours (store, sockets, segments or process group) and start the communication
        thread. Collective; idempotent; setup() calls it. Call it directly to use :meth:`allreduce_async`
        without a model (benchmarks). ``store``: the job's rendezvous store, when this process already
        holds it (several exchangers in one process: rank 0 can host the store only once); by default the
        store of a default process group made before (DDP's), else the job's."""
        if self._met:
            return
        opts = self.options
        if store is None and _default_group_exists():  # DDP's, a user's: its store (rank 0 may host one already)
            store = rendezvous.default_group_store(self.rank_info, opts.timeout)
        job = store if store is not None else rendezvous.connect_store(self.rank_info, opts.timeout)
        # Several exchangers may live in one job (benchmarks, a resumed run): exchanger_store gives each its own
        # namespace, numbered by how many this rank met before (every rank meets them in the same order).
        # Keeping going (min_workers=), a replacement may wait here until the running job admits it.
        self.store = self._start_quorum(job, job) or rendezvous.exchanger_store(job, self.rank_info, opts.timeout)
        self._orient()
        ns = self._ns = self._epoch_ns("ring/")
        self._secret = auth.load()
        if self.world_size > 1 and self._secret is None and self._kind.proves_secret:
            auth.warn_unauthenticated(f"ring:// {self.rank_info.who()}")
        self._thread = threading.Thread(target=self._serve, name=f"ring-comm-rank{self.rank}", daemon=True)
        self._thread.start()  # it waits for collectives; the first comes once the links are met
        self._met = True
        self._meet_first(lambda: self._links_and_hello(ns))  # a replacement re-forms if a member dies meanwhile
        self._started()

    def _links_and_hello(self, ns: str) -> None:
        """The two links under ``ns``, then a first tiny all-reduce that proves the whole ring is connected
        before anyone relies on it; the door closes behind it (no one else may connect to this ring)."""
        if self.world_size == 1:
            return
        self._meet_links(ns)
        if self._kind.proves_ring:
            self._hello()

    def _hello(self) -> None:
        self.allreduce(torch.zeros(self.world_size), what="ring hello")
        if self._meeting is not None:
            self._meeting.close_door()

    def _orient(self) -> None:
        """Neighbours and schedules from ``rank_info`` (which follows the membership when keeping going)."""
        self.left = (self.rank - 1) % self.world_size
        self.right = (self.rank + 1) % self.world_size
        self._ring_steps = ring_steps(self.rank, self.world_size)
        self._gather_steps = gather_steps(self.rank, self.world_size)
        self._plans.clear()
        self._moved.clear()

    def _reform_links(self) -> None:
        """Keeping going: a new ring over the membership ``rank_info`` now names, under this epoch's namespace
        (the old links closed; every member calls it)."""
        with self._ring_lock:
            self._close_links(linger_s=0)
            if self._meeting is not None:
                self._meeting.close()
                self._meeting = None
            self._broken, self._seq, self._kinds = None, 0, {}
            self._orient()
            ns = self._ns = self._epoch_ns("ring/")
            if self.world_size > 1:
                self._meet_links(ns)
        if self.world_size > 1 and self._kind.proves_ring:
            self._hello()

    def _wait_key(self, key: str, what: str) -> bytes:
        """The value a rank signed under ``key`` (``.../RANK``), waiting for it (bounded): CommTimeout naming
        the rank that never published it, AuthError naming the key if a stranger wrote it."""
        peer = self.rank_info.global_rank(int(key.rsplit("/", 1)[1]))
        if self.quorum is not None:  # keeping going: a rank that died while the ring re-forms is not waited for
            self.quorum.wait_key(self.store, key, peer, f"rank {peer}'s {what}")
            return auth.get(self.store, self._secret, key)
        try:
            self.store.wait([key], timedelta(seconds=self.options.timeout))
        except Exception as exc:
            raise CommTimeout(f"{self.rank_info.who()}: rank {peer} did not publish its {what} within "
                              f"{self.options.timeout:g}s", peer=peer, op="connect") from exc
        return auth.get(self.store, self._secret, key)

    def _watch_peer(self, position: int, what: str) -> None:
        """Keeping going: CommTimeout naming the rank at ``position`` if it is dead or silent (a wait for it ends)."""
        q, peer = self.quorum, self.rank_info.global_rank(position)
        if q is not None and (q.gone(peer) or q.silent(peer)):
            raise CommTimeout(f"{what}: rank {peer} is dead or has sent no heartbeat for {q.hb_s:g}s", peer=peer,
                              op="connect")

    def _link_kinds(self, ns: str) -> tuple[str, str]:
        """(link from the left, link to the right): the transport asked for, or for ``auto`` shm where
        the neighbour is on this host and in this network namespace (a namespace "host" keeps its own
        addresses and tc limits), tcp elsewhere. Both ends of a link reach the same answer."""
        kind = self.options.transport
        if kind != "auto":
            return kind, kind
        here = host_identity()
        auth.put(self.store, self._secret, f"{ns}where/{self.rank}", here)
        where = [self._wait_key(f"{ns}where/{k}", "host identity").decode() for k in range(self.world_size)]
        if not self.options.chunk_mb and len(set(where)) == 1:
            # every link of the ring is shared memory (every rank sees the same): shm's chunk
            self._chunk_mb = SHM_CHUNK_MB
            self._plans.clear()
        inward, outward = ("shm" if where[k] == here else "tcp" for k in (self.left, self.right))
        return inward, outward

    def _meet_links(self, ns: str) -> None:
        """The two links, each made by its kind (:class:`LinkKind`). In an order no rank can block on: publish
        what the neighbours need (our PULL address, or our segment and socket), connect to the right's PULL (or
        join the process group), attach to the left's segment and socket, then accept the right's connection."""
        inward, outward = self._link_kinds(ns)
        self._kinds = {"from_left": inward, "to_right": outward}
        self._meeting = meeting = RingMeeting(self, ns)
        left = LINK_KINDS[inward](meeting, self.left, f"{self.rank_info.who(self.left)} (left neighbour)", io_thread=0)
        right = LINK_KINDS[outward](meeting, self.right, f"{self.rank_info.who(self.right)} (right neighbour)",
                                    io_thread=self.options.io_threads - 1)  # a zmq I/O thread per direction if two
        left.publish_inbound()
        right.publish_outbound()
        right.connect_outbound()
        left.attach_inbound()
        self._outbox = right.accept_outbound()
        self._inbox = left.inbox(self._outbox)
        if meeting.heap_kept is not None:
            self._heap_kept = meeting.heap_kept

    # ----- the contract pieces ---------------------------------------------------------------
    def _connect(self, model, optimizer):
        self.meet()
        if self._joined is not None:  # a replacement: the state of a live rank, over the new ring
            self._heal(self._joined)
            if not self._kind.on_device:
                self._staging = HostStaging.for_buckets(self.buckets)
            return
        compress.agree(self.store, self.rank_info, self.options, self.options.timeout)
        self._agree_and_equalise(model, optimizer)  # rank 0's parameters, through the ring: the others add zeros
        if not self._kind.on_device:  # CUDA buckets through pinned mirrors (CPU ones pass through)
            self._staging = HostStaging.for_buckets(self.buckets)

    def _allreduce_bucket(self, bucket, what: str) -> Handle:
        """A staged (CUDA) bucket: its copy to the host starts here, in the backward hook, on the copy stream,
        after the kernels that wrote it; the communication thread waits for it, runs the ring on the host
        mirror and queues the copy back, which the training stream waits for. Others: in place."""
        st = self._staging
        if st is None or not st.is_staged(bucket.index):
            return self.allreduce_async(bucket.buffer, what)
        host, _ = st.to_host_async(bucket.index)
        return self.allreduce_async(host, what, staged=bucket.index)

    def allreduce_async(self, tensor: torch.Tensor, what: str = "all-reduce", staged: int | None = None) -> Handle:
        """Sum ``tensor`` in place over all ranks. Collective: every rank calls it with a tensor of the same
        size and dtype, in the same order. Does not block: the ring runs on this exchanger's
        communication thread, one collective after another in call order. Don't touch ``tensor`` until
        the handle is done. Needs :meth:`meet` (or setup) first. Thread-safe to call. ``staged``: ``tensor``
        is that bucket's host mirror (:class:`~commlab.core.staging.HostStaging`), its copy from the GPU under way."""
        flat = self._check(tensor, what)
        self._account(flat)
        return self._submit(lambda: self._reduce(flat, staged), what)

    def allreduce_per_hop_async(self, tensor: torch.Tensor, what: str = "all-reduce") -> Handle:
        """Sum a float16/bfloat16 ``tensor`` in place over all ranks, travelling at its own width: each hop adds
        in float32 and rounds the partial sum once for the next (:class:`~commlab.regimes.ring_links.
        HopCastCollective`); every rank gets the same bits. Sends 2(N-1)/N x 2n bytes (half of what
        :meth:`allreduce_async` sends for a half tensor, which it sums in float32 all the way). Same contract as
        :meth:`allreduce_async` otherwise (collective, non-blocking, in call order)."""
        flat = self._check(tensor, what)
        if flat.dtype not in HALF:
            raise ValueError(f"{what}: per-hop rounding is for float16/bfloat16 tensors, not {flat.dtype}")
        self._account(flat, flat.element_size())
        return self._submit(lambda: self._allreduce(flat, per_hop=True), what)

    def allgather_async(self, tensor: torch.Tensor, what: str = "all-gather") -> Handle:
        """Every rank's ``tensor`` (the same size and dtype on each): the handle's result is the list, in rank order
        (this rank's entry a copy). Collective, non-blocking, in call order with the all-reduces; ``tensor`` is
        copied when the ring reaches it, so don't touch it until the handle is done. A ring all-gather over the
        same links and schedule: N-1 steps, each forwarding one rank's tensor, (N-1) x its bytes sent per rank."""
        if not self._met:
            raise ConfigError("call meet() or setup() before allgather_async()")
        flat = tensor.detach().contiguous().reshape(-1)
        moved = (self.world_size - 1) * flat.numel() * flat.element_size()
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved
        return self._submit(lambda: self._allgather(flat, tensor.shape), what)

    @staticmethod
    def sums_exactly(dtype: torch.dtype) -> bool:
        """float32 and float64 are summed at their own width with no rounding below it. (Half types are summed in
        float32 too, but sent as float32: the compression seam moves them by :meth:`allreduce_per_hop_async`.)"""
        return dtype in (torch.float32, torch.float64)

    @staticmethod
    def sums_per_hop(dtype: torch.dtype) -> bool:
        """float16 and bfloat16: :meth:`allreduce_per_hop_async` sends them as they are, adding in float32."""
        return dtype in HALF

    def _submit(self, body, what: str) -> Handle:
        """Queue ``body`` (one collective) for the communication thread; its handle carries body's result."""
        future: cf.Future = cf.Future()
        with self._order:
            self._pending += 1
            self._jobs.put((body, future, what))
        return FutureHandle(future, f"{what} on {self.rank_info.who()}", on_timeout=self._stalled)

    def allreduce(self, tensor: torch.Tensor, what: str = "all-reduce") -> None:
        """Blocking form of :meth:`allreduce_async`. When nothing is queued for the communication thread it
        runs on the calling thread instead: two thread switches fewer, which is most of a small all-reduce."""
        flat = self._check(tensor, what)
        with self._order:
            inline = self._pending == 0
            if inline:
                self._pending += 1
        if not inline:
            return self.allreduce_async(tensor, what).wait(self.options.timeout)
        self._account(flat)
        self._run(lambda: self._reduce(flat, None), what)

    def _check(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if not self._met:
            raise ConfigError("call meet() or setup() before allreduce_async()")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the ring sums contiguous tensors in place; got strides {tensor.stride()}")
        if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
            raise ValueError(f"{what}: cannot sum dtype {tensor.dtype} (floating types and int32/int64 only)")
        return tensor.view(-1)

    def _account(self, flat: torch.Tensor, itemsize: int | None = None) -> None:
        """Count an all-reduce of ``flat`` sent with ``itemsize`` bytes an element (default: half types as float32)."""
        key = (flat.numel(), itemsize or (4 if flat.dtype in HALF else flat.element_size()))
        moved = self._moved.get(key)
        if moved is None:
            moved = bytes_moved(*key, self.rank, self.world_size)
            if len(self._moved) < 256:
                self._moved[key] = moved
        sent, received = moved
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received

    def facts(self) -> dict:
        o = self.options
        facts = {"scheme": self.scheme, "transport": o.transport, "chunk_mb": self._chunk_mb,
                 "links": dict(self._kinds) if self._kinds else "decided when the ring joins",
                 "two_rank_swap_up_to_kb": o.swap_kb if self.world_size == 2 else "n/a (N > 2)",
                 "zero_copy_above_bytes": wire.COPY_THRESHOLD, "half_types_reduce_in": "float32"}
        if self.compressor is not None:
            facts["compress"] = self.compressor.describe()
        facts.update(self._kind.facts(self))
        facts.update(self._keep_going_facts())
        return facts

    def close(self):
        super().close()
        if self.quorum is not None:
            self.quorum.close()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.options.timeout)  # its own waits are bounded by the same timeout
            if self._thread.is_alive():
                return  # still inside a wait: its sockets are not ours to close; the daemon thread dies with us
            self._thread = None
        if not self._met:
            return
        self._close_links(linger_s=min(5.0, self.options.timeout))
        if self._meeting is not None:
            self._meeting.close()  # and the process group, if the ring made one
            self._meeting = None
        self._met = False

    def _close_links(self, linger_s: float) -> None:
        for half in (self._inbox, self._outbox):
            if half is not None:
                half.close(linger_s)
        self._inbox = self._outbox = None

    # ----- failure reports -------------------------------------------------------------------
    # The first rank to fail writes {"origin": its rank, "peer": the culprit, "text": its error} to the store;
    # the others relay it with those fields (op="relay"; origin None where the store itself is gone).
    def _stalled(self) -> str:
        report = self._fault_report()
        return f" ({_quote(report)})" if report else rendezvous.stall_report(self.store, self.world_size, self._step,
                                                                               skip=self.rank,
                                                                               members=self.rank_info.members)

    def _fault_report(self) -> dict | None:
        """What the first rank to fail wrote to the store, or None."""
        try:
            if self.store.check([self._ns + "fault"]):
                return json.loads(auth.get(self.store, self._secret, self._ns + "fault"))
        except AuthError:  # a stranger's report cannot stop the ring
            self._forged += 1
            return None
        except Exception:
            return {"origin": None, "peer": 0,
                    "text": "the rendezvous store hosted by rank 0 is unreachable: rank 0 is likely dead"}
        return None

    def _check_reports(self) -> None:
        """Called while waiting: end the wait if another rank already reported the ring broken (keeping going: or
        this step was discarded, or the left neighbour's heartbeat stopped)."""
        q = self.quorum
        if q is not None:
            d = q.aborted(self._step)
            if d is not None:
                raise PeerLost(f"the ring is broken: {d.reason}", peer=d.lost[0] if d.lost else None, op="relay")
            if q.silent(self.rank_info.global_rank(self.left)):  # peer: a position, as the links' errors (_fail)
                raise CommTimeout(f"{self.rank_info.who(self.left)} (left neighbour) has sent no heartbeat for "
                                  f"{q.hb_s:g}s", peer=self.left, op="receive")
        report = self._fault_report()
        if report and report["origin"] != self.rank_info.global_rank():
            raise PeerLost(f"the ring is broken: {_quote(report)}", peer=report["peer"], origin=report["origin"],
                           op="relay")

    def _blame(self, exc: CommTimeout) -> CommTimeout:
        """Our left neighbour was silent for ``timeout``: was it the one that stalled, or was it waiting too?

        When a rank stalls, every rank after it times out at about the same moment, each waiting on its
        left neighbour. Each says so in the store; the culprit is the first rank along the chain of
        waits that is not itself waiting. We give our left neighbour a moment (a quarter of the timeout,
        at most a second) to report before we blame it.
        """
        ns, N = self._ns + "waits-on/", self.world_size
        try:
            self.store.set(f"{ns}{self.rank}", str(self.left))
            deadline = time.monotonic() + min(1.0, self.options.timeout / 4)
            while True:
                chain, k = [self.rank], self.left
                while self.store.check([f"{ns}{k}"]) and k not in chain:
                    chain.append(k)
                    k = int(self.store.get(f"{ns}{k}"))
                if k != self.left or time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        except Exception:  # the store is gone with rank 0: blame the neighbour we know about
            return exc
        if k == self.left:
            return exc
        if k in chain:
            return CommTimeout(f"{exc}: every rank timed out waiting for its left neighbour (nobody sent anything)",
                               peer=None, op="receive")
        who = self.rank_info.who
        waits = ", ".join(f"{who(a)} on {who(b)}" for a, b in zip(chain, chain[1:] + [k]))
        return CommTimeout(f"{who(k)} stalled: {exc} ({waits})", peer=k, op="receive")

    def _fail(self, exc: BaseException) -> BaseException:
        """Record the first failure for every rank to read, and close our links so neighbours stop too."""
        if not isinstance(exc, CommError) or exc.op == "relay":  # a caller's mistake, or another rank's: as it is
            self._close_links(linger_s=0)
            return exc
        if isinstance(exc, CommTimeout) and exc.op == "receive" and exc.peer == self.left:
            exc = self._blame(exc)
        if self.rank_info.members and isinstance(exc.peer, int):  # links and _blame count positions in the group
            exc.peer = self.rank_info.global_rank(exc.peer)
        me = self.rank_info.global_rank()
        try:
            mine = json.dumps({"origin": me, "peer": exc.peer, "text": str(exc)}).encode()
            key = self._ns + "fault"
            self.store.compare_set(key, "", self._secret.sign(key, mine) if self._secret is not None else mine)
        except Exception:
            pass
        if isinstance(exc, PeerLost):  # a neighbour that closed on purpose may have said why
            report = self._fault_report()
            if report and report["origin"] != me:
                exc = PeerLost(f"{exc}; {_quote(report)}", peer=report["peer"], origin=report["origin"], op=exc.op)
        self._close_links(linger_s=0)
        return exc

    # ----- the communication thread ----------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            body, future, what = job
            if not future.set_running_or_notify_cancel():
                with self._order:
                    self._pending -= 1
                continue
            try:
                future.set_result(self._run(body, what))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                future.set_exception(exc)

    def _run(self, body, what: str):
        """One collective (``body``, whose result is returned), on whichever thread holds the ring; a failure
        breaks the ring for good."""
        with self._ring_lock:
            try:
                if self._broken is not None:
                    b = self._broken
                    raise CommError(f"{what}: the ring broke earlier: {b}", **(b.fields() if isinstance(b, CommError)
                                                                                else {}))
                if self._trace is None:
                    return body()
                t0 = self._trace.now()
                try:
                    return body()
                finally:
                    self._trace.span("collective", "comm", t0, args={"what": what})
            except (CommError, ValueError) as caught:
                exc: BaseException = caught
                if self._broken is None:
                    exc = self._fail(caught)
                    exc = exc.reworded(f"{what}: {exc}") if isinstance(exc, CommError) else type(exc)(f"{what}: {exc}")
                    self._broken = exc
                raise exc from None
            finally:
                with self._order:
                    self._pending -= 1

    def _reduce(self, flat: torch.Tensor, staged: int | None) -> None:
        """The body of :meth:`allreduce_async`. ``staged``: ``flat`` is that bucket's host mirror: wait for its copy
        from the GPU first, copy the sum back after."""
        st = self._staging
        if staged is not None and st is not None:
            st.wait(staged, self.options.timeout)
            self._allreduce(flat)
            st.to_device(staged)
        else:
            self._allreduce(flat)

    def _allreduce(self, flat: torch.Tensor, per_hop: bool = False) -> None:
        """Sum ``flat`` in place; half types in float32 (sent as float32) unless ``per_hop`` (sent as they are,
        each partial sum rounded once per hop: :class:`HopCastCollective`)."""
        seq = self._next_seq()
        if flat.numel() == 0 or self.world_size == 1:
            return
        work = flat
        on = self._work_device(flat)
        if flat.dtype in HALF and not per_hop:  # summed in float32, rounded once at the end
            work = flat.to(on, torch.float32)
        elif flat.device != on:  # staged through host memory
            work = flat.to(on)
        bounds, K, plan = self.plan(work.numel(), work.element_size())
        with np.errstate(all="ignore"):  # inf and nan add up silently, as they do in torch
            self._schedule((HopCastCollective if per_hop else Collective)(work, seq, bounds, K, plan))
        if work is not flat:
            flat.copy_(work)

    def _allgather(self, flat: torch.Tensor, shape: torch.Size) -> list[torch.Tensor]:
        """The body of :meth:`allgather_async`: rank i's bytes land in segment i of one buffer, forwarded around
        the ring (:func:`gather_steps`), chunked as an all-reduce is."""
        seq = self._next_seq()
        N, S = self.world_size, flat.numel() * flat.element_size()
        out = torch.empty(N * S, dtype=torch.uint8, device=self._work_device(flat))
        out[self.rank * S:(self.rank + 1) * S].copy_(flat.view(torch.uint8))
        if S and N > 1:
            K = max(1, -(-S // max(1, int(self._chunk_mb * 2**20))))
            self._schedule(Collective(out, seq, [i * S for i in range(N + 1)], K, self._gather_steps))
        return [out[i * S:(i + 1) * S].view(flat.dtype).view(shape).to(flat.device) for i in range(N)]

    def _work_device(self, flat: torch.Tensor) -> torch.device:
        """Where a collective of ``flat`` runs: where it is if the links move device tensors, else host memory."""
        return flat.device if self._kind.on_device else torch.device("cpu")

    def _next_seq(self) -> int:
        """The next collective's number (every rank counts every collective, empty ones too, alike)."""
        seq = self._seq
        self._seq += 1
        return seq

    def _schedule(self, c: Collective) -> None:
        if self._inbox is None or self._outbox is None:
            raise CommError("the ring's links are closed")
        if self._trace is None:
            run_schedule(c, self._inbox, self._outbox)
            return
        who = self.rank_info.global_rank
        run_schedule(c, TracedInbox(self._inbox, self._trace, who(self.left), c),
                     TracedOutbox(self._outbox, self._trace, who(self.right), c))

    def plan(self, n: int, itemsize: int) -> tuple[list[int], int, tuple[Step, ...]]:
        """(segment bounds, chunks per segment, steps) for ``n`` elements (cached: buckets repeat every step).

        The ring, or at N = 2 for at most ``swap_kb``: one segment, one step (the module's "Two ranks")."""
        plan = self._plans.get((n, itemsize))
        if plan is None:
            if self.world_size == 2 and n * itemsize <= self.options.swap_kb * 1024:
                bounds, steps = [0, n], SWAP_STEPS
            else:
                bounds, steps = segment_bounds(n, self.world_size), self._ring_steps
            per = max(1, int(self._chunk_mb * 2**20) // itemsize)
            longest = max(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1))
            plan = bounds, max(1, -(-longest // per)), steps
            if len(self._plans) < 256:
                self._plans[(n, itemsize)] = plan
        return plan


def run_schedule(c: Collective, inbox: Inbox, outbox: Outbox) -> None:
    """The ring's plan of steps and chunks, for any transport (see :mod:`commlab.regimes.ring_links`).

    Every chunk of step 0 goes out at once; then each chunk received is added (or stored) and, unless
    it was the last step, forwarded at once as chunk j of the next step: reduce-scatter and all-gather
    overlap, and the transport moves bytes while this thread adds. Between receiving a chunk and
    forwarding it nothing else happens: on a busy machine every microsecond there costs the whole
    ring. Where a step adds into the segment it sent (the two-rank swap), the outbox first lets go of
    that chunk (``release``)."""
    K, plan, last = c.K, c.plan, len(c.plan) - 1
    outbox.begin(c)
    inbox.begin(c)
    for j in range(K):
        outbox.send(0, j)
    for t, (sent, seg, reduce) in enumerate(plan):
        release = outbox.release if sent == seg else None
        for j in range(K):
            if reduce:
                inbox.reduce(t, j, release)
            else:
                inbox.store(t, j)
            if t < last:
                outbox.send(t + 1, j)
    outbox.finish()


class TracedOutbox(Outbox):
    """An outbox that records each send of ``box`` on the timeline (``$COMMLAB_TRACE``; otherwise never made):
    the peer, the chunk's bytes, the step, and the bytes this collective handed to the link as a counter."""

    def __init__(self, box: Outbox, rec, peer: int, c: Collective):
        super().__init__(box.me, peer, box.who, box.timeout)
        self.box, self.rec, self.moved = box, rec, 0
        self.link = f"in flight rank{box.me}->rank{peer}"
        self.c = c

    def begin(self, c: Collective) -> None:
        self.box.begin(c)

    def send(self, t: int, j: int) -> None:
        rec, c = self.rec, self.c
        t0 = rec.now()
        self.box.send(t, j)
        lo, hi = c.sent(t, j)
        self.moved += (hi - lo) * c.itemsize
        t1 = rec.span("send", "comm", t0, args={"peer": f"rank{self.peer}", "bytes": (hi - lo) * c.itemsize,
                                                "step": t, "chunk": j, "seq": c.seq})
        rec.counter(self.link, {"bytes": self.moved}, t1)

    def release(self, t: int, j: int) -> None:
        self.box.release(t, j)

    def finish(self) -> None:
        t0 = self.rec.now()
        self.box.finish()
        t1 = self.rec.span("send done", "comm", t0, args={"peer": f"rank{self.peer}", "bytes": self.moved})
        self.moved = 0
        self.rec.counter(self.link, {"bytes": 0}, t1)


class TracedInbox(Inbox):
    """An inbox that records each receive of ``box`` (and the add that follows it, where the step adds)."""

    def __init__(self, box: Inbox, rec, peer: int, c: Collective):
        super().__init__(box.me, peer, box.who, box.timeout)
        self.box, self.rec, self.c = box, rec, c

    def begin(self, c: Collective) -> None:
        self.box.begin(c)

    def _record(self, name: str, t0: int, t: int, j: int) -> None:
        lo, hi = self.c.received(t, j)
        self.rec.span(name, "comm", t0, args={"peer": f"rank{self.peer}", "bytes": (hi - lo) * self.c.itemsize,
                                              "step": t, "chunk": j, "seq": self.c.seq})

    def reduce(self, t: int, j: int, release=None) -> None:
        t0 = self.rec.now()
        self.box.reduce(t, j, release)
        self._record("recv+reduce", t0, t, j)

    def store(self, t: int, j: int) -> None:
        t0 = self.rec.now()
        self.box.store(t, j)
        self._record("recv", t0, t, j)


# ----- meeting the neighbours: one kind per transport ------------------------------------------------------
class RingMeeting:
    """What a rank's two link ends share while the ring meets (:meth:`RingExchanger._meet_links`), and what
    outlives the meeting until :meth:`close`: the zmq context (made when a zmq end first asks), the ipc socket
    folder, the shared-memory run id."""

    def __init__(self, ring: RingExchanger, ns: str):
        opts = ring.options
        self.ring, self.ns, self.store, self.options, self.rank = ring, ns, ring.store, opts, ring.rank
        self.timeout = opts.timeout
        self.idle = ring._check_reports  # what every wait of a link calls about once a second
        self.slot_bytes = shm_slot_bytes(ring._chunk_mb)
        self.curve = _curve_keys(opts.keys, opts.key_name) if opts.keys else None
        self.secret = ring._secret
        self.links: list[Link] = []  # the zmq links made (they count the connections they refused)
        self.refused = 0  # shared-memory links' connections that did not prove the job's secret
        self.net: Transport | None = None
        self.heap_kept: bool | None = None
        self.ipc_dir: str | None = None
        self._shm_run: str | None = None
        self.group = None  # torch p2p: the default process group (made here, or the one before the ring)
        self.own_group = False

    def wait_key(self, key: str, what: str) -> bytes:
        return self.ring._wait_key(key, what)

    def put(self, key: str, value: str | bytes) -> None:
        """Publish ``value`` under ``key``, signed with the job's secret."""
        auth.put(self.store, self.secret, key, value)

    def answer(self, role: str, theirs: bytes, me: int, them: int) -> str:
        """Rank ``me``'s proof of the job's secret over rank ``them``'s nonce (:meth:`commlab.transport.auth.JobSecret.answer`)."""
        return self.secret.answer(role, theirs, b"", self.name(me), self.name(them)).hex() if self.secret else ""

    @staticmethod
    def name(rank: int) -> str:
        """How a rank is named in handshakes: its place in this exchanger's ring."""
        return f"ring-rank{rank}"

    def refusals(self) -> int:
        return self.refused + sum(link.refusals() for link in self.links)

    def close_door(self) -> None:
        """Admit no further zmq connection (each link's one sender has connected and proved the secret)."""
        if self.net is not None and self.secret is not None and self.curve is None:
            self.net.admit_plain({})

    def transport(self) -> Transport:
        """The zmq context and I/O threads both zmq ends use (made once)."""
        if self.net is None:
            opts = self.options
            if opts.heap == "keep":  # received zmq chunks reuse heap memory instead of faulting in fresh pages
                self.heap_kept = keep_freed_memory()
            self.net = Transport(io_threads=opts.io_threads, sndbuf=opts.sndbuf_kb * 1024 or None)
        return self.net

    def ipc_folder(self) -> str:
        if self.ipc_dir is None:
            scratch.sweep_stale()  # socket folders of ranks killed before they could remove them
            self.ipc_dir = scratch.mkdtemp("ring")
        return self.ipc_dir

    def shm_run(self) -> str:
        """The run id every rank's segments are named by (the first rank to ask picks it)."""
        if self._shm_run is None:
            shm.sweep_stale()  # what runs killed before they could unlink left behind
            key, mine = f"{self.ns}shm-run", shm.new_run_id().encode()
            won = self.store.compare_set(key, "", self.secret.sign(key, mine) if self.secret is not None else mine)
            self._shm_run = (self.secret.open(key, won) if self.secret is not None else won).decode()
        return self._shm_run

    def bind_host(self) -> str:
        """``host``, or for ``auto`` the local address of the route to the rendezvous store's host."""
        if self.options.host != "auto":
            return self.options.host
        info = self.ring.rank_info
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((info.master_addr, info.master_port or 9))  # no packet is sent
            return probe.getsockname()[0]
        finally:
            probe.close()

    def torch_group(self):
        """The default process group both torch p2p ends use: the one made before the ring (DDP's, a user's), never
        destroyed here, or one made now in the ring's store. Collective the first time (every rank asks)."""
        if self.group is None:
            import torch.distributed as dist
            backend, ring = self.options.backend, self.ring
            if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
                raise BackendUnavailable("ring://?transport=torch&backend=nccl needs CUDA and a torch build with "
                                         "NCCL; use backend=gloo for CPU tensors")
            if dist.is_initialized():
                if dist.get_world_size() != ring.world_size:
                    raise ConfigError(f"the process group has {dist.get_world_size()} ranks, this job "
                                      f"{ring.world_size}")
            else:
                if backend == "nccl":
                    torch.cuda.set_device(ring.rank_info.local_rank % torch.cuda.device_count())
                dist.init_process_group(backend, store=dist.PrefixStore(self.ns + "pg/", self.store), rank=self.rank,
                                        world_size=ring.world_size, timeout=timedelta(seconds=self.timeout))
                self.own_group = True
            self.group = dist.group.WORLD
        return self.group

    def close(self) -> None:
        if self.net is not None:
            self.net.close()
            self.net = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
        if self.own_group:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self.own_group = False
        self.group = None


class LinkKind:
    """One transport's way of making a ring link; an instance is this rank's end of one link: the link from
    the left neighbour (``*_inbound`` phases, then :meth:`inbox`) or the one to the right (``*_outbound``
    phases). :meth:`RingExchanger._meet_links` calls the phases in the same order on every rank; a kind
    implements those its transport needs (the others do nothing). The halves it makes supply send,
    receive-into / add-from and wait (:mod:`commlab.regimes.ring_links`); the schedule and the regime ask
    the kind only what it declares below, never its name."""

    # Moves tensors where they are (torch p2p: NCCL on the GPU). Else the ring runs on host memory: CUDA
    # buckets staged through pinned mirrors (commlab.core.staging), other CUDA tensors copied down and back.
    on_device: ClassVar[bool] = False
    # Links the members of a group (connect(group=...)) as well as a whole job.
    in_groups: ClassVar[bool] = True
    # A first tiny all-reduce after meeting proves every link before anyone relies on the ring.
    proves_ring: ClassVar[bool] = True
    # Both ends of a link prove the job's secret (commlab.transport.auth) before a byte of data moves; torch p2p
    # rides torch.distributed's own connections, on its trusted-network model (docs/faults.md).
    proves_secret: ClassVar[bool] = True

    def __init__(self, m: RingMeeting, peer: int, who: str, io_thread: int):
        self.m, self.peer, self.who, self.io_thread = m, peer, who, io_thread

    @classmethod
    def facts(cls, ring: RingExchanger) -> dict:
        """What a manifest records about links of this kind (zmq and shared memory: host-staged, their knobs)."""
        o = ring.options
        facts: dict = {"staging": (ring._staging.facts() if ring._staging is not None else
                                   "decided at setup: CUDA buckets through pinned host mirrors (no GPUDirect over "
                                   "zmq or shm); other CUDA tensors copied to host memory and back"),
                       "io_threads": o.io_threads, "sndbuf_kb": o.sndbuf_kb or "system",
                       "authentication": ("CURVE (keys folder)" if o.keys else auth.describe(ring._secret))
                       + (", unencrypted (insecure=1)" if o.insecure and not o.keys else ""),
                       "refused": {"connections": ring._meeting.refusals() if ring._meeting is not None else 0,
                                   "forged_reports": ring._forged}}
        if "shm" in ring._kinds.values() or o.transport in ("shm", "auto"):
            facts["shm"] = {"slots_per_link": SLOTS, "slot_bytes": shm_slot_bytes(ring._chunk_mb),
                            "segments": f"{shm.SHM_DIR}/commlab-<run>-<pid>.<start>-*, unlinked once mapped"}
        facts.update(ring._heap_facts())
        return facts

    def publish_inbound(self) -> None:
        """Put in the store what the left neighbour needs to send here. Never waits."""

    def publish_outbound(self) -> None:
        """Put in the store what the right neighbour needs to receive from here. Never waits."""

    def connect_outbound(self) -> None:
        """Reach the right neighbour's end; waits (bounded) only for what it published."""

    def attach_inbound(self) -> None:
        """Reach the left neighbour's end; waits (bounded) only for what it published."""

    def accept_outbound(self) -> Outbox:
        """The outbox to the right, once the right neighbour has reached this end (bounded wait)."""
        raise NotImplementedError

    def inbox(self, outbox: Outbox) -> Inbox:
        """The inbox from the left (its waits also watch ``outbox``)."""
        raise NotImplementedError


class ZmqKind(LinkKind):
    """tcp and ipc: the receiver binds a PULL socket and publishes its address, the sender connects a PUSH."""

    def __init__(self, m: RingMeeting, peer: int, who: str, io_thread: int):
        super().__init__(m, peer, who, io_thread)
        self.socket: zmq.Socket | None = None
        self.link: Link | None = None

    def where(self) -> str:
        """The address the PULL socket binds."""
        raise NotImplementedError

    # With the job's secret both ends prove it over the other's fresh nonce. A PUSH/PULL link carries
    # nothing back, and a PULL cannot tell which connection a message came from: so the sender proves it in
    # zmq's own PLAIN handshake (its password: an HMAC over the receiver's nonce, which the receiver's ZAP
    # handler checks; a connection that fails never delivers a message, and once the ring met no other is
    # admitted), and the receiver proves it over the sender's nonce through the store, where the sender
    # reads it before its first chunk goes out. With CURVE keys, CURVE admits the sender instead.
    def publish_inbound(self) -> None:
        m, curve = self.m, self.m.curve
        plain = curve is None and m.secret is not None
        nonce = os.urandom(auth.NONCE)
        if plain:  # the left neighbour's password, before it can connect
            m.transport().admit_plain({m.name(self.peer): m.answer("initiator", nonce, self.peer, m.rank)})
        self.socket = m.transport().bind(zmq.PULL, self.where(), io_thread=self.io_thread,
                                         curve=curve[0] if curve else None, authorized=curve[1] if curve else None,
                                         insecure=m.options.insecure, plain=plain)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._link()  # its monitor counts the connections refused from now on
        m.put(f"{m.ns}addr/{m.rank}", json.dumps({"endpoint": self.endpoint, "nonce": nonce.hex()}))

    def publish_outbound(self) -> None:
        self.nonce = os.urandom(auth.NONCE)
        self.m.put(f"{self.m.ns}nonce/{self.m.rank}", self.nonce.hex())

    def connect_outbound(self) -> None:
        m = self.m
        offer = json.loads(m.wait_key(f"{m.ns}addr/{self.peer}", "ring address"))
        self.endpoint = offer["endpoint"]
        plain = (m.name(m.rank), m.answer("initiator", bytes.fromhex(offer["nonce"]), m.rank, self.peer)) \
            if m.secret is not None and m.curve is None else None
        self.socket = m.transport().connect(zmq.PUSH, self.endpoint, io_thread=self.io_thread,
                                            curve=m.curve[2] if m.curve else None, plain=plain)

    def attach_inbound(self) -> None:
        m = self.m
        if m.secret is not None:  # our proof over the sender's nonce, for the address we bound
            theirs = bytes.fromhex(m.wait_key(f"{m.ns}nonce/{self.peer}", "link nonce").decode())
            m.put(f"{m.ns}proof/{m.rank}", m.answer("responder", theirs, m.rank, self.peer))

    def accept_outbound(self) -> Outbox:
        m = self.m
        if m.secret is not None:  # before our first chunk goes out: is the receiver this job's?
            got = m.wait_key(f"{m.ns}proof/{self.peer}", "link proof")
            if not m.secret.check(m.answer("responder", self.nonce, self.peer, m.rank).encode(), got):
                raise AuthError(f"no proof of the job's secret for {self.endpoint}, the address the store gives as "
                                f"{self.who}'s: it is not this job's", op="connect")
        return ZmqOutbox(self._link(), m.rank, self.peer, m.timeout)

    def _link(self) -> Link:
        """This end's link (made once)."""
        if self.link is None:
            self.link = Link(_met(self.socket, self.who), self.who, self.peer)
            self.m.links.append(self.link)
        return self.link

    def inbox(self, outbox: Outbox) -> Inbox:
        return ZmqInbox(self._link(), self.m.rank, self.peer, self.m.timeout, self.m.idle, outbox)


class TcpKind(ZmqKind):
    def where(self) -> str:
        host = self.m.bind_host()
        self.m.options.check_bind(host)
        return f"tcp://{host}:0"


class IpcKind(ZmqKind):
    def where(self) -> str:
        return f"ipc://{self.m.ipc_folder()}/r{self.m.rank}"


class ShmKind(LinkKind):
    """Shared memory: the sender offers its segment and a listening Unix socket (:class:`ShmOffer`), the
    receiver maps the segment and connects."""

    def __init__(self, m: RingMeeting, peer: int, who: str, io_thread: int):
        super().__init__(m, peer, who, io_thread)
        self.offer: ShmOffer | None = None
        self.attached: tuple[shm.Segment, socket.socket, int] | None = None
        self.claim: tuple[auth.Offer, bytes] | None = None  # with the job's secret: ours, and the offer's nonce

    def publish_outbound(self) -> None:
        m = self.m
        self.offer = ShmOffer(m.shm_run(), m.rank, m.slot_bytes, m.secret)
        m.put(f"{m.ns}shm/{m.rank}", self.offer.describe())

    def attach_inbound(self) -> None:
        m = self.m
        offer = m.wait_key(f"{m.ns}shm/{self.peer}", "shared-memory segment")
        self.attached, self.claim = ShmOffer.attach(json.loads(offer), m, self.peer, self.who)

    def accept_outbound(self) -> Outbox:
        m = self.m
        segment, conn = _met(self.offer, self.who).accept(m.timeout, self.who, self.peer, m)
        return ShmOutbox(segment, conn, m.slot_bytes, m.rank, self.peer, self.who, m.timeout, m.idle)

    def inbox(self, outbox: Outbox) -> Inbox:
        mapped, conn, theirs = _met(self.attached, self.who)
        ShmOffer.granted(self.claim, conn, self.m, self.peer, self.who)
        return ShmInbox(mapped, conn, theirs, self.m.rank, self.peer, self.who, self.m.timeout, self.m.idle, outbox)


class TorchKind(LinkKind):
    """torch.distributed ``isend``/``irecv`` to the neighbours (gloo for CPU tensors, NCCL for CUDA ones, on the
    GPU): both ends share the default process group, which the right end's connect phase joins (collective:
    every rank reaches that phase after publishing nothing). Its p2p would need a registered subgroup, so it
    links whole jobs only; joining the group proves the ring."""

    on_device = True
    in_groups = False
    proves_ring = False
    proves_secret = False

    def connect_outbound(self) -> None:
        self.m.torch_group()

    def accept_outbound(self) -> Outbox:
        return TorchOutbox(self.m.torch_group(), self.m.rank, self.peer, self.who, self.m.timeout)

    def inbox(self, outbox: Outbox) -> Inbox:
        return TorchInbox(self.m.torch_group(), self.m.rank, self.peer, self.who, self.m.timeout)

    @classmethod
    def facts(cls, ring: RingExchanger) -> dict:
        backend = ring.options.backend
        return {"backend": backend, "staging": ("none: NCCL send/recv on the GPU (GPUDirect RDMA where available)"
                                                if backend == "nccl" else "CPU tensors only (gloo)")}


LINK_KINDS: dict[str, type[LinkKind]] = {"tcp": TcpKind, "ipc": IpcKind, "shm": ShmKind, "torch": TorchKind}


def kind_for(transport: str) -> type[LinkKind]:
    """The kind ``transport=`` names, whose declarations the ring follows; ``auto`` picks tcp or shm per link,
    which declare alike (the base's)."""
    return LINK_KINDS.get(transport, LinkKind)

_T = TypeVar("_T")


def _met(end: _T | None, who: str) -> _T:
    """A link end's socket, offer or mapping, which the meeting's earlier phase made (a bug if not)."""
    if end is None:
        raise CommError(f"the link with {who} was used before its meeting phase made it")
    return end


def shm_slot_bytes(chunk_mb: float) -> int:
    """Bytes per shared-memory slot: a whole chunk (at most ``chunk_mb`` MiB), 64-byte aligned."""
    return max(64, -(-int(chunk_mb * 2**20) // 64) * 64)


class ShmOffer:
    """This rank's end of a shared-memory link to its right neighbour while the ring joins: the segment
    and a listening Unix socket (both under /dev/shm, removed once the neighbour has them)."""

    def __init__(self, run: str, rank: int, slot_bytes: int, secret: auth.JobSecret | None = None):
        self.slot_bytes = slot_bytes
        self.auth = auth.Offer(secret) if secret is not None else None
        self.segment = shm.Segment.create(run, f"r{rank}-out", SLOTS * slot_bytes)
        self.path = shm.path_for(run, f"r{rank}.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        shm.track(self.path)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(8)

    def describe(self) -> str:
        return json.dumps({"segment": self.segment.path, "socket": self.path, "slot_bytes": self.slot_bytes,
                           **({"nonce": self.auth.nonce.hex()} if self.auth is not None else {})})

    HANDSHAKE_S = 5.0  # longest one connection may take to prove the job's secret

    def accept(self, timeout: float, who: str, peer: int, m: RingMeeting | None = None
               ) -> tuple[shm.Segment, socket.socket]:
        """Wait (at most ``timeout``) for the right neighbour to connect; it has mapped the segment then. With
        a meeting ``m`` that holds the job's secret, a connection that does not prove it as the right
        neighbour (:func:`commlab.transport.auth.respond`) is closed, counted (``m.refused``) and the wait goes on."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                # keeping going, a neighbour that died while the ring re-forms is not waited for: look every 0.25 s
                watch = m is not None and m.ring.quorum is not None
                self.listener.settimeout(max(0.001, min(left, 0.25) if watch else left))
                try:
                    conn, _ = self.listener.accept()
                except socket.timeout:
                    if watch and m is not None and left > 0.25:
                        m.ring._watch_peer(peer, f"{who} did not connect to its shared-memory link")
                        continue
                    raise CommTimeout(f"{who} did not connect to its shared-memory link within {timeout:g}s",
                                      peer=peer, op="connect") from None
                if m is None or self.auth is None:
                    break
                conn.settimeout(min(self.HANDSHAKE_S, max(0.001, deadline - time.monotonic())))
                try:  # the right neighbour sent its claim when it connected (attach)
                    conn.send(self.auth.grant(conn.recv(auth.MAX_MESSAGE + 1), m.name(m.rank), m.name(peer)))
                    break
                except (AuthError, OSError):
                    m.refused += 1
                    conn.close()
        finally:
            self.listener.close()
            shm.remove(self.path)
        conn.setblocking(True)
        self.segment.unlink()
        return self.segment, conn

    @staticmethod
    def attach(offer: dict, m: RingMeeting | None = None, peer: int = -1, who: str = ""):
        """``((segment, connection, slot bytes), claim)``: the left neighbour's segment, mapped (and its file
        removed), and a connection to it; with a meeting ``m`` that holds the job's secret, our claim to be
        the right neighbour went out on it (the left answers in :meth:`accept`; :meth:`granted` checks the
        answer, a phase later, so that no rank waits inside this one), and ``claim`` is what checks it."""
        slot_bytes = int(offer["slot_bytes"])
        mapped = shm.Segment.attach(offer["segment"], SLOTS * slot_bytes)
        mapped.unlink()  # mapped: the file is no longer needed, and a kill -9 can no longer leave it behind
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(offer["socket"])
        claim = None
        if m is not None and m.secret is not None:
            mine, offered = auth.Offer(m.secret), bytes.fromhex(str(offer.get("nonce", "")))
            conn.send(mine.claim(offered, m.name(m.rank), m.name(peer)))
            claim = (mine, offered)
        return (mapped, conn, slot_bytes), claim

    @staticmethod
    def granted(claim: tuple[auth.Offer, bytes] | None, conn: socket.socket, m: RingMeeting, peer: int,
                who: str) -> None:
        """The left neighbour's answer to our claim (bounded by the meeting's timeout); AuthError, blaming no
        rank, when whoever holds the offered link is not this job's."""
        if claim is None:
            return
        mine, offered = claim
        conn.settimeout(m.timeout)
        try:
            mine.granted(conn.recv(auth.MAX_MESSAGE + 1), offered, m.name(m.rank), m.name(peer))
        except (AuthError, OSError) as exc:  # someone else answered at the address the store gave
            raise AuthError(f"the shared-memory link the store gives as {who}'s: {exc}", op="connect") from None
        finally:
            conn.settimeout(None)


def _curve_keys(folder: str, key_name: str):
    """(server pair, authorised clients folder, client pair) from a 'commlab keys' folder: every rank
    is a server to its left neighbour and a client of its right one."""
    from commlab.transport import keys
    server, clients = keys.server_keys(folder)
    return server, clients, keys.client_keys(folder, key_name)


def _default_group_exists() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


host_identity = shm.host_identity  # moved to commlab.transport.shm (the ps:// client uses it too)


def _quote(report: dict) -> str:
    return f"rank {report['origin']} reports: {report['text']}" if report.get("origin") is not None else report["text"]
