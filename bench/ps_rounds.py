"""``commlab bench ps-rounds``: commlab's ps:// beside a torch.distributed.rpc parameter server.

One server, N workers (default 2), a 4 MiB float32 vector; a round is "push the gradient, then
pull the parameters". Configurations, all on one host, in one run, each a job of the launcher
(:func:`bench.records.run_ranks`):

  ps-tcp         regime  commlab server (async) over tcp://127.0.0.1 (the server binds port 0)
  ps-ipc         regime  the same over ipc://
  ps-shm         regime  transport=shm: headers over ipc://, payloads through shared memory
  rpc-uv-basic   peer    torch.distributed.rpc, TensorPipe forced onto TCP (transport uv, channel basic)
  rpc-default    peer    torch.distributed.rpc, TensorPipe's own choice (shared memory / cross-memory copies)

The rpc peer: rank 0 of its job is the server, holding the vector; ``push(grad)`` applies
``p -= lr * grad`` under a lock, ``pull()`` returns a copy. Its rendezvous is torch's ``env://``
against the TCPStore the launcher hosts on port 0 (``TORCHELASTIC_USE_AGENT_STORE=True``: every
rank, the server included, is a client), so no port is picked and released. The ps:// worker uses
the client regime's benchmark hook ``PSExchanger.push_pull_async(tensor)`` after ``setup`` on a
one-parameter model.

Each configuration runs ``--repeats`` times, alternating with the others. Records (:mod:`bench.records`):
time = one round of one worker, ``rounds_per_s`` = the sum over workers of rounds / seconds (median over
repeats); each goal's ratio ("ps-tcp / rpc-uv-basic rounds/s") carries its 95% interval over the rounds.

    commlab bench ps-rounds [--rounds 200] [--only ps-shm rpc-default] [--json ps_rounds.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from bench import records as rec
from bench import verdict

CASE = "ps-rounds"


@dataclass(frozen=True)
class Config:
    kind: str  # "regime" | "peer"
    url: str = ""  # ps://: the workers' exchanger (the launcher starts its server)
    rpc: str = ""  # the rpc peer's TensorPipe choice: "uv-basic" | "default"


PS = "ps://?shards=1&mode=async&timeout=60"
CONFIGS = {
    "ps-tcp": Config("regime", PS + "&transport=tcp"),
    "ps-ipc": Config("regime", PS + "&transport=ipc"),
    "ps-shm": Config("regime", PS + "&transport=shm"),
    "rpc-uv-basic": Config("peer", rpc="uv-basic"),
    "rpc-default": Config("peer", rpc="default"),
}
# (a, b, goal): a's rounds/s >= goal x b's
GOALS = [("ps-tcp", "rpc-uv-basic", 1.5), ("ps-tcp", "rpc-default", 1.3), ("ps-ipc", "rpc-default", 2.0),
         ("ps-shm", "rpc-default", 2.0), ("ps-shm", "rpc-uv-basic", 3.0)]


# ----- the ranks ----------------------------------------------------------------------------------
def _timed_rounds(one_round, rounds: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + rounds):
        t0 = time.perf_counter()
        one_round()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def ps_rank(numel: int, rounds: int, warmup: int) -> None:
    """One ps:// worker ($COMMLAB_EXCHANGER): attach, wait until every worker is attached, time rounds."""
    import torch
    from torch import nn

    import commlab
    from commlab.core import metrics
    from commlab.transport import rendezvous

    torch.set_num_threads(1)
    info = rendezvous.from_env()
    model = nn.ParameterList([nn.Parameter(torch.zeros(numel))])
    with commlab.connect(rank=info) as ex:
        ex.setup(model, commlab.OptimizerSpec("sgd", lr=1e-6))
        deadline = time.monotonic() + 60
        while any(len(s["workers"]) < info.world_size for s in ex.server_stats()):
            if time.monotonic() > deadline:
                raise commlab.CommTimeout(f"rank {info.rank}: the other workers did not attach within 60s")
            time.sleep(0.01)
        grad = torch.full((numel,), 1e-3)
        times = _timed_rounds(lambda: ex.push_pull_async(grad).wait(60), rounds, warmup)
    metrics.report(0, rank=info.rank, round_s=times)


_STATE: dict = {}  # the rpc server's vector and lock; set only in its process


def _push(grad, lr: float) -> None:
    with _STATE["lock"]:
        _STATE["param"].add_(grad, alpha=-lr)


def _pull():
    with _STATE["lock"]:
        return _STATE["param"].clone()  # the reply is serialised after we return: hand it a stable copy


