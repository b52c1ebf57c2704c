"""Keep going when a rank dies: the collectives' membership, one decision per step (``min_workers=M``).

``ring://?min_workers=M`` and ``allreduce://?min_workers=M`` (docs/faults.md, "The collectives keep going")
run every step as a transaction over the job's rendezvous store, under ``ft/`` of the exchanger's namespace:

- **Membership epochs.** Epoch 0 is the whole job. ``e<E>/members`` holds epoch E's global ranks (written
  once, by ``compare_set``: the first proposal wins and every rank adopts it); ``epoch`` the latest E.
- **A decision per step.** When a rank's exchange of step s ends it votes: ``e<E>/s<s>/ok/<rank>`` and one
  ``add`` on ``e<E>/s<s>/n``; the rank whose add makes the count the epoch's size writes the decision
  ``commit`` (with the replacements waiting to be admitted). A rank whose exchange failed writes ``abort``
  (naming the rank its error blames) instead; so does a rank that sees a member that has not voted go
  silent (no heartbeat within ``heartbeat_s``). The decision key is written once (``compare_set``), so
  every rank reads the same one: either every member applies the step or none does (no half-applied
  step). On ``abort`` every survivor keeps its pre-step state, the members re-form (next epoch), and the
  step is exchanged again over them.
- **Re-forming.** Each survivor says ``e<E+1>/here/<rank>`` and waits (bounded by ``timeout``) until every
  member of epoch E has said so or is taken for dead: its heartbeat silent for ``heartbeat_s``, or, when
  a link of this step closed on it (the rank its error named), for a quarter of that. The first rank done
  proposes the ranks that said so; the others adopt the proposal. A rank the proposal leaves out (it was
  stopped, partitioned, too slow) is refused (:class:`StaleMember`): it stops instead of merging a stale
  state. Fewer than ``min_workers`` members end the job on every survivor (:class:`QuorumLost`, one line
  naming the ranks lost).
- **Replacements.** A process started for a lost rank (``commlab run --replace``, or by hand with the rank's
  environment) finds the job running (``epoch`` exists) and asks to join (``join/<rank>``: a nonce); the
  next ``commit`` admits it (``e<E+1>/admit``), every member re-forms with it after that step's update, and
  a healthy member (the lowest rank of the old epoch) sends it the state (the regime's heal).
- **Heartbeats.** A thread of each rank bumps ``hb/<rank>`` (job-wide, under commlab's prefix) every
  ``heartbeat_s / 4`` over a store connection of its own; a SIGSTOPped or hung process stops bumping it. The
  beat names the host (boot id and network namespace) and pid: a rank on the same host whose process is gone
  (or a zombie) is dead at once, without waiting for its silence.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from commlab.base.config import option
from commlab.base.errors import CommError, CommTimeout, ConfigError
from commlab.core.localsteps import LocalStepsOptions
from commlab.transport import rendezvous, shm
from commlab.transport.rendezvous import RankInfo

DEFAULT_HEARTBEAT_S = 2.0
HB = "ft-hb"  # the heartbeats' prefix under commlab's, job-wide
_MADE = [0]  # whole-job keep-going exchangers this process made (their namespace: a replacement's counts as its own)


@functools.lru_cache(maxsize=1)
def _here() -> str:
    """This host and network namespace (:func:`commlab.transport.shm.host_identity`), without spaces."""
    return shm.host_identity().replace(" ", "_")


def _dead(pid: int) -> bool:
    """Whether process ``pid`` of this host is gone or a zombie (killed, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


class StaleMember(CommError):
    """This rank was left out of a membership epoch (stopped, partitioned or too slow while the others re-formed):
    refused, not merged back. A replacement started for it may join."""


class QuorumLost(CommError):
    """Fewer ranks than ``min_workers`` are left: the job ends (``peer``: the lost ranks)."""


@dataclass(frozen=True)
class KeepGoingOptions(LocalStepsOptions):
    """A collective regime's options, with keep-going (``min_workers``)."""

    min_workers: int = option(0, "keep going when ranks die while at least M are left (docs/faults.md): a failure "
                                 "inside a step discards that step everywhere, the ranks left re-form and redo it "
                                 "averaged over themselves, a replacement (commlab run --replace) is healed from a "
                                 "live rank; fewer than M ends the job naming the ranks lost. 0: off (a dead rank "
                                 "stops every rank: PeerLost), 1 under commlab run --replace and --spares",
                              ge=0, le=1 << 20)
    heartbeat_s: float = option(0.0, f"keep going: a rank silent this long is taken for dead (hung, stopped); 0: "
                                     f"{DEFAULT_HEARTBEAT_S:g} s. A killed rank's closed links are seen at once",
                                ge=0, le=3600.0, why="an hour: longer is no heartbeat")

    def __post_init__(self):
        super().__post_init__()
        if self.min_workers:
            self.check_keep_going()

    def check_keep_going(self) -> None:
        """ConfigError, one line naming the option, for what keeping going cannot do (at parse time when
        ``min_workers`` is given; at setup when a launcher that replaces ranks turns keeping going on)."""
        if self.sync_every:
            raise ConfigError("option 'min_workers' (keep going) with sync_every= (local steps) is not supported")
        if self.heartbeat >= self.timeout:
            raise ConfigError(f"option 'heartbeat_s': {self.heartbeat:g} s must be below timeout "
                              f"({self.timeout:g} s)")

    @property
    def keep_going(self) -> int:
        """The quorum to keep going with: ``min_workers``, or 1 under a launcher that replaces dead ranks
        (``commlab run --replace``, ``--spares``); 0: off. ConfigError where the options cannot keep going."""
        keep = self.min_workers or (1 if rendezvous.keep_going() else 0)
        if keep:
            self.check_keep_going()
        elif self.heartbeat_s:
            raise ConfigError("option 'heartbeat_s': a silent rank is left out only when the others keep going: give "
                              "min_workers= too (or run under commlab run --replace)")
        return keep

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_s or DEFAULT_HEARTBEAT_S


@dataclass(frozen=True)
class Decision:
    """How step ``step`` of epoch ``epoch`` ended, the same on every member."""

    epoch: int
    step: int
    commit: bool
    lost: tuple[int, ...] = ()  # abort: the ranks the first failure blamed
    reason: str = ""
    admit: dict[int, str] = field(default_factory=dict)  # commit: replacements to admit after the step (rank: nonce)


class Heartbeat(threading.Thread):
    """Bumps ``hb/<rank>`` every ``period`` seconds over a store connection of its own (torch's store client is
    not shared across threads here)."""

    def __init__(self, info: RankInfo, timeout: float, period: float):
        super().__init__(name=f"commlab-heartbeat-rank{info.global_rank()}", daemon=True)
        self.info, self.timeout, self.period = info.job, timeout, period
        self.stopped = threading.Event()
        self.prefix = rendezvous.store_prefix(rendezvous.job_attempt(self.info, timeout))
        self.store: Any = None

    def run(self) -> None:
        import torch.distributed as dist

        tag, n = f"{_here()} {os.getpid()} ", 0  # where and who: a rank on this host tells a dead pid at once
        try:
            client = dist.TCPStore(self.info.master_addr, self.info.master_port, None, False,
                                   timedelta(seconds=self.timeout), wait_for_workers=False, use_libuv=True)
            self.store = dist.PrefixStore(HB, dist.PrefixStore(self.prefix, client))
            while not self.stopped.is_set():
                n += 1
                self.store.set(str(self.info.rank), tag + str(n))
                self.stopped.wait(self.period)
        except Exception:  # the store is gone (its host died): the others find that out themselves
            return

    def stop(self) -> None:
        self.stopped.set()


def _store_lost(method):
    """A store call that fails (its host died: rank 0, where it hosts the store) raises CommError saying so."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except CommError:
            raise
        except Exception as exc:  # torch's DistNetworkError, DistStoreError (RuntimeError)
            raise CommError(f"{self.scheme}:// rank {self.me}: the job's rendezvous store is gone, and keeping going "
                            f"needs it (a store hosted by rank 0 dies with it: run under commlab run or torchrun, "
                            f"whose agent hosts it): {exc}", op="connect") from exc

    return wrapped


class Quorum:
    """One rank's view of the membership and its per-step decisions (see the module's docstring)."""

    POLL_S = (0.0005, 0.02)  # polls of the store start at the first, back off to the second

    def __init__(self, store, info: RankInfo, options: KeepGoingOptions, scheme: str):
        import torch.distributed as dist

        if info.members:
            raise ConfigError(f"{scheme}://?min_workers= keeps whole jobs going, not groups (connect(group=...))")
        keep = options.keep_going
        if keep > info.world_size:
            raise ConfigError(f"option 'min_workers': {keep} is more than the job's {info.world_size} ranks")
        self.store = dist.PrefixStore("ft/", store)
        self.hb_store: Any = None  # the job-wide heartbeats, read on the caller's connection
        self.info, self.scheme = info, scheme
        self.me, self.size = info.global_rank(), info.world_size
        self.min_workers, self.hb_s, self.timeout = keep, options.heartbeat, options.timeout
        self.epoch, self.members = 0, tuple(range(info.world_size))
        self.lost: set[int] = set()  # every rank lost so far (and not readmitted)
        self.nonce = ""  # a replacement's join request
        self._seen: dict[int, tuple[str | None, float]] = {}  # rank -> (its heartbeat, when this rank saw it change)
        self._pids: dict[int, tuple[int, str]] = {}  # an admitted replacement's pid and host (its join request)
        self._beat: Heartbeat | None = None
        self.raw = store

    # ----- heartbeats -------------------------------------------------------------------
    def start(self, job_store) -> None:
        """Start this rank's heartbeat; ``job_store``: the job's store under commlab's prefix (heartbeats are
        job-wide, read from there)."""
        import torch.distributed as dist

        self.hb_store = dist.PrefixStore(HB, job_store)
        self._beat = Heartbeat(self.info, self.timeout, self.hb_s / 4)
        self._beat.start()

    def silent(self, rank: int, within: float | None = None) -> bool:
        """Whether ``rank``'s heartbeat has not moved for ``within`` (default ``heartbeat_s``) seconds, as far as
        this rank has watched it (the clock starts at the first look)."""
        now = time.monotonic()
        try:
            beat = self.hb_store.get(str(rank)).decode() if self.hb_store.check([str(rank)]) else None
        except Exception:
            return False  # the store is gone: the caller's own store calls fail and say so
        seen = self._seen.get(rank)
        if seen is None or seen[0] != beat:
            self._seen[rank] = (beat, now)
            return False
        return now - seen[1] >= (self.hb_s if within is None else within)

    def gone(self, rank: int) -> bool:
        """Whether ``rank``'s process is certainly dead: its heartbeat names a process on this host (and network
        namespace) that no longer runs, or is a zombie (killed, not reaped yet). A kill -9 is seen at once; a
        rank on another host only by :meth:`silent`."""
        try:
            beat = self.hb_store.get(str(rank)).decode() if self.hb_store.check([str(rank)]) else ""
        except Exception:
            return False
        where, _, rest = beat.partition(" ")
        pid = int(rest.split()[0]) if rest else None
        joined = self._pids.get(rank)
        if joined is not None and (pid, where) != joined:  # an admitted replacement, not beating yet: the beat is
            return joined[1] == _here() and _dead(joined[0])  # its predecessor's
        return where == _here() and pid is not None and _dead(pid)

    def close(self) -> None:
        if self._beat is not None:
            self._beat.stop()
            self._beat = None

    # ----- the step's decision ----------------------------------------------------------
    def _poll(self, ready, what: str, on_idle=None):
        """Until ``ready()`` returns something (not None), polling with back-off; ``on_idle()`` runs every 0.1 s.
        CommTimeout naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + self.timeout
        sleep, next_idle = self.POLL_S[0], time.monotonic() + 0.1
        while True:
            got = ready()
            if got is not None:
                return got
            now = time.monotonic()
            if now > deadline:
                raise CommTimeout(f"{self.scheme}:// rank {self.me}: {what} within {self.timeout:g}s "
                                  f"(membership epoch {self.epoch}, members {list(self.members)})", op="receive")
            if on_idle is not None and now >= next_idle:
                on_idle()
                next_idle = now + 0.1
            time.sleep(sleep)
            sleep = min(self.POLL_S[1], sleep * 2)

    @_store_lost
    def wait_key(self, store, key: str, rank: int, what: str) -> None:
        """Until ``key`` is in ``store`` (which ``rank`` writes), at most ``timeout``; CommTimeout naming ``rank`` at
        once when its heartbeat stops (it died while the others wait for it: re-forming, healing)."""
        def silent():
            if self.gone(rank) or self.silent(rank):
                raise CommTimeout(f"{self.scheme}:// rank {self.me}: no {what}: rank {rank} has sent no heartbeat for "
                                  f"{self.hb_s:g}s", peer=rank, op="connect")

        self._poll(lambda: True if store.check([key]) else None, f"no {what}", silent)

    def _propose(self, key: str, value: dict) -> dict:
        """Write ``value`` under ``key`` unless someone already did; the value that stands."""
        mine = json.dumps(value)
        return json.loads(self.store.compare_set(key, "", mine))

    def _read(self, key: str) -> dict | None:
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    @_store_lost
    def decide(self, step: int, failure: BaseException | None) -> Decision:
        """This rank's exchange of ``step`` ended (``failure``: how it failed, else None): the decision every member
        reads (commit, or abort naming the ranks blamed). Blocks until it is made, at most ``timeout``."""
        pre = f"e{self.epoch}/s{step}/"
        if failure is not None:
            self.abort(step, failure)
        else:
            self.store.set(f"{pre}ok/{self.me}", "1")
            if int(self.store.add(pre + "n", 1)) == len(self.members):
                self._propose(pre + "d", {"commit": True, "admit": self.joiners()})

        def idle():
            quiet = [r for r in self.members if r != self.me and not self.store.check([f"{pre}ok/{r}"])
                     and (self.gone(r) or self.silent(r))]
            if quiet:
                self._propose(pre + "d", {"commit": False, "lost": quiet,
                                          "reason": f"no heartbeat from rank(s) {quiet} within {self.hb_s:g}s"})

        d = self._poll(lambda: self._read(pre + "d"), f"no decision on step {step}", idle)
        return Decision(self.epoch, step, bool(d["commit"]), tuple(d.get("lost", ())), d.get("reason", ""),
                        {int(r): n for r, n in d.get("admit", {}).items()})

    @_store_lost
    def abort(self, step: int, failure: BaseException) -> None:
        """Discard ``step`` (this rank's exchange of it failed), unless it was decided already. Never waits."""
        self._propose(f"e{self.epoch}/s{step}/d", {"commit": False, "lost": self._blamed(failure),
                                                    "reason": f"rank {self.me}: {failure}"})

    def aborted(self, step: int) -> Decision | None:
        """The decision on ``step`` if it was made and is an abort (no waiting): a rank still inside the step's
        exchange ends it."""
        try:
            d = self._read(f"e{self.epoch}/s{step}/d")
        except Exception:
            return None
        if d is None or d["commit"]:
            return None
        return Decision(self.epoch, step, False, tuple(d.get("lost", ())), d.get("reason", ""))

    def _blamed(self, failure: BaseException) -> list[int]:
        peer = getattr(failure, "peer", None)
        return [peer] if isinstance(peer, int) and peer in self.members and peer != self.me else []

    def joiners(self) -> dict[str, str]:
        """The replacements asking to join (rank: nonce): ranks out of the membership with a join request."""
        out = {}
        for r in range(self.size):
            if r not in self.members and self.store.check([f"join/{r}"]):
                out[str(r)] = self.store.get(f"join/{r}").decode()
        return out

    # ----- re-forming -------------------------------------------------------------------
    @_store_lost
    def reform(self, blamed: tuple[int, ...] = ()) -> tuple[int, ...]:
        """After an abort: the next epoch's members (this rank among them), agreed with every survivor. Raises
        :class:`StaleMember` when the others left this rank out, :class:`QuorumLost` below ``min_workers``."""
        nxt = self.epoch + 1
        pre = f"e{nxt}/"
        self.store.set(f"{pre}here/{self.me}", "1")
        dead: set[int] = set()

        def ready():
            decided = self._read(pre + "members")
            if decided is not None:
                return decided
            waiting = [r for r in self.members if r != self.me and r not in dead
                       and not self.store.check([f"{pre}here/{r}"])]
            for r in waiting:
                if self.gone(r) or self.silent(r, self.hb_s / 4 if r in blamed else None):
                    dead.add(r)
            if all(r in dead for r in waiting):
                here = [r for r in self.members if r == self.me or self.store.check([f"{pre}here/{r}"])]
                return self._propose(pre + "members", {"members": here})
            return None

        members = tuple(self._poll(ready, f"the survivors did not re-form")["members"])
        return self._enter(nxt, members, writer=min(members))

    def _enter(self, epoch: int, members: tuple[int, ...], writer: int) -> tuple[int, ...]:
        """Take epoch ``epoch`` with ``members``; ``writer`` (a rank that calls this) publishes it as the latest."""
        before = self.members
        self.epoch, self.members = epoch, members
        self.lost |= set(before) - set(members)
        self.lost -= set(members)
        if self.me not in members:
            raise StaleMember(f"{self.scheme}:// rank {self.me} was left out of membership epoch {epoch} (members "
                              f"{list(members)}): refused, not merged back (it was stopped, cut off or too slow "
                              f"while the others re-formed)", peer=self.me, op="connect")
        if len(members) < self.min_workers:
            lost = sorted(self.lost)
            raise QuorumLost(f"{self.scheme}://: {len(members)} rank(s) {list(members)} left, below "
                             f"min_workers={self.min_workers}: lost rank(s) {lost}", peer=lost[0] if lost else None)
        if self.me == writer:
            self.store.set("epoch", str(epoch))
        return members

    @_store_lost
    def admit(self, joiners: dict[int, str]) -> tuple[int, ...]:
        """After a committed step that admits ``joiners``: the next epoch, with them. Every member computes the
        same members; the lowest writes the admission (the joiners wait for it)."""
        nxt, writer = self.epoch + 1, min(self.members)
        members = tuple(sorted(set(self.members) | set(joiners)))
        for r, nonce in joiners.items():  # its silence counts from now; a beat of another pid is its predecessor's
            self._seen.pop(r, None)
            pid, _, where = nonce.partition(" ")
            self._pids[r] = (int(pid.split(".")[0]), where)
        got = tuple(self._propose(f"e{nxt}/members", {"members": list(members),
                                                       "admit": {str(r): n for r, n in joiners.items()}})["members"])
        return self._enter(nxt, got, writer)

    # ----- a replacement ------------------------------------------------------------------
    @staticmethod
    def namespace(store):
        """``store`` (the job's, under commlab's prefix) as this process's next keep-going exchanger sees it:
        numbered by the exchangers this process made (``ft1/``...), not by the store's count per rank as
        others are (:func:`commlab.transport.rendezvous.instance`), so that a replacement meets where the
        rank it replaces met."""
        import torch.distributed as dist

        _MADE[0] += 1
        return dist.PrefixStore(f"ft{_MADE[0]}", store)

    def running(self) -> bool:
        """Whether this exchanger's job is already running (a replacement finds it so)."""
        return self.store.check(["epoch"])

    def started(self) -> None:
        """Epoch 0 formed (every rank met): the job is running from now on."""
        if self.me == 0:
            self.store.set("epoch", "0")

    @_store_lost
    def join(self) -> tuple[int, dict[int, str]]:
        """A replacement: ask to join and wait (bounded by ``timeout``) until a committed step admitted it; then
        (its epoch's number, the replacements admitted with it)."""
        self.nonce = f"{os.getpid()}.{time.time_ns()} {_here()}"  # who and where: the members watch for its death
        self.store.set(f"join/{self.me}", self.nonce)
        first = int(self.store.get("epoch"))

        def ready():
            e = int(self.store.get("epoch"))
            for k in range(first + 1, e + 1):
                got = self._read(f"e{k}/members")
                if got is not None and got.get("admit", {}).get(str(self.me)) == self.nonce:
                    return k, got
            return None

        epoch, got = self._poll(ready, "was not admitted by the running job")
        self.epoch, self.members = epoch, tuple(got["members"])
        return epoch, {int(r): n for r, n in got["admit"].items()}

    def admitted(self, joiners: dict[int, str]) -> None:
        """The joiners are in and healed: their requests go (a later replacement of the same rank asks anew)."""
        if self.me == min(self.members):
            for r, nonce in joiners.items():
                key = f"join/{r}"
                try:
                    if self.store.check([key]) and self.store.get(key).decode() == nonce:
                        self.store.delete_key(key)
                except Exception:
                    pass
