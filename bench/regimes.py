"""The regimes the benchmarks compare: one line each (docs/bench.md, "Regimes: one line each").

A bandwidth entry names the regime's URL and how one exchange of a flat tensor is driven (``method``):
``allreduce`` (``ex.meet()``, then ``ex.allreduce_async(t).wait()``: each rank ends with the sum),
``pushpull`` (``ex.setup(one flat parameter)``, then ``ex.push_pull_async(g).wait()``: each worker
pushes its tensor and pulls the updated parameter) or ``noop`` (nothing moves: the harness's floor).
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.base.config import ExchangerURL
from commlab.core.registry import resolve
from commlab.transport.sockets import is_loopback


@dataclass(frozen=True)
class BandwidthEntry:
    url: str
    method: str  # "allreduce" | "pushpull" | "noop"
    note: str = ""
    one_size_per_job: bool = False  # setup() binds a model of one size: fresh servers (and clients) per size
    # the regime picks 127.0.0.1 addresses itself: cannot cross --link namespaces. (Servers a regime
    # starts through plan_local are moved into namespaces by bench.jobs.place_servers, so ps:// can.)
    loopback_only: bool = False
    needs_cuda: bool = False


@dataclass(frozen=True)
class ConvergenceEntry:
    url: str
    # "reference" (one worker, combined batch) | "sync" | "compressed" (synchronous, not local's arithmetic)
    # | "async" | "floor"
    kind: str
    note: str = ""
    loopback_only: bool = False
    # async/ssp apply one update per worker push, N per step where sync applies one of the mean: with
    # lr_over_n the learning rate is lr / N, so the updates of one step add up to sync's step length
    lr_over_n: bool = False
    # a peer that is no commlab regime (DDP): ``python -m MODULE`` under the launcher, taking the built-in
    # worker's flags and writing its lines; ``url`` is then only what the launcher is told (no servers)
    module: str = ""


BANDWIDTH: dict[str, BandwidthEntry] = {
    "noop": BandwidthEntry("noop://", "noop", "moves nothing: the harness floor"),
    "gloo": BandwidthEntry("allreduce://?backend=gloo", "allreduce", "torch.distributed gloo all_reduce"),
    "nccl": BandwidthEntry("allreduce://?backend=nccl", "allreduce", "torch.distributed NCCL all_reduce", needs_cuda=True),
    "ring": BandwidthEntry("ring://", "allreduce", "the ring as users get it: auto, shared memory on one host",
                           loopback_only=True),
    "ring-tcp": BandwidthEntry("ring://?transport=tcp", "allreduce", "pyzmq ring all-reduce over tcp", loopback_only=True),
    "ring-ipc": BandwidthEntry("ring://?transport=ipc", "allreduce", "pyzmq ring all-reduce over ipc", loopback_only=True),
    "ring-shm": BandwidthEntry("ring://?transport=shm", "allreduce", "ring all-reduce through shared memory (one host)",
                               loopback_only=True),
    # across --link namespaces: each rank binds the address it reaches rank 0 from; insecure=1 is said in so
    # many words (the bench's own namespaces; a real cluster passes keys=DIR instead)
    "ring-hosts": BandwidthEntry("ring://?transport=tcp&host=auto&insecure=1", "allreduce",
                                 "pyzmq ring all-reduce over tcp between hosts (no keys: bench namespaces only)"),
    "ring-torch": BandwidthEntry("ring://?transport=torch", "allreduce", "ring all-reduce over torch isend/irecv"),
    "ps-1": BandwidthEntry("ps://?shards=1&mode=sync&update=server", "pushpull", "parameter server, 1 shard, sync",
                           one_size_per_job=True),
    "ps-2": BandwidthEntry("ps://?shards=2&mode=sync&update=server", "pushpull", "parameter server, 2 shards, sync",
                           one_size_per_job=True),
}

# Ceilings measured in the same run, beside the regimes.
CEILINGS = {
    "tcp-oneway": "raw TCP, two processes, sendall -> recv_into a preallocated buffer, 1-byte ack",
    "tcp-duplex": "raw TCP, two processes, both directions at once (what a ring meets)",
    "zmq-tcp": "pyzmq PUSH/PULL over tcp, both directions at once, the ring's 4 MiB zero-copy frames, not read",
    "zmq-ipc": "the same over ipc (Unix sockets)",
    "memcpy": "numpy copy in one process (S bytes read + S written)",
}

CONVERGENCE: dict[str, ConvergenceEntry] = {
    "local": ConvergenceEntry("local://", "reference", "one worker, the combined batch"),
    "gloo": ConvergenceEntry("allreduce://?backend=gloo", "sync"),
    "ring": ConvergenceEntry("ring://", "sync", "auto: shared memory on one host", loopback_only=True),
    "ring-tcp": ConvergenceEntry("ring://?transport=tcp", "sync", loopback_only=True),
    "ddp": ConvergenceEntry("noop://", "sync", "torch DistributedDataParallel over gloo (bench.ddp_worker)",
                            loopback_only=True, module="bench.ddp_worker"),
    "ps-sync": ConvergenceEntry("ps://?shards=1&mode=sync", "sync"),
    "ps-sync-2": ConvergenceEntry("ps://?shards=2&mode=sync", "sync", "sharded PS"),
    # replication's cost when nothing fails (docs/ps.md, "Replicated shards"), beside the same unreplicated: for
    # `commlab bench --conv-regimes`; the step time: `commlab bench train-step --peers '' --regimes URL URL`
    "ps-server-2": ConvergenceEntry("ps://?shards=2&mode=sync&update=server", "sync", "sharded PS, the optimizer on "
                                    "the shards"),
    "ps-server-2-r2": ConvergenceEntry("ps://?shards=2&mode=sync&update=server&replicas=2", "sync",
                                       "the same, each shard on a primary and a backup"),
    "ps-async": ConvergenceEntry("ps://?shards=1&mode=async", "async", "the same per-update lr as sync"),
    "ps-async-lr/N": ConvergenceEntry("ps://?shards=1&mode=async", "async", "lr / N per update", lr_over_n=True),
    "ps-ssp-1": ConvergenceEntry("ps://?shards=1&mode=ssp&staleness=1", "async", "SSP, bound 1"),
    "ps-ssp-1-lr/N": ConvergenceEntry("ps://?shards=1&mode=ssp&staleness=1", "async", "SSP, bound 1, lr / N",
                                      lr_over_n=True),
    "ps-ssp-2": ConvergenceEntry("ps://?shards=1&mode=ssp&staleness=2", "async", "SSP, bound 2"),
    "ps-ssp-4": ConvergenceEntry("ps://?shards=1&mode=ssp&staleness=4", "async", "SSP, bound 4"),
    # the default run's one row of compression (issue 26); `commlab bench compress` is the whole comparison
    "ring-powersgd": ConvergenceEntry("ring://?compress=powersgd:4,start_iter=10", "compressed",
                                      "PowerSGD rank 4 after 10 uncompressed steps", loopback_only=True),
    "noop": ConvergenceEntry("noop://", "floor", "workers never talk: the step-time floor"),
}

DEFAULT_BANDWIDTH = ["noop", "gloo", "nccl", "ring", "ring-tcp", "ps-1", "ps-2"]
# in order of importance (a run given a shorter --budget-s skips the last); the default budget runs them all
DEFAULT_CONVERGENCE = ["local", "ddp", "gloo", "ring", "ring-tcp", "ps-sync", "ps-async", "ps-async-lr/N", "ps-ssp-1",
                       "ps-ssp-1-lr/N", "ring-powersgd", "noop"]
# step time and exposed communication against N (N = --workers comes from the convergence runs when they ran)
DEFAULT_SCALING = ["gloo", "ring-tcp"]


def with_query(url: str, extra: str) -> str:
    """``url`` with ``extra`` (``key=value[&...]``) appended to its query; ``url`` itself if ``extra`` is empty."""
    return url + ("&" if "?" in url else "?") + extra if extra else url


def url_of(name: str) -> str:
    """A convergence regime's URL by its name (``gloo`` -> ``allreduce://?backend=gloo``); a URL as given."""
    return CONVERGENCE[name].url if name in CONVERGENCE else name


