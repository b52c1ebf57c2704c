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

import json
import os
import re
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Mapping

from commlab.base.errors import CommTimeout, ConfigError

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun sets it in every worker: the job's restarts so far
# Keep-going (docs/faults.md): a launcher that replaces a dead rank alone (commlab run --replace, --spares) sets
# KEEP_GOING in every rank, so that the regimes keep going when a peer dies (ps://: min_workers defaults to 1);
# a rank started in a dead one's place gets REPLACEMENT = when the launcher noticed the death (time.time()).
KEEP_GOING = "COMMLAB_KEEP_GOING"
REPLACEMENT = "COMMLAB_REPLACEMENT"


def keep_going(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank's launcher replaces dead ranks alone (the survivors must keep going)."""
    return (os.environ if env is None else env).get(KEEP_GOING, "") == "1"


ENTERED = re.compile(r"entered at step (\d+)(?:, ([\d.]+) s after)?")  # announce_entry's line, as launchers read it


def announce_entry(who: str, step: int, env: Mapping[str, str] | None = None) -> dict:
    """A replacement entered its job at ``step`` (every regime that heals one calls this once): one line on
    stdout, ``WHO: a replacement, entered at step E, X s after its predecessor's death was noticed``, which
    the launcher reads back for its report (:data:`ENTERED`); returns ``{step, seconds}`` for the regime's
    facts (``seconds`` only where ``$COMMLAB_REPLACEMENT`` says when the death was noticed)."""
    healed: dict = {"step": step}
    since = replacement_since(env)
    if since is not None:
        healed["seconds"] = round(time.time() - since, 3)
    print(f"{who}: a replacement, entered at step {step}" + (
        f", {healed['seconds']:.2f} s after its predecessor's death was noticed" if "seconds" in healed else ""),
          flush=True)
    return healed


def replacement_since(env: Mapping[str, str] | None = None) -> float | None:
    """When this process's predecessor's death was noticed (wall clock), if this process replaces a dead
    rank; None for an ordinary start."""
    value = (os.environ if env is None else env).get(REPLACEMENT, "")
    try:
        return float(value) if value else None
    except ValueError:
        raise ConfigError(f"${REPLACEMENT} must be a time in seconds, got {value!r}") from None


@dataclass(frozen=True)
class RankInfo:
    """This process's place: in the whole job, or (``members`` set) in a group of the job's ranks.

    In a group, ``rank`` and ``world_size`` are the position in the group and its size (what an
    exchanger over the group computes with), ``members`` the job's global ranks in position order
    and ``job_size`` the job's world size. :meth:`who` names a position by its global rank, as every
    failure message must; :attr:`job` is the whole job's view (whose rank 0 hosts the store)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # which launcher's convention supplied it
    members: tuple[int, ...] = ()  # a group's global ranks, position order; (): the whole job
    job_size: int = 0  # with members: the job's world size
    attempt: int = 0  # TORCHELASTIC_RESTART_COUNT: 0 first, N after the N-th restart (an exchanger: job_attempt)

    def __post_init__(self):
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size} (from {self.source})")
        if self.attempt < 0:
            raise ConfigError(f"TORCHELASTIC_RESTART_COUNT must be >= 0, got {self.attempt}")
        if self.members and len(self.members) != self.world_size:
            raise ConfigError(f"a group of {len(self.members)} ranks {list(self.members)} with world size "
                              f"{self.world_size}")

    @classmethod
    def single(cls) -> "RankInfo":
        return cls(0, 1, 0, "127.0.0.1", 0, "single")

    def global_rank(self, position: int | None = None) -> int:
        """The job's rank of ``position`` in this group (default: this process's)."""
        position = self.rank if position is None else position
        return self.members[position] if self.members else position

    def who(self, position: int | None = None) -> str:
        """``'rank 5'``: ``position`` (default: this process) named by its global rank."""
        return f"rank {self.global_rank(position)}"

    @property
    def job(self) -> "RankInfo":
        """The whole job's view of this process (itself when it is not a group's)."""
        if not self.members:
            return self
        return replace(self, rank=self.global_rank(), world_size=self.job_size, members=(), job_size=0)

    @property
    def namespace(self) -> str:
        """The group's prefix for rendezvous keys (``'g0-2/'``), ``''`` for the whole job."""
        return f"{group_key(self.members)}/" if self.members else ""

    def within(self, members) -> "RankInfo":
        """This process's view of the group of the job's global ranks ``members`` (position order).
        ConfigError, in one line naming the ranks, for a rank outside the job, a repeated rank, or a
        group this process is not in."""
        job = self.job
        members = tuple(members)
        if not members or not all(isinstance(r, int) and not isinstance(r, bool) for r in members):
            raise ConfigError(f"group= takes a non-empty list of the job's global ranks (ints), got {list(members)}")
        outside = [r for r in members if not 0 <= r < job.world_size]
        if outside:
            raise ConfigError(f"group {list(members)} names rank(s) {outside}, outside the job of "
                              f"{job.world_size} ranks (0..{job.world_size - 1})")
        if len(set(members)) != len(members):
            raise ConfigError(f"group {list(members)} names a rank twice")
        if job.rank not in members:
            raise ConfigError(f"rank {job.rank} is not in its own group {list(members)}")
        return replace(job, rank=members.index(job.rank), world_size=len(members), members=members,
                       job_size=job.world_size)


