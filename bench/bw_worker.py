"""One rank of a bandwidth job (``python -m bench.bw_worker``), started by the launcher like a worker.

A job measures several *cases* (regimes and the ceilings of :data:`bench.regimes.CEILINGS`) at once;
docs/bench.md ("What is measured") says what each measures and how it is checked. For each size S
(float32, ``count = S / 4``), iteration i runs every case once, starting from case i mod their number,
in the same order on every rank (:func:`turns`), each exchange after a start line outside the timing
(:func:`start_line`); the first ``warmup`` iterations are not kept. Each rank writes its rows as lines of
its metrics file ``OUT`` (rank r > 0: ``OUT.rank<r>``; :func:`commlab.core.metrics.report`) as soon as they
are known: per (case, size) ``times_s``, ``cpu_s`` and ``wrong``; a case's ``setup_error``; the case that
``failed`` while running (``at``: when); the regimes' ``facts`` at the end. The parent
(:func:`bench.bandwidth.combine_ranks`) takes the slowest rank's time of each iteration.

Inputs and references are small integers, so every sum is exact in float32 and "wrong" means wrong, not
rounded (rank r's input is ``x_r[i] = (r + 1) + (i mod 13)``). The input is refilled before every exchange
and every result checked, both outside the timing, so ``wrong`` counts over all timed ones; ``--corrupt``
shifts one element of the reference, to prove the check can fail. A case whose setup fails on any rank is
left out on every rank (the ranks agree through the store); one that fails while running stops the job,
naming itself, and the parent runs the others again without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import socket
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
from torch import nn

import commlab
from commlab.launch import launcher, scratch
from commlab.core import metrics
from commlab.transport import rendezvous
from commlab.base.config import ExchangerURL
from commlab.core.exchanger import Collective, PlansServers
from commlab.base.handles import DoneHandle
from commlab.core.optim import OptimizerSpec
from commlab.core.registry import regime_class

PATTERN = 13
CEILINGS = ("tcp-oneway", "tcp-duplex", "zmq-tcp", "zmq-ipc", "memcpy")


def fill_input(buf: torch.Tensor, rank: int) -> None:
    n = buf.numel()
    buf.copy_(torch.arange(n, dtype=torch.int64).remainder_(PATTERN).to(buf.dtype).add_(rank + 1))


def allreduce_reference(count: int, world: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64).remainder_(PATTERN).to(torch.float32).mul_(world).add_(
        world * (world + 1) / 2)


def mean_input(count: int, world: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64).remainder_(PATTERN).to(torch.float32).add_((world + 1) / 2)


def count_wrong(result: torch.Tensor, reference: torch.Tensor) -> int:
    """Elements of ``result`` that differ from ``reference`` (exact comparison; NaN counts as wrong).
    An equal result (the usual case) is confirmed by ``torch.equal``, 9x faster here at 32 MiB than
    counting; only a result that differs is counted."""
    result = result.cpu()
    if torch.equal(result, reference):
        return 0
    return int((result != reference).sum().item())


def corrupt(reference: torch.Tensor) -> torch.Tensor:
    if reference.numel():
        reference = reference.clone()
        reference[reference.numel() // 2] += 1
    return reference


def turns(names: list, i: int) -> list:
    """The order of iteration ``i``: every case once, starting from case ``i mod len``."""
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def start_line(store, rank: int, world: int, n: int, timeout: float, what: str) -> None:
    """Start line ``n``: every rank waits here before each exchange, outside the timing, so a rank's time
    is the exchange's own. Without it a rank that came early counted its wait for the others: after a
    ceiling only rank 0 runs (memcpy) or only ranks 0 and 1 (raw TCP), the others began the next case
    that much sooner (after a 256 MiB memcpy: 35 ms). Through the store: the last rank's key wakes the
    others within about 25 us (median; p90 45 us, measured on loopback). A rank that never comes is
    named."""
    prefix = f"bench/line/{n}/"
    store.set(f"{prefix}{rank}", b"1")
    keys = [f"{prefix}{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # the store's own timeout error: say who never came
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise commlab.CommTimeout(f"rank {rank}: rank(s) {missing} did not reach the start of {what} within "
                                  f"{timeout:g}s ({type(exc).__name__})") from None


# ----- one size's exchange under one case ----------------------------------------------------------
class Exchange:
    """``arm()`` (untimed: refill the input), ``go()`` (timed: one exchange, returns when this rank
    has its result), ``wrong()`` (untimed: elements of the result that differ from the reference)."""

    def __init__(self, count: int, rank: int, world: int, device: torch.device, corrupt_ref: bool):
        self.count, self.world, self.device, self.corrupt_ref = count, world, device, corrupt_ref
        src = torch.empty(count, dtype=torch.float32)
        fill_input(src, rank)
        self.src = src.to(device)
        self.buf = torch.empty(count, dtype=torch.float32, device=device)

    def arm(self) -> None:
        self.buf.copy_(self.src)

    def go(self) -> None:
        raise NotImplementedError

    def result_and_reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def wrong(self) -> int:
        got, ref = self.result_and_reference()
        return count_wrong(got, corrupt(ref) if self.corrupt_ref else ref)

    def close(self) -> None:
        pass


class AllReduce(Exchange):
    """``allreduce_async`` in place; every rank must end with the sum of all inputs."""

    def __init__(self, ex, timeout: float, *args):
        super().__init__(*args)
        self.ex, self.timeout = ex, timeout
        self.ref = allreduce_reference(self.count, self.world)
        # NCCL's wait() only orders streams: wait for the device, so the time is the exchange's
        self.settle = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

    def arm(self) -> None:
        super().arm()
        self.settle()

    def go(self) -> None:
        self.ex.allreduce_async(self.buf).wait(self.timeout)
        self.settle()

    def result_and_reference(self):
        return self.buf, self.ref


class Noop(Exchange):
    """Nothing moves: the buffer must still hold the input."""

    def go(self) -> None:
        DoneHandle().wait(0)

    def result_and_reference(self):
        return self.buf, self.src.cpu()


class PushPull(Exchange):
    """A sync PS, SGD lr 1 on one flat parameter from zero: each pull is the previous one minus the mean push."""

    def __init__(self, url: str, info, timeout: float, *args):
        super().__init__(*args)
        self.timeout = timeout
        self.ex = commlab.connect(url, info)
        self.model = nn.ParameterList([nn.Parameter(torch.zeros(self.count))])  # one flat parameter
        self.ex.setup(self.model, OptimizerSpec("sgd", lr=1.0))
        self.mean = mean_input(self.count, self.world)
        self.prev = torch.zeros(self.count)
        self.pulled = self.prev

    def go(self) -> None:
        got = self.ex.push_pull_async(self.buf).wait(self.timeout)
        # the client returns the pulled parameter (or leaves it in the model's parameter)
        self.pulled = got if isinstance(got, torch.Tensor) else self.model[0]

    def result_and_reference(self):
        got, ref = self.pulled.detach().cpu().clone(), self.prev - self.mean
        self.prev = got
        return got, ref

    def wrong(self) -> int:
        got, ref = self.result_and_reference()
        ref = corrupt(ref) if self.corrupt_ref else ref
        if self.world & (self.world - 1) == 0:
            return count_wrong(got, ref)
        # the mean of N pushes is exact in float32 only when 1/N is (N a power of two): elsewhere one
        # rounding per step is allowed, never more (the reference restarts from each pull)
        return int((~torch.isclose(got, ref, rtol=4e-7, atol=0.0)).sum().item())

    def close(self) -> None:
        self.ex.close()


class Bytes(Exchange):
    """A ceiling's S bytes: ``go`` moves ``send`` into ``recv``; wrong = whether they differ."""

    def __init__(self, size: int, takes_part: bool):
        self.takes_part = takes_part
        self.send = bytearray(bytes(range(256)) * (size // 256 + 1))[:size] if takes_part else bytearray()
        self.recv = bytearray(len(self.send))
        self.checked = True  # the one-way sender receives nothing to check

    def arm(self) -> None:
        pass

    def go(self) -> None:
        if self.takes_part:
            self.move()

    def move(self) -> None:
        raise NotImplementedError

    def wrong(self) -> int:
        return int(self.takes_part and self.checked and self.recv != self.send)


class Memcpy(Bytes):
    """Rank 0 copies S bytes in memory (numpy): read S, write S."""

    def __init__(self, size: int, rank: int):
        super().__init__(size, rank == 0)
        import numpy as np
        self.src, self.dst = np.frombuffer(self.send, np.uint8), np.frombuffer(self.recv, np.uint8)

    def move(self) -> None:
        import numpy as np
        np.copyto(self.dst, self.src)


class TcpLink:
    """One TCP connection between ranks 0 and 1 for the raw ceilings, made once per job: rank 1 listens on
    ``$BENCH_ADDR`` (loopback unless a ``--link`` namespace sets it). Ranks > 1 pass their turns."""

    def __init__(self, store, info, timeout: float, method: str):
        self.sock, self.rank, self.timeout = None, info.rank, timeout
        if info.rank > 1:
            return
        key = f"bench/{method}/addr"
        if info.rank == 1:
            lsock = socket.socket()
            lsock.bind((os.environ.get("BENCH_ADDR", "127.0.0.1"), 0))
            lsock.listen(1)
            lsock.settimeout(timeout)
            host, port = lsock.getsockname()
            store.set(key, f"{host}:{port}")
            self.sock, _ = lsock.accept()
            lsock.close()
        else:
            store.wait([key], timedelta(seconds=timeout))
            host, port = store.get(key).decode().rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise commlab.PeerLost("the TCP peer closed the connection mid-message")
        got += k


class TcpOneway(Bytes):
    """Rank 0 sends S bytes (sendall), rank 1 receives them into a preallocated buffer and acks 1 byte."""

    def __init__(self, link: TcpLink, size: int):
        super().__init__(size, link.sock is not None)
        self.link, self.checked = link, link.rank == 1

    def move(self) -> None:
        sock = self.link.sock
        if self.link.rank == 0:
            sock.sendall(self.send)
            _recv_exact(sock, memoryview(bytearray(1)))
        else:
            _recv_exact(sock, memoryview(self.recv))
            sock.sendall(b"k")


class TcpDuplex(Bytes):
    """Ranks 0 and 1 each send S bytes while receiving S, on one thread (no GIL hand-offs)."""

    def __init__(self, link: TcpLink, size: int):
        super().__init__(size, link.sock is not None)
        self.link = link

    def move(self) -> None:
        sock, timeout, send, recv = self.link.sock, self.link.timeout, memoryview(self.send), memoryview(self.recv)
        sent = got = 0
        sock.setblocking(False)
        try:
            while sent < len(send) or got < len(recv):
                r, w, _ = select.select([sock] if got < len(recv) else [], [sock] if sent < len(send) else [], [],
                                        timeout)
                if not r and not w:
                    raise commlab.CommTimeout(f"rank {self.link.rank}: duplex TCP peer silent for {timeout:g}s")
                if w:
                    sent += sock.send(send[sent:])
                if r:
                    k = sock.recv_into(recv[got:])
                    if k == 0:
                        raise commlab.PeerLost(f"rank {self.link.rank}: the TCP peer closed the connection mid-message")
                    got += k
        finally:
            sock.settimeout(timeout)


class ZmqLink:
    """PUSH/PULL between ranks 0 and 1 over ``method``'s transport (``zmq-tcp``, ``zmq-ipc``), set up as the
    ring sets up its sockets (I/O threads, send buffer, heap setting), once per job."""

    PIECE = 4 << 20

    def __init__(self, store, info, timeout: float, method: str):
        import zmq

        from commlab.core.heap import keep_freed_memory
        from commlab.regimes.ring import RingOptions
        from commlab.transport.sockets import Transport

        self.rank, self.timeout, self.net, self.folder, self.push = info.rank, timeout, None, None, None
        if info.rank > 1:
            return
        keep_freed_memory()
        io_threads = RingOptions.io_threads
        self.net = Transport(io_threads=io_threads, sndbuf=RingOptions.sndbuf_kb * 1024 or None)
        self.folder = scratch.mkdtemp("bench") if method == "zmq-ipc" else None
        where = f"ipc://{self.folder}/r{info.rank}" if self.folder else "tcp://127.0.0.1:0"
        self.pull = self.net.bind(zmq.PULL, where, io_thread=0)
        key = f"bench/{method}/"
        store.set(f"{key}{info.rank}", self.pull.last_endpoint.decode())
        store.wait([f"{key}{1 - info.rank}"], timedelta(seconds=timeout))
        self.push = self.net.connect(zmq.PUSH, store.get(f"{key}{1 - info.rank}").decode(), io_thread=io_threads - 1)
        self.push.send(b"hello")
        self.pull.recv()

    def close(self) -> None:
        if self.net is not None:
            self.net.close()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


class ZmqBothWays(Bytes):
    """Ranks 0 and 1 each send S bytes to the other at once, 4 MiB zero-copy frames, received and
    not read (``wrong`` stays 0: nothing is compared)."""

    def __init__(self, link: ZmqLink, size: int):
        super().__init__(size, link.push is not None)
        self.link, self.checked = link, False

    def arm(self) -> None:
        if self.takes_part:  # start together, untimed
            self.link.push.send(b"go")
            self.link.pull.recv()

    def move(self) -> None:
        link, piece, out = self.link, ZmqLink.PIECE, memoryview(self.send)
        trackers = [link.push.send(out[s:s + piece], copy=False, track=True) for s in range(0, len(out), piece)]
        for _ in range(0, len(out), piece):
            link.pull.recv(copy=False)
        for t in trackers:
            t.wait(link.timeout)


# ----- a job: its cases, set up once, measured size by size --------------------------------------------
# ceiling -> (the link it keeps for the whole job, between ranks 0 and 1; one size's exchange over it)
CEILING_LINKS = {"tcp-oneway": (TcpLink, TcpOneway), "tcp-duplex": (TcpLink, TcpDuplex),
                 "zmq-tcp": (ZmqLink, ZmqBothWays), "zmq-ipc": (ZmqLink, ZmqBothWays)}


class ServersPerSize:
    """Fresh servers for every size, for a regime whose ``setup()`` binds one model (``ps://``).

    Rank 0 starts the servers the regime's ``plan_local`` asks for, as its own children, and
    publishes the workers' URL in the job's store; when every rank has closed its client,
    rank 0 stops them and removes the plan's scratch folder. Cheaper than a job per size: the
    ranks stay up, only servers restart.
    """

    def __init__(self, name: str, url: str, info, store, timeout: float):
        self.name, self.url, self.info, self.timeout, self.store = name, url, info, timeout, store
        self.procs: list[launcher.Proc] = []
        self.plan = contextlib.ExitStack()  # rank 0: the current size's launcher.server_plan

    def start(self, size: int) -> str:
        key = f"bench/servers/{self.name}/{size}"
        if self.info.rank == 0:
            template, argvs = self.plan.enter_context(launcher.server_plan(self.url, self.info.world_size))
            url = launcher.start_servers(template, argvs, os.environ, None, self.timeout, self.procs)
            self.store.set(key, url)
            return url
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except Exception as exc:  # torch raises its own timeout types
            raise commlab.CommTimeout(f"rank {self.info.rank}: rank 0 did not start the servers for "
                                      f"{size} bytes within {self.timeout:g}s") from exc
        return self.store.get(key).decode()

    def stop(self, size: int) -> None:
        key = f"bench/servers/{self.name}/{size}/closed"
        self.store.add(key, 1)
        if self.info.rank != 0:
            return
        deadline = time.monotonic() + self.timeout
        while int(self.store.add(key, 0)) < self.info.world_size:
            if time.monotonic() > deadline:
                raise commlab.CommTimeout(f"rank 0: not every rank closed its {self.name} client for {size} bytes "
                                          f"within {self.timeout:g}s")
            time.sleep(0.01)
        self.close()

    def close(self) -> None:
        launcher.stop_all(self.procs)
        self.procs = []
        self.plan.close()


class CaseFailed(Exception):
    def __init__(self, case: str, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.case = case


class Job:
    """This rank's cases (``[{"name", "method", "url"}]``), set up in an order every rank shares:
    an ``allreduce://`` regime first (its process group and store serve the others), then the rest."""

    def __init__(self, cases: list[dict], info, timeout: float, corrupt_ref: bool):
        self.info, self.timeout, self.corrupt_ref = info, timeout, corrupt_ref
        self.cases = sorted(cases, key=lambda c: not c["url"].startswith("allreduce://"))
        self.state: dict[str, object] = {}  # name -> exchanger, link or ServersPerSize
        self.devices: dict[str, torch.device] = {}
        self.errors: dict[str, str] = {}
        self.client_facts: dict[str, dict] = {}  # per-size clients (ps://): the last one's
        self.store = None
        self.lines = 0  # start lines passed (:func:`start_line`)
        for c in self.cases:
            try:
                self._setup(c)
            except (commlab.CommError, commlab.ConfigError, ImportError, OSError) as exc:
                self.errors[c["name"]] = f"{type(exc).__name__}: {exc}"
        if self.store is None:
            self.store = rendezvous.connect_store(info, timeout)
        self.errors = self._agree(self.errors)
        self.names = [c["name"] for c in self.cases if c["name"] not in self.errors]

    def _setup(self, c: dict) -> None:
        name, method, url = c["name"], c["method"], c["url"]
        if method == "allreduce":
            ex = commlab.connect(url, self.info)
            self.state[name] = ex
            if not isinstance(ex, Collective):
                raise commlab.ConfigError(f"{url}: the regime has no meet()/allreduce_async(), needed for method "
                                          "allreduce")
            if url.startswith("allreduce://"):
                ex.meet()
                self.store = ex.store
            else:
                ex.meet(self._store())
            self.devices[name] = torch.device("cpu")
            if getattr(ex.options, "backend", "") == "nccl":  # meet() picked this rank's GPU
                self.devices[name] = torch.device("cuda", torch.cuda.current_device())
        elif method == "pushpull":
            if issubclass(regime_class(ExchangerURL.parse(url).scheme), PlansServers):
                self.state[name] = ServersPerSize(name, url, self.info, self._store(), self.timeout)
        elif method in CEILING_LINKS:
            self.state[name] = CEILING_LINKS[method][0](self._store(), self.info, self.timeout, method)
        elif method not in ("noop", "memcpy"):
            raise commlab.ConfigError(f"unknown method {method!r}")

    def _store(self):
        if self.store is None:
            self.store = rendezvous.connect_store(self.info, self.timeout)
        return self.store

    def _agree(self, errors: dict[str, str]) -> dict[str, str]:
        """Every rank's setup errors, so that all leave out the same cases."""
        self.store.set(f"bench/setup/{self.info.rank}", json.dumps(errors))
        keys = [f"bench/setup/{r}" for r in range(self.info.world_size)]
        self.store.wait(keys, timedelta(seconds=self.timeout))
        out: dict[str, str] = {}
        for r, k in enumerate(keys):
            for name, err in json.loads(self.store.get(k)).items():
                out.setdefault(name, err if r == self.info.rank else f"on rank {r}: {err}")
        return out

    def exchange(self, c: dict, size: int) -> Exchange:
        name, method, rank, world = c["name"], c["method"], self.info.rank, self.info.world_size
        common = (size // 4, rank, world, self.devices.get(name, torch.device("cpu")), self.corrupt_ref)
        st = self.state.get(name)
        if method == "allreduce":
            return AllReduce(st, self.timeout, *common)
        if method == "noop":
            return Noop(*common)
        if method == "pushpull":  # setup() binds one model: a fresh client (and servers) per size
            return PushPull(st.start(size) if st else c["url"], self.info, self.timeout, *common)
        if method == "memcpy":
            return Memcpy(size, rank)
        return CEILING_LINKS[method][1](st, size)

    def measure(self, out: Callable[[dict], None], size: int, iters: int, warmup: int) -> None:
        """Every case on ``size``, taking turns; ``out(row)`` once per case."""
        by_name = {c["name"]: c for c in self.cases}
        xs: dict[str, Exchange] = {}
        try:
            for name in self.names:
                try:
                    xs[name] = self.exchange(by_name[name], size)
                except Exception as exc:
                    raise CaseFailed(name, exc) from exc
            times = {n: [] for n in self.names}
            cpu = {n: [] for n in self.names}
            wrong = dict.fromkeys(self.names, 0)
            for i in range(warmup + iters):
                for name in turns(self.names, i):
                    x = xs[name]
                    try:
                        x.arm()
                        self.lines += 1
                        start_line(self.store, self.info.rank, self.info.world_size, self.lines, self.timeout,
                                   f"{name}, {size} bytes, exchange {i + 1}")
                        t0, c0 = time.perf_counter(), time.process_time()
                        x.go()
                        t, c = time.perf_counter() - t0, time.process_time() - c0
                        w = x.wrong()  # also for warm-ups: a push-pull's reference follows the previous pull
                    except Exception as exc:
                        raise CaseFailed(name, exc) from exc
                    if i >= warmup:
                        times[name].append(t)
                        cpu[name].append(c)
                        wrong[name] += w
        finally:
            for name, x in xs.items():
                if isinstance(x, PushPull):
                    self.client_facts[name] = x.ex.facts()
                x.close()
        for name in self.names:
            if isinstance(self.state.get(name), ServersPerSize):
                self.state[name].stop(size)
        for name in self.names:
            out({"case": name, "size_bytes": size, "count": size // 4, "iters": iters, "warmup": warmup,
                        "times_s": times[name], "cpu_s": cpu[name], "wrong": wrong[name]})

    def facts(self) -> dict:
        facts = {name: st.facts() for name, st in self.state.items() if hasattr(st, "facts")}
        return {**facts, **self.client_facts}

    def close(self) -> None:
        for st in reversed(list(self.state.values())):
            with contextlib.suppress(Exception):
                st.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bw_worker")
    p.add_argument("--exchanger", required=True, help="set by the launcher (noop://: the job starts its own servers)")
    p.add_argument("--cases", required=True, help='JSON list of {"name", "method", "url"}')
    p.add_argument("--sizes", required=True, help="bytes, comma-separated")
    p.add_argument("--iters", required=True, help="timed iterations per size, comma-separated")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p.add_argument("--corrupt", action="store_true", help="shift one element of the reference (to test the check)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(s) for s in a.sizes.split(",")]
    iters = [int(s) for s in a.iters.split(",")]
    info = rendezvous.from_env()
    # this rank's rows, each a line of its metrics file as soon as it is known: a job stopped midway (a
    # failure, the time budget) still leaves what it measured
    out = lambda row: metrics.report(0, path=a.out, rank=info.rank, **row)
    job = None
    try:
        # "@launcher": the URL the launcher handed the ranks (servers it placed, bench.jobs.place_servers)
        cases = [dict(c, url=a.exchanger if c["url"] == "@launcher" else c["url"]) for c in json.loads(a.cases)]
        job = Job(cases, info, a.timeout, a.corrupt)
        for name, err in job.errors.items():
            out({"case": name, "setup_error": err})
        for size, n in zip(sizes, iters):
            job.measure(out, size, n, a.warmup)
        out({"facts": job.facts()})
    except CaseFailed as exc:
        out({"case": exc.case, "failed": str(exc), "at": time.time()})
        print(f"commlab worker rank {info.rank}: {exc.case}: {exc}", file=sys.stderr)
        return 2
    except (commlab.CommError, commlab.ConfigError) as exc:
        print(f"commlab worker rank {info.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        if job is not None:
            job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
