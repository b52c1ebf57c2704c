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

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun sets it in every worker: the job's restarts so far


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # which launcher's convention supplied it
    attempt: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: 0 first, N after the N-th restart of the job

    def __post_init__(self):
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size} (from {self.source})")
        if self.attempt < 0:
            raise ConfigError(f"TORCHELASTIC_RESTART_COUNT must be >= 0, got {self.attempt}")

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
    attempt = _int(env, RESTART_COUNT) if env.get(RESTART_COUNT) else 0
    return RankInfo(r, w, local, addr or "127.0.0.1", port or 0, src, attempt)


def store_prefix(env: Mapping[str, str] | None = None) -> str:
    """commlab's keys in the job's store: ``commlab/``, and ``commlab/attemptN/`` after the N-th restart,
    so that a store that outlives an attempt (a launcher that keeps it) never hands one attempt's keys
    to the next."""
    env = os.environ if env is None else env
    attempt = env.get(RESTART_COUNT, "0")
    return "commlab/" if attempt in ("", "0") else f"commlab/attempt{attempt}/"


def connect_store(info: RankInfo, timeout: float, env: Mapping[str, str] | None = None):
    """The job's TCPStore (rank 0 hosts it unless torchrun's agent already does)."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                              is_master=info.rank == 0 and not agent, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False, use_libuv=True)
    except Exception as exc:  # torch raises DistNetworkError/RuntimeError with the socket detail
        raise CommTimeout(f"rank {info.rank} could not reach the rendezvous store at "
                          f"{info.master_addr}:{info.master_port} within {timeout:g}s: {exc}") from exc
    return dist.PrefixStore(store_prefix(env), store)


def default_group_store():
    """The store of the default process group someone else made (DDP's, a user's ``init_process_group``),
    under commlab's prefix: the one store every rank surely reaches (rank 0 may already host one on
    ``MASTER_PORT``, so a second could not bind it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return dist.PrefixStore(store_prefix(), distributed_c10d._get_default_store())


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
