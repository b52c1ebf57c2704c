"""A replacement's state, relayed from a live peer (keep-going under update=worker; docs/faults.md).

Under ``update=worker`` the shards hold sums only: the trained parameters, buffers and optimizer state are the
workers', the same on every live one (each runs the optimizer on the same pulled averages). So a replacement
that enters at step E takes them from a live peer, through the shards:

* ``enter`` starts a :class:`Relay` for the rank (again, when its entry moves to a later step).
* The lowest rank that pushes step E - 1 here is the *donor*: the first reply of its sums of step E - 1 after
  the entry asks it (``{donate: {step: E, ranks}}``). Each shard's step E - 1 was still gathering when the
  replacement entered, so at least one such reply goes out after the entry.
* After its optimizer step E - 1 the donor sends each shard that asked a byte range of its state
  (:func:`commlab.core.keepgoing.pack_heal`), in messages no larger than the shard's pieces (``donate``); the
  shard copies it into the relay and never reads it.
* The replacement's ``pull what=heal`` is answered once the shard holds its whole range; the relay then goes.

The donor is never failed for the replacement's sake: a donation nobody waits for (the replacement left, its
entry moved) is acknowledged and dropped. A donor that leaves before its whole range is here fails the relay:
the replacement's pull is answered with one line naming the donor and the step (it is not asked of another
peer), and the replacement exits with it. One object per key space, on the shard's thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from commlab.transport import psproto, wire


@dataclass
class Relay:
    """One entering rank's state, as this shard relays it."""

    step: int  # the replacement's entry step: the state is the donor's after its optimizer step step - 1
    donor: int | None = None  # asked in a reply of step step - 1 (None: not yet)
    size: int = -1  # bytes of the whole state (-1: nothing arrived yet)
    lo: int = 0  # this shard's range of it: [lo, hi)
    hi: int = 0
    got: int = 0  # bytes of the range received, in order from lo
    data: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    failed: str = ""

    @property
    def complete(self) -> bool:
        return self.size >= 0 and self.got == self.hi - self.lo and not self.failed


class Relays:
    def __init__(self, srv):
        self.srv = srv  # the key space (servers.server.ParameterServer)
        self.by_rank: dict[int, Relay] = {}

    def enter(self, rank: int, step: int) -> None:
        """A replacement under update=worker enters at ``step``: its relay starts (a moved entry drops what was
        relayed for the earlier one)."""
        self.by_rank[rank] = Relay(step)

    def ask(self, rank: int, after: int) -> dict:
        """What a reply of step ``after``'s sums to ``rank`` carries besides: the ranks entering at ``after + 1``
        whose state this shard still awaits, when ``rank`` is the donor (the lowest rank pushing ``after``)."""
        if not self.by_rank:
            return {}
        waiting = [r for r, x in self.by_rank.items() if x.step == after + 1 and x.size < 0 and not x.failed]
        if not waiting or rank != min(self.srv.pushers(after), default=None):
            return {}
        for r in waiting:
            self.by_rank[r].donor = rank
        return {"donate": {"step": after + 1, "ranks": sorted(waiting)}}

    def donate(self, rank: int, h: wire.Header, data) -> dict:
        """``rank``'s part of the state (or its refusal to send it); the reply's meta. Whatever does not fit a
        relay is dropped (said in the reply), never refused: the donor is a survivor."""
        m = h.meta
        ranks: list = m["ranks"] if isinstance(m.get("ranks"), list) else []
        mine = [x for r, x in self.by_rank.items() if r in ranks and x.step == m.get("entry") and x.donor == rank
                and not x.failed and not x.complete]
        if not mine:
            return {"dropped": f"no replacement waits on {self.srv.cfg.name} for rank {rank}'s state of step "
                               f"{m.get('entry')} (it left, or entered at another step)"}
        refused = m.get("refused")
        if refused is not None:
            return self._fail(mine, f"rank {rank}, the live peer asked for it, could not send it: {str(refused):.400}")
        size, rng = m.get("size"), m.get("range")
        if not (isinstance(size, int) and isinstance(rng, list) and len(rng) == 2
                and all(isinstance(v, int) for v in rng) and 0 <= rng[0] <= rng[1] <= size):
            return self._fail(mine, f"rank {rank} sent it with a bad size or range ({size!r:.40}, {rng!r:.40})")
        lo, hi = rng
        limit = psproto.relay_limit(self.srv.max_bytes)
        if hi - lo > limit:
            return self._fail(mine, f"{self.srv.cfg.name} would relay {hi - lo} bytes of it, more than its limit of "
                                    f"{limit} (16 times its pieces and 1 MiB)")
        for x in mine:
            if x.size < 0:
                x.size, x.lo, x.hi, x.data = size, lo, hi, torch.empty(hi - lo, dtype=torch.uint8)
            elif (x.size, x.lo, x.hi) != (size, lo, hi):
                return self._fail(mine, f"rank {rank} sent two layouts of it")
            for spec, frame in zip(h.frames, data):
                at = x.lo + x.got
                if spec.key != "heal" or spec.dtype != "uint8" or spec.offset > at or spec.offset + spec.count > x.hi:
                    return self._fail(mine, f"rank {rank} sent {spec.key}:{spec.dtype}[{spec.offset}:"
                                            f"{spec.offset + spec.count}] of it; {self.srv.cfg.name} expected bytes "
                                            f"from {at} of [{x.lo}, {x.hi})")
                if spec.offset + spec.count <= at:
                    continue  # sent again after a reconnect
                skip = at - spec.offset
                x.data[at - x.lo:spec.offset + spec.count - x.lo].copy_(wire.frame_tensor(spec, frame)[skip:])
                x.got = spec.offset + spec.count - x.lo
        return {}

    def _fail(self, relays: list[Relay], why: str) -> dict:
        for x in relays:
            x.failed, x.data = why, torch.empty(0, dtype=torch.uint8)
        return {"dropped": why}

    def ready(self, rank: int) -> bool:
        """Whether a heal pull of ``rank`` can be answered now (its relay complete or failed, or none)."""
        x = self.by_rank.get(rank)
        return x is None or x.complete or bool(x.failed)

    def answer(self, rank: int) -> tuple[str, dict, list]:
        """The reply to ``rank``'s heal pull: (op, meta, parts). The relay goes with it."""
        x = self.by_rank.pop(rank, None)
        if x is None:
            return "error", {"reason": f"{self.srv.cfg.name} relays no state to rank {rank}: it is no replacement "
                                       f"entering under update=worker"}, []
        if x.failed:
            return "error", {"reason": f"the state of step {x.step - 1} for rank {rank} (a replacement entering at "
                                       f"step {x.step}) did not reach {self.srv.cfg.name}: {x.failed}"}, []
        return "params", {"step": x.step, "donor": x.donor, "size": x.size, "range": [x.lo, x.hi]}, \
            wire.split("heal", x.data, x.lo)

    def lose(self, rank: int, why: str) -> None:
        """``rank`` left: its own relay goes; a relay it was sending fails (not asked of another peer)."""
        self.by_rank.pop(rank, None)
        for r, x in self.by_rank.items():
            if x.donor == rank and not x.complete and not x.failed:
                self._fail([x], f"rank {rank}, the live peer sending it, left the job ({why}) before all of it had "
                                f"arrived: the replacement cannot take a survivor's state (it is not asked of another "
                                f"peer)")

    def stats(self) -> dict:
        return {str(r): {"step": x.step, "donor": x.donor, "got": x.got, "of": x.hi - x.lo if x.size >= 0 else None,
                         **({"failed": x.failed} if x.failed else {})} for r, x in sorted(self.by_rank.items())}
