"""When to talk: every step, or every H steps with an outer optimizer (DiLoCo), a fragment at a time.

This is the schedule the exchanger consults (:attr:`commlab.core.exchanger.BucketedExchanger.talk`), written
once; a regime supplies only where the outer optimizer lives (:class:`Outer`): on every rank of a
collective (:class:`ReplicatedOuter`, identical bits on every rank), or on a parameter server's shards.

Local steps (``sync_every=H``, docs/localsteps.md)::

    step s = 1, 2, ... (real optimizer steps: one GradScaler skipped is not one)
    s <= W (warmup=W)    ordinary synchronous steps: backward exchanges gradients as always
    s == W               the anchor x := the parameters (equal on every rank); W = 0: at setup
    s > W, t = s - W     backward exchanges nothing; the user's optimizer (the inner one) steps alone
    fragment p is due when t = o_p (mod H), o_p = floor(H (p+1) / P) (torchft's rule; P = 1: every H steps)
      delta_p = x_p - theta_p, averaged over the ranks (compress= with error feedback applies to it)
      x_p := outer optimizer step on x_p with x_p.grad = mean delta_p
      theta_p := alpha theta_p + (1 - alpha) x_p            at t + T (overlap=T; T = 0: at once)
      theta_p := x_p + (theta_p - theta_p at t)             at t + T, instead, with merge=delta
    every t = 0 (mod H): the module buffers are averaged over the ranks (unless buffers=none)

With ``overlap=T`` the fragment's exchange (the regime's non-blocking all-reduce, or the servers' push and
pull) runs while the next T inner steps compute; the training thread waits for it only at step t + T, and
only if the link took longer than those T steps. ``alpha`` weights the *local* side (torchft's
``lerp(local, global, 1 - alpha)``); the default 0 takes the global value, so the T inner steps taken while
the fragment was on the link are dropped from it. ``merge=delta`` keeps them: the fragment becomes the new
global value plus the local change since its push (one copy of the fragment is held while it is in flight).
That is what makes a long overlap (one fragment, T near H) worth having.

The parameters of the model are split into ``fragments=P`` groups of whole tensors (:func:`fragments`), or,
with ``fragment_by=slices``, every tensor into P contiguous slices of its elements (``torch.tensor_split``),
slice p of each in fragment p (:func:`slices`): balanced to a few elements whatever the tensors' sizes (a
model that is mostly one matrix has no balanced fragments of whole tensors). Each group's anchor is one flat
float32 tensor, which the outer optimizer (a real ``torch.optim`` optimizer, :func:`parse_outer`) steps as one
parameter: elementwise optimizers (SGD, Nesterov, Adam) give the same numbers as over the separate tensors.
"""

from __future__ import annotations

import abc
import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from commlab.compress import CompressOptions
from commlab.compress.seam import CompressedExchange
from commlab.base.config import option
from commlab.base.errors import ConfigError
from commlab.core.groups import local
from commlab.base.handles import DoneHandle, GroupHandle, Handle

if TYPE_CHECKING:
    from commlab.core.exchanger import BucketedExchanger

DEFAULT_OUTER = "sgd:lr=0.7,momentum=0.9,nesterov=1"  # DiLoCo's outer step
MAX_STEPS = 10**9  # any step count a run can reach
EF_KEY = 1 << 20  # compressor keys of the pseudo-gradients: apart from the (warm-up) gradient buckets'


def _optimizer_class(name: str) -> type:
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    if name.lower() not in classes:
        raise ConfigError(f"outer: unknown optimizer {name!r}; known: {', '.join(sorted(classes))}")
    return classes[name.lower()]


def _value(key: str, raw: str, default: Any) -> Any:
    """``raw`` as the type of the keyword's default: bool (1/0/true/false), a tuple of floats written with ``/``
    (``betas=0.9/0.95``), else a number (an integer where the default is one and ``raw`` is whole)."""
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "0", "true", "false"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true")
        if isinstance(default, tuple):
            return tuple(float(v) for v in raw.split("/"))
        number = float(raw)  # an int default (SGD's momentum=0) may still take a fraction
        return int(number) if isinstance(default, int) and number == int(number) and "." not in raw else number
    except ValueError:
        raise ConfigError(f"outer: {key}={raw!r} is not a valid value") from None


