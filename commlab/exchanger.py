"""The Exchanger contract and the bucketing machinery every regime shares.

A training loop knows only this::

    ex = commlab.connect("allreduce://?backend=gloo")     # or ring://, ps://, local://
    ex.setup(model, OptimizerSpec(name="sgd", lr=0.1))    # collective: every rank calls it
    for batch in data:
        ex.zero_grad()
        loss_fn(model(batch)).backward()                  # buckets start exchanging here
        ex.step()                                         # finish the exchange, apply the update

``step()`` leaves every worker with the same parameters. How depends on the
regime: all-reduce regimes average the gradients and step a local optimizer;
parameter-server regimes push gradients and pull the parameters a server
updated. The loop cannot tell the difference, which is the point.

Overlap: ``setup`` carves the trainable parameters into buckets of about
``bucket_mb`` MiB in *reverse* parameter order (the order backward produces
gradients) and registers a post-accumulate-grad hook on each parameter. When a
bucket's last gradient lands, its exchange starts at once, while backward goes
on computing earlier layers. Buckets are started strictly in index order on
every rank, so collectives line up even when some parameters get no gradient.

Gradients end up in the buckets: ``zero_grad`` sets every ``p.grad`` to None,
backward hands each parameter a fresh gradient (autograd's own tensor, no
accumulation pass), and the hook moves it into the parameter's slot of its
bucket with one scaled copy (``x 1/N`` for the all-reduce regimes, so the sum
over ranks is already the average: no division pass afterwards) and leaves
``p.grad`` a view of that slot. The exchange then works in place and the
optimizer reads the result through the same views: no flatten or unflatten
copy. Under ``no_sync`` the hooks leave gradients where autograd put them, so
micro-steps add up as in plain torch, and the last backward moves the sum.
A gradient the caller assigned itself is moved when its bucket starts.
Compared with accumulating into zeroed views this saves a memset and a
read-modify-write of every gradient per step (measured 4 + 14 ms of 150 on the
25M-parameter MLP).

A regime subclasses :class:`BucketedExchanger` and supplies three primitives:
``_connect`` (once, after buckets exist), ``_start_bucket`` (begin one bucket's
exchange, return a handle) and ``_apply`` (after every bucket finished: make the
parameters consistent).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch
from torch import nn

from commlab.config import CommonOptions
from commlab.errors import ConfigError, ModelMismatch
from commlab.handles import GroupHandle, Handle
from commlab.optim import OptimizerSpec
from commlab import rendezvous
from commlab.rendezvous import RankInfo


@dataclass
class ExchangeStats:
    """Running totals, since setup, of what this worker moved."""

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0


@dataclass(frozen=True)
class StepReport:
    step: int
    wait_s: float  # time step() blocked: the communication backward did not hide
    bytes_sent: int  # by this worker in this step
    bytes_received: int


def model_manifest(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every trainable parameter, in registration order."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters() if p.requires_grad]


def manifest_difference(mine: list, theirs: list, who: str) -> str | None:
    """First difference between two manifests, in words, or None if equal."""
    if len(mine) != len(theirs):
        return f"{who} has {len(theirs)} trainable parameters, this rank has {len(mine)}"
    for (n1, s1, d1), (n2, s2, d2) in zip(mine, theirs):
        if n1 != n2:
            return f"parameter {n1!r} here is {n2!r} on {who}"
        if tuple(s1) != tuple(s2) or d1 != d2:
            return f"parameter {n1!r} is {d1}{list(s1)} here but {d2}{list(s2)} on {who}"
    return None


class Exchanger:
    """What a training loop calls after ``loss.backward()``.

    Thread-safety: one training thread drives an exchanger; regimes may run
    their own communication threads behind it.
    """

    scheme: ClassVar[str]
    Options: ClassVar[type] = CommonOptions

    def __init__(self, options, rank: RankInfo):
        self.options = options
        self.rank_info = rank
        self.stats = ExchangeStats()

    @property
    def rank(self) -> int:
        return self.rank_info.rank

    @property
    def world_size(self) -> int:
        return self.rank_info.world_size

    def setup(self, model: nn.Module, optim: OptimizerSpec) -> None:
        """Attach to ``model``. Collective: every rank calls it with the same model.

        Makes the ranks' initial parameters equal (rank 0's, or the server's),
        and raises :class:`ModelMismatch` naming the first differing parameter
        if the ranks' models disagree. Blocks until every rank arrived or the
        timeout passes.
        """
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Clear this worker's gradients before the next backward."""
        raise NotImplementedError

    # Collective regimes (allreduce://, ring://) also offer, for benchmarks and tests:
    #   join()                          meet the peers without a model (collective, idempotent)
    #   allreduce_async(tensor) -> Handle   sum a flat tensor in place over all ranks (collective)

    def step_async(self) -> Handle:
        """Finish this step's exchange in the background; the handle's ``wait``
        returns a :class:`StepReport` once the parameters are consistent.
        Parameters and gradients must not be touched until then."""
        raise NotImplementedError

    def step(self, timeout: float | None = None) -> StepReport:
        """Blocking form of :meth:`step_async`."""
        return self.step_async().wait(self.options.timeout if timeout is None else timeout)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside this block exchange nothing;
        gradients add up (in autograd's own tensors for the bucketed regimes) until a backward
        outside it."""
        yield

    def facts(self) -> dict:
        """What a benchmark manifest should record about this regime (backend, transport, staging)."""
        return {"scheme": self.scheme}

    def close(self) -> None:
        """Release sockets, threads and process groups. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Bucket:
    """A flat buffer holding the gradients of a run of parameters.

    ``buffer`` is ``[grad of params[0] | grad of params[1] | ... | presence flags]``;
    the presence flags (one per parameter, 1 if it got a gradient this step) are
    there only for regimes that reduce them along with the gradients.
    """

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    present: list[bool] = field(default_factory=list)
    moved: list[bool] = field(default_factory=list)  # this step's gradient is in the slot already
    pending: int = 0

    @property
    def grads(self) -> torch.Tensor:
        """The gradient part of the buffer (without presence flags)."""
        return self.buffer[: self.numel]

    @property
    def flags(self) -> torch.Tensor:
        return self.buffer[self.numel :]

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int, carry_presence: bool) -> list[Bucket]:
    """Group parameters into buckets in reverse order, splitting on dtype/device changes."""
    buckets: list[Bucket] = []
    run: list[tuple[str, nn.Parameter]] = []

    def close_run():
        if not run:
            return
        offsets, total = [], 0
        for _, p in run:
            offsets.append(total)
            total += p.numel()
        first = run[0][1]
        extra = len(run) if carry_presence else 0
        buffer = torch.zeros(total + extra, dtype=first.dtype, device=first.device)
        buckets.append(Bucket(len(buckets), [p for _, p in run], [n for n, _ in run], offsets, total, buffer))
        run.clear()

    size = 0
    for name, p in reversed(named_params):
        if run and (p.dtype != run[0][1].dtype or p.device != run[0][1].device or size >= bucket_bytes):
            close_run()
            size = 0
        run.append((name, p))
        size += p.numel() * p.element_size()
    close_run()
    return buckets