def rpc_rank(kind: str, numel: int, rounds: int, warmup: int, lr: float = 1e-6) -> None:
    """One rank of the rpc peer: rank 0 serves, the others time rounds. ``init_rpc``'s rendezvous is
    ``env://`` (MASTER_ADDR/MASTER_PORT): the launcher's store."""
    import torch
    import torch.distributed.rpc as rpc

    from commlab.core import metrics

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if kind == "uv-basic":
        opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=120, init_method="env://", _transports=["uv"],
                                               _channels=["basic"])
    else:
        opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=120, init_method="env://")
    if rank == 0:
        _STATE.update(param=torch.zeros(numel), lock=threading.Lock())
        rpc.init_rpc("ps", rank=0, world_size=world, rpc_backend_options=opts)
        rpc.shutdown()  # waits for every worker to finish
        return
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    grad = torch.full((numel,), 1e-3)

    def one_round():
        rpc.rpc_sync("ps", _push, args=(grad, lr))
        rpc.rpc_sync("ps", _pull)
    times = _timed_rounds(one_round, rounds, warmup)
    metrics.report(0, rank=rank, round_s=times)
    rpc.shutdown()


# ----- the case -----------------------------------------------------------------------------------
def run_config(name: str, a, numel: int) -> list[list[float]]:
    """One job of configuration ``name``: each worker's round times."""
    c = CONFIGS[name]
    args = ["--numel", str(numel), "--rounds", str(a.rounds), "--warmup", str(a.warmup)]
    if c.kind == "regime":
        ranks = rec.run_ranks(f"ps-rounds {name}", ("-m", "bench.ps_rounds", "--rank-of", "ps"), args,
                              workers=a.workers, deadline_s=a.timeout, exchanger=c.url)
    else:  # rank 0 is the rpc server
        ranks = rec.run_ranks(f"ps-rounds {name}", ("-m", "bench.ps_rounds", "--rank-of", f"rpc-{c.rpc}"), args,
                              workers=a.workers + 1, deadline_s=a.timeout)[1:]
    got = [next((r["round_s"] for r in rows if "round_s" in r), None) for rows in ranks]
    if any(g is None for g in got):
        raise rec.CaseFailed(f"ps-rounds {name}: a worker reported no rounds")
    return [g for g in got if g is not None]


def to_record(name: str, repeats: list[list[list[float]]], a, numel: int) -> dict:
    """``repeats[i][w]``: worker w's round times in repeat i."""
    c = CONFIGS[name]
    rates = [sum(len(t) / sum(t) for t in workers) for workers in repeats]
    return rec.record(CASE, name, kind=c.kind, method="pushpull", workers=a.workers, size_bytes=numel * 4,
                      times_s=[t for workers in repeats for w in workers for t in w], url=c.url, warmup=a.warmup,
                      rounds_per_s=statistics.median(rates), rounds_per_s_samples=rates,
                      note="torch.distributed.rpc, TensorPipe " + c.rpc if c.rpc else "")


def verdicts(records: list[dict]) -> list[tuple[str, verdict.Verdict, float]]:
    """The goals' ratios (a's rounds/s over b's = mean round time of b over a's), with their intervals."""
    by = {r["regime"]: r for r in records}
    return [(f"{x} / {y} rounds/s", verdict.compare(x, by[x]["samples_us"], y, by[y]["samples_us"], paired=False,
                                                     stat="mean"), goal)
            for x, y, goal in GOALS if x in by and y in by]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench ps-rounds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200, help="timed rounds per worker")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration, alternating")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--mib", type=float, default=4.0, help="vector size in MiB (float32)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="seconds one configuration's job may take")
    p.add_argument("--json", help="write the records, verdicts and failures here")
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), help="a subset of the configurations")
    p.add_argument("--rank-of", choices=("ps", "rpc-uv-basic", "rpc-default"), help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.rank_of == "ps":
        ps_rank(a.numel, a.rounds, a.warmup)
        return 0
    if a.rank_of:
        rpc_rank(a.rank_of.removeprefix("rpc-"), a.numel, a.rounds, a.warmup)
        return 0
    if a.rounds < 1 or a.repeats < 1 or a.warmup < 0 or a.workers < 1 or a.mib <= 0:
        p.error("--rounds, --repeats and --workers must be >= 1, --warmup >= 0, --mib > 0")
    numel = max(1, int(a.mib * 2**20) // 4)
    names = [n for n in CONFIGS if not a.only or n in a.only]
    samples, failures = rec.take_turns(
        CASE, names, a.repeats, lambda name: run_config(name, a, numel),
        lambda rep, name, times: print(f"  [{rep + 1}/{a.repeats}] {name:13} "
                                       f"{sum(len(t) / sum(t) for t in times):8.1f} rounds/s", file=sys.stderr,
                                       flush=True))
    records = [to_record(n, samples[n], a, numel) for n in names if samples[n] and n not in failures]
    return rec.conclude(CASE, f"parameter-server rounds: 1 server, {a.workers} workers, {a.mib:g} MiB float32, push "
                        f"then pull, {a.repeats} repeats x {a.rounds} rounds (after {a.warmup} warm-up)", records,
                        [("rounds/s", "rounds_per_s")], verdicts(records), failures, lambda n: CONFIGS[n].url, a.json,
                        {k: v for k, v in vars(a).items() if k not in ("rank_of", "numel")})


if __name__ == "__main__":  # python -m bench.ps_rounds: the same as commlab bench ps-rounds
    raise SystemExit(main())
