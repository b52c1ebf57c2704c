"""The ``ps://`` client's side of an update placement under the servers' consistency mode.

Hello tells the worker the servers' mode and placement (:class:`commlab.transport.psproto.Consistency`,
:class:`commlab.transport.psproto.Placement`); :func:`for_servers` then builds one object that the exchanger asks
on every step, instead of comparing names:

==================  =======================================  ==========================================
object              a push, then                              ``optimizer.step()``
==================  =======================================  ==========================================
:class:`Averages`   the keys' averages asked back at once     the user's own optimizer, on the averages
(update=worker)     (``pull what=sum``), into ``p.grad``
:class:`Commit`     the shards' report (sum of squares,        commit (factor: unscale x clip; the groups'
(server, sync)      finite?) read at the end of backward       hyperparameters) or skip; pull parameters
:class:`Apply`      nothing (the push carries the groups'     pull the newest parameters the mode allows
(server, async,     hyperparameters: applied alone)
ssp)
==================  =======================================  ==========================================

Local steps with the outer optimizer on the shards (``sync_every=H``: :class:`LocalOuter`, whose
:class:`ShardsOuter` pushes the pseudo-gradient and pulls the anchor every H steps) is one more such class
and one more entry in :data:`PLACEMENTS`; the exchanger's step path does not change. The shard's side of the same choices is :mod:`servers.modes`.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch

from commlab.transport import psproto, wire
from commlab.base.errors import ConfigError, ModelMismatch
from commlab.base.handles import FutureHandle, GroupHandle
from commlab.core import localsteps
from commlab.core.manifest import _plain
from commlab.regimes.ps_compress import CompressedPushes

if TYPE_CHECKING:
    from commlab.regimes.ps import PSExchanger, _Shard


class StepPlacement:
    """What one placement does on the worker at each point of a step (the defaults: nothing).

    Every method runs on the training thread unless it says otherwise; ``ex`` is the exchanger that
    built it (its shards, buckets, stats)."""

    spec: psproto.Placement
    clips = False  # URL clip_norm= can be honoured (the shards commit one step over the average)

    def __init__(self, ex: "PSExchanger", mode: psproto.Consistency):
        self.ex, self.mode = ex, mode

    @property
    def updates_remotely(self) -> bool:
        """``optimizer.step()`` is taken over (the shards step); else the user's optimizer steps here."""
        return self.spec.shards_step

    @property
    def keeps_state(self) -> bool:
        """A restarted job resumes from the servers (parameters, optimizer state, applied steps)."""
        return self.spec.shards_step

    def resume_step(self, steps: list[int]) -> int:
        """The wire step to go on from, given every shard's hello (``next_step``). The shards hold the
        trained state: the step they have applied, which is where the loop resumes (:attr:`start_step`; 0 on
        a fresh start). A step applied on some shards only (a rank killed between its commits; a push of
        async that reached one shard) is pushed again: those shards acknowledge it as a duplicate, the others
        apply it, so each applies it once. They hold none (update=worker, the user's checkpoint does): the
        numbering goes on from the furthest shard and :attr:`start_step` stays 0."""
        if not self.keeps_state:
            return max(steps)
        self.ex.start_step = min(steps)
        return self.ex.start_step

    def start_after(self, base: int, next_step: int) -> int:
        """The step after which the start pull reads a shard whose hello said ``next_step``: the step before the
        wire step the loop goes on from (``base``), on every shard alike."""
        return base - 1

    def adopt(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        """Setup, before the start pull: what becomes of the user's optimizer."""

    def push_meta(self) -> dict:
        """What every push of this step carries besides its gradients."""
        return {}

    def after_push(self, shard: "_Shard", step: int, keys: list[str], shown: str) -> None:
        """On ``shard``'s thread, right after one push of ``keys``: what to ask for at once."""

    @property
    def replies_in_backward(self) -> bool:
        """Whether :meth:`after_push` asked for replies the end of backward must collect."""
        return False

    def finish(self, step: int) -> None:
        """The end of backward, every push of step ``step`` sent (and, where the placement asked for them
        during backward, every reply in): make ``p.grad`` what the loop should see."""

    def remote_update(self, timeout: float) -> None:
        """What ``optimizer.step()`` becomes where the shards step."""
        raise ConfigError(f"ps:// update={self.spec.name}: the user's optimizer steps on the workers")

    def outer(self) -> localsteps.Outer:
        """Local steps (``sync_every=``): where the anchor and the outer optimizer live."""
        raise ConfigError(f"ps:// sync_every= needs the servers to run the outer optimizer (update=outer); they "
                          f"run update={self.spec.name}")

    def join_parts(self, shard: int) -> list:
        """Frames a joining worker sends ``shard`` along with its join."""
        return []

    def bench_commit(self) -> dict | None:
        """What :meth:`~commlab.regimes.ps.PSExchanger.push_pull_async` commits between its push and its pull
        (None: nothing)."""
        return None

    def loaded(self) -> None:
        """``ex.load_state_dict`` ran: where the shards hold the model, rank 0's parameters go to them."""
        ex = self.ex
        if self.keeps_state and ex.rank == 0:
            ex._on_all(lambda s: s.request("load", -1, ex._parts(s.index, None), what="parameters"), "parameters")


class Averages(StepPlacement):
    """update=worker: the shards average; each bucket's averages come back into ``p.grad`` during backward."""

    spec = psproto.WORKER

    def after_push(self, shard, step, keys, shown):
        shard.post("pull", step, meta={"after_step": step, "keys": keys, "what": "sum"},
                   what=f"average of {shown} at step {step}", take=lambda h, data: self._take_sum(h, data, shard))

    @property
    def replies_in_backward(self) -> bool:
        return True

    def _take_sum(self, h: wire.Header, data, shard: "_Shard") -> int:
        """On a shard's thread: an average into the bucket ranges of its keys (``p.grad`` views). Keep-going: a
        shard that asks this rank for its state (a replacement enters) is noted (:meth:`PSExchanger._donate`)."""
        ex = self.ex
        if "donate" in h.meta:
            ex._asked(shard.index, h.meta["donate"])
        st = ex._staging
        for spec, frame in zip(h.frames, data):
            bi, _, start = ex._locate(spec.key, spec.offset, spec.count, "the average of ")
            # in the bucket's layout: p.grad's view, or (CUDA) its host mirror
            st.host(bi)[start:start + spec.count].copy_(wire.frame_tensor(spec, frame))
            if st.is_staged(bi):
                st.to_device(bi, start=start, stop=start + spec.count)
        absent = h.meta.get("absent", [])
        if absent:
            ex._absent.update(absent)
        return h.data_bytes

    def finish(self, step):
        ex = self.ex
        dropped = {pc.param for pieces in ex._pieces for pc in pieces if pc.key in ex._absent}
        for b in ex.buckets:
            for i, (name, p) in enumerate(zip(b.names, b.params)):
                p.grad = None if name in dropped else b.view(i)

    def join_parts(self, shard):
        return self.ex._parts(shard, None)  # kept as everyone's final parameters when this rank joins last


class ShardsStep(StepPlacement):
    """update=server: the shards run the user's optimizer class over their pieces; ``p.grad`` after
    backward stays this worker's own gradient, and ``optimizer.step()`` becomes a pull of the parameters."""

    spec = psproto.SERVER

    def __init__(self, ex, mode):
        super().__init__(ex, mode)
        self._probe: tuple[torch.Tensor, int, float] | None = None  # (bucket grads, index, value pushed)
        self._warned = False  # said once that the servers cannot do what the loop does to p.grad

    def adopt(self, optimizer, fresh):
        ex = self.ex
        if optimizer.state:
            ex._carry_state(optimizer, fresh)  # before the start pull: no push can reach a shard before it
        ex._take_over_state(optimizer)

    def _note_probe(self) -> None:
        """Note one element of this worker's gradient (the largest) to measure, when ``optimizer.step()``
        runs, what the loop did to ``p.grad`` in between (:meth:`_loop_factor`)."""
        best, self._probe = 0.0, None
        for b in self.ex.buckets:
            if b.numel:
                i = int(b.grads.abs().argmax())
                v = float(b.grads[i])
                if abs(v) > best:
                    best, self._probe = abs(v), (b.grads, i, v)

    def _loop_factor(self) -> float:
        """What the loop multiplied ``p.grad`` by between backward and ``optimizer.step()``: GradScaler's
        ``unscale_`` (a power of two), a ``clip_grad_norm_`` (anything else), or 1. Says once (:meth:`_lost`)
        when the servers cannot do what the loop meant."""
        if self._probe is None:
            return 1.0
        grads, i, pushed = self._probe
        factor = float(grads[i]) / pushed
        if factor != 1.0 and not self._warned:
            why = self._lost(factor)
            if why:
                self._warned = True
                warnings.warn(why, stacklevel=6)
        return factor

    def _lost(self, factor: float) -> str:
        """What is lost when the loop scaled ``p.grad`` by ``factor`` ("" : nothing)."""
        raise NotImplementedError


class Commit(ShardsStep):
    """update=server under a gathering mode (sync): at the end of backward every shard reports its part
    of the average's squared norm and whether it is finite; ``optimizer.step()`` commits (one factor: the
    loop's unscale times clip_norm's coefficient; the groups' hyperparameters), and the N-th commit steps
    the shards' optimizer once."""

    clips = True

    def __init__(self, ex, mode):
        super().__init__(ex, mode)
        self._skipped = False  # this step's summed gradient was not finite
        self._norm = 0.0  # global L2 norm of this step's averaged (pushed) gradient

    def finish(self, step):
        self.ex._drop_absent_grads()  # p.grad: this worker's own gradient
        self._report(step)

    def _report(self, step: int) -> None:
        """Every shard's squared norm of its part of the average and whether it is finite, once every
        worker's gradient is in. Not finite: every worker skips the step on every shard (the same decision
        everywhere, since every worker reads the same reports) and writes inf into its own gradient, so that a
        GradScaler finds it and lowers its scale on every rank."""
        ex = self.ex
        reports: list[dict] = [{} for _ in ex.shards]

        def ask(s: "_Shard"):
            def take(h, _data):
                reports[s.index] = h.meta.get("report") or {}
                return 0
            s.post("pull", step, meta={"after_step": step, "what": "report"}, what=f"report of step {step}",
                   take=take)
            return s.collect()

        ex._on_all(ask, f"report of step {step}")
        if any(r.get("step") != step for r in reports):
            raise ModelMismatch(f"the shards reported steps {[r.get('step') for r in reports]}, expected {step}")
        sumsq = math.fsum(float(r["sumsq"]) for r in reports)  # shard order: the same sum on every worker
        self._skipped = not (all(r["finite"] for r in reports) and math.isfinite(sumsq))
        self._norm = math.sqrt(sumsq) if not self._skipped else math.inf
        self._probe = None
        if self._skipped:
            ex._on_all(lambda s: s.request("commit", step, meta={"skip": True}, what=f"skip of step {step}"),
                       f"skip of step {step}")
            for b in ex.buckets:
                for p in b.params:
                    if p.grad is not None:
                        p.grad.view(-1)[0] = math.inf
                        return
            return
        self._note_probe()

    def _lost(self, factor):
        if math.frexp(abs(factor))[0] == 0.5:  # a power of two: GradScaler's unscale_, which the factor carries
            return ""
        return (f"ps:// update=server: the loop scaled the gradients between backward and optimizer.step() by "
                f"{factor:.4g}, as clip_grad_norm_ does; it sees this worker's own gradient, so the servers apply "
                f"local clipping, not DDP's clipping of the average: drop it from the loop and use ps://?clip_norm=X")

    def commit_meta(self, factor: float = 1.0) -> dict:
        return {"factor": factor, "hyper": hypers(self.ex.optimizer)}

    def bench_commit(self):
        return self.commit_meta()

    def remote_update(self, timeout):
        ex = self.ex
        step = ex._wire_step() - 1  # the exchange backward just finished
        if self._skipped:
            return  # every shard dropped this step (its summed gradient was not finite)
        factor = self._loop_factor()  # GradScaler's unscale_ (and a clip in the loop) scaled p.grad in place
        if ex.options.clip_norm:
            total = self._norm * abs(factor)
            factor *= min(1.0, ex.options.clip_norm / (total + 1e-6))  # clip_grad_norm_'s coefficient
        meta = self.commit_meta(factor)

        def commit(s: "_Shard"):
            s.post("commit", step, meta=meta, what=f"commit of step {step}")
            return s.pull(step)

        ex.stats.bytes_received += sum(ex._on_all(commit, f"commit and pull of step {step}"))


class Apply(ShardsStep):
    """update=server under a mode that applies each push alone (async, ssp): a push carries the groups'
    hyperparameters (a scheduler's change travels with the next push); ``optimizer.step()`` pulls the
    newest parameters the mode allows."""

    def push_meta(self):
        return {"hyper": hypers(self.ex.optimizer)}

    def finish(self, step):
        if not self._warned:  # only to say once if the loop changes p.grad, which the servers never see
            self._note_probe()

    def _lost(self, factor):
        return (f"ps:// mode={self.mode.name}: the loop changed the gradients between backward and "
                f"optimizer.step() (scaled them by {factor:.4g}); the servers apply the gradient pushed during "
                f"backward, so the change is lost (clipping there needs mode=sync and ps://?clip_norm=X)")

    def remote_update(self, timeout):
        ex = self.ex
        step = ex._wire_step() - 1
        if not self._warned:
            self._loop_factor()
        ex.stats.bytes_received += sum(ex._on_all(lambda s: s.pull(step), f"pull after step {step}"))


class LocalOuter(Averages):
    """Local steps (``sync_every=H``): the shards own the anchor and the outer optimizer. The user's optimizer
    is the inner one and steps *here* (``optimizer.step()`` is not taken over, although the shards step: they
    step the outer optimizer); backward pushes nothing, except in the warm-up's synchronous steps
    (``warmup=W``, mode=sync), which are :class:`Averages`' (the shards average, the averages come back into
    ``p.grad``, the inner optimizer steps on them); at its end rank 0's parameters become the shards' anchor
    (:meth:`ShardsOuter.start`). Every H-th real step the schedule
    (:class:`commlab.core.localsteps.LocalSteps`) asks :class:`ShardsOuter` to push this worker's pseudo-gradient
    and pull the new anchor."""

    spec = psproto.OUTER

    @property
    def updates_remotely(self) -> bool:
        return False  # the inner optimizer steps on the worker

    @property
    def keeps_state(self) -> bool:
        return False  # the inner optimizer's state and the position within H are the user's checkpoint

    def start_after(self, base: int, next_step: int) -> int:
        """Each shard counts its own syncs (``fragments=``: not every sync reaches every shard), so after a restart
        a shard may be behind the furthest one (``base``): the start pull reads each at the last step it applied,
        never at one it has not (a sync that some rank pushed alone before the job died waits for the others)."""
        return min(base, next_step) - 1

    def outer(self) -> localsteps.Outer:
        return ShardsOuter(self.ex, self.mode)


class ShardsOuter(localsteps.Outer):
    """The anchor and the outer optimizer on the shards. A sync of fragment p (``fragments=P``; one fragment: the
    whole model) goes to each shard that holds a piece of it, as that shard's next wire step (each shard counts
    its own: every rank syncs the same fragments in the same order, so they agree): the pseudo-gradient of the
    fragment's pieces as a push (the shard's other keys named absent, so its outer optimizer steps only these);
    sync: once every worker's is in, the shard's report, then this worker's commit (the N-th commit steps the
    outer optimizer once over the mean), then a pull of the fragment's new anchor; async: the pull right after
    the push (the shard applies each push alone as it lands, :class:`servers.modes.OuterOptimizer`). The pull
    lands in this worker's copy of the fragment's anchor, never in the parameters: the schedule
    (:class:`commlab.core.localsteps.LocalSteps`) mixes it in at its step (``overlap=T``: T inner steps later,
    by ``alpha``), so the exchange runs on the shards' threads while the training thread computes. Thread:
    :meth:`begin` on the training thread, the exchange on the shards' threads."""

    def __init__(self, ex: "PSExchanger", mode: psproto.Consistency):
        self.ex, self.mode = ex, mode
        self._anchors: list[torch.Tensor] = []
        self._names: list[list[str]] = []  # each fragment's parameter names, in the order of its flat anchor
        self.syncs = 0  # fragment syncs this worker started
        self.sent: dict[int, int] = {}  # shard -> wire steps this worker sent it (after the warm-up's)
        # syncs the exchanger's numbering (its _base: the furthest shard's next step at hello) already counts: those
        # of the state a restarted worker loaded, which the servers applied before it died (counted once, not twice)
        self.counted = 0

    def divide(self, parts):
        assert self.ex.model is not None
        names = {id(q): n for n, q in self.ex.model.named_parameters()}
        self._names = [[names[id(q)] for q in part] for part in parts]

    def start(self, anchors):
        self._anchors = anchors
        ex = self.ex
        if ex.options.warmup and ex.rank == 0:  # the end of the warm-up: the parameters (equal on every rank)
            ex._on_all(lambda s: s.request("load", -1, ex._parts(s.index, None), what="the anchor after warm-up"),
                       "the anchor after warm-up")

    def anchors(self):
        return self._anchors

    def next_step(self, shard: int) -> int:
        """The wire step of this worker's next sync on ``shard`` (each shard counts its own)."""
        return self.ex._wire_step() + self.sent.get(shard, 0) - self.counted

    def begin(self, p, delta, shapes, share=1.0):
        ex = self.ex
        at, offset = {}, 0  # parameter name -> its first element in the fragment's flat anchor
        for name in self._names[p]:
            at[name] = offset
            offset += ex.model.get_parameter(name).numel()  # type: ignore[union-attr]
        anchor = self._anchors[p]
        commit = {"factor": 1.0, "hyper": None} if self.mode.gathers else None
        self.syncs += 1
        handles = []
        pushes = ex._pushes
        # compress=: each shard's unit of the fragment's pseudo-gradient through the compressor, pushed as the
        # gradient path pushes a compressed unit (regimes.ps_compress); the shard decodes and sums it (servers.compressed)
        packed = pushes.outer_push(p, delta) if isinstance(pushes, CompressedPushes) else None
        # the new anchor's dtype on the wire ("": the shard's own, float32); the copy here stays float32
        as_dtype = "" if ex.options.anchor_dtype == "float32" else ex.options.anchor_dtype
        for s in ex.shards:
            mine = [pc for pc in ex._pieces[s.index] if pc.param in at]
            if not mine:
                continue  # this shard holds nothing of the fragment: it sees no step of it
            step = self.next_step(s.index)
            self.sent[s.index] = self.sent.get(s.index, 0) + 1
            parts: list = []
            extra: dict = {}
            if packed is not None:
                parts, extra = packed[s.index]
            for pc in mine if packed is None else []:
                start = at[pc.param] + pc.start
                parts += wire.split(pc.key, delta[start:start + pc.count].to(wire.DTYPES[pc.dtype]))
                ex.stats.bytes_sent += pc.nbytes
            absent = [pc.key for pc in ex._pieces[s.index] if pc.param not in at]
            where = {pc.key: at[pc.param] + pc.start for pc in mine}

            def take(h: wire.Header, data, where=where) -> int:
                for spec, frame in zip(h.frames, data):  # the fragment's new anchor, into this worker's copy
                    first = where[spec.key] + spec.offset
                    anchor[first:first + spec.count].copy_(wire.frame_tensor(spec, frame))
                return h.data_bytes

            def exchange(s: "_Shard", step=step, parts=parts, absent=absent, keys=[pc.key for pc in mine],
                         take=take, extra=extra) -> int:
                return s.push_then_pull(step, parts, {"base": s.version, **extra, "absent": absent},
                                        f"pseudo-gradient of fragment {p} at step {step}", commit, keys, take,
                                        as_dtype)

            handles.append(FutureHandle(s.submit(exchange, s), f"ps:// outer step of fragment {p} on {s.name}"))
        what = f"ps:// outer step {self.syncs - 1} (fragment {p}) of {ex.rank_info.who()}"

        def landed(received: list) -> torch.Tensor:
            ex.stats.bytes_received += sum(received)
            if isinstance(pushes, CompressedPushes):  # every shard has the push: error feedback keeps what this
                pushes.close(pushes.units[p])  # rank's own decoding lost
            return anchor

        return _Retrying(handles, what, then=landed, retries=ex.options.retries)

    @property
    def buffer_offset(self) -> int:
        """The buffers' round (on shard 0) at the end of an H: the wire step of shard 0's latest sync, over the
        exchanger's. Every fragment syncs once per H and shard 0 holds a piece of one at least, so it moves on
        every H; that sync ran on shard 0's thread before the buffers do, so the shard has it."""
        return max(0, self.sent.get(0, 0) - self.counted - 1)

    def state_dict(self):
        return {"anchors": [a.clone() for a in self._anchors], "syncs": self.syncs, "sent": dict(self.sent)}

    def load_state_dict(self, state):
        if "anchors" in state:
            self._anchors = [a.clone().float() for a in state["anchors"]]
        self.syncs = int(state.get("syncs", 0))
        self.sent = {int(k): int(v) for k, v in state.get("sent", {}).items()}
        if "sent" not in state:  # saved before fragments: every sync went to every shard
            self.sent = {s.index: self.syncs for s in self.ex.shards}
        self.counted = max(self.sent.values(), default=0)
        # the shards hold the anchor and the outer optimizer, which cannot be rewound: a state whose syncs are not
        # the ones each shard applied (servers ahead of it, or fresh ones) would redo or skip outer steps silently
        ex = self.ex
        for s, applied in zip(ex.shards, getattr(ex, "hello_steps", [])):
            mine = ex._step + self.sent.get(s.index, 0)  # the warm-up's exchanges, then this state's syncs
            if applied != mine:
                raise ModelMismatch(f"ps:// {ex.rank_info.who()}: the loaded state (ex.load_state_dict) has "
                                    f"{mine} wire steps on {s.name}, which applied {applied}: with sync_every= the "
                                    f"shards hold the anchor and the outer optimizer, so resume from the checkpoint "
                                    f"of their last sync (or restart the shards from theirs)")


class _Retrying(GroupHandle):
    """The shards' exchange of one sync: each shard's thread waits up to ``timeout`` for a reply and then
    reconnects and resends up to ``retries`` times (a restarted shard), so the whole is given that long."""

    def __init__(self, handles, what, then, retries: int):
        super().__init__(handles, what, then)
        self.retries = retries

    def _wait(self, timeout):
        return super()._wait(timeout * (self.retries + 2))


# (placement name, whether the mode gathers a step) -> the client's object
PLACEMENTS: dict[tuple[str, bool], type[StepPlacement]] = {
    ("worker", True): Averages, ("server", True): Commit, ("server", False): Apply,
    ("outer", True): LocalOuter, ("outer", False): LocalOuter}


def for_servers(ex: "PSExchanger", mode: psproto.Consistency, placement: psproto.Placement) -> StepPlacement:
    """The client's object for what hello said the servers run."""
    cls = PLACEMENTS.get((placement.name, mode.gathers))
    if cls is None:
        raise ConfigError(f"ps:// the servers run mode={mode.name} with update={placement.name}, which this "
                          f"client cannot take part in")
    return cls(ex, mode)


def hypers(optimizer: torch.optim.Optimizer | None) -> list[dict]:
    """Each param group's hyperparameters as plain data (what a scheduler changes travels so)."""
    if optimizer is None:
        raise ConfigError("call setup(model, optimizer) before exchanging")
    return [{k: v for k, (ok, v) in ((k, _plain(v)) for k, v in g.items() if k != "params") if ok}
            for g in optimizer.param_groups]