def group_key(members) -> str:
    """A group's name on the store and on servers: ``'g0-2'`` for ranks {0, 2} (sorted: the same set is
    the same group whatever its order; position order is checked separately); a long list is hashed, to
    stay a valid ps:// key space (at most 64 characters)."""
    name = "g" + "-".join(str(r) for r in sorted(members))
    if len(name) <= 48:
        return name
    import hashlib
    return f"g{len(members)}x{hashlib.sha1(name.encode()).hexdigest()[:16]}"



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
    return RankInfo(r, w, local, addr or "127.0.0.1", port or 0, src, attempt=attempt)


def store_prefix(attempt: int) -> str:
    """commlab's keys in the job's store: ``commlab/``, and ``commlab/attemptN/`` for attempt N > 0 (see
    :func:`job_attempt`), so that a store that outlives an attempt (torchrun's agent's) never hands one
    attempt's keys to the next."""
    return "commlab/" if attempt == 0 else f"commlab/attempt{attempt}/"


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun: its agent hosts the store
RUN_ID = "TORCHELASTIC_RUN_ID"  # set by torchrun (not by commlab run, whose restart count is exact)

_STORES: dict[tuple[str, int], Any] = {}  # (addr, port) -> this process's client of (or host for) the job's store
_ROUND_KEY = "commlab/round"  # agree_round's keys, beside every attempt's prefix
_ROUNDS: dict[tuple[str, int], int] = {}  # (addr, port) -> the attempt agreed through that store (one per process)


def job_attempt(info: RankInfo, timeout: float, env: Mapping[str, str] | None = None) -> int:
    """The job's attempt id, the same on every rank of this attempt and larger than any earlier attempt's:
    what pushes carry to the servers and what names commlab's keys in the store (:func:`store_prefix`).

    ``commlab run`` counts exactly: ``TORCHELASTIC_RESTART_COUNT`` (``info.attempt``), with a fresh store per
    attempt. Under torchrun (``TORCHELASTIC_RUN_ID`` set) the count cannot serve: torchrun does not raise it
    on a membership change (``--nnodes MIN:MAX``), an agent that joins later starts at 0, and the store may
    be one that outlives rounds (the agent's) or a fresh one (rank 0's): the ranks agree on a round id
    through the store instead (:func:`agree_round`). Collective on the first call (every rank of the job
    sets up an exchanger); later calls in the process return the agreed id."""
    env = os.environ if env is None else env
    if RUN_ID not in env or not info.master_port:
        return info.attempt
    where = (info.master_addr, info.master_port)
    if where not in _ROUNDS:
        _ROUNDS[where] = agree_round(_meeting_store(info, timeout, env), info.job, timeout)
    return _ROUNDS[where]


