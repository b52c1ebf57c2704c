"""Who am I, how many are we, and where do we meet.

Rank and world size come from the launcher the user already has, in this
order: torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT``), Slurm (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``),
Open MPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``), then explicit
flags. Peers meet in torch.distributed's ``TCPStore`` hosted by rank 0 (or by
torchrun's agent), so any launcher torch supports works across machines.

The store also carries a heartbeat per rank and step; when a wait times out,
:func:`stall_report` reads it and names the ranks that never reached the step,
the way Horovod's stall inspector does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

from commlab.errors import CommTimeout, ConfigError


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # which launcher's convention supplied it

    def __post_init__(self):
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size} (from {self.source})")

    @classmethod
    def single(cls) -> "RankInfo":
        return cls(0, 1, 0, "127.0.0.1", 0, "single")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as ``node[01-04,07],gpu3``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ConfigError(f"cannot read Slurm nodelist {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_env(env: Mapping[str, str] | None = None, *, rank: int | None = None, world_size: int | None = None,
             master_addr: str | None = None, master_port: int | None = None) -> RankInfo:
    """Read the launcher's environment; flags fill in only what no launcher set."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or master_addr
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else master_port
    if "RANK" in env and "WORLD_SIZE" in env:
        src, r, w = "torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else r
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        src, r, w = "slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if addr is None and nodelist:
            addr = first_slurm_host(nodelist)
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        src, r, w = "openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
    elif rank is not None or world_size is not None:
        src, r, w, local = "flags", rank or 0, world_size or 1, rank or 0
    else:
        return RankInfo.single()
    if rank is not None and rank != r:
        raise ConfigError(f"--rank {rank} contradicts {src}'s rank {r}")
    if world_size is not None and world_size != w:
        raise ConfigError(f"--workers {world_size} does not match {src}'s world size {w}")
    if w > 1 and (addr is None or port is None):
        raise ConfigError(f"{src} gave rank {r} of {w} but no rendezvous address: set MASTER_ADDR and MASTER_PORT")
    return RankInfo(r, w, local, addr or "127.0.0.1", port or 0, src)


_STORES: dict[tuple[str, int], object] = {}  # (addr, port) -> this process's client of (or host for) the job's store


def connect_store(info: RankInfo, timeout: float, env: Mapping[str, str] | None = None):
    """The job's TCPStore (rank 0 hosts it unless torchrun's agent or commlab's launcher already does),
    under this exchanger's own namespace (:func:`instance`). One connection per process and job: every
    exchanger after the first reuses it, so rank 0 hosts the store once and keeps it for the job."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    where = (info.master_addr, info.master_port)
    store = _STORES.get(where)
    if store is None:
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:
            store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                                  is_master=info.rank == 0 and not agent, timeout=timedelta(seconds=timeout),
                                  wait_for_workers=False, use_libuv=True)
        except Exception as exc:  # torch raises DistNetworkError/RuntimeError with the socket detail
            raise CommTimeout(f"rank {info.rank} could not reach the rendezvous store at "
                              f"{info.master_addr}:{info.master_port} within {timeout:g}s: {exc}") from exc
        _STORES[where] = store
    return instance(dist.PrefixStore("commlab/", store), info.rank)


def default_group_store(rank: int):
    """The store of the default process group someone else made (DDP's, a user's ``init_process_group``),
    under commlab's prefix and this exchanger's namespace: the one store every rank surely reaches (rank 0
    may already host one on ``MASTER_PORT``, so a second could not bind it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return instance(dist.PrefixStore("commlab/", distributed_c10d._get_default_store()), rank)


def instance(store, rank: int):
    """The namespace of this rank's next exchanger in the job's store: ``1`` for the first, ``2`` for the
    second... Every rank meets its exchangers in the same order (meeting is collective), so the numbers
    agree. The store outlives each exchanger (the launcher's, torchrun's agent's, a default group's): without
    its own namespace, a later exchanger would read an earlier one's keys, gloo's listening addresses among
    them, whose listeners are closed, whenever the peer had not yet overwritten them (``Gloo
    connectFullMesh failed ... Connection refused``: a second exchanger in one process, as a resumed run
    makes, failed that way whenever one rank reached it first)."""
    import torch.distributed as dist

    return dist.PrefixStore(str(int(store.add(f"instances/{rank}", 1))), store)  # PrefixStore adds the "/"


def heartbeat(store, rank: int, step: int) -> None:
    """Record that ``rank`` has entered ``step``."""
    store.set(f"hb/{rank}", str(step))


def stall_report(store, world_size: int, step: int, skip: int | None = None) -> str:
    """``' (waiting for rank 2, last seen at step 14)'`` or ``''`` if every rank reached ``step``."""
    behind = []
    for r in range(world_size):
        if r == skip:
            continue
        try:
            seen = int(store.get(f"hb/{r}")) if store.check([f"hb/{r}"]) else -1
        except Exception:  # the store itself is gone: rank 0 died
            return f" (the rendezvous store hosted by rank 0 is unreachable: rank 0 is likely dead)"
        if seen < step:
            behind.append(f"rank {r} (last seen at step {seen})" if seen >= 0 else f"rank {r} (never seen)")
    return f" (waiting for {', '.join(behind)})" if behind else ""


def leave(store, info: RankInfo, timeout: float, name: str = "leave") -> None:
    """Orderly exit: every rank checks out, and nobody (above all rank 0, which hosts the
    store) tears down before all have, so no rank loses the store or a peer mid-shutdown.
    Best effort: a rank that already died must not turn a clean exit into a hang."""
    import time

    try:
        store.add(name, 1)
        deadline = time.monotonic() + timeout
        while int(store.add(name, 0)) < info.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # the store is gone: its host exited, nothing left to wait for
        pass
