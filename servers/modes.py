"""The consistency modes of a shard, one object each with the same few methods.

The server (:mod:`servers.server`) validates a request, then asks its mode what to do with it:
which step a worker's push must carry (:meth:`Mode.expected_step`), what a validated push does
(:meth:`Mode.fold`), whether a waiting pull can be answered (:meth:`Mode.ready`), what a commit
does (:meth:`Mode.commit`), whom pulls wait for (:meth:`Mode.waiting_for`) and what goes into a
checkpoint. The mode owns its step bookkeeping (each rank's last applied step, what each rank has
sent of the step in flight, async's gradient buffers): the server asks it (:meth:`Mode.partial_step`,
:meth:`Mode.step_in`, :attr:`Mode.last_step`); a mode reads the server's membership and pieces, counts
into its stats and steps its optimizer, and sets none of its attributes. The server owns sockets, keys,
membership and the optimizer.

Update placement (``update=`` in the worker's URL, fixed by the first hello), one object each with the
same few methods (:class:`Placement`): what the shard builds to step (:meth:`Placement.build_optimizer`),
what one update does (:meth:`Placement.apply`), what a sync step does once every push is in
(:meth:`Placement.gathered`) and which pull its workers make then (:attr:`Placement.step_pull`):

* :class:`Averages` (``worker``, sync only): the shard sums. Step t's average of a key is sent to every
  worker (``pull what=sum``) as soon as its N contributions are in; the workers' own optimizers step.
* :class:`ShardOptimizer` (``server``): the shard holds the optimizer. Sync: the average waits for every
  worker's ``commit`` (hyperparameters and one factor: unscale x clip) or for a ``skip`` (the summed
  gradient was not finite: every worker's GradScaler skips), then one update. Async/ssp: each worker's
  push is applied when complete, with the hyperparameters it carries.

A mode and a placement are independent: a mode decides when pushes become an update and when a pull may be
answered, a placement what an update is. Local steps with an outer optimizer (:class:`OuterOptimizer`,
``update=outer``: the shards own the anchor and the outer optimizer; workers push the pseudo-gradient and pull
the anchor) is one more placement, served by the same modes. The protocol-level description both sides read is :mod:`commlab.transport.psproto`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from typing import Callable

import torch

from commlab.transport import psproto, wire
from commlab.core.localsteps import async_outer_refusal
from commlab.core.optim import torch_optimizer


class Refused(Exception):
    """A request this server will not serve; the message goes back to the worker."""


def optimizer_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The torch.optim class a description names (``torch.optim.adamw.AdamW``): only torch.optim's own
    classes, looked up by name, are built; nothing is imported or unpickled from the wire."""
    cls = torch_optimizer(name)
    if cls is None:
        raise Refused(f"optimizer {name} is not one of torch.optim's: the servers cannot build it "
                      f"(use update=worker to step it on the workers)")
    return cls


ROW = 1024  # sum_of_squares: elements per partial sum


def sum_of_squares(buf: torch.Tensor) -> float:
    """``buf``'s squared L2 norm, to about 1e-7 relative (float32 rounding of each row's norm): the norms of
    rows of :data:`ROW` elements in the buffer's own precision (at least float32), squared and summed in
    float64. A norm in float64 of the whole buffer (``dtype=torch.float64``) casts every element
    on one thread, ~25x slower (48 ms against 2 ms for 12.5M floats here), on the server's serving thread
    between a step's last push and its replies; a float32 norm of the whole is off by 1e-3 at that size."""
    flat = buf.reshape(-1)
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    whole = flat.numel() // ROW * ROW
    total = float(torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1, dtype=acc)
                  .to(torch.float64).square().sum()) if whole else 0.0
    if whole < flat.numel():
        total += float(flat[whole:].to(torch.float64).square().sum())
    if not math.isfinite(total) and flat.dtype != torch.float64:
        # a non-finite element, or a row whose float32 norm overflowed: float64 says which (skipped only if the former)
        total = float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
    return total


def hyper_from_wire(data: dict) -> dict:
    """Hyperparameters from the wire: lists become tuples again (betas)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


class Placement:
    """Where a key space's update runs (see the module's docstring); one instance per key space."""

    spec: psproto.Placement
    consistency: psproto.Consistency | None = None  # the mode it serves under (Mode.placement sets it)
    step_pull = ""  # what a sync worker pulls of a gathered step, beside the parameters: "sum" or "report"

    @property
    def step_pulls(self) -> tuple[str, ...]:
        """Every pull of a gathered step a worker of this placement may make."""
        return (self.step_pull,)

    def check(self, optim: dict) -> None:
        """Hello: refuse, before anything is fixed, what this placement cannot serve."""

    def build_optimizer(self, srv) -> torch.optim.Optimizer | None:
        """What steps the key space's pieces (``srv.params``, in hello order), or None."""
        return None

    def apply(self, srv, grads: dict[str, torch.Tensor], hyper) -> None:
        """One update over the keys in ``grads`` with the hyperparameters a push or commit carried."""
        raise Refused(f"{srv.cfg.name} holds no optimizer (update={self.spec.name})")

    def gathered(self, sync: "Sync") -> None:
        """Every worker still training completed sync's step."""
        raise NotImplementedError


