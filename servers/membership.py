"""Who trains in a key space, when workers keep going (``ps://?min_workers=M``; docs/faults.md).

Without ``min_workers`` (0, the default) a shard waits for every rank of the job, as it always did: a dead
worker stalls a synchronous step until the launcher restarts the job or the survivors' pulls time out
naming it. With it, the shard keeps a *membership*:

* A rank whose connection closes (kill -9: at once; a frozen or partitioned worker: once zmq's heartbeat
  TTL that the worker asked for with ``heartbeat_s`` runs out) leaves it. The mode takes out what it had
  pushed of the step in flight (:meth:`servers.modes.Mode.lose`); the step completes over the ranks left,
  averaged over them; the survivors go on with no restart of anything.
* Every change (a rank lost, a replacement entering) moves the membership *epoch* on. A process of a lost
  rank that comes back (a partition healed, a SIGSTOP ended) is refused by name: its connection is not the
  one its rank's current process said hello on, or its hello is not a new process's (``fresh``).
* A new process for a lost rank (``commlab run --replace`` or ``--spares``) says a fresh hello; it enters at
  a step boundary the mode names (:meth:`servers.modes.Mode.entry_step`, then the ``enter`` request).
* Fewer than ``min_workers`` ranks left ends the key space's job: every waiting and later request is
  answered with one line naming the ranks lost.

One object per key space, on the shard's thread; the server asks it at hello, before every other request
(:meth:`check`), and when a connection closes (:meth:`closed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from servers.modes import Refused


@dataclass(frozen=True)
class Loss:
    rank: int
    epoch: int  # the membership epoch the rank's process belonged to
    step: int  # the step the shard was on (sync: gathering; async: the rank's next)
    why: str


class Membership:
    def __init__(self, name: str):
        self.name = name  # the shard's, for messages
        self.min_workers = 0  # 0: off (a dead rank is waited for); fixed by the first hello
        self.fixed = False
        self.epoch = 0
        self.lost: dict[int, Loss] = {}
        self.conn: dict[int, bytes] = {}  # rank -> the connection its current process said hello on
        self.live: dict[int, bytes] = {}  # rank -> its heartbeat connection (heartbeat_s=: PINGs only)
        self.since: dict[int, int] = {}  # rank -> the epoch its current process entered at
        self.hello_epoch: dict[int, int] = {}  # rank -> the epoch its current process's fresh hello was answered at
        self.pending: set[int] = set()  # replacements that said hello and have not entered yet
        self.ended = ""  # why the job lost its quorum ("": it did not)
        self.replaced = 0  # replacements that entered

    @property
    def on(self) -> bool:
        return self.min_workers > 0

    def reset(self) -> None:
        """A new attempt of the job (every rank restarted): everyone is a member again."""
        self.lost.clear()
        self.conn.clear()
        self.live.clear()
        self.since.clear()
        self.hello_epoch.clear()
        self.pending.clear()
        self.ended = ""
        self.epoch += 1

    def fix(self, min_workers, sender: str, world: int) -> None:
        """Hello: the first fixes min_workers (none said: 0, off); a different one later is refused."""
        min_workers = 0 if min_workers is None else min_workers
        if not isinstance(min_workers, int) or isinstance(min_workers, bool) or not 0 <= min_workers <= world:
            raise Refused(f"hello from {sender}: min_workers must be an integer in [0, {world}], got {min_workers!r}")
        if self.fixed and min_workers != self.min_workers:
            raise Refused(f"worker {sender} says min_workers={min_workers}, the job on {self.name} runs with "
                          f"min_workers={self.min_workers}: every rank must keep going alike")
        self.min_workers, self.fixed = min_workers, True

    def hello(self, rank: int, ident: bytes, meta: dict) -> bool:
        """Admit a hello on connection ``ident``; True when it is a replacement for a lost rank (it enters
        later, :meth:`entered`). Refuses a stale process of a lost rank, and a second process for a live one."""
        if not self.on:
            self.conn[rank] = ident
            return False
        fresh = meta.get("fresh") is True
        if rank in self.lost:
            if not fresh:
                raise Refused(self._stale(rank, meta.get("epoch")))
            del self.lost[rank]
            self.pending.add(rank)
            self.conn[rank] = ident
            self.epoch += 1
            self.hello_epoch[rank] = self.epoch
            return True
        old = self.conn.get(rank)
        if fresh and old is not None and old != ident and rank not in self.pending:
            raise Refused(f"a new process says hello as rank {rank}, which is live on another connection to "
                          f"{self.name} (membership epoch {self.epoch}): two processes for one rank?")
        said, took = meta.get("epoch"), self.hello_epoch.get(rank)
        if not fresh and isinstance(said, int) and took is not None and said < took:
            # (a process of the rank's lost predecessor, back after a replacement took the rank over: its old
            # connection is refused by check(); this is its hello on a new one, after a failover or a reconnect)
            raise Refused(f"hello from rank {rank} of membership epoch {said}: the rank left the job and a new "
                          f"process took it over at epoch {took} on {self.name} (the job is at epoch {self.epoch}): "
                          f"a process that comes back is refused, not merged")
        if fresh:
            self.hello_epoch[rank] = self.epoch
        self.conn[rank] = ident
        self.since.setdefault(rank, self.epoch)
        return rank in self.pending

    def entered(self, rank: int) -> None:
        self.pending.discard(rank)
        self.since[rank] = self.epoch
        self.replaced += 1

    def check(self, rank: int | None, ident: bytes, op: str, sender: str) -> None:
        """Before any request but hello and stats: the job still has its quorum, and the request comes from
        its rank's current process."""
        if not self.on or rank is None:
            return
        if self.ended:
            raise Refused(self.ended)
        if rank in self.lost:
            raise Refused(self._stale(rank, None, op))
        if self.conn.get(rank, ident) != ident:
            raise Refused(f"{op} from {sender} on a connection its process did not say hello on: rank {rank} left "
                          f"and entered again (membership epoch {self.since.get(rank, self.epoch)}); this process is "
                          f"of an earlier epoch: refused, not merged")

    def _stale(self, rank: int, epoch, op: str = "hello") -> str:
        loss = self.lost[rank]
        said = f" (it says epoch {epoch})" if isinstance(epoch, int) else ""
        return (f"{op} from rank {rank} of membership epoch {loss.epoch}{said}: the rank left the job on {self.name} "
                f"at step {loss.step} ({loss.why}); the job is at epoch {self.epoch}: a process that comes back is "
                f"refused, not merged (a new process takes the rank over: commlab run --replace)")

    def heartbeat(self, rank: int | None, ident: bytes, sender: str) -> None:
        """``ident`` is the heartbeat connection of ``rank``'s current process."""
        if not self.on or rank is None or rank in self.lost or rank not in self.conn:
            raise Refused(f"live from {sender}: not a member's process on {self.name} (keep-going off, or the rank "
                          f"left: membership epoch {self.epoch})")
        self.live[rank] = ident

    def closed(self, ident: bytes) -> int | None:
        """The rank whose current connection (or heartbeat connection) ``ident`` was (None: no rank's)."""
        if not self.on:
            return None
        return next((r for table in (self.conn, self.live) for r, i in table.items()
                     if i == ident and r not in self.lost), None)

    def lose(self, rank: int, step: int, why: str, world: int) -> None:
        """``rank`` left; ends the job when fewer than min_workers are left."""
        self.lost[rank] = Loss(rank, self.since.get(rank, self.epoch), step, why)
        self.conn.pop(rank, None)
        self.live.pop(rank, None)
        self.pending.discard(rank)
        self.epoch += 1
        left = world - len(self.lost)
        if left < self.min_workers and not self.ended:
            ranks = sorted(self.lost)
            self.ended = (f"the job lost its quorum on {self.name}: rank(s) {ranks} lost ("
                          + "; ".join(f"rank {r}: {self.lost[r].why} at step {self.lost[r].step}" for r in ranks)
                          + f"), {left} of {world} left, min_workers={self.min_workers}")

    def state(self) -> dict:
        """For the shard's checkpoint: a shard restarted with --resume keeps who left (connections are not kept:
        every live rank says hello again)."""
        return {"min_workers": self.min_workers, "fixed": self.fixed, "epoch": self.epoch, "replaced": self.replaced,
                "ended": self.ended, "lost": {r: [x.epoch, x.step, x.why] for r, x in self.lost.items()},
                "pending": sorted(self.pending), "hello_epoch": dict(self.hello_epoch)}

    def load(self, state: dict) -> None:
        self.min_workers, self.fixed = int(state.get("min_workers", 0)), bool(state.get("fixed", False))
        self.epoch, self.replaced, self.ended = int(state.get("epoch", 0)), int(state.get("replaced", 0)), \
            str(state.get("ended", ""))
        self.lost = {int(r): Loss(int(r), int(e), int(t), str(w)) for r, (e, t, w) in state.get("lost", {}).items()}
        self.pending = {int(r) for r in state.get("pending", [])}
        self.hello_epoch = {int(r): int(e) for r, e in state.get("hello_epoch", {}).items()}

    def out(self) -> set[int]:
        """Ranks that push nothing now: lost, or replacements not entered yet."""
        return set(self.lost) | self.pending

    def stats(self) -> dict:
        return {"min_workers": self.min_workers, "epoch": self.epoch, "ended": self.ended,
                "lost": {str(r): {"epoch": x.epoch, "step": x.step, "why": x.why} for r, x in sorted(self.lost.items())},
                "entering": sorted(self.pending), "replaced": self.replaced}
