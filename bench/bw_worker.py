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
import json
import os
import select
import socket
import sys
import time

import torch
from torch import nn

import commlab
from commlab import rendezvous
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


class FlatParam(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(count))


def measure(op, check, iters: int, warmup: int) -> tuple[list[float], int]:
    """Run ``op()`` warmup + iters times; time each; ``check()`` after each timed one returns wrong elements."""
    for _ in range(warmup):
        prep = op(prepare=True)
        prep()
        check(timed=False)
    times, wrong = [], 0
    for _ in range(iters):
        go = op(prepare=True)
        t0 = time.perf_counter()
        go()
        times.append(time.perf_counter() - t0)
        wrong += check(timed=True)
    return times, wrong


def run_sizes(method: str, url: str, info, sizes: list[int], iters: list[int], warmup: int, timeout: float,
              corrupt_ref: bool) -> list[dict]:
    rank, world = info.rank, info.world_size
    out = []
    ex = None
    if method == "allreduce":
        ex = commlab.connect(url, info)
        if not hasattr(ex, "join") or not hasattr(ex, "allreduce_async"):
            raise commlab.ConfigError(f"{url}: the regime has no join()/allreduce_async(), needed for method allreduce")
        ex.join()
    try:
        for size, n_iter in zip(sizes, iters):
            count = size // 4
            buf = torch.empty(count, dtype=torch.float32)
            src = torch.empty(count, dtype=torch.float32)
            fill_input(src, rank)
            if method == "allreduce":
                ref = allreduce_reference(count, world)

                def op(prepare, buf=buf, src=src):
                    buf.copy_(src)
                    return lambda: ex.allreduce_async(buf).wait(timeout)
                result = lambda: buf
            elif method == "noop":
                ref = src.clone()

                def op(prepare, buf=buf, src=src):
                    buf.copy_(src)
                    return lambda: DoneHandle().wait(timeout)
                result = lambda: buf
            elif method == "pushpull":
                ex = commlab.connect(url, info)
                model = FlatParam(count)
                ex.setup(model, OptimizerSpec("sgd", lr=1.0))
                mean = mean_input(count, world)
                state = {"prev": torch.zeros(count), "pulled": None}

                def op(prepare, buf=buf, src=src):
                    buf.copy_(src)

                    def go():
                        got = ex.push_pull_async(buf).wait(timeout)
                        # the seam: the client may return the pulled tensor, or leave it in the parameter
                        state["pulled"] = got if isinstance(got, torch.Tensor) else model.weight.detach()
                    return go
                result = lambda: state["pulled"]
                ref = None
            else:
                raise ValueError(f"unknown method {method!r}")

            def check(timed, result=result):
                if method == "pushpull":
                    expected = state["prev"] - mean
                    state["prev"] = state["pulled"].detach().clone().cpu()
                else:
                    expected = ref
                if not timed:
                    return 0
                return count_wrong(result(), corrupt(expected) if corrupt_ref else expected)

            times, wrong = measure(op, check, n_iter, warmup)
            out.append({"size_bytes": size, "count": count, "iters": n_iter, "warmup": warmup, "times_s": times,
                        "wrong": wrong})
            if method == "pushpull":
                ex.close()
                ex = None
    finally:
        if ex is not None:
            facts = ex.facts()
            ex.close()
            out.append({"facts": facts})
    return out


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


def run_tcp(method: str, info, sizes: list[int], iters: list[int], warmup: int, timeout: float) -> list[dict]:
    """Raw TCP between ranks 0 and 1 (other ranks idle). Rank 0 times; each message is S bytes."""
    rank = info.rank
    store = rendezvous.connect_store(info, timeout)
    if rank > 1:
        return []
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
    out = []
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
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bw_worker")
    p.add_argument("--exchanger", required=True)
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
    try:
        if a.method.startswith("tcp"):
            if info.world_size < 2:
                raise commlab.ConfigError(f"{a.method} needs 2 ranks, got {info.world_size}")
            rows = run_tcp(a.method, info, sizes, iters, a.warmup, a.timeout)
        else:
            rows = run_sizes(a.method, a.exchanger, info, sizes, iters, a.warmup, a.timeout, a.corrupt)
    except (commlab.CommError, commlab.ConfigError) as exc:
        print(f"commlab worker rank {info.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    path = a.out if info.rank == 0 else f"{a.out}.rank{info.rank}"
    with open(path, "w") as fh:
        json.dump({"rank": info.rank, "world_size": info.world_size, "rows": rows}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