class Averages(Placement):
    """update=worker: the shard only averages; the workers' optimizers step on what they pull."""

    spec = psproto.WORKER
    step_pull = "sum"

    def gathered(self, sync):
        sync.publish()


class ShardOptimizer(Placement):
    """update=server: the worker's optimizer class over this shard's pieces, one group per worker group (a
    group may hold no piece here), with the groups' hyperparameters."""

    spec = psproto.SERVER
    step_pull = "report"

    def check(self, optim):
        optimizer_class(optim["class"])

    def build_optimizer(self, srv):
        if srv.optim_desc is None:
            raise Refused("no optimizer yet: a worker must say hello first")
        cls = optimizer_class(srv.optim_desc["class"])
        groups = []
        for g in srv.optim_desc["groups"]:
            names = set(g["params"])
            groups.append({**hyper_from_wire(g["hyper"]), "params": [p for k, p in srv.params.items()
                                                                     if srv.piece_param[k] in names]})
        return cls(groups)

    def apply(self, srv, grads, hyper):
        srv.set_hyper(hyper)
        srv.step_optimizer(grads)

    def gathered(self, sync):
        sync.await_commits()


class OuterOptimizer(ShardOptimizer):
    """Local steps (``sync_every=H``, docs/localsteps.md): the pieces are the anchor, and the optimizer is the
    outer one, built from ``optim["outer"]`` of the hello (``{"class": "torch.optim.sgd.SGD", "kwargs": {...}}``,
    data, never pickled) as one group over this shard's pieces; a push is a worker's pseudo-gradient
    (anchor - its local parameters). Its state goes into the shard checkpoint with the optimizer's.

    Sync: the mode averages the N pushes, the commits apply one outer step (no hyperparameters travel: the
    outer ones are fixed by the spec). Async: Delayed Nesterov (Liu et al. 2024), each push applied alone as it
    lands (:meth:`apply`); the spec must be SGD (lr, momentum, nesterov)."""

    spec = psproto.OUTER

    def check(self, optim):
        outer = optim.get("outer")
        if not (isinstance(outer, dict) and isinstance(outer.get("class"), str) and isinstance(outer.get("kwargs"), dict)):
            raise Refused("update=outer: the hello carries no outer optimizer {class, kwargs}")
        cls = optimizer_class(outer["class"])
        kwargs = hyper_from_wire(outer["kwargs"])
        warmup = outer.get("warmup", 0)
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise Refused(f"update=outer: warmup must be a whole number of steps >= 0, got {warmup!r}")
        if warmup and self.consistency is not None and not self.consistency.gathers:
            raise Refused("update=outer: warmup= needs mode=sync (its steps are synchronous)")
        try:
            cls([torch.zeros(1)], **kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise Refused(f"outer optimizer {outer['class']}: {exc}") from None
        why = async_outer_refusal(cls, kwargs) if self.consistency is not None and not self.consistency.gathers else ""
        if why:
            raise Refused(why)

    @property
    def step_pulls(self):
        return ("report", "sum")  # the outer steps' report; the warm-up steps' averages

    def gathered(self, sync):
        """Sync: a warm-up step (``warmup=W``: wire steps below W, ordinary synchronous steps) is an average
        the workers pull into ``p.grad`` (as update=worker); a sync awaits the commits of its outer step."""
        if sync.step < int(sync.srv.optim_desc["outer"].get("warmup", 0)):
            sync.publish()
        else:
            sync.await_commits()

    def build_optimizer(self, srv):
        if srv.optim_desc is None:
            raise Refused("no optimizer yet: a worker must say hello first")
        self.check(srv.optim_desc)
        outer = srv.optim_desc["outer"]
        return optimizer_class(outer["class"])(list(srv.params.values()), **hyper_from_wire(outer["kwargs"]))

    def apply(self, srv, grads, hyper):
        if srv.mode.spec.gathers:  # sync: the average of the N pushes, one outer step
            srv.step_optimizer(grads)
            return
        self.delayed_nesterov(srv, grads)

    @staticmethod
    def delayed_nesterov(srv, grads: dict[str, torch.Tensor]) -> None:
        """Async: one pseudo-gradient ``g`` (of one worker, the keys it holds here) applied as it lands, with
        Delayed Nesterov: N = the workers, lr, beta (momentum) and nesterov from the outer SGD spec. Per key::

            x -= (lr / N) g                       every arrival: plain SGD
            D += g; k += 1                        the window's sum, the key's arrivals
            every N-th arrival (k = 0 mod N):     the momentum, once per N arrivals
                m' = beta m + D / N                (the first time: D / N, as torch's first buffer)
                x -= lr beta m'   (nesterov)  or  x -= lr beta m   (heavy ball)
                D = 0

        Over a window of N pushes from the same anchor this is exactly one synchronous ``SGD(lr, momentum,
        nesterov)`` step on their mean (its ``lr x mean`` spread over the arrivals); with momentum 0, plain
        SGD x 1/N per push. m, D and k live in the outer optimizer's state (``momentum_buffer``,
        ``delayed_sum``, ``arrivals``), so the shard checkpoint keeps them."""
        group = srv.optimizer.param_groups[0]
        lr, beta, nesterov = float(group["lr"]), float(group.get("momentum", 0.0)), bool(group.get("nesterov"))
        n = srv.world_size()
        for key, g in grads.items():
            srv._writable(key)
            p = srv.params[key]
            g = g.to(p.dtype)
            p.data.add_(g, alpha=-lr / n)
            if not beta:
                continue
            st = srv.optimizer.state[p]
            if "delayed_sum" not in st:
                st["delayed_sum"], st["arrivals"] = torch.zeros_like(p.data), 0
            st["delayed_sum"].add_(g)
            st["arrivals"] += 1
            if st["arrivals"] % n:
                continue
            old = st.get("momentum_buffer")
            new = st["delayed_sum"] / n if old is None else old * beta + st["delayed_sum"] / n
            st["momentum_buffer"] = new
            if nesterov:
                p.data.add_(new, alpha=-lr * beta)
            elif old is not None:
                p.data.add_(old, alpha=-lr * beta)
            st["delayed_sum"].zero_()


PLACEMENTS: dict[str, type[Placement]] = {"worker": Averages, "server": ShardOptimizer, "outer": OuterOptimizer}


@dataclass
class Partial:
    """What one worker has sent of one step so far."""

    step: int
    seen: set = field(default_factory=set)
    absent: set = field(default_factory=set)
    base: int | None = None  # oldest version its gradients were computed on
    rounds: dict = field(default_factory=dict)  # compress=: unit -> the last round it pushed
    skipped: set = field(default_factory=set)  # compress=: units a push named wholly absent from this step


class Mode:
    spec: psproto.Consistency
    refuses_nonfinite = True  # a NaN/Inf push poisons every worker's parameters: refuse it
    buffers_wait = False  # buffer pulls wait for their round (sync) or take the latest (async, ssp)

    def __init__(self, srv):
        self.srv = srv
        self.last_step: dict[int, int] = {}  # rank -> last step applied (-1: none)
        self.partial: dict[int, Partial] = {}  # rank -> what it has sent of the step in flight
        self.enters: dict[int, int] = {}  # a replacement rank -> the first step it pushes (servers.membership)

    @property
    def name(self) -> str:
        return self.spec.name

    def check_hello(self, meta: dict, sender: str) -> None:
        """Refuse a worker that asked for another mode (or, ssp, another bound)."""
        mode = meta.get("mode")
        if mode and mode != self.name:
            raise Refused(f"{self.srv.cfg.name} runs mode {self.name!r}, worker {sender} asked for {mode!r}")

    def placement(self, update, sender: str) -> Placement:
        """The placement a hello's ``update`` names (none: the mode's default), refused where not allowed."""
        try:
            placement = PLACEMENTS[self.spec.placement(update or "").name]()
        except ValueError as exc:
            raise Refused(f"{self.srv.cfg.name}: worker {sender} asked for update={update!r}, but {exc}") from None
        placement.consistency = self.spec
        return placement

    @property
    def gathering(self) -> int | None:
        """The step the shard gathers from every worker (sync), or None: each push is applied alone."""
        return None

    def step_pulls(self) -> frozenset[str]:
        """What a pull may ask for besides parameters, buffers and the final ones (``what=``)."""
        return frozenset()

    def answer(self, what: str, h: wire.Header) -> tuple[str, dict, list, bool]:
        """The reply to a ready pull of one of :meth:`step_pulls`: (op, meta, parts, through the worker's
        shared-memory link)."""
        raise Refused(f"{self.srv.cfg.name} runs {self.name}, which serves no pull of {what}")

    def partial_step(self, rank: int, t: int) -> Partial:
        """What ``rank`` has sent of step ``t`` so far: a fresh record when ``t`` is not the step it was on."""
        part = self.partial.get(rank)
        if part is None or part.step != t:
            part = self.partial[rank] = Partial(t)
        return part

    def step_in(self, rank: int) -> bool:
        """Whether ``rank``'s whole step is in while the shard still gathers the others' (sync): a push of
        that step again is a duplicate. Async, ssp: never (a complete step is applied at once)."""
        return False

    def start_step(self) -> int:
        """The step a rank the shard never saw starts at (hello of a new or resumed worker)."""
        return 0

    def expected_step(self, rank: int) -> int:
        return self.last_step[rank] + 1

    def latest_pull(self, rank: int) -> int:
        """The latest step a pull from ``rank`` may name (a later one could only wait forever)."""
        return self.last_step[rank] + 1

    def fold(self, rank: int, t: int, part: Partial, frames: dict, absent: list, meta: dict) -> None:
        raise NotImplementedError

    def fold_unit(self, rank: int, t: int, part: Partial, units, unit, r: int, payload: list, absent: list,
                  meta: dict) -> None:
        """A compressed push (:mod:`servers.compressed`): round ``r`` of ``unit``'s payload."""
        raise NotImplementedError

    def ready(self, rank: int, after: int, what: str, meta: dict) -> bool:
        return self.last_step[rank] >= after

    def commit(self, rank: int, t: int, meta: dict) -> dict:
        raise Refused(f"mode {self.name} takes no commit: each push is applied as it completes")

    def join(self, rank: int, t: int) -> None:
        """``rank`` left its loop (ex.join()) before step ``t``; the server records it after this returns."""

    def settle(self) -> None:
        """A worker joined or left: whatever waited only for it may go on."""

    def lose(self, rank: int) -> int:
        """``rank`` left the membership (:mod:`servers.membership`): take out what it sent of the step in flight
        and has not been applied; return 1 when such a partial step was dropped, else 0. The server settles
        afterwards."""
        part = self.partial.pop(rank, None)
        return int(part is not None and bool(part.seen or part.absent or part.rounds))

    def entry_step(self, rank: int) -> int:
        """The soonest step a replacement for ``rank`` may push (its first after the start pull)."""
        return self.last_step.get(rank, -1) + 1

    def enter(self, rank: int, t: int) -> None:
        """A replacement for ``rank`` pushes from step ``t`` on (``t`` >= :meth:`entry_step`)."""
        self.enters[rank] = t
        self.last_step[rank] = t - 1

    def entry_open(self, rank: int) -> bool:
        """``rank`` entered and has pushed nothing since: its entry may move to a later step (another shard went
        past the one it asked for first)."""
        return rank in self.enters and rank not in self.partial and self.last_step.get(rank) == self.enters[rank] - 1

    def waiting_for(self) -> list[int]:
        return []

    def whole(self) -> list[int]:
        """The ranks whose push of the step in flight is whole on this shard (sync; [] where a push is applied alone)."""
        return []

    def restart(self) -> int:
        """A new attempt of the job (every rank restarted; the server set its world size already): drop what
        the dead attempt left half-done, so that the new attempt's pushes replace it; return how many ranks' pushes were dropped. Async, ssp: a
        rank's partial step (not every piece in) was never applied, and the rank pushes that step again."""
        dropped = len(self.partial)
        self.partial.clear()
        self.enters.clear()
        return dropped

    def state(self) -> dict:
        """The mode's part of a checkpoint (``last_step`` is stored beside it, see :meth:`load`)."""
        return {}

    def load(self, state: dict, last_step: dict[int, int]) -> None:
        """Resume from a checkpoint: :meth:`state`'s dict, and each rank's last applied step."""
        self.last_step = dict(last_step)


class Async(Mode):
    """Each worker's step is applied once all of its pieces for this shard are in."""

    spec = psproto.ASYNC

    def __init__(self, srv):
        super().__init__(srv)
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # rank -> key -> buffer: a step that came in pieces

    def start_step(self):
        """A rank joining a job that already ran (a grown attempt) starts on the slowest clock still held, so
        SSP's bound neither stalls the others for its sake nor lets it run ahead; 0 for a fresh job."""
        return min((t + 1 for t in self.last_step.values()), default=0)

    def restart(self):
        self.grads.clear()
        return super().restart()

    def lose(self, rank):
        self.grads.pop(rank, None)  # a step that came in pieces, never applied
        return super().lose(rank)

    def entry_step(self, rank):
        """A replacement goes on from its rank's clock, or from the slowest live one when that is further (so
        that SSP's bound does not hold the others back for the steps it missed)."""
        clocks = [self.last_step.get(r, -1) + 1 for r in self.srv.on_the_clock()]
        return max(self.last_step.get(rank, -1) + 1, min(clocks, default=0))

    def fold(self, rank, t, part, frames, absent, meta):
        tensors = {key: [(spec.offset, wire.frame_tensor(spec, frame)) for spec, frame in parts]
                   for key, parts in frames.items()}
        self._fold_tensors(rank, t, part, tensors, absent, meta)

    def fold_unit(self, rank, t, part, units, unit, r, payload, absent, meta):
        dense = units.decoded(unit, payload, meta["cmeta"])  # decoded alone: the push's own gradient
        if self.refuses_nonfinite and not bool(torch.isfinite(dense.sum())):
            self.srv.stats.nonfinite += 1
            raise Refused(f"push of step {t} from rank {rank}: unit {unit.key} holds NaN or Inf; refused, nothing "
                          f"applied")
        part.rounds[unit.key] = r
        tensors = {k: [(0, dense[o:o + c])] for k, (o, c) in unit.slices.items() if k not in absent}
        self._fold_tensors(rank, t, part, tensors, absent, meta)

    def _fold_tensors(self, rank, t, part, tensors: dict, absent, meta):
        """``tensors``: key -> [(offset, values)], ranges of that key's gradient."""
        srv = self.srv
        part.base = meta["base"] if part.base is None else min(part.base, meta["base"])
        whole = len(tensors) + len(absent) == len(srv.pieces) and not part.seen and not part.absent
        if whole and all(len(parts) == 1 for parts in tensors.values()):
            grads = {key: parts[0][1] for key, parts in tensors.items()}  # no copy at all
        else:
            buffers = self.grads.setdefault(rank, {})
            for key, parts in tensors.items():
                buf = buffers.get(key)
                if buf is None:
                    buf = buffers[key] = srv.new_buffer(key)
                for offset, values in parts:
                    buf[offset:offset + values.numel()].copy_(values)
            part.seen |= set(tensors)
            part.absent |= set(absent)
            if len(part.seen) + len(part.absent) < len(srv.pieces):
                return
            grads = {k: buffers[k] for k in part.seen}
        del self.partial[rank]
        srv.placement.apply(srv, grads, meta.get("hyper"))
        clocks = [self.last_step.get(r, -1) + 1 for r in srv.on_the_clock()]
        srv.stats.clock_gap[t - min(clocks, default=t)] += 1
        self.last_step[rank] = t
        srv.count_update([srv.version - part.base])


class SSP(Async):
    """Async updates; a pull after step t waits while ``t + 1 - slowest > S``."""

    spec = psproto.SSP

    def check_hello(self, meta, sender):
        super().check_hello(meta, sender)
        if meta.get("mode") and meta.get("staleness") not in (None, self.srv.cfg.staleness):
            raise Refused(f"{self.srv.cfg.name} runs ssp with staleness {self.srv.cfg.staleness}, worker {sender} "
                          f"asked for {meta.get('staleness')}")

    def _active(self) -> dict[int, int]:
        return {r: self.last_step.get(r, -1) + 1 for r in self.srv.on_the_clock()}

    def ready(self, rank, after, what, meta):
        if not super().ready(rank, after, what, meta):
            return False
        slowest = min(self._active().values(), default=after + 1)
        return after + 1 - slowest <= self.srv.cfg.staleness

    def waiting_for(self):
        active = self._active()
        slowest = min(active.values(), default=0)
        return [r for r, t in active.items() if t == slowest]


class Sync(Mode):
    """Bulk-synchronous: step t's N gradients are averaged as they arrive (``x 1/N`` each).

    update=worker: a key's average goes out as soon as its N contributions are in; the step
    completes (one "update" in the stats) when every worker's pieces are in.
    update=server: once every worker's pieces are in (the step is *gathered*), each worker asks
    for a report (the shard's squared norm of the average and whether it is finite) and then
    commits (factor, hyperparameters) or skips; the N-th commit applies one optimizer step.
    """

    spec = psproto.SYNC
    refuses_nonfinite = False  # summed: every worker sees the inf, and every GradScaler skips
    buffers_wait = True

    def __init__(self, srv):
        super().__init__(srv)
        self.step = 0  # the step being gathered
        self.sums: dict[str, torch.Tensor] = {}
        self.present: Counter = Counter()  # key -> workers that sent it this step
        self.contributed: Counter = Counter()  # key -> workers that sent it or said it is absent
        self.summed: set[str] = set()  # keys whose N contributions are in
        self.complete: set[int] = set()  # ranks whose step is in
        self.gathered = False  # update=server: every rank is in, the commits are awaited
        self.commits: dict[int, tuple[float, list | None]] = {}
        self.report: dict | None = None  # update=server: this step's (or, once done, the last step's)
        self.last_sums: dict[str, torch.Tensor] = {}  # update=worker: the last completed step's averages
        self.last_absent: list[str] = []
        # keep-going (servers.membership): rank -> what it folded of the step in flight, (key, offset, values)
        # views of the received frames, held until its step is in, so that a rank lost before can be taken out
        self.held: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
        self.retake: set[int] = set()  # compress=, keep-going: units whose aggregate a lost rank was taken out of

    def start_step(self):
        return self.step

    @property
    def gathering(self):
        return self.step

    def step_in(self, rank):
        return rank in self.complete

    def expected_step(self, rank):
        return self.step

    def latest_pull(self, rank):
        return max(self.step, self.enters.get(rank, 0) - 1)  # a replacement's start pull: before its entry

    def _owing(self) -> set[int]:
        """The ranks whose pushes this step waits for: not joined, not lost, entered (a joined one counts as zeros)."""
        return set(self.srv.pushers(self.step))

    def _needed(self) -> int:
        """Contributions each key of this step takes: the owing ranks', and those of ranks lost with their step
        in (kept: it was whole on this shard)."""
        return len(self._owing() | self.complete)

    def _divisor(self) -> int:
        """What the step's mean divides by: the ranks whose step counts, and the joined ones when they asked to
        be counted as zeros (DDP's ``divide_by_initial_world_size``)."""
        srv = self.srv
        joined = len(srv.joined) if srv.joined and all(d for _, d in srv.joined.values()) else 0
        return len(self._owing() | self.complete) + joined

    def entry_step(self, rank):
        return self.step + 1  # the step in flight is the survivors'; the replacement enters at the next boundary

    def enter(self, rank, t):
        self.enters[rank] = t
        self.last_step[rank] = self.step - 1

    def entry_open(self, rank):
        return (rank in self.enters and self.step <= self.enters[rank] and rank not in self.complete
                and rank not in self.partial)

    def fold(self, rank, t, part, frames, absent, meta):
        srv = self.srv
        scale, needed = 1.0 / srv.world_size(), self._needed()
        for key in [*frames, *absent]:
            if key in frames:
                buf = self.sums.get(key)
                if buf is None:
                    buf = self.sums[key] = srv.new_buffer(key)
                first = self.present[key] == 0
                for spec, frame in frames[key]:  # straight from the received frame into the mean
                    src, dst = wire.frame_tensor(spec, frame), buf[spec.offset:spec.offset + spec.count]
                    torch.mul(src, scale, out=dst) if first else dst.add_(src, alpha=scale)
                    if srv.members.on:
                        self.held.setdefault(rank, []).append((key, spec.offset, src))
                self.present[key] += 1
            self.contributed[key] += 1
            self._sum_if_in(key, needed)
        part.seen |= set(frames)
        part.absent |= set(absent)
        if len(part.seen) + len(part.absent) == len(srv.pieces):
            del self.partial[rank]
            self.held.pop(rank, None)
            self.complete.add(rank)
        self._complete_if_in(needed)

    def fold_unit(self, rank, t, part, units, unit, r, payload, absent, meta):
        """Held until every worker's is in, then summed (:meth:`servers.compressed.Units.total`); round 0 counts the
        unit's pieces present (or absent). Once every worker's last round of a unit is in, update=server takes its
        aggregate as the pieces' averaged gradient; a worker's step is in once its last round of every unit is."""
        last, needed = units.comp.rounds - 1, self._needed()
        acc = units.add(rank, unit, r, payload, meta["cmeta"])
        part.rounds[unit.key] = r
        if r == 0:
            part.absent.update(absent)
            for key in unit.keys:
                self.contributed[key] += 1
                self.present[key] += key not in absent
            for other in meta["skipped"]:  # units named wholly absent: counted once, their rounds all done
                if other.key not in part.rounds:
                    part.skipped.add(other.key)
                    part.rounds[other.key] = last
                    for key in other.keys:
                        self.contributed[key] += 1
        if len(acc.payloads) >= needed:
            self._total(units, unit, r, needed)
        if all(part.rounds.get(u) == last for u in units.units):
            del self.partial[rank]
            self.complete.add(rank)
            if self.srv.members.on and not self._published():
                units.release(rank)
        self._complete_if_in(needed)

    def _published(self) -> bool:
        """compress=: whether a (unit, round)'s sum may go out once made: the workers pull it (update=worker, or
        a compressor whose payloads do not decode alone: PowerSGD's next round needs the summed P). Then a rank
        lost after its payload went into the sum keeps its part there, as an uncompressed key's average that
        went out does; else the shard alone reads the sum, and a lost rank's part is taken out again."""
        return not self.srv.placement.spec.shards_step or not self.srv.units.comp.decodes_alone

    def _factor(self, needed: int) -> float:
        """What a sum of the ranks' 1/N-scaled payloads is multiplied by to be their mean: N / the ranks that
        count (1 while every rank does; compress= has no joined ranks, so the divisor is ``needed``)."""
        return 1.0 if needed == self.srv.world else self.srv.world / self._divisor()

    def _total(self, units, unit, r: int, needed: int) -> None:
        """Every worker still training sent (unit, round): its sum. Published sums are the mean over the ranks
        that count at once (keep-going: x N / them); a sum the shard alone reads stays unscaled, keeping the
        payloads of ranks whose step is not whole (keep-going), until its aggregate is taken (:meth:`_aggregate`)."""
        if self._published():
            units.total(unit, r, self._factor(needed))
        else:
            units.total(unit, r, keep=set(self.partial) if self.srv.members.on else ())
        if r == units.comp.rounds - 1 and self.srv.placement.spec.shards_step:  # the shard steps on the average
            self._aggregate(units, unit, needed)

    def _aggregate(self, units, unit, needed: int) -> None:
        """update=server: a unit's last round is summed: its aggregate is its pieces' averaged gradient."""
        dense = units.aggregate(unit)
        factor = 1.0 if self._published() else self._factor(needed)
        if factor != 1.0:
            dense.mul_(factor)
        for key, (o, c) in unit.slices.items():
            if self.present[key]:
                self.sums[key] = dense[o:o + c]
            else:
                self.sums.pop(key, None)

    def _lose_units(self, rank: int, part: Partial) -> None:
        """compress=: ``rank`` left with its step half-pushed here. Each payload of it that is not in a sum yet
        goes; one in a sum the shard alone reads (update=server, payloads that decode alone) is subtracted
        again, and that unit's aggregate is taken anew once the membership dropped the rank (:meth:`settle`);
        one in a published sum keeps its part (some survivor may hold that sum). Round 0's counts follow."""
        units = self.srv.units
        for u in part.skipped:  # named absent, nothing of it held: its count goes
            for key in units.units[u].keys:
                self.contributed[key] -= 1
        for unit in units.units.values():
            for r in range(units.comp.rounds):
                if not units.take_out(unit, r, rank):
                    continue
                if r == 0:
                    for key in unit.keys:
                        self.contributed[key] -= 1
                        self.present[key] -= key not in part.absent
                if units.ready(unit.key, r) and r == units.comp.rounds - 1:
                    self.retake.add(unit.key)

    def join(self, rank, t):
        pushed = rank in self.complete or rank in self.partial
        if t != self.step or pushed:
            raise Refused(f"join of rank {rank} before step {t}, but {self.srv.cfg.name} is gathering step "
                          f"{self.step}" + (" with pushes of that rank" if pushed else ""))

    def settle(self):
        needed, units = self._needed(), self.srv.units
        if units is None:
            for key in list(self.contributed):
                self._sum_if_in(key, needed)
        else:  # compress=: the (unit, round)s that waited only for ranks that left, and the sums they were taken out of
            for (u, r), acc in sorted(units.acc.items()):
                if acc.total is None and acc.payloads and len(acc.payloads) >= needed:
                    self._total(units, units.units[u], r, needed)
            if self.srv.placement.spec.shards_step:
                for u in sorted(self.retake):
                    self._aggregate(units, units.units[u], needed)
            self.retake.clear()
        self._complete_if_in(needed)
        if self.gathered and self.commits:  # the commit that was missing was a lost rank's
            self._apply_if_committed()

    def _sum_if_in(self, key: str, needed: int) -> None:
        """Every worker still training has sent ``key`` (or said it is absent): its average is ready. Divided
        by N; by the workers still training instead when the joined ones asked for that (DDP's option), and
        never by ranks lost before their step was in (keep-going)."""
        if self.contributed[key] < needed or key in self.summed:
            return
        self.summed.add(key)
        divisor = self._divisor()
        if divisor != self.srv.world and key in self.sums and divisor:
            self.sums[key].mul_(self.srv.world / divisor)
        self.srv.summed(key)

    def _complete_if_in(self, needed: int) -> None:
        """Every worker still training completed the step: the placement says what that means."""
        owing = self._owing()
        if needed and owing and owing <= self.complete and not self.gathered:
            self.srv.placement.gathered(self)

    def lose(self, rank):
        """A rank whose step is whole on this shard stays in it (its average may be out already). Otherwise
        what it folded in is subtracted again (its held frames), its keys counted out, and the keys whose
        mean was fixed re-divided once the others are in; under update=worker a key whose average was out
        already (some survivor may hold it) keeps its part. compress=: the same per (unit, round)
        (:meth:`_lose_units`)."""
        part = self.partial.pop(rank, None)
        held = self.held.pop(rank, [])
        if rank in self.complete or part is None:
            return 0
        if part.rounds:  # compress=
            self._lose_units(rank, part)
            return 1
        srv, scale = self.srv, 1.0 / self.srv.world_size()
        published = not srv.placement.spec.shards_step  # update=worker: a summed key went out
        divisor = self._divisor()  # the lost rank still counted (the membership drops it after this returns)
        for key in part.seen | part.absent:
            if key in self.summed:
                if published:
                    continue
                self.summed.discard(key)
                if key in self.sums and divisor != srv.world and divisor:
                    self.sums[key].mul_(divisor / srv.world)  # back to sum / N
            self.contributed[key] -= 1
            if key in part.seen:
                self.present[key] -= 1
        for key, offset, src in held:
            if key in part.seen and (key not in self.summed or not published):
                self.sums[key][offset:offset + src.numel()].sub_(src, alpha=scale)
        return 1

    def publish(self) -> None:
        """The step's averages are final (update=worker): kept for the pulls still to come; the step is done."""
        self.last_sums = self.sums
        self.last_absent = [k for k in self.srv.pieces if self.present[k] == 0]
        self._done(counted=True)

    def await_commits(self) -> None:
        """The step is gathered (update=server): its report is ready; every worker's commit applies it."""
        self.gathered = True
        self.report = self._report()

    def _report(self) -> dict:
        sumsq = 0.0
        for key, buf in self.sums.items():
            if self.present[key]:
                sumsq += sum_of_squares(buf)
        return {"step": self.step, "sumsq": sumsq, "finite": math.isfinite(sumsq)}

    def commit(self, rank, t, meta):
        srv = self.srv
        if not srv.placement.spec.shards_step:
            raise Refused(f"commit from rank {rank}: {srv.cfg.name} only sums (update={srv.placement.spec.name})")
        if t < self.step:
            return {"duplicate": True}  # sent again after a reconnect, or the step was skipped already
        if t != self.step or not self.gathered:
            raise Refused(f"commit of step {t} from rank {rank}, but {srv.cfg.name} is gathering step "
                          f"{self.step} (every worker's gradients must be in first)")
        if meta.get("skip"):  # every worker saw the same non-finite report: the step is dropped for all
            srv.stats.skipped += 1
            self._done(counted=False)
            return {"skipped": True}
        factor, hyper = meta.get("factor"), meta.get("hyper")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor):
            raise Refused(f"commit from rank {rank}: factor must be a finite number, got {factor!r}")
        srv.check_hyper(hyper)  # now, not when the last commit applies the step
        self.commits[rank] = (float(factor), hyper)
        self._apply_if_committed()
        return {}

    def _apply_if_committed(self) -> None:
        """Every owing rank committed: one update with the mean of their factors."""
        srv = self.srv
        if not self.gathered or not self._owing() <= set(self.commits):
            return
        factors = [f for f, _ in self.commits.values()]
        factor = factors[0] if len(set(factors)) == 1 else math.fsum(factors) / len(factors)
        grads = {k: buf for k, buf in self.sums.items() if self.present[k]}
        if factor != 1.0:
            for buf in grads.values():
                buf.mul_(factor)
        srv.placement.apply(srv, grads, self.commits[min(self.commits)][1])
        self._done(counted=True)

    def restart(self):
        """The step in flight, pushed by some ranks only, is dropped whole: every rank of the new attempt
        pushes it again (the sums keep no per-rank part to take out, and every rank restarts). A step
        gathered (update=server: every push in, the commits awaited) is kept, and its commits dropped: its
        average exists, and another shard may have applied it already (a rank killed between its commits
        to two shards), so the new attempt's pushes of it are duplicates and its commits apply it here, once,
        from the same pushes as there; so are the pushes of a rank the new attempt added (its world, already
        set, may be another). Applied steps are kept, whatever their pulls' fate."""
        self.enters.clear()
        if self.gathered:
            self.commits.clear()
            self.complete = set(range(self.srv.world))
            return 0
        dropped = len(self.complete | set(self.partial))
        self.partial.clear()
        self._clear()
        return dropped

    def _done(self, counted: bool) -> None:
        srv = self.srv
        for r in range(srv.world):
            self.last_step[r] = self.step
        self.step += 1
        if srv.units is not None:
            srv.units.next_step()  # compress=: this step's sums stay for the pulls still to come
        self._clear()
        if counted:
            srv.count_update([0])

    def _clear(self) -> None:
        """Nothing of the current step gathered yet."""
        self.sums = {}  # fresh buffers: a zero-copy reply may still read the old ones
        self.present.clear()
        self.contributed.clear()
        self.summed.clear()
        self.complete.clear()
        self.commits.clear()
        self.held.clear()
        self.retake.clear()
        self.gathered = False
        if self.srv.units is not None:
            self.srv.units.drop_step()  # compress=: the step's held payloads and sums

    def ready(self, rank, after, what, meta):
        if what == "sum":
            keys = meta.get("keys")
            return self.step > after or bool(keys) and self.summed.issuperset(keys)
        if what == "report":
            return self.step > after or self.gathered
        if what == "csum":
            units = self.srv.units
            return self.step > after or units is not None and units.ready(meta["unit"], meta["round"])
        return self.step > after

    def step_pulls(self):
        """The placement's pull of a gathered step, and compress='s sums of a (unit, round)."""
        return frozenset({*self.srv.placement.step_pulls, *(("csum",) if self.srv.units is not None else ())})

    def answer(self, what, h):
        srv, current = self.srv, self.step == h.meta["after_step"]
        if what == "report":
            return "ok", {"report": self.report}, [], False
        if what == "sum":
            sums = self.sums if current else self.last_sums
            keys = h.meta.get("keys") or list(srv.pieces)
            absent = [k for k in keys if (self.present[k] == 0 if current else k in self.last_absent)]
            parts = [part for k in keys if k not in absent for part in wire.split(k, sums[k])]
            return "params", {"version": srv.version, "absent": absent}, parts, True
        units = srv.units  # csum: step_pulls offered it only with compress=
        unit = units.units[h.meta["unit"]]
        absent = [k for k in unit.keys if (self.present[k] == 0 if current else k in self.last_absent)]
        parts, meta = units.sums(unit.key, h.meta["round"], current)
        return "params", {"version": srv.version, "absent": absent, **meta}, parts, False

    def whole(self):
        return sorted(self.complete)

    def waiting_for(self):
        owing = sorted(self._owing())
        if self.gathered:
            return [r for r in owing if r not in self.commits]
        return [r for r in owing if r not in self.complete]

    def state(self):
        return {"sync_step": self.step, "last_sums": {k: v.clone() for k, v in self.last_sums.items()},
                "last_absent": list(self.last_absent), "report": self.report}

    def load(self, state, last_step):
        super().load(state, last_step)
        self.step = int(state.get("sync_step", 0))
        self.last_sums = dict(state.get("last_sums", {}))
        self.last_absent = list(state.get("last_absent", []))
        self.report = state.get("report")


MODES: dict[str, type[Mode]] = {m.spec.name: m for m in (Sync, Async, SSP)}