def parse_outer(spec: str) -> tuple[type, dict[str, Any]]:
    """``NAME[:KEY=VALUE[,KEY=VALUE...]]`` -> (a ``torch.optim`` class, its keyword arguments).

    NAME is a ``torch.optim`` class, case-insensitive (``sgd``, ``adam``, ``adamw``, ``nadam``...); each value
    takes the type of that keyword's default (booleans ``1/0/true/false``, tuples ``a/b``). Commas and colons,
    not ``&``, since the spec sits inside the URL's query. Refuses an unknown class or keyword, and values
    the optimizer itself refuses, with :class:`ConfigError` naming ``outer``."""
    name, _, rest = spec.partition(":")
    cls = _optimizer_class(name.strip())
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ConfigError(f"outer: {item!r} is not KEY=VALUE")
        if key not in params or key == "params":
            raise ConfigError(f"outer: {cls.__name__} takes no keyword {key!r}")
        kwargs[key] = _value(key, raw, params[key].default)
    try:
        cls([torch.zeros(1)], **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"outer: {spec!r}: {exc}") from None
    return cls, kwargs


ASYNC_KEYS = ("lr", "momentum", "nesterov")  # what the asynchronous outer rule (Delayed Nesterov) reads of SGD's


def async_outer_refusal(cls: type, kwargs: dict[str, Any]) -> str:
    """Why the asynchronous outer rule (Delayed Nesterov, docs/localsteps.md) cannot run the outer optimizer
    ``cls(**kwargs)``; "" when it can: SGD with lr, momentum and nesterov, its other keywords at their defaults."""
    if cls is not torch.optim.SGD:
        return (f"outer: mode=async applies each pseudo-gradient as it lands with Delayed Nesterov, which takes "
                f"outer=sgd:lr=..,momentum=..,nesterov=..; not {cls.__name__}")
    defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
    other = sorted(k for k, v in kwargs.items() if k not in ASYNC_KEYS and v != defaults.get(k))
    if other:
        return f"outer: mode=async (Delayed Nesterov) reads only {', '.join(ASYNC_KEYS)} of SGD; drop {other[0]}="
    return ""