def _meeting_store(info: RankInfo, timeout: float, env: Mapping[str, str]):
    """The store every rank of the job reaches: the default process group's when the script made one (its
    rank 0 may host it on MASTER_PORT already), else the one at the launcher's address."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    return _raw_store(info, timeout, env)


def agree_round(store, info: RankInfo, timeout: float) -> int:
    """Every rank of a new round of the job learns the same fresh round id from ``store``, which may hold a
    dead round's keys. Rank 0 draws it: its clock in milliseconds, above the last id this store handed
    out, so it grows across rounds whatever store each round met in (torchrun may host a fresh one when
    rank 0 moves). Rank 0 hands it to each rank that asked with a random nonce; a rank takes only the
    answer to its own nonce and acknowledges with the id, so neither side takes a dead round's key for this
    round's. Blocks until every rank has it, at most ``timeout``: CommTimeout naming the ranks that never
    took it (rank 0) or rank 0 that never answered (the others)."""
    import uuid

    deadline = time.monotonic() + timeout
    if info.rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_ROUND_KEY}/ask/{info.rank}", nonce)
        while True:
            if store.check([f"{_ROUND_KEY}/give/{info.rank}"]):
                got, _, number = store.get(f"{_ROUND_KEY}/give/{info.rank}").decode().partition(" ")
                if got == nonce:
                    store.set(f"{_ROUND_KEY}/took/{info.rank}", number)
                    return int(number)
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {info.rank}: rank 0 did not hand out this round's id within {timeout:g}s "
                                  f"(agreed through the job's store)", peer=0, op="connect")
            time.sleep(0.01)
    last = int(store.get(f"{_ROUND_KEY}/last")) if store.check([f"{_ROUND_KEY}/last"]) else 0
    number = str(max(time.time_ns() // 1_000_000, last + 1))
    store.set(f"{_ROUND_KEY}/last", number)
    pending = set(range(1, info.world_size))
    while pending:
        for r in sorted(pending):
            if store.check([f"{_ROUND_KEY}/took/{r}"]) and store.get(f"{_ROUND_KEY}/took/{r}").decode() == number:
                pending.discard(r)
            elif store.check([f"{_ROUND_KEY}/ask/{r}"]):
                store.set(f"{_ROUND_KEY}/give/{r}", f"{store.get(f'{_ROUND_KEY}/ask/{r}').decode()} {number}")
        if pending and time.monotonic() > deadline:
            raise CommTimeout(f"rank 0: rank(s) {sorted(pending)} did not take round {number} within {timeout:g}s "
                              f"(agreed through the job's store)", peer=min(pending), op="connect")
        time.sleep(0.01 if pending else 0)
    return int(number)


def _raw_store(info: RankInfo, timeout: float, env: Mapping[str, str]):
    """This process's connection to the job's store (hosting it on rank 0 unless a launcher's agent does)."""
    import torch.distributed as dist

    info = info.job  # the job's rank 0 hosts it, whatever group this process is in
    where = (info.master_addr, info.master_port)
    store = _STORES.get(where)
    if store is None:
        agent = env.get(AGENT_STORE) == "True"
        try:
            store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                                  is_master=info.rank == 0 and not agent, timeout=timedelta(seconds=timeout),
                                  wait_for_workers=False, use_libuv=True)
        except Exception as exc:  # torch raises DistNetworkError/RuntimeError with the socket detail
            raise CommTimeout(f"rank {info.rank} could not reach the rendezvous store at "
                              f"{info.master_addr}:{info.master_port} within {timeout:g}s: {exc}") from exc
        _STORES[where] = store
    return store


def connect_store(info: RankInfo, timeout: float, env: Mapping[str, str] | None = None):
    """The job's TCPStore under commlab's prefix for this attempt (rank 0 hosts it unless torchrun's agent or
    commlab's launcher already does). One connection per process and job: every exchanger after the first
    reuses it, so rank 0 hosts the store once and keeps it for the job. An exchanger meets in its own
    namespace of it (:func:`exchanger_store`)."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    store = _raw_store(info, timeout, env)
    return dist.PrefixStore(store_prefix(job_attempt(info, timeout, env)), store)


def default_group_store(info: RankInfo, timeout: float):
    """The store of the default process group someone else made (DDP's, a user's ``init_process_group``),
    under commlab's prefix: the one store every rank surely reaches (rank 0 may already host one on
    ``MASTER_PORT``, so a second could not bind it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return dist.PrefixStore(store_prefix(job_attempt(info, timeout)), distributed_c10d._get_default_store())


