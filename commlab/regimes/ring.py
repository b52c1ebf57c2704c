"""``ring://?transport=tcp|ipc|torch&chunk_mb=4``: a hand-written ring all-reduce (pyzmq or torch p2p).

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

Pipelining: each segment is further cut into chunks of about ``chunk_mb``; a
chunk is forwarded to the right as soon as it has been added (or stored), so the
reduce-scatter of later chunks overlaps the all-gather of earlier ones and zmq's
I/O thread moves bytes while this thread adds. Sends above 1 MiB are zero-copy
(tracked: the collective returns only after zmq let go of the caller's buffer),
smaller ones are copied (cheaper than tracking). Received chunks are added
straight from zmq's frame (reduce-scatter) or written straight into the caller's
tensor (all-gather); small reduce-scatter chunks land in one reused scratch
buffer. Half types (float16, bfloat16) are summed in a float32 copy, sent as
float32, and rounded once at the end. CUDA tensors are staged through host
memory for tcp/ipc; only ``transport=torch`` with NCCL keeps them on the GPU
(GPUDirect RDMA where the machine has it).

Two ranks: at N = 2 both neighbours are the same rank, and a tensor of up to
``swap_kb`` (4 MiB) takes one step instead of two: each rank sends the whole
tensor and adds what it receives. The bytes are the ring's (S each way, which
is 2(N-1)/N x S at N = 2); the latency is one message instead of two, which is
most of a small all-reduce. Both ranks compute x0 + x1 (addition commutes
exactly), so they hold the same bits. Each rank adds all S instead of S/2,
which is why big tensors keep the ring. When the swap's send went zero-copy,
a chunk is added into only after zmq has let go of it.

Transports: ``tcp`` (zmq PUSH/PULL over TCP, ``host`` is where each rank binds),
``ipc`` (zmq over Unix sockets, one host), ``torch`` (torch.distributed
``isend``/``irecv`` to the neighbours: gloo for CPU tensors, NCCL for CUDA ones;
the default process group is reused if the process already has one).

Failure: every wait is bounded by ``timeout``. A neighbour that dies is noticed
by the zmq monitor at once (:class:`~commlab.errors.PeerLost` naming it); one
that stalls gives :class:`~commlab.errors.CommTimeout` naming it. The first
rank to see a failure writes it to the rendezvous store and closes its sockets,
so ranks further around the ring stop too and name the same culprit.

Initial parameters: rank 0's, sent through the ring itself (the other ranks
contribute zeros to one all-reduce per bucket; x + 0 is exact).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import zmq

from commlab import rendezvous, wire
from commlab.config import CommonOptions, option
from commlab.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, PeerLost, ProtocolError
from commlab.exchanger import CollectiveExchanger
from commlab.handles import FutureHandle, Handle
from commlab.heap import keep_freed_memory
from commlab.transport import Link, Transport

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RingOptions(CommonOptions):
    transport: str = option("tcp", "how neighbours talk", choices=("tcp", "ipc", "torch"))
    chunk_mb: float = option(4.0, "pipeline chunk size in MiB: a chunk is forwarded as soon as it is added")
    host: str = option("127.0.0.1", "address each rank binds for transport=tcp (loopback only: the ring has no "
                                    "CURVE keys option)")
    backend: str = option("gloo", "torch.distributed backend for transport=torch", choices=("gloo", "nccl"))
    io_threads: int = option(2, "zmq I/O threads for tcp/ipc: 2 gives receiving from the left and sending to the "
                                "right a thread each, 1 makes one thread take turns", choices=(1, 2))
    sndbuf_kb: int = option(512, "kernel send buffer towards a right neighbour on this host (loopback tcp, ipc) in "
                                 "KiB, 0: the system's autotuning (always used towards other hosts): a small one "
                                 "keeps in flight only what the neighbour copies out while it is still in cache")
    swap_kb: int = option(4096, "at N = 2, tensors of up to this many KiB take one step instead of two: each rank "
                              "sends all of it and adds what it receives (0: always the two-step ring)")

    def __post_init__(self):
        super().__post_init__()
        if self.chunk_mb <= 0:
            raise ConfigError(f"chunk_mb must be > 0, got {self.chunk_mb}")
        if self.sndbuf_kb < 0:
            raise ConfigError(f"sndbuf_kb must be >= 0 (0: the system's default), got {self.sndbuf_kb}")
        if self.swap_kb < 0:
            raise ConfigError(f"swap_kb must be >= 0 (0: always the two-step ring), got {self.swap_kb}")


def segment_bounds(n: int, world: int) -> list[int]:
    """Start of each of the ``world`` segments of ``n`` elements, then ``n`` (sizes differ by at most 1)."""
    return [i * n // world for i in range(world + 1)]


def ring_schedule(rank: int, world: int, step: int) -> tuple[int, int]:
    """(segment sent, segment received) by ``rank`` at ``step`` of the ring (see the module's table)."""
    return (rank - step) % world, (rank - step - 1) % world


Step = tuple[int, int, bool]  # (segment sent, segment received, whether the received one is added)


def ring_steps(rank: int, world: int) -> tuple[Step, ...]:
    """The ring's 2(N-1) steps for ``rank``: N-1 that add (reduce-scatter), N-1 that store (all-gather)."""
    return tuple((*ring_schedule(rank, world, t), t < world - 1) for t in range(2 * world - 2))


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
        self._joined = False
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._broken: BaseException | None = None
        self._ring_lock = threading.Lock()  # held by whichever thread runs a collective
        self._order = threading.Lock()  # guards _pending: collectives submitted, not yet finished
        self._pending = 0
        self._seq = 0
        self._plans: dict[tuple[int, int], tuple[list[int], int, tuple[Step, ...]]] = {}  # (numel, itemsize) -> plan()
        self._moved: dict[tuple[int, int], tuple[int, int]] = {}  # (numel, itemsize) -> bytes_moved()
        self._transport: Transport | None = None
        self._ipc_dir: str | None = None
        self._inbox: Link | None = None  # PULL from the left neighbour
        self._outbox: Link | None = None  # PUSH to the right neighbour
        self._group = None
        self._own_group = False
        # small reduce-scatter chunks land here (and one-frame messages, header first)
        self._scratch = torch.empty(wire.COPY_THRESHOLD + wire.CHUNK_HEADER.size, dtype=torch.uint8)
        self._scratch_view = memoryview(self._scratch.numpy())
        self.left = (self.rank - 1) % self.world_size
        self.right = (self.rank + 1) % self.world_size
        self._ring_steps = ring_steps(self.rank, self.world_size)

    # ----- meeting the neighbours ----------------------------------------------------------
    def join(self, store=None) -> None:
        """Meet the neighbours (store, sockets or process group) and start the communication thread.
        Collective; idempotent; setup() calls it. Call it directly to use :meth:`allreduce_async`
        without a model (benchmarks). ``store``: the job's rendezvous store, when this process already
        holds it (several exchangers in one process: rank 0 can host the store only once)."""
        if self._joined:
            return
        opts = self.options
        self.store = store if store is not None else rendezvous.connect_store(self.rank_info, opts.timeout)
        # Several ring exchangers may live in one job (benchmarks): each gets its own namespace,
        # numbered by how many this rank made before (every rank makes them in the same order).
        ns = f"ring/{self.store.add(f'ring/instances/{self.rank}', 1)}/"
        self._ns = ns
        if self.world_size > 1:
            if opts.transport == "torch":
                self._join_torch(ns)
            else:
                self._join_zmq(ns)
        self._thread = threading.Thread(target=self._serve, name=f"ring-comm-rank{self.rank}", daemon=True)
        self._thread.start()
        self._joined = True
        if self.world_size > 1 and opts.transport != "torch":
            # A first tiny all-reduce proves the whole ring is connected before anyone relies on it.
            self.allreduce(torch.zeros(self.world_size), what="ring hello")

    def _join_zmq(self, ns: str) -> None:
        opts = self.options
        if opts.heap == "keep":  # received chunks reuse heap memory instead of faulting in fresh pages
            self._heap_kept = keep_freed_memory()
        self._transport = Transport(io_threads=opts.io_threads, sndbuf=opts.sndbuf_kb * 1024 or None)
        inward, outward = 0, opts.io_threads - 1  # one I/O thread per direction when there are two
        if opts.transport == "tcp":
            where = f"tcp://{opts.host}:0"
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="commlab-ring-")
            where = f"ipc://{self._ipc_dir}/r{self.rank}"
        pull = self._transport.bind(zmq.PULL, where, io_thread=inward)
        self._inbox = Link(pull, f"rank {self.left} (left neighbour)")
        self.store.set(f"{ns}addr/{self.rank}", pull.last_endpoint)
        key = f"{ns}addr/{self.right}"
        try:
            self.store.wait([key], timedelta(seconds=opts.timeout))
        except Exception as exc:
            raise CommTimeout(f"rank {self.rank}: right neighbour rank {self.right} did not publish its ring "
                              f"address within {opts.timeout:g}s") from exc
        push = self._transport.connect(zmq.PUSH, self.store.get(key).decode(), io_thread=outward)
        self._outbox = Link(push, f"rank {self.right} (right neighbour)")

    def _join_torch(self, ns: str) -> None:
        import torch.distributed as dist
        backend = self.options.backend
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise BackendUnavailable("ring://?transport=torch&backend=nccl needs CUDA and a torch build with NCCL; "
                                     "use backend=gloo for CPU tensors")
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise ConfigError(f"the process group has {dist.get_world_size()} ranks, this job {self.world_size}")
            self._group = dist.group.WORLD
            return
        if backend == "nccl":
            torch.cuda.set_device(self.rank_info.local_rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=dist.PrefixStore(ns + "pg/", self.store), rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=self.options.timeout))
        self._group, self._own_group = dist.group.WORLD, True

    # ----- the contract pieces ---------------------------------------------------------------
    def _connect(self, model, optimizer):
        self.join()
        self._agree_and_equalise(model, optimizer)  # rank 0's parameters, through the ring: the others add zeros

    def allreduce_async(self, tensor: torch.Tensor, what: str = "all-reduce") -> Handle:
        """Sum ``tensor`` in place over all ranks. Collective: every rank calls it with a tensor of the same
        size and dtype, in the same order. Does not block: the ring runs on this exchanger's
        communication thread, one collective after another in call order. Don't touch ``tensor`` until
        the handle is done. Needs :meth:`join` (or setup) first. Thread-safe to call."""
        flat = self._check(tensor, what)
        future: cf.Future = cf.Future()
        self._account(flat)
        with self._order:
            self._pending += 1
            self._jobs.put((flat, future, what))
        return FutureHandle(future, f"{what} on rank {self.rank}", on_timeout=self._stalled)

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
        self._run(flat, what)

    def _check(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if not self._joined:
            raise ConfigError("call join() or setup() before allreduce_async()")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the ring sums contiguous tensors in place; got strides {tensor.stride()}")
        if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
            raise ValueError(f"{what}: cannot sum dtype {tensor.dtype} (floating types and int32/int64 only)")
        return tensor.view(-1)

    def _account(self, flat: torch.Tensor) -> None:
        key = (flat.numel(), 4 if flat.dtype in HALF else flat.element_size())
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
        facts = {"scheme": self.scheme, "transport": o.transport, "chunk_mb": o.chunk_mb,
                 "two_rank_swap_up_to_kb": o.swap_kb if self.world_size == 2 else "n/a (N > 2)",
                 "zero_copy_above_bytes": wire.COPY_THRESHOLD, "half_types_reduce_in": "float32"}
        if o.transport == "torch":
            facts["backend"] = o.backend
            facts["staging"] = ("none: NCCL send/recv on the GPU (GPUDirect RDMA where available)"
                                if o.backend == "nccl" else "CPU tensors only (gloo)")
        else:
            facts["staging"] = "CUDA tensors are copied to host memory and back (no GPUDirect over zmq)"
            facts["io_threads"] = o.io_threads
            facts["sndbuf_kb"] = o.sndbuf_kb or "system"
            facts.update(self._heap_facts())
        return facts

    def close(self):
        super().close()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.options.timeout)  # its own waits are bounded by the same timeout
            if self._thread.is_alive():
                return  # still inside a wait: its sockets are not ours to close; the daemon thread dies with us
            self._thread = None
        if not self._joined:
            return
        self._close_links(linger_s=min(5.0, self.options.timeout))
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if self._own_group:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self._own_group = False
        self._joined = False

    def _close_links(self, linger_s: float) -> None:
        for link in (self._inbox, self._outbox):
            if link is not None:
                link.close(linger_s)
        self._inbox = self._outbox = None

    # ----- failure reports -------------------------------------------------------------------
    def _stalled(self) -> str:
        report = self._fault_report()
        return f" ({report})" if report else rendezvous.stall_report(self.store, self.world_size, self._step,
                                                                     skip=self.rank)

    def _fault_report(self) -> str | None:
        """What the first rank to fail wrote to the store, or None."""
        try:
            if self.store.check([self._ns + "fault"]):
                return self.store.get(self._ns + "fault").decode()
        except Exception:
            return "the rendezvous store hosted by rank 0 is unreachable: rank 0 is likely dead"
        return None

    def _check_reports(self) -> None:
        """Called while waiting: end the wait if another rank already reported the ring broken."""
        report = self._fault_report()
        if report:
            raise PeerLost(f"the ring is broken: {report}")

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
            return CommTimeout(f"{exc}: every rank timed out waiting for its left neighbour (nobody sent anything)")
        waits = ", ".join(f"rank {a} on rank {b}" for a, b in zip(chain, chain[1:] + [k]))
        return CommTimeout(f"rank {k} stalled: {exc} ({waits})")

    def _fail(self, exc: BaseException) -> BaseException:
        """Record the first failure for every rank to read, and close our sockets so neighbours stop too."""
        if isinstance(exc, CommTimeout) and self._inbox is not None and str(exc).startswith(
                f"no message from {self._inbox.who}"):
            exc = self._blame(exc)
        if isinstance(exc, CommError) and "the ring is broken" not in str(exc):
            try:
                self.store.compare_set(self._ns + "fault", "", f"rank {self.rank} reports: {exc}")
            except Exception:
                pass
        if isinstance(exc, PeerLost) and "disconnected" in str(exc) and "the ring is broken" not in str(exc):
            report = self._fault_report()  # a neighbour that closed on purpose may have said why
            if report and not report.startswith(f"rank {self.rank} "):
                exc = PeerLost(f"{exc}; {report}")
        self._close_links(linger_s=0)
        return exc

    # ----- the communication thread ----------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            flat, future, what = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self._run(flat, what)
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                future.set_exception(exc)

    def _run(self, flat: torch.Tensor, what: str) -> None:
        """One collective, on whichever thread holds the ring; a failure breaks the ring for good."""
        with self._ring_lock:
            try:
                if self._broken is not None:
                    raise CommError(f"{what}: the ring broke earlier: {self._broken}")
                self._allreduce(flat)
            except (CommError, ValueError) as caught:
                exc: BaseException = caught
                if self._broken is None:
                    exc = self._fail(caught)
                    exc = type(exc)(f"{what}: {exc}")
                    self._broken = exc
                raise exc from None
            finally:
                with self._order:
                    self._pending -= 1

    def _allreduce(self, flat: torch.Tensor) -> None:
        seq = self._seq
        self._seq += 1
        if flat.numel() == 0 or self.world_size == 1:
            return
        if self.options.transport == "torch":
            work = flat.float() if flat.dtype in HALF else flat
            self._ring_torch(work, seq)
        else:
            work = flat
            if flat.is_cuda or flat.dtype in HALF:
                work = flat.to("cpu", torch.float32 if flat.dtype in HALF else flat.dtype)
            with np.errstate(all="ignore"):  # inf and nan add up silently, as they do in torch
                self._ring_zmq(work, seq)
        if work is not flat:
            flat.copy_(work)

    def plan(self, n: int, itemsize: int) -> tuple[list[int], int, tuple[Step, ...]]:
        """(segment bounds, chunks per segment, steps) for ``n`` elements (cached: buckets repeat every step).

        The ring, or at N = 2 for at most ``swap_kb``: one segment, one step (the module's "Two ranks")."""
        plan = self._plans.get((n, itemsize))
        if plan is None:
            if self.world_size == 2 and n * itemsize <= self.options.swap_kb * 1024:
                bounds, steps = [0, n], SWAP_STEPS
            else:
                bounds, steps = segment_bounds(n, self.world_size), self._ring_steps
            per = max(1, int(self.options.chunk_mb * 2**20) // itemsize)
            longest = max(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1))
            plan = bounds, max(1, -(-longest // per)), steps
            if len(self._plans) < 256:
                self._plans[(n, itemsize)] = plan
        return plan

    @staticmethod
    def _chunk(bounds: list[int], seg: int, j: int, k: int) -> tuple[int, int]:
        lo, length = bounds[seg], bounds[seg + 1] - bounds[seg]
        return lo + length * j // k, lo + length * (j + 1) // k

    def _ring_zmq(self, work: torch.Tensor, seq: int) -> None:
        r, left = self.rank, self.left
        inbox, outbox = self._inbox, self._outbox
        if inbox is None or outbox is None:
            raise CommError("the ring's sockets are closed")
        isz, dtype = work.element_size(), work.dtype
        bounds, K, plan = self.plan(work.numel(), isz)
        flat_np = work.numpy()
        raw = work.view(torch.uint8).numpy().data
        scratch, scratch_np = self._scratch_view, self._scratch.numpy()
        timeout, steps = self.options.timeout, len(plan)
        hsize = wire.CHUNK_HEADER.size
        trackers: list = []  # per message sent, in order (step t, chunk j is t * K + j): a tracker, or None (copied)

        def outgoing(t: int, j: int) -> tuple[bytes, memoryview]:
            lo, hi = self._chunk(bounds, plan[t][0], j, K)
            return wire.chunk_header(r, seq, t, j, lo, hi - lo, dtype), raw[lo * isz:hi * isz]

        def send(message: tuple[bytes, memoryview]) -> None:
            trackers.append(outbox.send(*message))

        def release(t: int, j: int) -> None:  # adding into what step t sent (the swap): zmq must have let go
            tracker = trackers[t * K + j] if plan[t][0] == plan[t][1] else None
            if tracker is not None and not tracker.done:
                try:
                    tracker.wait(timeout)
                except zmq.NotDone:
                    raise CommTimeout(f"sends to {outbox.who} did not leave within {timeout:g}s") from None

        for j in range(K):
            send(outgoing(0, j))
        # Between receiving a chunk and forwarding it, do as little as possible: on a busy machine every
        # microsecond there costs the whole ring (the next message is prepared before the wait instead).
        for t, (_, seg, reduce) in enumerate(plan):
            last = t == steps - 1
            watch = () if last else (outbox,)
            for j in range(K):
                lo, hi = self._chunk(bounds, seg, j, K)
                nbytes = (hi - lo) * isz
                expected = wire.chunk_header(left, seq, t, j, lo, hi - lo, dtype)
                forward = None if last else outgoing(t + 1, j)
                if nbytes <= wire.INLINE_MAX:  # one frame, header then data, into the scratch buffer
                    size = inbox.recv_message_into(scratch, timeout, watch, self._check_reports)
                    if size != hsize + nbytes or bytes(scratch[:hsize]) != expected:
                        wire.check_chunk_header(bytes(scratch[:min(size, hsize)]), expected, inbox.who)
                        raise ProtocolError(f"{inbox.who} sent a {size}-byte message for elements [{lo}, {hi}) of "
                                            f"collective {seq} step {t}, expected {hsize + nbytes} in one frame")
                    if not reduce:
                        raw[lo * isz:hi * isz] = scratch[hsize:hsize + nbytes]
                    elif nbytes:  # numpy: a tenth of torch's per-call overhead on small chunks
                        dst = flat_np[lo:hi]
                        np.add(dst, scratch_np[hsize:hsize + nbytes].view(dst.dtype), out=dst)
                    if forward is not None:
                        send(forward)
                    continue
                got = inbox.recv_header(timeout, watch, idle=self._check_reports)
                wire.check_chunk_header(got, expected, inbox.who)
                if not inbox.more():
                    raise ProtocolError(f"{inbox.who} sent a chunk header without its data frame")
                if not reduce:  # all-gather: the final sum, straight into the caller's tensor
                    size = inbox.recv_into(raw[lo * isz:hi * isz])
                elif nbytes <= len(scratch) - hsize:  # reduce-scatter, mid-sized: into the reused scratch, then add
                    size = inbox.recv_into(scratch[:nbytes])
                    if size == nbytes:
                        work[lo:hi].add_(self._scratch[:nbytes].view(dtype))
                else:  # reduce-scatter, large: add straight from zmq's frame
                    frame = inbox.recv_frame()
                    size = len(frame)
                    if size == nbytes:
                        release(t, j)
                        work[lo:hi].add_(torch.frombuffer(frame.buffer, dtype=dtype, count=hi - lo))
                if size != nbytes or inbox.more():
                    raise ProtocolError(f"{inbox.who} sent {size} bytes for elements [{lo}, {hi}) of collective "
                                        f"{seq} step {t}, expected {nbytes} in one frame")
                if forward is not None:
                    send(forward)
        for tracker in trackers:  # zmq may still read our buffer until then
            if tracker is None:
                continue
            try:
                tracker.wait(timeout)
            except zmq.NotDone:
                raise CommTimeout(f"sends to {outbox.who} did not leave within {timeout:g}s") from None

    def _ring_torch(self, work: torch.Tensor, seq: int) -> None:
        """The same schedule over torch.distributed isend/irecv (gloo on CPU, NCCL on CUDA).

        Up to ``window`` receives are posted ahead: reduce-scatter ones into scratch slots, all-gather
        ones straight into ``work``. Tags number the messages of one collective so none can be matched
        to the wrong receive."""
        import torch.distributed as dist
        bounds, K, plan = self.plan(work.numel(), work.element_size())
        steps, total = len(plan), len(plan) * K
        window = min(total, 4)
        per = max(hi - lo for lo, hi in (self._chunk(bounds, s, j, K) for s in range(len(bounds) - 1)
                                         for j in range(K)))
        adding = sum(reduce for _, _, reduce in plan) * K
        slots = [torch.empty(per, dtype=work.dtype, device=work.device) for _ in range(min(window, adding))]
        timeout = timedelta(seconds=self.options.timeout)
        sends: list = []  # per message sent, in order; None once waited for (gloo's second wait never returns)
        recvs: dict = {}

        def post_recv(m: int) -> None:
            t, j = divmod(m, K)
            lo, hi = self._chunk(bounds, plan[t][1], j, K)
            dest = slots[m % len(slots)][:hi - lo] if plan[t][2] else work[lo:hi]
            recvs[m] = (dist.irecv(dest, src=self.left, group=self._group, tag=m), dest, lo, hi)

        def send(t: int, j: int) -> None:
            lo, hi = self._chunk(bounds, plan[t][0], j, K)
            sends.append(dist.isend(work[lo:hi], dst=self.right, group=self._group, tag=t * K + j))

        def finish(w, who: str, what: str) -> None:
            try:
                w.wait(timeout)
            except Exception as exc:  # gloo raises RuntimeError for timeouts and closed connections alike
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                cls = CommTimeout if "time" in text.lower() else PeerLost
                raise cls(f"{what} {who} failed in collective {seq}: {text}") from exc

        for m in range(window):
            post_recv(m)
        for j in range(K):
            send(0, j)
        for m in range(total):
            t, j = divmod(m, K)
            w, dest, lo, hi = recvs.pop(m)
            finish(w, f"rank {self.left} (left neighbour)", "receive from")
            if plan[t][2]:
                if plan[t][0] == plan[t][1]:  # adding into what step t sent (the swap): gloo/NCCL read it until done
                    finish(sends[m], f"rank {self.right} (right neighbour)", "send to")
                    sends[m] = None
                work[lo:hi].add_(dest)
            if m + window < total:
                post_recv(m + window)
            if t + 1 < steps:
                send(t + 1, j)
        for w in sends:
            if w is not None:
                finish(w, f"rank {self.right} (right neighbour)", "send to")
