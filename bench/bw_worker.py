"""One rank of a bandwidth run. Started by the launcher (``python -m bench.bw_worker``), like a worker.

For each size S (float32, ``count = S / 4``) it runs ``warmup`` untimed exchanges,
then ``iters`` timed ones, and writes, per size, the time of every timed
exchange and the number of wrong elements. Rank r > 0 writes ``OUT.rank<r>``;
the parent takes, per iteration, the slowest rank's time.

Inputs and references are small integers, so every sum is exact in float32 and
"wrong" means wrong, not rounded. Rank r's input is ``x_r[i] = (r + 1) + (i mod 13)``:

- all-reduce: every rank must end with ``sum_r x_r = N(N+1)/2 + N (i mod 13)``;
- push-pull (parameter server, sync, SGD with lr 1 on a parameter that starts at 0):
  after each round the pulled parameter must be the previous one minus the workers'
  mean ``(N+1)/2 + (i mod 13)``;
- noop: the buffer must still hold the input.

The input is refilled before every timed exchange (outside the timing), and every
timed result is checked, so ``wrong`` counts over all of them. ``--corrupt`` shifts
one element of the reference, to prove the check can fail.

TCP ceilings (``tcp-oneway``, ``tcp-duplex``) use ranks 0 and 1 only: rank 1
listens on its own address (``BENCH_ADDR``, loopback unless a ``--link`` namespace
sets it), publishes it in the job's rendezvous store, rank 0 connects.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
from torch import nn

import commlab
from commlab import launcher, rendezvous
from commlab.config import ExchangerURL
from commlab.registry import regime_class
from commlab.exchanger import Collective, PlansServers
from commlab.handles import DoneHandle
from commlab.optim import OptimizerSpec

PATTERN = 13


def fill_input(buf: torch.Tensor, rank: int) -> None:
    n = buf.numel()
    buf.copy_(torch.arange(n, dtype=torch.int64).remainder_(PATTERN).to(buf.dtype).add_(rank + 1))


def allreduce_reference(count: int, world: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64).remainder_(PATTERN).to(torch.float32).mul_(world).add_(
        world * (world + 1) / 2)


def mean_input(count: int, world: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64).remainder_(PATTERN).to(torch.float32).add_((world + 1) / 2)


def count_wrong(result: torch.Tensor, reference: torch.Tensor) -> int:
    """Elements of ``result`` that differ from ``reference`` (exact comparison; NaN counts as wrong)."""
    return int((result.cpu() != reference).sum().item())


def corrupt(reference: torch.Tensor) -> torch.Tensor:
    if reference.numel():
        reference = reference.clone()
        reference[reference.numel() // 2] += 1
    return reference


class Results(list):
    """This rank's rows, written to its file after every size (atomically), so a job stopped
    midway (a failure, the time budget) still leaves what it measured."""

    def __init__(self, path: str, info):
        super().__init__()
        self.path, self.info = path, info
        self.save()

    def append(self, row: dict) -> None:
        super().append(row)
        self.save()

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"rank": self.info.rank, "world_size": self.info.world_size, "rows": list(self)}, fh)
        os.replace(tmp, self.path)


class FlatParam(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(count))


class Exchange:
    """One size's exchange under one method: ``arm()`` (untimed: refill the input),
    ``go()`` (timed: one exchange, returns when this rank has its result),
    ``wrong()`` (untimed: elements of the result that differ from the exact reference)."""

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
        self.model = FlatParam(self.count)
        self.ex.setup(self.model, OptimizerSpec("sgd", lr=1.0))
        self.mean = mean_input(self.count, self.world)
        self.prev = torch.zeros(self.count)
        self.pulled = self.prev

    def go(self) -> None:
        got = self.ex.push_pull_async(self.buf).wait(self.timeout)
        # the client returns the pulled parameter (or leaves it in the model's parameter)
        self.pulled = got if isinstance(got, torch.Tensor) else self.model.weight

    def result_and_reference(self):
        got, ref = self.pulled.detach().cpu().clone(), self.prev - self.mean
        self.prev = got
        return got, ref

    def close(self) -> None:
        self.ex.close()


def measure(x: Exchange, iters: int, warmup: int) -> tuple[list[float], int]:
    """``warmup`` + ``iters`` exchanges; the time of each timed one, and wrong elements over them."""
    times, wrong = [], 0
    for i in range(warmup + iters):
        x.arm()
        t0 = time.perf_counter()
        x.go()
        t = time.perf_counter() - t0
        w = x.wrong()  # also for warm-ups: a push-pull's reference follows the previous pull
        if i >= warmup:
            times.append(t)
            wrong += w
    return times, wrong


class ServersPerSize:
    """Fresh servers for every size, for a regime whose ``setup()`` binds one model (``ps://``).

    Rank 0 starts the servers the regime's ``plan_local`` asks for, as its own children, and
    publishes the workers' URL in the job's store; when every rank has closed its client,
    rank 0 stops them and removes the plan's scratch folder. Cheaper than a job per size: the
    ranks stay up, only servers restart.
    """

    def __init__(self, url: str, info, timeout: float):
        self.url, self.info, self.timeout = url, info, timeout
        self.store = rendezvous.connect_store(info, timeout)
        self.procs: list[launcher.Proc] = []
        self.plan = contextlib.ExitStack()  # rank 0: the current size's launcher.planned_servers

    def start(self, size: int) -> str:
        key = f"bench/servers/{size}"
        if self.info.rank == 0:
            url, argvs = self.plan.enter_context(launcher.planned_servers(self.url, self.info.world_size))
            self.procs = [launcher.Proc(f"server {i}", subprocess.Popen([sys.executable, "-m", "servers", *argv]))
                          for i, argv in enumerate(argvs)]
            self.store.set(key, url)
            return url
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except Exception as exc:  # torch raises its own timeout types
            raise commlab.CommTimeout(f"rank {self.info.rank}: rank 0 did not start the servers for "
                                      f"{size} bytes within {self.timeout:g}s") from exc
        return self.store.get(key).decode()

    def stop(self, size: int) -> None:
        key = f"bench/servers/{size}/closed"
        self.store.add(key, 1)
        if self.info.rank != 0:
            return
        deadline = time.monotonic() + self.timeout
        while int(self.store.add(key, 0)) < self.info.world_size:
            if time.monotonic() > deadline:
                raise commlab.CommTimeout(f"rank 0: not every rank closed its client for {size} bytes "
                                          f"within {self.timeout:g}s")
            time.sleep(0.01)
        launcher.stop_all(self.procs)
        self.procs = []
        self.plan.close()

    def close(self) -> None:
        launcher.stop_all(self.procs)
        self.plan.close()


def run_sizes(out: Results, method: str, url: str, info, sizes: list[int], iters: list[int], warmup: int,
              timeout: float, corrupt_ref: bool) -> None:
    rank, world = info.rank, info.world_size
    facts = {}
    ex, device, servers = None, torch.device("cpu"), None
    if method == "pushpull":
        cls = regime_class(ExchangerURL.parse(url).scheme)
        if issubclass(cls, PlansServers):  # servers the launcher would start: started here, per size
            servers = ServersPerSize(url, info, timeout)
    if method == "allreduce":
        ex = commlab.connect(url, info)
        if not isinstance(ex, Collective):
            raise commlab.ConfigError(f"{url}: the regime has no join()/allreduce_async(), needed for method allreduce")
        ex.join()
        if getattr(ex.options, "backend", "") == "nccl":  # join() picked this rank's GPU
            device = torch.device("cuda", torch.cuda.current_device())
    try:
        for size, n_iter in zip(sizes, iters):
            common = (size // 4, rank, world, device, corrupt_ref)
            if method == "allreduce":
                x = AllReduce(ex, timeout, *common)
            elif method == "noop":
                x = Noop(*common)
            elif method == "pushpull":  # setup() binds one model: a fresh client (and servers) per size
                x = PushPull(servers.start(size) if servers else url, info, timeout, *common)
            else:
                raise ValueError(f"unknown method {method!r}")
            try:
                times, wrong = measure(x, n_iter, warmup)
                if method == "pushpull":
                    facts = x.ex.facts()
            finally:
                x.close()
            if servers:
                servers.stop(size)
            out.append({"size_bytes": size, "count": size // 4, "iters": n_iter, "warmup": warmup, "times_s": times,
                        "wrong": wrong})
    finally:
        if ex is not None:
            facts = ex.facts()
            ex.close()
        if servers:
            servers.close()
        if facts:
            out.append({"facts": facts})


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise commlab.PeerLost("the TCP peer closed the connection mid-message")
        got += k


def _duplex(sock: socket.socket, send: memoryview, recv: memoryview, timeout: float, rank: int) -> None:
    """Send all of ``send`` while receiving all of ``recv``, on one thread (no GIL hand-offs)."""
    sent = got = 0
    sock.setblocking(False)
    try:
        while sent < len(send) or got < len(recv):
            r, w, _ = select.select([sock] if got < len(recv) else [], [sock] if sent < len(send) else [], [], timeout)
            if not r and not w:
                raise commlab.CommTimeout(f"rank {rank}: duplex TCP peer silent for {timeout:g}s")
            if w:
                sent += sock.send(send[sent:])
            if r:
                k = sock.recv_into(recv[got:])
                if k == 0:
                    raise commlab.PeerLost(f"rank {rank}: the TCP peer closed the connection mid-message")
                got += k
    finally:
        sock.settimeout(timeout)


def run_tcp(out: Results, method: str, info, sizes: list[int], iters: list[int], warmup: int, timeout: float) -> None:
    """Raw TCP between ranks 0 and 1 (other ranks idle). Rank 0 times; each message is S bytes."""
    rank = info.rank
    store = rendezvous.connect_store(info, timeout)
    if rank > 1:
        return
    if rank == 1:
        lsock = socket.socket()
        lsock.bind((os.environ.get("BENCH_ADDR", "127.0.0.1"), 0))
        lsock.listen(1)
        lsock.settimeout(timeout)
        host, port = lsock.getsockname()
        store.set("tcp/addr", f"{host}:{port}")
        sock, _ = lsock.accept()
        lsock.close()
    else:
        store.wait(["tcp/addr"])
        host, port = store.get("tcp/addr").decode().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    try:
        for size, n_iter in zip(sizes, iters):
            send = bytearray(bytes(range(256)) * (size // 256 + 1))[:size]  # same on both ranks: checkable
            recv = bytearray(size)
            sview, rview = memoryview(send), memoryview(recv)
            times = []
            for i in range(warmup + n_iter):
                t0 = time.perf_counter()
                if method == "tcp-oneway":
                    if rank == 0:
                        sock.sendall(sview)
                        _recv_exact(sock, memoryview(ack))
                    else:
                        _recv_exact(sock, rview)
                        sock.sendall(b"k")
                else:  # duplex: both send S while receiving S
                    _duplex(sock, sview, rview, timeout, rank)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            wrong = 0 if method == "tcp-oneway" and rank == 0 else int(recv != send)
            out.append({"size_bytes": size, "count": size // 4, "iters": n_iter, "warmup": warmup, "times_s": times,
                        "wrong": wrong})
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bw_worker")
    p.add_argument("--exchanger", required=True)
    p.add_argument("--regime-url", help="the regime to measure, when the launcher is given noop:// so that it starts "
                                        "no servers (servers are then started per size, see ServersPerSize)")
    p.add_argument("--method", required=True, choices=("allreduce", "pushpull", "noop", "tcp-oneway", "tcp-duplex"))
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
    out = Results(a.out if info.rank == 0 else f"{a.out}.rank{info.rank}", info)
    try:
        if a.method.startswith("tcp"):
            if info.world_size < 2:
                raise commlab.ConfigError(f"{a.method} needs 2 ranks, got {info.world_size}")
            run_tcp(out, a.method, info, sizes, iters, a.warmup, a.timeout)
        else:
            run_sizes(out, a.method, a.regime_url or a.exchanger, info, sizes, iters, a.warmup, a.timeout, a.corrupt)
    except (commlab.CommError, commlab.ConfigError) as exc:
        print(f"commlab worker rank {info.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