def exchanger_store(store, info: RankInfo, timeout: float):
    """``store`` (the job's, under commlab's prefix) as one exchanger sees it: a grouped exchanger's under
    its group's namespace (:func:`group_store`), a whole-job exchanger's under its number (:func:`instance`).
    The job's store outlives each exchanger (the launcher's, torchrun's agent's, a default group's):
    without a namespace of its own, a later exchanger would read an earlier one's keys, gloo's listening
    addresses among them, whose listeners are closed, whenever the peer had not yet overwritten them
    (``Gloo connectFullMesh failed ... Connection refused``: a second exchanger in one process, as a
    resumed run makes, failed that way whenever one rank reached it first)."""
    return group_store(store, info, timeout) if info.members else instance(store, info.global_rank())


def instance(store, rank: int):
    """The namespace of this rank's next whole-job exchanger: ``1`` for the first, ``2`` for the second...
    Every rank meets its whole-job exchangers in the same order (meeting is collective), so the numbers
    agree. (Grouped exchangers count per group: :func:`check_group`.)"""
    import torch.distributed as dist

    return dist.PrefixStore(str(int(store.add(f"instances/{rank}", 1))), store)  # PrefixStore adds the "/"


def job_store(info: RankInfo, timeout: float):
    """The job's store under commlab's prefix: the default process group's when the script made one (a
    pipeline's, DDP's), else the one at the launcher's address (:func:`connect_store`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return default_group_store(info, timeout)
    return connect_store(info, timeout)


def group_store(store, info: RankInfo, timeout: float):
    """``store`` (the job's, under commlab's prefix) as one grouped exchanger of ``info``'s group sees it:
    its keys under the group's namespace and the exchanger's number (``g1-3/2/``: the members' second
    exchanger over ranks 1 and 3), so positions can name keys and a later exchanger over the same group
    reads none of an earlier one's (heartbeats, a process group's). First checks through the store that
    the groups agree (:func:`check_group`). The whole job's store is returned as it is."""
    if not info.members:
        return store
    import torch.distributed as dist

    n = check_group(store, info, timeout)
    return dist.PrefixStore(f"{info.namespace}{n}/", store)


def check_group(store, info: RankInfo, timeout: float) -> int:
    """Every member of this process's group must name the same group, in the same order, for the same
    exchanger (the n-th grouped exchanger each process sets up): then the groups that exchangers of the
    same n name are disjoint, a partition of the ranks that take part. Publishes this rank's group and
    reads every member's, waiting at most ``timeout`` for each. ConfigError naming the global ranks that
    disagree; CommTimeout naming the members that never said (dead, or not setting up this exchanger).
    Returns n."""
    me = info.global_rank()
    n = int(store.add(f"groups/made/{me}", 1))
    store.set(f"groups/{n}/{me}", json.dumps(list(info.members)))
    deadline = time.monotonic() + timeout
    for r in info.members:
        if r == me:
            continue
        key = f"groups/{n}/{r}"
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {me}: rank {r} of its group {list(info.members)} did not set up its "
                                  f"grouped exchanger #{n} within {timeout:g}s (dead, or not in this group?)",
                                  peer=r, op="connect")
            time.sleep(0.01)
        theirs = json.loads(store.get(key))
        if theirs != list(info.members):
            raise ConfigError(f"rank {me} names group {list(info.members)} but rank {r} names {theirs} (grouped "
                              f"exchanger #{n}): the groups must partition the job, every member naming the same "
                              f"ranks in the same order")
    return n


def heartbeat(store, rank: int, step: int) -> None:
    """Record that ``rank`` has entered ``step``."""
    store.set(f"hb/{rank}", str(step))


def stall_report(store, world_size: int, step: int, skip: int | None = None, members: tuple[int, ...] = ()) -> str:
    """``' (waiting for rank 2, last seen at step 14)'`` or ``''`` if every rank reached ``step``. In a
    group (``members``: the global ranks of positions ``0..world_size-1``), ranks are named globally."""
    behind = []
    for r in range(world_size):
        if r == skip:
            continue
        try:
            seen = int(store.get(f"hb/{r}")) if store.check([f"hb/{r}"]) else -1
        except Exception:  # the store itself is gone: rank 0 died
            return f" (the rendezvous store hosted by rank 0 is unreachable: rank 0 is likely dead)"
        if seen < step:
            name = members[r] if members else r
            behind.append(f"rank {name} (last seen at step {seen})" if seen >= 0 else f"rank {name} (never seen)")
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
