"""All-reduce bandwidth of ring:// against gloo's all_reduce and raw TCP, in the nccl-tests format.

    python bench/ring_bandwidth.py                 # full sweep, N = 2, 3, 4 (a couple of minutes)
    python bench/ring_bandwidth.py --quick         # fewer sizes and iterations
    python bench/ring_bandwidth.py --json out.json --workers 2 --regimes gloo,ring-tcp --sizes 4K,256M

Columns (nccl-tests): size, time (median, with min-max over the timed iterations, measured on rank 0),
algbw = S/t, busbw = S/t x 2(N-1)/N (what each rank's link carries, comparable across N), wrong =
elements that differ from the exact expected sum after the last iteration (inputs are small integers,
so any float sum order gives the exact result), then the ratio to gloo's busbw, the share of the raw
TCP ceiling, and the CPU time of rank 0's whole process per operation (steadier than the wall time
on a shared machine). The all-reduces of one size take turns, iteration by iteration (gloo, then
ring-tcp, then ring-ipc, the starting one rotating), so their ratios are taken over the same seconds
of a noisy machine; the ceilings run right after, each on its own sockets. ``raw-tcp`` (N = 2 only) is the ceiling: two processes
each sending S bytes to the other over one loopback TCP connection at the same time (1 MiB sendall /
recv_into into a preallocated buffer); its busbw is S/t each way, what a two-rank ring would carry if
adding were free. ``zmq-tcp`` and ``zmq-ipc`` (N = 2 only) are the same exchange through the ring's own
transport: pyzmq PUSH/PULL, 4 MiB zero-copy frames, received zero-copy and not even read, with the
ring's heap setting. They are the ceiling a ring over that transport meets before it adds a byte.

Importable: :func:`measure` runs one (regime, size, N) and returns its record; :func:`sweep` runs many
cases in one set of processes per N (cheaper: torch is imported once per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from bench.text import parse_sizes

REGIMES = {
    "gloo": None,  # torch.distributed.all_reduce, gloo
    "ring-tcp": "ring://?transport=tcp",
    "ring-ipc": "ring://?transport=ipc",
    "ring-shm": "ring://?transport=shm",
    "ring-auto": "ring://?transport=auto",
    "ring-torch": "ring://?transport=torch",
    "raw-tcp": None,  # both directions at once over one socket, N = 2 only
    "zmq-tcp": None,  # both directions at once through pyzmq PUSH/PULL as the ring uses it, N = 2 only
    "zmq-ipc": None,
}
CEILINGS = ("raw-tcp", "zmq-tcp", "zmq-ipc")
SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "4M": 4 << 20, "16M": 16 << 20, "64M": 64 << 20,
         "256M": 256 << 20}
FULL_SIZES = ["4K", "64K", "1M", "4M", "16M", "64M", "256M"]
QUICK_SIZES = ["4K", "1M", "16M", "256M"]
TIMEOUT = 120.0


def iterations(size: int, quick: bool) -> tuple[int, int]:
    """(warm-up, timed) iterations for a size: enough for a median, few enough for a short sweep."""
    if size <= 64 << 10:
        return (20, 100) if quick else (50, 300)
    if size <= 4 << 20:
        return (5, 30) if quick else (10, 60)
    if size <= 64 << 20:
        return (2, 6) if quick else (2, 12)
    return (1, 4) if quick else (1, 6)


def record(regime: str, workers: int, size: int, times: list[float], wrong: int, cpu: list[float] | None = None) -> dict:
    t = statistics.median(times)
    algbw = size / t / 1e9
    factor = 1.0 if regime in CEILINGS else 2 * (workers - 1) / workers
    return {"regime": regime, "workers": workers, "size_bytes": size, "time_us": t * 1e6,
            "time_min_us": min(times) * 1e6, "time_max_us": max(times) * 1e6, "iterations": len(times),
            "algbw_gbps": algbw, "busbw_gbps": algbw * factor, "wrong": wrong,
            # CPU seconds of the whole rank-0 process (all its threads) per operation: on a shared
            # machine this is steadier than the wall time, and the cores are what a ring runs out of
            "cpu_us": statistics.median(cpu) * 1e6 if cpu else None}


# ----- what each rank runs --------------------------------------------------------------------------
def _interleaved(ops: dict, base: torch.Tensor, rank: int, world: int, warm: int, timed: int) -> dict:
    """Time every all-reduce in ``ops`` (name -> blocking op) on the same input, taking turns: iteration
    i runs each once, starting from a different one each time (every rank picks the same order, as a
    collective must). A slow spell of a shared machine then hits all of them alike, so their ratios are
    taken over the same seconds. Returns name -> (times, cpu seconds, wrong elements)."""
    names = list(ops)
    xs = {name: torch.empty_like(base) for name in names}
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for i in range(warm + timed):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            x = xs[name]
            torch.mul(base, rank + 1, out=x)  # refill (the op sums in place), not timed
            t0, c0 = time.perf_counter(), time.process_time()
            ops[name](x)
            if i >= warm:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    expected = base * (world * (world + 1) // 2)
    return {name: (times[name], cpu[name], int((xs[name] != expected).sum())) for name in names}


def _raw_tcp(store, rank: int, size: int, warm: int, timed: int) -> tuple[list[float], list[float]]:
    """Both ranks send ``size`` bytes to each other at once over one TCP connection; time per exchange."""
    piece = 1 << 20
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", 0))
        store.set(f"raw/port/{size}", str(srv.getsockname()[1]))
        sock, _ = srv.accept()
        srv.close()
    else:
        store.wait([f"raw/port/{size}"])
        sock = socket.create_connection(("127.0.0.1", int(store.get(f"raw/port/{size}"))))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, inb = bytearray(size), bytearray(size)
    outv, inv = memoryview(out), memoryview(inb)

    def send_all():
        for s in range(0, size, piece):
            sock.sendall(outv[s:s + piece])

    times, cpu = [], []
    for i in range(warm + timed):
        t0, c0 = time.perf_counter(), time.process_time()
        sender = threading.Thread(target=send_all)
        sender.start()
        got = 0
        while got < size:
            n = sock.recv_into(inv[got:got + piece])
            if n == 0:
                raise ConnectionError("raw-tcp peer closed")
            got += n
        sender.join()
        if i >= warm:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    sock.close()
    return times, cpu


def _zmq_both_ways(store, rank: int, size: int, warm: int, timed: int, transport: str
                   ) -> tuple[list[float], list[float]]:
    """Both ranks send ``size`` bytes to each other at once through pyzmq PUSH/PULL, in the ring's
    4 MiB zero-copy frames (tracked, like the ring's), with the ring's default I/O threads (one per
    direction), send buffer and heap setting; time per exchange."""
    import tempfile
    import zmq

    from commlab.heap import keep_freed_memory
    from commlab.regimes.ring import RingOptions
    from commlab.transport import Transport

    keep_freed_memory()
    piece = 4 << 20
    io_threads = RingOptions.io_threads
    net = Transport(io_threads=io_threads, sndbuf=RingOptions.sndbuf_kb * 1024 or None)
    folder = tempfile.mkdtemp(prefix="commlab-bench-") if transport == "ipc" else None
    try:
        pull = net.bind(zmq.PULL, f"ipc://{folder}/r{rank}" if folder else "tcp://127.0.0.1:0", io_thread=0)
        key = f"zmq/{transport}/{size}/"
        store.set(f"{key}{rank}", pull.last_endpoint.decode())
        store.wait([f"{key}{1 - rank}"])
        push = net.connect(zmq.PUSH, store.get(f"{key}{1 - rank}").decode(), io_thread=io_threads - 1)
        out = memoryview(bytearray(size))
        push.send(b"hello")
        pull.recv()
        times, cpu = [], []
        for i in range(warm + timed):
            push.send(b"go")  # start together
            pull.recv()
            t0, c0 = time.perf_counter(), time.process_time()
            trackers = [push.send(out[s:s + piece], copy=False, track=True) for s in range(0, size, piece)]
            for _ in range(0, size, piece):
                pull.recv(copy=False)
            for t in trackers:
                t.wait(TIMEOUT)
            if i >= warm:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        return times, cpu
    finally:
        net.close()
        if folder:
            import shutil
            shutil.rmtree(folder, ignore_errors=True)


def _rank(rank: int, world: int, port: int, cases: list[tuple[str, int]], quick: bool, results,
          timed_override: int | None = None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        import commlab
        from commlab.rendezvous import connect_store, from_env

        store = connect_store(from_env(), TIMEOUT)
        regimes = list(dict.fromkeys(r for r, _ in cases))
        if "gloo" in regimes or "ring-torch" in regimes:
            from datetime import timedelta
            dist.init_process_group("gloo", store=dist.PrefixStore("bench/pg/", store), rank=rank, world_size=world,
                                    timeout=timedelta(seconds=TIMEOUT))
        ops, exchangers = {}, []
        for regime in regimes:
            if regime == "gloo":
                ops[regime] = lambda x: dist.all_reduce(x)  # noqa: E731
            elif regime not in CEILINGS:
                url = REGIMES.get(regime) or regime  # a name above, or any ring:// URL
                ex = commlab.connect(url + ("&" if "?" in url else "?") + f"timeout={TIMEOUT:g}")
                ex.join(store)
                exchangers.append(ex)
                ops[regime] = ex.allreduce  # blocking, like dist.all_reduce
        for size in dict.fromkeys(s for _, s in cases):
            here = [r for r, s in cases if s == size]
            warm, timed = iterations(size, quick)
            timed = timed_override or timed
            algos = {r: ops[r] for r in here if r in ops}
            if algos:  # all-reduces of one size take turns (see _interleaved)
                base = (torch.arange(size // 4, dtype=torch.float32) % 5) + 1
                for regime, (times, cpu, wrong) in _interleaved(algos, base, rank, world, warm, timed).items():
                    results.put((rank, "ok", record(regime, world, size, times, wrong, cpu)))
                del base
            for regime in here:  # the ceilings, right after, each on its own sockets
                if regime == "raw-tcp":
                    times, cpu = _raw_tcp(store, rank, size, warm, timed)
                elif regime in ("zmq-tcp", "zmq-ipc"):
                    times, cpu = _zmq_both_ways(store, rank, size, warm, timed, regime[4:])
                else:
                    continue
                results.put((rank, "ok", record(regime, world, size, times, 0, cpu)))
        for ex in exchangers:
            ex.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        results.put((rank, "done", None))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_cases(cases: list[tuple[str, int]], workers: int, quick: bool = False, timeout: float = 600.0,
              on_record=None, timed: int | None = None) -> list[dict]:
    """Run ``cases`` [(regime, size_bytes), ...] in one set of ``workers`` processes; rank 0's records."""
    from commlab.launcher import free_port

    if any(r in CEILINGS for r, _ in cases) and workers != 2:
        raise ValueError("raw-tcp, zmq-tcp and zmq-ipc measure two processes: use workers=2")
    unknown = sorted({r for r, _ in cases if not r.startswith("ring://")} - set(REGIMES))
    if unknown:
        raise ValueError(f"unknown regime(s) {unknown}; known: {sorted(REGIMES)}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, workers, port, cases, quick, results, timed), daemon=True)
             for r in range(workers)]
    for p in procs:
        p.start()
    out, done = [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(done) < workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark ranks {sorted(set(range(workers)) - done)} did not finish in {timeout:g}s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"benchmark rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"benchmark rank {rank} failed:\n{value}")
            if status == "done":
                done.add(rank)
            elif rank == 0:
                out.append(value)
                if on_record:
                    on_record(value)
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def measure(regime: str, size_bytes: int, workers: int, quick: bool = False) -> dict:
    """One (regime, size, N): spawn the ranks, time the all-reduce, return the record."""
    return run_cases([(regime, size_bytes)], workers, quick)[0]


def sweep(regimes: list[str], sizes: list[int], workers: list[int], quick: bool = False, on_record=None,
          timed: int | None = None) -> list[dict]:
    out = []
    for n in workers:
        cases = [(r, s) for r in regimes for s in sizes if not (r in CEILINGS and (n != 2 or s < 1 << 20))]
        out += run_cases(cases, n, quick, on_record=on_record, timed=timed)
    return out


# ----- reporting -------------------------------------------------------------------------------------
def human(size: int) -> str:
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << k and size % (1 << k) == 0:
            return f"{size >> k}{unit}"
    return str(size)


def table(records: list[dict]) -> str:
    gloo = {(r["workers"], r["size_bytes"]): r for r in records if r["regime"] == "gloo"}
    raw = {r["size_bytes"]: r for r in records if r["regime"] == "raw-tcp"}
    zmq_ceiling = {(r["regime"][4:], r["size_bytes"]): r for r in records if r["regime"] in ("zmq-tcp", "zmq-ipc")}
    width = max([11] + [len(r["regime"]) + 1 for r in records])
    lines = [f"{'N':>2} {'regime':<{width}}{'size':>6} {'time us (min-max)':>26} {'algbw':>7} {'busbw':>7} {'wrong':>6}"
             f" {'x gloo':>7} {'of raw':>7} {'of zmq':>7} {'cpu us':>9}"]
    for r in sorted(records, key=lambda r: (r["workers"], r["regime"], r["size_bytes"])):
        g = gloo.get((r["workers"], r["size_bytes"]))
        vs = f"{r['busbw_gbps'] / g['busbw_gbps']:7.2f}" if g and r["regime"] != "gloo" else " " * 7
        rw = raw.get(r["size_bytes"]) if r["workers"] == 2 and r["regime"] not in CEILINGS else None
        of = f"{r['busbw_gbps'] / rw['busbw_gbps']:6.0%}" if rw else ""
        transport = "ipc" if "ipc" in r["regime"] else "tcp"
        zc = zmq_ceiling.get((transport, r["size_bytes"])) if r["workers"] == 2 and r["regime"].startswith("ring") \
            and "shm" not in r["regime"] and "auto" not in r["regime"] else None  # zmq's ceiling is no shm's
        ofz = f"{r['busbw_gbps'] / zc['busbw_gbps']:6.0%}" if zc else ""
        span = f"{r['time_us']:.0f} ({r['time_min_us']:.0f}-{r['time_max_us']:.0f})"
        lines.append(f"{r['workers']:>2} {r['regime']:<{width}}{human(r['size_bytes']):>6} {span:>26} "
                     f"{r['algbw_gbps']:7.3f} {r['busbw_gbps']:7.3f} {r['wrong']:>6} {vs} {of:>7} {ofz:>7} "
                     f"{r['cpu_us'] or 0:9.0f}")
    return "\n".join(lines)


def header_cost(n: int = 20000) -> dict:
    """Microseconds to build and check one header: msgpack (encode + decode) vs the fixed chunk header."""
    from commlab import wire
    data = torch.zeros(1024)
    parts = wire.split("grad", data)
    t0 = time.perf_counter()
    for i in range(n):
        frames = wire.encode("chunk", "rank0", i, parts)
        wire.decode(frames, ops=("chunk",))
    t1 = time.perf_counter()
    for i in range(n):
        expected = wire.chunk_header(0, i, 1, 0, 0, 1024, torch.float32)
        wire.check_chunk_header(wire.chunk_header(0, i, 1, 0, 0, 1024, torch.float32), expected, "rank 0")
    t2 = time.perf_counter()
    return {"msgpack_us": (t1 - t0) / n * 1e6, "chunk_header_us": (t2 - t1) / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"sizes {','.join(QUICK_SIZES)}, fewer iterations")
    p.add_argument("--workers", default="2,3,4", help="comma-separated world sizes")
    p.add_argument("--regimes", default="gloo,ring-tcp,ring-ipc,ring-shm,raw-tcp,zmq-tcp,zmq-ipc",
                   help=f"from {','.join(REGIMES)}, or ring:// URLs (e.g. 'ring://?transport=tcp&chunk_mb=2')")
    p.add_argument("--sizes", help=f"comma-separated, e.g. {','.join(SIZES)} (or bytes)")
    p.add_argument("--json", help="write the records here (a JSON list)")
    p.add_argument("--timed", type=int, help="timed iterations per case (default: by size, fewer with --quick)")
    p.add_argument("--header-cost", action="store_true", help="only measure the per-message header cost")
    a = p.parse_args(argv)
    if a.header_cost:
        print(json.dumps(header_cost()))
        return 0
    names = a.sizes.split(",") if a.sizes else (QUICK_SIZES if a.quick else FULL_SIZES)
    sizes = parse_sizes(",".join(names))
    regimes = a.regimes.split(",")
    records = sweep(regimes, sizes, [int(n) for n in a.workers.split(",")], a.quick,
                    on_record=lambda r: print(f"  N={r['workers']} {r['regime']:<10} {human(r['size_bytes']):>5}: "
                                              f"{r['time_us']:.0f} us, busbw {r['busbw_gbps']:.2f} GB/s",
                                              file=sys.stderr, flush=True), timed=a.timed)
    print(table(records))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