class BucketedExchanger(Exchanger):
    """The shared mechanics: buckets, backward hooks, ordered starts, deadlines.

    Subclasses set ``carry_presence`` and implement ``_connect``,
    ``_start_bucket`` and ``_apply``.
    """

    carry_presence: ClassVar[bool] = True
    # Gradients are multiplied by this on their way into a bucket (all-reduce regimes: 1/N).
    grad_scale: float = 1.0
    _heap_kept: bool | None = None

    def __init__(self, options, rank: RankInfo):
        super().__init__(options, rank)
        self.model: nn.Module | None = None
        self.optim_spec: OptimizerSpec | None = None
        self.buckets: list[Bucket] = []
        self._hooks: list = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        self._sync = True
        self._step = 0
        self._reset_step_state()

    # ----- primitives a regime supplies -------------------------------------------------
    def _connect(self, model: nn.Module, optim: OptimizerSpec) -> None:
        """Once, after the buckets exist: join peers, agree on the model, equalise parameters."""
        raise NotImplementedError

    def _start_bucket(self, bucket: Bucket) -> Handle:
        """Begin exchanging ``bucket`` (its grads and presence are filled in). Must not block."""
        raise NotImplementedError

    def _apply(self) -> None:
        """After every bucket's handle completed: make the parameters consistent."""
        raise NotImplementedError

    # ----- the contract ------------------------------------------------------------------
    def setup(self, model: nn.Module, optim: OptimizerSpec) -> None:
        if self.model is not None:
            raise ConfigError("setup() was already called on this exchanger")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ModelMismatch("the model has no trainable parameters to exchange")
        self.model, self.optim_spec = model, optim
        if self.options.heap == "keep" and not any(p.is_cuda for _, p in named):
            from commlab.heap import keep_freed_gradients
            self._heap_kept = keep_freed_gradients(p for _, p in named)
        self.buckets = make_buckets(named, int(self.options.bucket_mb * 2**20), self.carry_presence)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b.index, i)
                p.grad = b.view(i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._reset_step_state()
        self._connect(model, optim)

    def zero_grad(self) -> None:
        """Forget every gradient (``p.grad = None``, as torch's ``zero_grad`` does by default):
        the next backward writes fresh ones, which the hooks move into the buckets."""
        self._got.clear()
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def step_async(self) -> Handle:
        if self.model is None:
            raise ConfigError("call setup(model, optim) before step()")
        if not self._sync:
            raise ConfigError("step() inside no_sync(): leave the block for the last micro-step")
        # Buckets whose parameters did not all get a gradient never became ready
        # during backward; start them now, in order.
        self._launch_until(len(self.buckets))
        started = time.perf_counter()
        sent0, recv0 = self._sent0, self._recv0  # buckets started during backward count too
        handles = self._handles
        step = self._step

        def finish(_results):
            self._apply()
            waited = time.perf_counter() - started
            self.stats.steps += 1
            self.stats.wait_s += waited
            self._step += 1
            self._reset_step_state()
            return StepReport(step, waited, self.stats.bytes_sent - sent0, self.stats.bytes_received - recv0)

        return GroupHandle(handles, f"step {step} of rank {self.rank}", then=finish)

    def _heap_facts(self) -> dict:
        return {"heap": self.options.heap, "heap_kept_by_glibc": self._heap_kept}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ----- machinery ---------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._got: set[int] = set()  # id(param) of every parameter backward gave a gradient since zero_grad
        self._sent0, self._recv0 = self.stats.bytes_sent, self.stats.bytes_received
        self._ready = [False] * len(self.buckets)
        self._handles: list[Handle] = []
        self._next = 0
        for b in self.buckets:
            b.pending = len(b.params)
            b.moved = [False] * len(b.params)

    def _on_grad(self, param: nn.Parameter) -> None:
        self._got.add(id(param))
        if not self._sync:
            return
        bi, slot = self._where[id(param)]
        if bi < self._next:
            raise ConfigError(
                f"a second backward reached bucket {bi} before step(): wrap micro-steps in exchanger.no_sync()")
        bucket = self.buckets[bi]
        self._move_in(bucket, slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._ready[bi] = True
            while self._next < len(self.buckets) and self._ready[self._next]:
                self._launch_until(self._next + 1)

    def _launch_until(self, stop: int) -> None:
        while self._next < stop:
            bucket = self.buckets[self._next]
            self._prepare(bucket)
            self._handles.append(self._start_bucket(bucket))
            self._next += 1

    def _move_in(self, bucket: Bucket, i: int) -> None:
        """Move ``p.grad`` into its slot of the bucket (scaled by ``grad_scale``); leave ``p.grad`` the slot."""
        p, view = bucket.params[i], bucket.view(i)
        g = p.grad
        if g is None:
            return
        if g.data_ptr() == view.data_ptr() and g.shape == view.shape:  # already there (written in place)
            if self.grad_scale != 1.0:
                view.mul_(self.grad_scale)
        else:
            if g.shape != view.shape or g.dtype != view.dtype or g.device != view.device:
                raise ModelMismatch(f"gradient of {bucket.names[i]!r} is {g.dtype}{list(g.shape)} on {g.device}, "
                                    f"parameter is {view.dtype}{list(view.shape)} on {view.device}")
            if self.grad_scale != 1.0:
                torch.mul(g, self.grad_scale, out=view)
            else:
                view.copy_(g)
            p.grad = view
        bucket.moved[i] = True

    def _prepare(self, bucket: Bucket) -> None:
        """Move in the grads no hook moved (the caller assigned them), zero absent ones, set presence.

        A parameter has a gradient this step if backward produced one since ``zero_grad``
        (its hook fired) or ``p.grad`` holds a tensor: the caller assigned one, or wrote into
        the view left from the last step after zeroing it in place. A view that is all zeros
        and that no backward touched counts as absent, like ``None``: a parameter the loss did
        not reach must not count as a zero gradient, or weight decay and momentum would still
        move it, unlike torch's optimizers, which skip ``grad=None``."""
        bucket.present = []
        for i, p in enumerate(bucket.params):
            view = bucket.view(i)
            g = p.grad
            if not bucket.moved[i] and g is not None and id(p) not in self._got \
                    and g.data_ptr() == view.data_ptr() and not bool(view.any()):
                g = p.grad = None  # an untouched zero view: no gradient
            if g is None:
                view.zero_()
                bucket.present.append(False)
                continue
            if not bucket.moved[i]:
                self._move_in(bucket, i)
            bucket.present.append(True)
        if self.carry_presence:
            # Scalar fills, not a copy from a host list: on CUDA a pageable host->device copy
            # would wait for every kernel backward has queued, inside the hook, and kill the overlap.
            bucket.flags.fill_(1)
            for i, present in enumerate(bucket.present):
                if not present:
                    bucket.flags[i].fill_(0)

    def _apply_averaged_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """For all-reduce regimes: buffers hold averages (each rank scaled by 1/N on the way in);
        drop the grads no rank had, step."""
        for b in self.buckets:
            if self.carry_presence and not all(b.present):  # our own flag of 1 makes every count >= 1 otherwise
                counts = b.flags.tolist()  # (a device->host sync on CUDA: only when some slot was empty here)
                for i, p in enumerate(b.params):
                    if counts[i] == 0:  # no rank produced a gradient: like torch, skip the update
                        p.grad = None
        optimizer.step()


class CollectiveExchanger(BucketedExchanger):
    """The all-reduce regimes: each bucket is summed over ranks as soon as it is ready;
    gradients enter their bucket scaled by 1/N, so the sums are the averages, and ``step()``
    steps this worker's own optimizer on them.

    A subclass supplies ``_connect`` (which must set ``self.store`` and ``self.optimizer``)
    and ``allreduce_async(tensor, what) -> Handle`` (sum in place over all ranks).
    """

    store: Any = None
    optimizer: torch.optim.Optimizer

    def __init__(self, options, rank: RankInfo):
        super().__init__(options, rank)
        self.grad_scale = 1.0 / rank.world_size  # the all-reduce's sum of scaled grads is their average

    def allreduce_async(self, tensor: torch.Tensor, what: str = "all-reduce") -> Handle:
        raise NotImplementedError

    def _start_bucket(self, bucket: Bucket) -> Handle:
        if bucket.index == 0:  # the stall report reads how far each rank got
            rendezvous.heartbeat(self.store, self.rank, self._step)
        return self.allreduce_async(bucket.buffer, f"{self.scheme}:// all-reduce of bucket {bucket.index} "
                                                   f"({bucket.names[0]}...) at step {self._step}")

    def _apply(self) -> None:
        self._apply_averaged_grads(self.optimizer)