@dataclass(frozen=True)
class LocalStepsOptions(CompressOptions):
    """Options of a regime that can talk rarely (allreduce://, ring://, ps://)."""

    sync_every: int = option(0, "local steps (DiLoCo): the ranks talk every H optimizer steps, the change averaged "
                                "and applied by an outer optimizer; 0: every step (ordinary data parallelism)",
                             ge=0, le=MAX_STEPS)
    outer: str = option(DEFAULT_OUTER, "with sync_every: the outer optimizer, NAME[:KEY=VALUE,...] of torch.optim "
                                       "(sgd:lr=1 is plain averaging)")
    warmup: int = option(0, "with sync_every: ordinary synchronous steps before the local steps begin", ge=0,
                         le=MAX_STEPS)
    fragments: int = option(1, "with sync_every: split the parameters into P fragments of whole tensors, each "
                               "synced at its own step within the H (streaming DiLoCo)", ge=1, le=MAX_STEPS)
    overlap: int = option(0, "with sync_every: a fragment's exchange runs during the next T inner steps "
                             "(T < H/fragments)", ge=0, le=MAX_STEPS)
    alpha: float = option(0.0, "with overlap: merged = alpha x local + (1 - alpha) x global (0: the global value)",
                          ge=0, le=1)
    fragment_by: str = option("tensors", "with fragments: tensors (whole tensors, strided and balanced by bytes) "
                                         "or slices (every tensor cut in P slices, slice p in fragment p: "
                                         "balanced whatever the tensors' sizes)", choices=("tensors", "slices"))
    merge: str = option("lerp", "with overlap: how a landed anchor meets the parameters: lerp (by alpha) or delta "
                                "(the new global value plus the local change since the push: the overlap's inner "
                                "steps kept)", choices=("lerp", "delta"))

    def __post_init__(self):
        super().__post_init__()
        if self.sync_every < 0:
            raise ConfigError(f"sync_every must be >= 1 (or 0: every step), got {self.sync_every}")
        if self.sync_every == 0:
            given = [k for k, d in (("outer", DEFAULT_OUTER), ("warmup", 0), ("fragments", 1), ("overlap", 0),
                                    ("alpha", 0.0), ("merge", "lerp"), ("fragment_by", "tensors"))
                     if getattr(self, k) != d]
            if given:
                raise ConfigError(f"{given[0]} needs sync_every=H (local steps)")
            return
        parse_outer(self.outer)
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0 steps, got {self.warmup}")
        if not 1 <= self.fragments <= self.sync_every:
            raise ConfigError(f"fragments must be between 1 and sync_every={self.sync_every}, got {self.fragments}")
        if self.overlap < 0 or (self.overlap and self.overlap * self.fragments >= self.sync_every):
            raise ConfigError(f"overlap must be >= 0 and below sync_every/fragments = "
                              f"{self.sync_every}/{self.fragments}, got {self.overlap}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.fragment_by not in ("tensors", "slices"):
            raise ConfigError(f"fragment_by must be tensors or slices, got {self.fragment_by!r}")
        if self.fragment_by == "slices" and self.fragments == 1:
            raise ConfigError("fragment_by=slices needs fragments=P > 1 (one fragment is the whole model)")
        if self.merge not in ("lerp", "delta"):
            raise ConfigError(f"merge must be lerp or delta, got {self.merge!r}")
        if self.merge == "delta" and not self.overlap:
            raise ConfigError("merge=delta needs overlap=T (without an overlap there is no local change to keep)")
        if self.merge == "delta" and self.alpha:
            raise ConfigError("merge=delta takes no alpha (the local change since the push is kept whole)")


def fragments(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices (into ``sizes``, bytes per tensor in model order) of each of ``parts`` fragments of whole tensors:
    each tensor goes to the fragment with the fewest bytes so far, ties to the first one after the fragment
    that took the previous tensor. Equal layers are thus strided across fragments (the paper's layout),
    and unequal ones balanced. A fragment may be empty only when there are fewer tensors than fragments."""
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    last = parts - 1
    for i, size in enumerate(sizes):
        order = [(last + 1 + k) % parts for k in range(parts)]
        p = min(order, key=lambda q: load[q])  # min() keeps the first of equals: the cyclic successor
        out[p].append(i)
        load[p] += size
        last = p
    return out


def fragment_indices(params: Sequence[torch.Tensor], parts: int) -> list[list[int]]:
    """:func:`fragments` of these tensors by their bytes: the whole-tensor layout every user of it shares (the
    schedule, and ps://'s compressed units, which are laid out before the schedule binds)."""
    return fragments([p.numel() * p.element_size() for p in params], parts)


def slices(params: Sequence[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """``fragment_by=slices``: fragment p holds slice p of every tensor (``torch.tensor_split`` of its elements
    into ``parts``), in model order. The slices are views: a merge writes through to the parameter. An empty
    slice (a tensor of fewer elements than fragments) is left out."""
    out: list[list[torch.Tensor]] = [[] for _ in range(parts)]
    for i, q in enumerate(params):
        if not q.is_contiguous():
            raise ConfigError(f"fragment_by=slices: parameter {i} (shape {tuple(q.shape)}) is not contiguous, so "
                              f"its slices cannot be views of it; use fragment_by=tensors")
        for p, piece in enumerate(torch.tensor_split(q.detach().view(-1), parts)):
            if piece.numel():
                out[p].append(piece)
    return out


def offsets(every: int, parts: int) -> list[int]:
    """The step within each period of ``every`` at which fragment p syncs: floor(H (p+1) / P) mod H."""
    return [(every * (p + 1) // parts) % every for p in range(parts)]


class Outer(abc.ABC):
    """Where the anchor and the outer optimizer live; one per exchanger in local-steps mode."""

    def divide(self, parts: list[list[torch.Tensor]]) -> None:
        """Setup: the parameters of each fragment, in the order of its flat anchor."""

    @abc.abstractmethod
    def start(self, anchors: list[torch.Tensor]) -> None:
        """The anchor is taken (end of warm-up): one flat float32 tensor per fragment, equal on every rank."""

    @abc.abstractmethod
    def begin(self, p: int, delta: torch.Tensor, shapes: tuple[torch.Size, ...], share: float = 1.0) -> Handle:
        """Begin fragment ``p``'s outer step from this rank's pseudo-gradient ``delta`` (anchor - local;
        the callee may use it as scratch). Collective over the ranks. Does not block; the handle's result is
        the new anchor of the fragment (float32), valid until the fragment's next :meth:`begin`. ``share``
        (inside ``join()``): the factor from the mean over every rank to the mean over those still training."""

    @abc.abstractmethod
    def anchors(self) -> list[torch.Tensor]:
        """The current anchor per fragment (this process's copy)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ReplicatedOuter(Outer):
    """The collectives': every rank holds the anchor and the outer optimizer and runs the same step on the
    same averaged bits, so they stay identical. The average is the regime's all-reduce of the pseudo-gradient
    scaled by 1/N (or its compressed exchange, error feedback per fragment)."""

    def __init__(self, ex: "BucketedExchanger", spec: str):
        self.ex, self.spec = ex, spec
        self._anchors: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None

    def start(self, anchors):
        self._anchors = anchors
        cls, kwargs = parse_outer(self.spec)
        self.optimizer = cls(anchors, **kwargs)

    def anchors(self):
        return self._anchors

    def begin(self, p, delta, shapes, share=1.0):
        ex, opt, anchor = self.ex, self.optimizer, self._anchors[p]
        assert opt is not None  # start() ran
        what = f"{ex.scheme}:// pseudo-gradient of fragment {p} on {ex.rank_info.who()}"
        delta.mul_(1.0 / ex.world_size)  # the sum over ranks is the mean
        comp = ex.compressor
        if comp is None:
            moved = ex.allreduce_async(delta, what)  # type: ignore[attr-defined]
        else:
            moved = CompressedExchange(comp, EF_KEY + p, delta, shapes, None, ex, what)  # type: ignore[arg-type]

        def step(results: list) -> torch.Tensor:
            if share != 1.0:  # join(): the mean over the ranks still training
                delta.mul_(share)
            anchor.grad = delta  # the mean pseudo-gradient (a compressed exchange decodes into it)
            for other in self._anchors:
                if other is not anchor:
                    other.grad = None
            opt.step()
            anchor.grad = None
            return anchor

        return GroupHandle([moved], what, then=step)

    def state_dict(self):
        return {"anchors": [a.clone() for a in self._anchors],
                "outer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state):
        if state.get("outer") is None:
            return
        self.start([a.clone().float() for a in state["anchors"]])
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["outer"])


class Talk:
    """The schedule the exchanger consults: today's, every step. Backward exchanges gradients;
    nothing happens after the optimizer's step."""

    every_step = True

    def exchanges_gradients(self) -> bool:
        """Whether the backward of the coming step exchanges gradients."""
        return True

    def bind(self, ex: "BucketedExchanger") -> None:
        """End of ``setup``: the model is equal on every rank."""

    def after_step(self) -> float | None:
        """After each real optimizer step. Returns the seconds spent waiting on the link, or None when this
        schedule does not report steps itself."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _InFlight:
    p: int
    merge_at: int  # local step t at which it is merged
    handle: Handle
    local: torch.Tensor | None = None  # merge=delta: the fragment's parameters (flat, float32) at the push


class LocalSteps(Talk):
    """``sync_every=H``: see the module docstring for the rule. Thread: the training thread only (the
    fragment exchanges run on the regime's communication thread or on torch's)."""

    every_step = False

    def __init__(self, options: LocalStepsOptions):
        self.options = options
        self.H, self.W, self.T, self.alpha = options.sync_every, options.warmup, options.overlap, options.alpha
        self.delta = options.merge == "delta"
        self.due = offsets(self.H, options.fragments)
        self.steps = 0  # real optimizer steps since the start of training
        self.ex: "BucketedExchanger | None" = None
        self.outer: Outer | None = None
        self.parts: list[list[torch.Tensor]] = []  # the parameters of each fragment
        self.inflight: list[_InFlight] = []
        self.syncs = 0  # fragment syncs finished (merged) by this process

    def exchanges_gradients(self) -> bool:
        return self.steps < self.W

    def bind(self, ex):
        assert ex.model is not None
        self.ex = ex
        self.outer = ex._make_outer(self.options)
        params = [local(p) for p in ex.model.parameters() if p.requires_grad]
        if self.options.fragment_by == "slices":
            self.parts = slices(params, self.options.fragments)
        else:
            self.parts = [[params[i] for i in idx] for idx in fragment_indices(params, self.options.fragments)]
        self.outer.divide(self.parts)
        if self.steps == self.W:
            self._take_anchor()

    def _flat(self, p: int) -> torch.Tensor:
        params = self.parts[p]
        if not params:
            return torch.zeros(0)
        return torch.cat([t.detach().reshape(-1).float() for t in params])

    def _take_anchor(self) -> None:
        assert self.outer is not None
        self.outer.start([self._flat(p) for p in range(len(self.parts))])

    def after_step(self) -> float | None:
        self.steps += 1
        if self.steps < self.W:
            return None
        if self.steps == self.W:
            self._take_anchor()
            return None
        ex = self.ex
        assert ex is not None and self.outer is not None
        t = self.steps - self.W
        waited = 0.0
        for f in [f for f in self.inflight if f.merge_at == t]:
            waited += self._merge(f)
        due = [p for p, o in enumerate(self.due) if t % self.H == o]
        if not due:
            return waited
        started = time.perf_counter()
        share = ex._join.sync_point(self.steps)  # inside join(): the ranks still training (a vote)
        waited += time.perf_counter() - started
        for p in due:
            flat = self._flat(p)
            delta = self.outer.anchors()[p] - flat
            shapes = tuple(q.shape for q in self.parts[p])
            f = _InFlight(p, t + self.T, self.outer.begin(p, delta, shapes, share), flat if self.delta else None)
            self.inflight.append(f)
            if self.T == 0:
                waited += self._merge(f)
        if t % self.H == 0:
            waited += self._buffers()
        return waited

    def _buffers(self) -> float:
        """The end of each H: the module buffers averaged over the ranks (inside join(): those still training)."""
        ex = self.ex
        assert ex is not None
        if ex.options.buffers == "none" or not ex.module_buffers:
            return 0.0
        t0 = ex._trace.now() if ex._trace is not None else 0
        started = time.perf_counter()
        ex._sync_buffers("average")
        if ex._trace is not None:
            ex._trace.span("buffers sync", "blocked", t0, args={"step": self.steps - 1})
        return time.perf_counter() - started

    def land(self) -> None:
        """Every fragment exchange in flight lands and is merged now (a rank whose loop ended, in join())."""
        for f in list(self.inflight):
            self._merge(f)

    def leave(self, who: str) -> None:
        """A rank whose loop ended inside ``join()``: every fragment exchange in flight lands and is merged now; one
        that ran out during the warm-up is refused (the anchor is taken after it, with every rank)."""
        self.land()
        if self.steps < self.W:
            raise ConfigError(f"join() with sync_every=: {who} ran out of inputs during warmup={self.W} (after "
                              f"{self.steps} steps): give every rank at least the warm-up's steps")

    def shadow(self, steps: int, share: float) -> None:
        """A joined rank's part in the others' sync at their step ``steps``: the due fragments' exchanges on zeros
        and the same outer steps (its anchor and outer state stay theirs; its parameters are not touched), then
        the buffers' average at the end of an H. Collective."""
        assert self.ex is not None and self.outer is not None
        self.steps = steps
        t = steps - self.W
        for p, o in enumerate(self.due):
            if t % self.H == o:
                zeros = torch.zeros_like(self.outer.anchors()[p])
                self.outer.begin(p, zeros, tuple(q.shape for q in self.parts[p]), share).wait(self.ex.options.timeout)
        if t % self.H == 0:
            self._buffers()

    def take_steps_from(self, src: int) -> None:
        """The end of join(): every rank takes rank ``src``'s step count (with its model). Collective."""
        ex = self.ex
        assert ex is not None
        flat = torch.tensor([float(self.steps), float(self.syncs)], dtype=torch.float64,
                            device=ex.buckets[0].buffer.device)
        ex._broadcast_from(src, flat, f"local steps' count of {ex.rank_info.who(src)}")  # type: ignore[attr-defined]
        self.steps, self.syncs = int(flat[0]), int(flat[1])

    def _merge(self, f: _InFlight) -> float:
        """Wait for fragment ``f.p``'s outer step and mix its new anchor into the parameters."""
        assert self.ex is not None
        rec = self.ex._trace
        t0 = rec.now() if rec is not None else 0
        started = time.perf_counter()
        anchor = f.handle.wait(self.ex.options.timeout)
        waited = time.perf_counter() - started
        if rec is not None:  # the timeline's blocked time, as the step report counts it
            rec.span("local-step sync", "blocked", t0, args={"fragment": f.p, "step": self.steps - 1, "wait_s": waited})
        self.inflight.remove(f)
        offset = 0
        with torch.no_grad():
            for q in self.parts[f.p]:
                new = anchor[offset:offset + q.numel()].view_as(q)
                if f.local is not None:  # merge=delta: the new global value plus the change since the push
                    q.copy_((q.float() - f.local[offset:offset + q.numel()].view_as(q) + new).to(q.dtype))
                elif self.alpha:
                    q.mul_(self.alpha).add_(new.to(q.dtype), alpha=1.0 - self.alpha)
                else:
                    q.copy_(new)
                offset += q.numel()
        self.syncs += 1
        return waited

    def state_dict(self) -> dict:
        """The position within the H steps, the anchor, the outer optimizer's state and every fragment
        exchange in flight, landed first (waits for it: the outer step it carries is applied now, the merge
        into the parameters still happens at its own step, so the arithmetic is unchanged)."""
        assert self.ex is not None and self.outer is not None
        pending = []
        for f in self.inflight:
            f.handle.wait(self.ex.options.timeout)  # the outer step lands in the anchor saved below
            pending.append({"p": f.p, "merge_at": f.merge_at, **({"local": f.local} if f.local is not None else {})})
        return {"steps": self.steps, "syncs": self.syncs, "outer": self.outer.state_dict(), "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        """Resume where :meth:`state_dict` was taken (after ``setup``; the model and the inner optimizer are
        the user's checkpoint, taken at the same step)."""
        assert self.outer is not None
        self.steps, self.syncs = int(state["steps"]), int(state.get("syncs", 0))
        self.outer.load_state_dict(state["outer"])
        if self.steps >= self.W and not self.outer.anchors():
            raise ConfigError(f"local steps: the state is at step {self.steps}, past warmup={self.W}, "
                              f"but carries no anchor")
        pending = state.get("pending", [])
        if self.delta and any("local" not in d for d in pending):
            raise ConfigError("local steps: merge=delta, but the state's fragment exchanges in flight carry no "
                              "parameters at their push (saved without merge=delta?)")
        self.inflight = [_InFlight(int(d["p"]), int(d["merge_at"]),
                                   DoneHandle(self.outer.anchors()[int(d["p"])], "restored fragment exchange"),
                                   d.get("local") if self.delta else None)
                         for d in pending]

    def close(self) -> None:
        assert self.ex is not None or not self.inflight
        for f in list(self.inflight):  # nothing is left running on the link behind a closed exchanger
            try:
                f.handle.wait(self.ex.options.timeout if self.ex is not None else 1.0)
            except Exception:  # closing after a failure: the error was raised where it happened
                pass
        self.inflight.clear()


def schedule(options) -> Talk:
    """The schedule ``options`` ask for: every step, or local steps with ``sync_every=H``."""
    if getattr(options, "sync_every", 0):
        return LocalSteps(options)
    return Talk()