def unavailable(url: str) -> str | None:
    """Why the regime ``url`` names cannot run in this checkout, or None if it can be tried."""
    try:
        resolve(url)
    except (ImportError, ValueError) as exc:  # ConfigError is a ValueError
        return f"{type(exc).__name__}: {exc}"
    return None


def bandwidth_entry(name: str) -> BandwidthEntry:
    """The table's entry for ``name``, or for a regime URL given as is (``ring://?transport=shm&chunk_mb=1``):
    ``ps://`` is driven by push-pull with fresh servers per size, ``noop://`` by nothing, the rest by
    all-reduce; a ring that binds loopback (no ``host=``, or a loopback one) cannot cross ``--link``."""
    if name in BANDWIDTH:
        return BANDWIDTH[name]
    if "://" not in name:
        raise ValueError(f"unknown bandwidth regime {name!r}; known: {', '.join(BANDWIDTH)}, or a regime URL")
    url = ExchangerURL.parse(name)
    query = dict(url.query)
    method = {"ps": "pushpull", "noop": "noop"}.get(url.scheme, "allreduce")
    host = query.get("host", "127.0.0.1")
    loopback = url.scheme == "ring" and query.get("transport") != "torch" and \
        is_loopback(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")
    return BandwidthEntry(name, method, "given as a URL", one_size_per_job=url.scheme == "ps", loopback_only=loopback,
                          needs_cuda=query.get("backend") == "nccl")


def pick(table: dict, names: list[str], what: str) -> list[str]:
    """``names`` checked against ``table``; bandwidth regimes may also be URLs (:func:`bandwidth_entry`)."""
    unknown = [n for n in names if n not in table and not (table is BANDWIDTH and "://" in n)]
    if unknown:
        raise ValueError(f"unknown {what} regime(s) {unknown}; known: {', '.join(table)}"
                         + (", or a regime URL" if table is BANDWIDTH else ""))
    if table is BANDWIDTH:
        for n in names:
            bandwidth_entry(n)  # a URL that does not parse fails here, before any process starts
    return names
