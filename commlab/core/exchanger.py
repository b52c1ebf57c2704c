"""The Exchanger contract and the bucketing machinery every regime shares.

A training loop knows only this (the user's own optimizer, schedule, clipping, AMP)::

    ex = commlab.connect()                                # URL from $COMMLAB_EXCHANGER, or connect(url)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ex.setup(model, optimizer)                            # collective: every rank calls it
    for batch in data:
        optimizer.zero_grad()
        loss_fn(model(batch)).backward()                  # buckets exchange during backward; when it
                                                          # returns, p.grad is final and equal on every rank
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()                                  # (or scaler.step(optimizer), or ex.step())

As under DDP, the exchange and the update are separate steps. The exchange ends inside
``backward()``; the update is the user's ``optimizer.step()``, untouched for regimes that
average gradients (all-reduce, ring, a parameter server that only sums). A regime that
updates on its servers (``ps://?update=server``) takes over that one optimizer's ``step``
(and its ``state_dict``) instead, since the servers hold the optimizer's state.

Overlap: ``setup`` carves the trainable parameters into buckets of about ``bucket_mb`` MiB
in *reverse* parameter order (the order backward produces gradients) and registers a
post-accumulate-grad hook on each parameter. When a bucket's last gradient lands, its
exchange starts at once, while backward goes on computing earlier layers. Buckets are
started strictly in index order on every rank, so collectives line up even when some
parameters get no gradient.

End of backward: the first hook of a backward queues a callback on autograd's engine
(``queue_callback``), which runs when that backward is complete. It starts the buckets no
hook completed (parameters the loss did not reach), waits for every bucket (bounded by the
regime's ``timeout``; an error is raised out of ``backward()``), lets the regime make
``p.grad`` final (:meth:`BucketedExchanger._finish`) and makes every rank's buffers equal
(``buffers=broadcast|average|none``). Under a reentrant ``torch.utils.checkpoint`` the
callback queued inside the block's inner backward runs when that inner backward ends; it
finalizes only if every bucket is complete by then, else the outer backward's callback
does. A step pre-hook on the optimizer finalizes when no backward did (gradients assigned
by hand), so no rank ever steps on gradients that were not exchanged.

Gradients end up in the buckets: backward hands each parameter a fresh gradient (after
``zero_grad``'s ``None``), and the hook moves it into its bucket slot with one scaled copy
(``x 1/N`` for the all-reduce regimes, so the sum over ranks is already the average) and
leaves ``p.grad`` a view of that slot: the exchange works in place and the optimizer reads
the result through the same views. Under ``no_sync`` the hooks leave gradients where
autograd put them, so micro-steps add up as in plain torch, and the last backward moves
the sum. A second backward without ``no_sync`` and without ``zero_grad`` accumulates into
the exchanged (averaged) gradient and is exchanged again: since the averaged part is equal
on every rank, the result is the earlier average plus the new one, as under DDP.

A regime subclasses :class:`BucketedExchanger` and supplies ``_connect`` (once, after
buckets exist), ``_start_bucket`` (begin one bucket's exchange, return a handle),
``_finish`` (every bucket exchanged: make ``p.grad`` final) and ``_sync_buffers``.
"""

from __future__ import annotations

import abc
import contextlib
import time
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterator, Sequence, cast

import torch
from torch import nn

from commlab.base.config import CommonOptions
from commlab.base.errors import ConfigError, ModelMismatch
from commlab.core.groups import local
from commlab.core.keepgoing import KeepGoing
from commlab.base.handles import CallHandle, GroupHandle, Handle
from commlab.core.manifest import describe_optimizer
from commlab.core.optim import OptimizerSpec
from commlab import compress
from commlab.base import trace
from commlab.transport import rendezvous
from commlab.compress import seam as compress_seam
from commlab.core import localsteps
from commlab.transport.rendezvous import RankInfo


@dataclass
class ExchangeStats:
    """Running totals, since setup, of what this worker moved."""

    steps: int = 0  # optimizer steps taken (a step GradScaler skipped is not one)
    exchanges: int = 0  # gradient exchanges finished
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0
    bytes_uncompressed: int = 0  # under compress=: what the same exchanges would have sent uncompressed


@dataclass(frozen=True)
class StepReport:
    step: int  # index of the (last) exchange this report is about
    wait_s: float  # time the ends of backward (and a remote update) blocked: communication backward did not hide
    bytes_sent: int  # by this worker in this step, over every exchange of the step
    bytes_received: int
    bytes_uncompressed: int = 0  # under compress=: what this step would have sent uncompressed (else 0)
    exchanges: int = 1  # exchanges in this step (more than one: backward passes exchanged between two steps)


@dataclass(frozen=True)
class JoinOptions:
    """``Exchanger.join``'s options, DDP's: see :meth:`BucketedExchanger.join`."""

    divide_by_initial_world_size: bool = True
    throw_on_early_termination: bool = False


class Join:
    """One ``join()`` of one exchanger (torch's ``JoinHook``): its options, its state, and what it does at each
    exchange. The exchanger holds one (this base class outside ``join()``, where every call does nothing) and
    consults it alone; a regime makes its own by :meth:`BucketedExchanger._join_hook`. This base is also the
    join of a regime with nobody to wait for (local://).

    Called on the training thread only: :meth:`exchange_begins` and :meth:`exchange_ends` on a rank still
    training (every rank, in the same exchanges), :meth:`wait_out` once this rank's loop is over."""

    def __init__(self, options: JoinOptions | None = None):
        self.options = options

    @property
    def joining(self) -> bool:
        """Inside ``join()``."""
        return self.options is not None

    def exchange_begins(self) -> None:
        """A rank still training: its exchange's first bucket is about to start. Collective; does not block."""

    def exchange_ends(self) -> None:
        """A rank still training: every bucket of its exchange is summed; ``p.grad`` is not final yet."""

    def voters(self, world_size: int) -> Sequence[int]:
        """The ranks whose buffers an ``average`` takes: every rank, or inside join() the ranks still training."""
        return range(world_size)

    def buffer_source(self) -> int:
        """The rank whose buffers every rank takes: 0, or inside join() the highest rank still training (DDP's)."""
        return 0

    def sync_point(self, steps: int) -> float:
        """A rank still training, at a sync of local steps (``sync_every=``; ``steps``: its real optimizer steps so
        far), before its first collective there: the factor that makes the sum of the pseudo-gradients (each
        scaled by 1/N) their mean over the ranks still training. Collective inside ``join()``."""
        return 1.0

    def wait_out(self) -> None:
        """This rank's loop is over: take part in the others' exchanges until every rank's is, then take the last
        joiner's model (DDP's join: the highest rank among those that left their loop last). Collective."""


SYNC_FLAG = "require_backward_grad_sync"  # DDP's attribute; a False read at forward time means no_sync()


class Collective(abc.ABC):
    """Ability: sum flat tensors over every rank, without a model (benchmarks, probes, buffers)."""

    @abc.abstractmethod
    def meet(self) -> None:
        """Meet the peers. Collective; idempotent; ``setup`` calls it."""

    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor, what: str = "all-reduce") -> Handle:
        """Sum ``tensor`` in place over all ranks. Collective (same order on every rank); does not
        block; ``tensor`` must not be touched until the handle is done."""

    def sums_per_hop(self, dtype: torch.dtype) -> bool:
        """Whether the regime can also sum ``dtype`` sent at its own width with float32 partial sums rounded once
        per hop (``allreduce_per_hop_async``, :class:`commlab.compress.seam.Mover`): not unless it says so."""
        return False


class AveragesSteps(abc.ABC):
    """Ability: average every rank's gradients of a step in lockstep and leave the update to the caller, a whole
    step at a time on request (:meth:`exchange_step`) rather than bucket by bucket (:class:`Collective`). What
    :func:`commlab.ddp_hook` needs from a regime that is not a collective (``ps://`` with mode=sync and
    update=worker), whose own buckets it fills through a mirror of DDP's parameters."""

    @abc.abstractmethod
    def check_averages(self) -> None:
        """Raise :class:`ConfigError` (one line, naming the option) unless this exchanger, as configured (and, after
        ``setup``, as its peers run it), averages in lockstep and leaves the update to the caller. Never blocks."""

    @abc.abstractmethod
    def exchange_step(self, timeout: float | None = None) -> StepReport:
        """Exchange the gradients now in the parameters' ``.grad`` as a backward would have, and close the step
        with no ``optimizer.step()`` of this exchanger's (the caller's own optimizer steps on the result).
        Collective: every rank calls it once per step, after ``setup``. Blocks until ``.grad`` is final and equal
        on every rank (bounded by ``timeout``, default the URL's); until then the ``.grad`` tensors are the
        exchanger's, not to be touched."""


class PlansServers(abc.ABC):
    """Ability: the regime needs server processes, which a launcher on this host can start."""

    @classmethod
    @abc.abstractmethod
    def plan_local(cls, url, workers: int, scratch: Callable[[], str]) -> tuple[str, list[list[str]]]:
        """(URL for the workers, [argv of ``python -m servers`` per server]) for a job on this host."""


class Exchanger:
    """What a training loop talks to. See the module docstring for the loop.

    Thread-safety: one training thread drives an exchanger (setup, backward, step, close);
    regimes may run their own communication threads behind it.
    """

    scheme: ClassVar[str]
    Options: ClassVar[type] = CommonOptions
    # a DeviceMesh dimension's process group, when connect(group=mesh["dp"]) gave one: borrowed, never destroyed
    torch_group: Any = None

    def __init__(self, options, rank: RankInfo):
        self.options = options
        self.rank_info = rank
        self.stats = ExchangeStats()
        self.optimizer: torch.optim.Optimizer | None = None
        # a restarted job (torchrun's --max-restarts): where the loop resumes and the state it committed, when
        # the regime keeps them (ps:// update=server); 0 and None otherwise, where the user's checkpoint is the state
        self.start_step = 0
        self.restored_state: dict | None = None
        self.restored_step: int | None = None  # the step restored_state belongs to (the loop's next when committed)
        # which attempt of the job this is, the same on every rank of it and larger than any earlier one's
        # (rendezvous.job_attempt: the restart count under commlab run, a round id agreed under torchrun);
        # set by setup in the regimes that need it (ps://: the servers refuse an older attempt), else 0
        self.attempt_id = 0

    @property
    def keeps_state(self) -> bool:
        """Whether a restarted job resumes from this regime's own state (:attr:`start_step`,
        :attr:`restored_state`, :meth:`commit_state`) rather than from the user's checkpoint."""
        return False

    def commit_state(self, state: dict) -> None:
        """Keep this rank's small state (a scheduler's, a scaler's, a data position) where a restarted job
        finds it again as :attr:`restored_state`. Only regimes whose servers outlive the ranks keep it
        (``ps://`` with update=server); the others raise: their state is the user's checkpoint."""
        raise ConfigError(f"{self.scheme}:// keeps no state across a restart: save it in your checkpoint "
                          f"(docs/scripts.md); ps://?update=server keeps it on the servers")

    @classmethod
    def from_url(cls, url, rank: RankInfo) -> "Exchanger":
        """Build from a parsed URL (``commlab.core.registry`` calls this); a regime with URL parts beyond
        its options (a PS's HOST:PORT list) overrides :meth:`options_from_url`."""
        return cls(cls.options_from_url(url), rank)

    @classmethod
    def options_from_url(cls, url):
        from commlab.base.config import parse_options
        return parse_options(cls.Options, url)

    @property
    def rank(self) -> int:
        """This process's position among the exchanging ranks (in its group, under ``connect(group=)``)."""
        return self.rank_info.rank

    @property
    def world_size(self) -> int:
        """How many ranks exchange (the group's size under ``connect(group=)``)."""
        return self.rank_info.world_size

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerSpec) -> None:
        """Attach to ``model`` and ``optimizer``. Collective: every rank calls it, with the same model
        and an optimizer of the same class, param groups and hyperparameters.

        ``optimizer`` is any ``torch.optim.Optimizer`` over the model's parameters (param groups,
        a user's subclass), or an :class:`OptimizerSpec`, built here (then ``self.optimizer``).
        Makes the ranks' initial parameters and buffers equal (rank 0's, or the server's), and
        raises :class:`ModelMismatch` / :class:`ConfigError` naming the first differing parameter
        or optimizer setting. Blocks until every rank arrived or the timeout passes.
        """
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Clear this worker's gradients before the next backward (``p.grad = None``)."""
        raise NotImplementedError

    def step_async(self) -> Handle:
        """The update of this step, as a handle. Does not block; the handle's ``wait`` finishes the
        exchange if no backward did, then runs ``optimizer.step()`` (on the servers for a regime that
        updates there), once, and returns a :class:`StepReport`. Parameters and gradients must not
        be touched until it returns. A second ``step_async`` before this handle was waited for raises."""
        raise NotImplementedError

    def step(self, timeout: float | None = None) -> StepReport:
        """Blocking form of :meth:`step_async`: ``optimizer.step()`` plus this step's report."""
        return self.step_async().wait(self.options.timeout if timeout is None else timeout)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside this block exchange nothing; gradients add up
        (in autograd's own tensors) until a backward outside it, which exchanges the sum. Setting
        ``model.require_backward_grad_sync = False`` (on the model given to setup, or on its
        ``torch.compile`` wrapper) before a forward does the same for the backward of that forward, as
        under DDP."""
        yield

    def flush(self) -> None:
        """Exchange now what the backward passes since the last step accumulated, and make ``p.grad``
        final and equal on every rank, as the backward after ``no_sync()`` would have. For loops whose
        backward passes are not the user's: a pipeline schedule runs one per micro-batch, so it runs
        inside ``no_sync()`` and ``flush()`` follows it, one exchange per step. Collective; blocks until
        the exchange ends (bounded by ``timeout``); a no-op when the last backward already exchanged.
        ``optimizer.step()`` flushes by itself, so this is needed only to read the gradients before
        it (clipping, a global norm across pipeline stages)."""

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Uneven inputs, as DDP's ``join()``: wrap the training loop; a rank whose loop ends before the
        others' contributes zeros to each of their exchanges (gradients scaled by 1/N, or by 1/(ranks still
        training) with ``divide_by_initial_world_size=False``) and receives their buffers; once every rank
        has left its loop, every rank holds the parameters and buffers of the last rank to leave (the
        highest such rank). ``throw_on_early_termination``: the first rank to run out raises instead, and
        so does every other rank at its next exchange. Collective: every rank wraps its loop."""
        yield

    def state_dict(self) -> dict:
        """The exchanger's own state for a checkpoint (plain data); the model's, the optimizer's, the
        scheduler's and the scaler's are the user's to save, as without commlab."""
        return {"scheme": self.scheme, "exchanges": self.stats.exchanges, "steps": self.stats.steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: call after ``setup``, on every rank."""
        self.stats.exchanges = int(state.get("exchanges", 0))
        self.stats.steps = int(state.get("steps", 0))

    def facts(self) -> dict:
        """What a benchmark manifest should record about this regime (backend, transport, staging)."""
        return {"scheme": self.scheme}

    def close(self) -> None:
        """Release sockets, threads and process groups, and take the hooks off the model and the
        optimizer. Idempotent. Not collective, but a peer still exchanging with this rank will
        time out naming it."""

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
        p = local(self.params[i])
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def like(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (a local tensor) as ``p`` is laid out: a DTensor over ``p``'s mesh and placements wrapping it
    (no copy) when ``p`` is one, else ``shard`` itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return shard
    with torch.no_grad():
        return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())


def make_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int, carry_presence: bool) -> list[Bucket]:
    """Group parameters into buckets in reverse order, splitting on dtype/device changes. A DTensor
    parameter takes the room of its local shard."""
    buckets: list[Bucket] = []
    run: list[tuple[str, nn.Parameter]] = []

    def close_run():
        if not run:
            return
        offsets, total = [], 0
        for _, p in run:
            offsets.append(total)
            total += local(p).numel()
        first = local(run[0][1])
        extra = len(run) if carry_presence else 0
        buffer = torch.zeros(total + extra, dtype=first.dtype, device=first.device)
        buckets.append(Bucket(len(buckets), [p for _, p in run], [n for n, _ in run], offsets, total, buffer))
        run.clear()

    size = 0
    for name, p in reversed(named_params):
        shard = local(p)
        if run and (p.dtype != run[0][1].dtype or shard.device != local(run[0][1]).device or size >= bucket_bytes):
            close_run()
            size = 0
        run.append((name, p))
        size += shard.numel() * shard.element_size()
    close_run()
    return buckets


def _graph_task_id() -> int:
    """The running backward's id (nested backwards, such as a reentrant checkpoint's, have their own)."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else 0


def _eager(hook):
    """``hook`` run as Python even when the module it is on is called from compiled code."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(hook) if disable is not None else hook


def _in_nested_backward() -> bool:
    """True inside a backward started by a node of another backward (reentrant checkpoint)."""
    get = getattr(torch._C, "_current_autograd_node", None)
    return get is not None and get() is not None


class BucketedExchanger(Exchanger):
    """The shared mechanics: buckets, backward hooks, the end-of-backward wait, buffers, deadlines.

    Subclasses set ``carry_presence`` and implement ``_connect``, ``_start_bucket``, ``_finish``
    and ``_sync_buffers``; one that updates on servers sets ``updates_remotely`` and implements
    ``_remote_update``.
    """

    carry_presence: ClassVar[bool] = True
    # Gradients are multiplied by this on their way into a bucket (all-reduce regimes: 1/N).
    grad_scale: float = 1.0
    # a replacement that joined a running job (min_workers=): setup took the state of a live rank, and
    # runs none of the job's start-up collectives (the buffers' first broadcast)
    entered_running: bool = False
    _heap_kept: bool | None = None

    def __init__(self, options, rank: RankInfo):
        super().__init__(options, rank)
        self.model: nn.Module | None = None
        self.optim_spec: OptimizerSpec | None = None  # when setup() was given a spec
        self.buckets: list[Bucket] = []
        self.module_buffers: list[tuple[str, torch.Tensor]] = []
        self._hooks: list = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        self._sync = True
        self._step = 0  # exchanges finished; the running exchange's index while one is collecting
        self._open_step: Handle | None = None
        self.last_report: StepReport | None = None
        self.compressor = compress.from_options(options, rank.world_size)  # None unless compress= (commlab.compress)
        # the compressed step's state, handed to every bucket's start (commlab.compress.seam)
        self.compress_state = compress_seam.CompressState(self.compressor) if self.compressor is not None else None
        self._fwd_sync = True  # require_backward_grad_sync as the last forward (with grad enabled) read it
        self._flag_holders: list[nn.Module] = []  # where that flag is read: the model, and its compile wrapper
        self._join = Join()  # inside join(): the regime's (_join_hook), for that join() alone
        self.talk = localsteps.schedule(options)  # when to talk: every step, or every H (commlab.core.localsteps)
        # the timeline (commlab.base.trace): None unless $COMMLAB_TRACE is set; every seam checks this alone
        self._trace = trace.recorder("rank", rank.global_rank())
        if self._trace is not None and self.compress_state is not None:
            self.compress_state.trace = self._trace  # encode and decode spans (commlab.compress.seam)
        self._tr_step0 = self._tr_bwd0 = self._tr_opt0 = 0  # where the open step, backward, optimizer step began
        self._tr_tasks: set[int] = set()  # backwards whose end the timeline waits for
        self._tr_torch: trace.TorchProfile | None = None  # --trace-torch: torch.profiler over the chosen steps
        self._begin_step_totals()
        self._reset_step_state()

    # ----- primitives a regime supplies -------------------------------------------------
    def _connect(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Once, after the buckets exist: meet peers, agree on the model and the optimizer
        (:func:`commlab.core.manifest.describe_optimizer`), equalise parameters."""
        raise NotImplementedError

    def _start_bucket(self, bucket: Bucket) -> Handle:
        """Begin exchanging ``bucket`` (its grads and presence are filled in). Must not block."""
        raise NotImplementedError

    def _finish(self) -> None:
        """Every bucket's handle completed (end of backward): make ``p.grad`` final."""
        raise NotImplementedError

    def _sync_buffers(self, mode: str) -> None:
        """Make every rank's :attr:`module_buffers` equal: ``broadcast`` rank 0's, or ``average``."""
        raise NotImplementedError

    updates_remotely: ClassVar[bool] = False
    joins_local_steps: ClassVar[bool] = False  # join() works under sync_every= (the regime's _join_hook says how)

    def _remote_update(self, timeout: float) -> None:
        """For a regime that updates on servers: what ``optimizer.step()`` becomes."""
        raise NotImplementedError

    def _join_hook(self, options: JoinOptions) -> Join:
        """The :class:`Join` of one ``join()`` with ``options``: the base's (nothing to wait for) unless the
        regime has peers to wait out (a vote among the collectives, the servers' count on ps://)."""
        return Join(options)

    def _take_model_from(self, src: int) -> None:
        """Every rank takes rank ``src``'s parameters (trainable or not) and buffers. Collective."""
        raise NotImplementedError

    def _make_outer(self, options) -> localsteps.Outer:
        """Where the anchor and the outer optimizer of local steps (``sync_every=``) live for this regime."""
        raise ConfigError(f"{self.scheme}:// cannot take local steps (sync_every=)")

    def _trace_clocks(self, rec: trace.Recorder) -> None:
        """Tracing: measure the clocks of the processes this regime meets (:meth:`trace.Recorder.peer_clock`).
        Collective where the regime's peers answer (the collectives: through the store). Default: none."""

    # ----- the contract ------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerSpec) -> None:
        if self.model is not None:
            raise ConfigError("setup() was already called on this exchanger")
        wrapper, inner = None, getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):  # torch.compile's OptimizedModule
            wrapper, model = model, inner
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ModelMismatch("the model has no trainable parameters to exchange")
        if isinstance(optimizer, OptimizerSpec):
            self.optim_spec = optimizer
            optimizer = optimizer.build([p for _, p in named])
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"setup(model, optimizer) takes a torch.optim.Optimizer or an OptimizerSpec, "
                              f"not {type(optimizer).__name__}")
        describe_optimizer(optimizer, model)  # refuses tensors that are not the model's, before anything
        self.model, self.optimizer = model, optimizer
        self.module_buffers = [(n, b) for n, b in model.named_buffers() if b is not None]
        if self.options.heap == "keep" and not any(p.is_cuda for _, p in named):
            from commlab.core.heap import keep_freed_gradients
            self._heap_kept = keep_freed_gradients(p for _, p in named)
        self.buckets = make_buckets(named, int(self.options.bucket_mb * 2**20), self.carry_presence)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b.index, i)
                p.grad = None
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        # require_backward_grad_sync, read where DDP reads it: at the forward. A flag set on torch.compile's
        # wrapper stays there in some torch versions, so the wrapper is read too and the hook goes on it
        # (its own call runs outside the compiled code); on a bare model the hook is kept out of a graph.
        self._flag_holders = [m for m in (wrapper, model) if m is not None]
        read = self._read_sync_flag if wrapper is not None else _eager(self._read_sync_flag)
        self._hooks.append((wrapper if wrapper is not None else model).register_forward_pre_hook(read))
        self._reset_step_state()
        self._connect(model, optimizer)
        if self.options.buffers != "none" and self.module_buffers and not self.entered_running:
            self._sync_buffers("broadcast")  # every rank starts from rank 0's buffers, as under DDP
        self._reset_step_state()  # what setup moved is not the first step's
        self._begin_step_totals()
        self.talk.bind(self)
        if self.updates_remotely:
            self._take_over_step(optimizer)
        else:
            self._hooks.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before_step()))
            self._hooks.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_step()))
        if self._trace is not None:
            self._trace_setup(wrapper if wrapper is not None else model)

    # ----- the timeline (commlab.base.trace): recorded only with $COMMLAB_TRACE -------------------
    def _trace_setup(self, model: nn.Module) -> None:
        """Forward and backward hooks that only record, the clocks of the peers, this regime in the metadata."""
        rec = self._trace
        assert rec is not None
        self._trace_clocks(rec)
        rec.meta.setdefault("regimes", []).append({"scheme": self.scheme, "world_size": self.world_size,
                                                   "rank": self.rank, "buckets": len(self.buckets)})

        def before_forward(module, args):
            if torch.is_grad_enabled():
                now = rec.now()
                if not self._tr_step0:
                    self._tr_step0 = now
                self._tr_fwd0 = now

        def after_forward(module, args, output):
            if torch.is_grad_enabled() and getattr(self, "_tr_fwd0", 0):
                rec.span("forward", "compute", self._tr_fwd0)
                self._tr_fwd0 = 0
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(self._trace_backward_begins)

        self._hooks.append(model.register_forward_pre_hook(_eager(before_forward)))
        self._hooks.append(model.register_forward_hook(_eager(after_forward)))
        steps = trace.torch_steps()
        if steps is not None and self._tr_torch is None:
            self._tr_torch = trace.TorchProfile(rec, steps)
            self._tr_torch.at_step(self.stats.steps)

    def _trace_backward_begins(self, grad=None):
        """The backward reached the model's output (or a first parameter): its span starts, and its end is
        waited for with a callback queued ahead of the exchange's (so the blocked time follows it)."""
        rec = self._trace
        if rec is None:
            return None
        if not self._tr_bwd0:
            self._tr_bwd0 = rec.now()
            if not self._tr_step0:
                self._tr_step0 = self._tr_bwd0
        task = _graph_task_id()
        if task not in self._tr_tasks:
            self._tr_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._trace_backward_ends)
        return None

    def _trace_backward_ends(self) -> None:
        rec = self._trace
        self._tr_tasks.clear()
        if rec is not None and self._tr_bwd0:
            rec.span("backward", "compute", self._tr_bwd0, args={"exchange": self._step})
            self._tr_bwd0 = 0

    def zero_grad(self) -> None:
        """Forget every gradient (``p.grad = None``, as torch's ``zero_grad`` does by default):
        the next backward writes fresh ones, which the hooks move into the buckets."""
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

    def flush(self) -> None:
        if self.model is None:
            raise ConfigError("call setup(model, optimizer) before flush()")
        if not self._sync:
            raise ConfigError("flush() inside no_sync(): leave the block first")
        self._finalize(self.options.timeout)

    def _read_sync_flag(self, module, args) -> None:
        """Forward pre-hook: DDP's ``require_backward_grad_sync``, read at the forward whose backward it governs."""
        if torch.is_grad_enabled():
            self._fwd_sync = all(bool(getattr(m, SYNC_FLAG, True)) for m in self._flag_holders)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        if self.model is None:
            raise ConfigError("call setup(model, optimizer) before join()")
        if not enable:
            yield
            return
        if not self.talk.every_step and not self.joins_local_steps:
            raise ConfigError(f"{self.scheme}:// join() with sync_every= (local steps) is not supported: give every "
                              f"rank the same number of optimizer steps")
        if self._join.joining:
            raise ConfigError("join() inside join() on the same exchanger")
        self._join = self._join_hook(JoinOptions(bool(divide_by_initial_world_size), bool(throw_on_early_termination)))
        try:
            yield  # an error in the loop propagates as it is, as under DDP: nothing is shadowed then
            self._join.wait_out()
        finally:
            self._join = Join()
            self._reset_step_state()

    def step_async(self) -> Handle:
        if self.model is None or self.optimizer is None:
            raise ConfigError("call setup(model, optimizer) before step()")
        if self._open_step is not None and not self._open_step.done():
            raise ConfigError("step_async() was called again before the last step's handle was waited for")
        optimizer = self.optimizer

        def run(timeout: float) -> StepReport:
            self._finalize(timeout)
            before = self.stats.steps
            optimizer.step()
            if self.stats.steps == before:  # a step hook of the user's raised nothing but the step did not count
                raise ConfigError("optimizer.step() did not run commlab's step hook (was the optimizer replaced?)")
            assert self.last_report is not None  # _finalize made one
            return self.last_report

        self._open_step = CallHandle(run, f"step {self._step} of {self.rank_info.who()}")
        return self._open_step

    def state_dict(self) -> dict:
        extra: dict = {}
        if not self.talk.every_step:  # local steps: the position within H, the anchor, the outer optimizer
            extra["talk"] = self.talk.state_dict()  # first: it lands the syncs in flight, closing their error feedback
        if self.compressor is not None:
            extra["compress"] = self.compressor.state_dict()
        return dict(super().state_dict(), step=self._step, **extra)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.compressor is not None and "compress" in state:
            self.compressor.load_state_dict(state["compress"])
        if state.get("scheme", self.scheme) != self.scheme:
            pass  # resuming under another regime is allowed: the counters carry over
        self._step = int(state.get("step", self.stats.exchanges))
        if not self.talk.every_step:
            if "talk" not in state:
                raise ConfigError("sync_every= (local steps): the state has no local-steps part (the anchor); it "
                                  "was saved without sync_every")
            self.talk.load_state_dict(state["talk"])

    def _heap_facts(self) -> dict:
        return {"heap": self.options.heap, "heap_kept_by_glibc": self._heap_kept, "buffers": self.options.buffers}

    def close(self) -> None:
        self.talk.close()
        if self._trace is not None:
            if self._tr_torch is not None:
                self._tr_torch.close()
            self._trace.write()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.optimizer is not None and "step" in vars(self.optimizer):  # the step we took over
            del self.optimizer.step

    # ----- machinery ---------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        """A new exchange begins: nothing received, nothing started."""
        self._phase = "collecting"  # -> "exchanged" once _finalize ran, until the optimizer stepped
        self._got: set[int] = set()  # id(param) of every parameter backward gave a gradient since the last exchange
        self._queued: set[int] = set()  # backward (graph task) ids with an end-of-backward callback queued
        self._ready = [False] * len(self.buckets)
        self._handles: list[Handle] = []
        self._next = 0
        for b in self.buckets:
            b.pending = len(b.params)
            b.moved = [False] * len(b.params)

    def _begin_step_totals(self) -> None:
        """A new optimizer step begins: its report counts every exchange from here."""
        self._step_sent0, self._step_recv0 = self.stats.bytes_sent, self.stats.bytes_received
        self._step_raw0 = self.stats.bytes_uncompressed
        self._step_wait, self._step_exchanges = 0.0, 0

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._trace is not None:
            self._trace_backward_begins()
        if self._phase == "exchanged":  # a backward after an exchange no step consumed: a new exchange
            bi, slot = self._where[id(param)]
            if param.grad is None or local(param.grad).data_ptr() != self.buckets[bi].view(slot).data_ptr():
                self._begin_step_totals()  # zero_grad ran: a new step (the last one's step was skipped)
            self._reset_step_state()
        self._got.add(id(param))
        if not (self._sync and self._fwd_sync and self.talk.exchanges_gradients()):
            return
        task = _graph_task_id()
        if task not in self._queued:
            self._queued.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        bi, slot = self._where[id(param)]
        if bi < self._next:
            raise ConfigError(f"a gradient for bucket {bi} ({self.buckets[bi].names[slot]}) arrived after the "
                              f"bucket's exchange had started: did one backward reach a parameter twice?")
        bucket = self.buckets[bi]
        self._move_in(bucket, slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            if self._trace is not None:
                self._trace.instant("ready", "bucket", {"bucket": bi, "exchange": self._step})
            self._ready[bi] = True
            while self._next < len(self.buckets) and self._ready[self._next]:
                self._launch_until(self._next + 1)

    def _on_backward_end(self) -> None:
        """autograd's final callback of a backward that reached at least one parameter."""
        if self._phase != "collecting" or not (self._sync and self._fwd_sync):
            return
        if all(self._ready) or not _in_nested_backward():
            self._finalize(self.options.timeout)

    def _finalize(self, timeout: float) -> None:
        """Finish this exchange: start what is left, wait for all, final grads, equal buffers."""
        if self._phase != "collecting" or not self.talk.exchanges_gradients():
            return
        if not self._sync:
            raise ConfigError("step() inside no_sync(): leave the block for the last micro-step")
        self._launch_until(len(self.buckets))
        t0 = self._trace.now() if self._trace is not None else 0
        started = time.perf_counter()
        self._exchange(timeout)
        waited = time.perf_counter() - started
        if self._trace is not None:
            self._trace.span("blocked", "blocked", t0, args={"exchange": self._step, "wait_s": waited})
        self.stats.wait_s += waited
        self.stats.exchanges += 1
        self._step_wait += waited
        self._step_exchanges += 1
        self.last_report = StepReport(self._step, self._step_wait, self.stats.bytes_sent - self._step_sent0,
                                      self.stats.bytes_received - self._step_recv0,
                                      self.stats.bytes_uncompressed - self._step_raw0, self._step_exchanges)
        self._step += 1
        self._phase = "exchanged"

    def _exchange(self, timeout: float) -> None:
        """The exchange's end, every bucket launched: wait for all, final grads, equal buffers."""
        deadline = time.monotonic() + timeout
        for h in self._handles:
            h.wait(max(1e-3, deadline - time.monotonic()))
        self._join.exchange_ends()
        self._finish()
        if self.options.buffers != "none" and self.module_buffers:
            self._sync_buffers(self.options.buffers)

    def _before_step(self) -> None:
        if not self._sync:
            raise ConfigError("optimizer.step() inside exchanger.no_sync(): leave the block for the last micro-step")
        self._finalize(self.options.timeout)
        if self._trace is not None:
            self._tr_opt0 = self._trace.now()

    def exchange_step(self, timeout: float | None = None) -> StepReport:
        """See :meth:`AveragesSteps.exchange_step` (a regime that updates on its servers refuses: its update is
        not the caller's to take)."""
        if self.model is None:
            raise ConfigError("call setup(model, optimizer) before exchange_step()")
        if self.updates_remotely:
            raise ConfigError(f"{self.scheme}:// updates on its servers: use optimizer.step(), not exchange_step()")
        self._finalize(self.options.timeout if timeout is None else timeout)
        report = self.last_report
        assert report is not None  # _finalize made one
        self._after_step()
        return report

    def _after_step(self) -> None:
        rec = self._trace
        if rec is not None and self._tr_opt0:
            rec.span("optimizer", "compute", self._tr_opt0, args={"step": self.stats.steps})
            self._tr_opt0 = 0
        self.stats.steps += 1
        t0 = rec.now() if rec is not None else 0
        waited = self.talk.after_step()  # local steps: their syncs' blocked spans are recorded there
        if rec is not None:
            rec.span("step", "step", self._tr_step0 or t0, args={"step": self.stats.steps - 1})
            self._tr_step0 = 0
            if self._tr_torch is not None:
                self._tr_torch.at_step(self.stats.steps)
        if waited is not None:  # a local step (and the fragment syncs due at it) reports itself
            self.stats.wait_s += waited
            self.last_report = StepReport(self.stats.steps - 1, waited, self.stats.bytes_sent - self._step_sent0,
                                          self.stats.bytes_received - self._step_recv0,
                                          self.stats.bytes_uncompressed - self._step_raw0, 0)
        self._reset_step_state()
        self._begin_step_totals()

    def _exchange_begins(self) -> None:
        """An exchange's first bucket is about to start (a regime that keeps going admits replacements here)."""

    def _take_over_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` becomes the regime's remote update (an instance attribute, so the class,
        ``isinstance`` checks, schedulers and GradScaler see the user's optimizer unchanged)."""

        def step(opt, closure=None):
            if closure is not None:
                raise ConfigError(f"{self.scheme}:// updates on its servers, which cannot call a closure; "
                                  f"use an update placement that runs the optimizer on the workers")
            self._before_step()
            t0 = self._trace.now() if self._trace is not None else 0
            started = time.perf_counter()
            self._remote_update(self.options.timeout)
            waited = time.perf_counter() - started
            if self._trace is not None:
                self._trace.span("remote update", "blocked", t0, args={"step": self.stats.steps, "wait_s": waited})
                self._tr_opt0 = 0
            self.stats.wait_s += waited
            if self.last_report is not None:
                r = self.last_report
                self.last_report = StepReport(r.step, r.wait_s + waited, self.stats.bytes_sent - self._step_sent0,
                                              self.stats.bytes_received - self._step_recv0, r.bytes_uncompressed,
                                              r.exchanges)
            self._after_step()

        # A bound method, as the class's step is: an LR scheduler made after setup wraps ``step.__func__``
        # and rebinds it to the optimizer.
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def _launch_until(self, stop: int) -> None:
        if self._next == 0 and stop > 0:
            self._exchange_begins()
            self._join.exchange_begins()
        while self._next < stop:
            bucket = self.buckets[self._next]
            t0 = self._trace.now() if self._trace is not None else 0
            self._prepare(bucket)
            self._handles.append(self._start_bucket(bucket))
            if self._trace is not None:
                self._trace.span("start bucket", "bucket", t0, args={"bucket": bucket.index, "bytes": bucket.nbytes,
                                                                      "exchange": self._step})
            self._next += 1

    def _move_in(self, bucket: Bucket, i: int) -> None:
        """Move ``p.grad`` into its slot of the bucket (scaled by ``grad_scale``); leave ``p.grad`` the slot."""
        p, view = bucket.params[i], bucket.view(i)
        g = p.grad
        if g is None:
            return
        g = local(g)
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
            p.grad = like(p, view)
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
                    and local(g).data_ptr() == view.data_ptr() and not bool(view.any()):
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

    def _drop_absent_grads(self) -> None:
        """After an exchange that carried presence flags: a parameter no rank had a gradient for gets
        ``p.grad = None``, so the optimizer skips it as torch does (weight decay and momentum would
        otherwise move it). Where this rank had every gradient of a bucket, its own flag of 1 makes every
        count >= 1, so nothing can be dropped and the flags are not read (on CUDA, a device->host sync)."""
        for b in self.buckets:
            if not b.present:
                continue
            if self.carry_presence and not all(b.present):
                counts = b.flags.tolist()
                for i, p in enumerate(b.params):
                    if counts[i] == 0:
                        p.grad = None
            elif not self.carry_presence:
                for p, present in zip(b.params, b.present):
                    if not present:
                        p.grad = None


class CollectiveExchanger(KeepGoing, BucketedExchanger, Collective):
    """The all-reduce regimes: each bucket is summed over ranks as soon as it is ready;
    gradients enter their bucket scaled by 1/N, so the sums are the averages, and the user's
    own optimizer steps on them.

    A subclass supplies ``_connect`` (which must call :meth:`meet`, which sets ``self.store``, then
    :meth:`_agree_and_equalise`), ``meet`` and ``allreduce_async``; to keep going when a rank dies
    (``min_workers=``, :class:`~commlab.core.keepgoing.KeepGoing`), ``_reform_links`` too.
    """

    store: Any = None

    def __init__(self, options, rank: RankInfo):
        super().__init__(options, rank)
        self.grad_scale = 1.0 / rank.world_size  # the all-reduce's sum of scaled grads is their average

    def _agree_and_equalise(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank checks its model and optimizer against rank 0's (through the store), then takes
        rank 0's parameters, trainable or not."""
        from commlab.core.peers import agree_on_model
        agree_on_model(self.store, self.rank_info, model, self.options.timeout, optimizer)
        self._take_model_from(0, buffers=False)  # the buffers: setup's first _sync_buffers

    def _take_model_from(self, src: int, buffers: bool = True) -> None:
        """Rank ``src``'s parameters, by one all-reduce per bucket to which the other ranks contribute zeros
        (x + 0 is exact), then its frozen parameters and (``buffers``) buffers in one more."""
        assert self.model is not None
        with torch.no_grad():
            for b in self.buckets:
                shards = [local(p) for p in b.params]
                flat = torch.cat([p.detach().reshape(-1) for p in shards])
                self._broadcast_from(src, flat, f"parameters of {self.rank_info.who(src)}, bucket {b.index}")
                for p, off in zip(shards, b.offsets):
                    p.copy_(flat[off:off + p.numel()].view_as(p))
            rest: list[torch.Tensor] = [p for p in self.model.parameters() if not p.requires_grad]
            if buffers and self.options.buffers != "none":
                rest += [b for _, b in self.module_buffers]
            if rest:
                self._equalise(rest, "broadcast", f"frozen parameters and buffers of {self.rank_info.who(src)}", src)

    def _broadcast_from(self, src: int, flat: torch.Tensor, what: str) -> None:
        if self.rank != src:
            flat.zero_()
        self.allreduce_async(flat, what).wait(self.options.timeout)

    def _equalise(self, tensors: Sequence[torch.Tensor], mode: str, what: str, src: int = 0) -> None:
        """One all-reduce of a float64 copy of ``tensors`` (exact for float32 values and for integers
        below 2**53): ``broadcast`` takes rank ``src``'s values, ``average`` the mean of floating ones over
        the ranks still training (integer tensors, such as BatchNorm's step counter, are ``src``'s: an
        average would not be an integer)."""
        device = tensors[0].device
        flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float64) for t in tensors])
        if mode == "average":
            voters = self._join.voters(self.world_size)
            offset = 0
            for t in tensors:
                part = flat[offset:offset + t.numel()]
                if t.is_floating_point() and self.rank in voters:
                    part.mul_(1.0 / len(voters))
                elif self.rank != src:
                    part.zero_()
                offset += t.numel()
            self.allreduce_async(flat, what).wait(self.options.timeout)
        else:
            self._broadcast_from(src, flat, what)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _sync_buffers(self, mode: str) -> None:
        self._equalise([b for _, b in self.module_buffers], mode, f"buffers ({mode}) after step {self._step}",
                       self._join.buffer_source())

    joins_local_steps = True

    def _join_hook(self, options: JoinOptions) -> Join:
        return VoteJoin(self, options) if self.talk.every_step else LocalVoteJoin(self, options)

    def begin_exchange(self, step: int) -> None:
        """For a caller that drives this regime's collectives itself (:func:`commlab.ddp_hook`): its exchange
        ``step`` begins on this rank. A stall report names that step, and this rank's heartbeat says it got
        there. Call it before the step's first collective; not collective; one store write, bounded."""
        self._step = step
        rendezvous.heartbeat(self.store, self.rank, step)

    def _make_outer(self, options) -> localsteps.Outer:
        return localsteps.ReplicatedOuter(self, options.outer)

    def _trace_clocks(self, rec: trace.Recorder) -> None:
        trace.sync_over_store(rec, self.store, self.rank, self.world_size, self.options.timeout)

    def _start_bucket(self, bucket: Bucket) -> Handle:
        self._keep_gradient(bucket)
        if bucket.index == 0:  # the stall report reads how far each rank got
            rendezvous.heartbeat(self.store, self.rank, self._step)
        what = f"{self.scheme}:// all-reduce of bucket {bucket.index} ({bucket.names[0]}...) at step {self._step}"
        if self.compressor is not None:
            n = self.world_size  # uncompressed, the bucket would have been all-reduced: 2(N-1)/N of it sent
            self.stats.bytes_uncompressed += 2 * (n - 1) * bucket.nbytes // n
            return self._start_compressed(bucket, what)
        return self._allreduce_bucket(bucket, what)

    def _start_compressed(self, bucket: Bucket, what: str) -> Handle:
        """Begin ``bucket``'s exchange through the compressor; this regime moves the payloads (allreduce_async,
        allgather_async: a regime that compresses also gathers)."""
        assert self.compress_state is not None
        return compress_seam.start_compressed(self.compress_state, bucket, cast(compress_seam.Mover, self), what,
                                              self.carry_presence)

    def _allreduce_bucket(self, bucket: Bucket, what: str) -> Handle:
        """Start summing ``bucket``'s buffer (a regime that stages CUDA buckets through the host overrides it)."""
        return self.allreduce_async(bucket.buffer, what)

    def _finish(self) -> None:
        self._drop_absent_grads()


class VoteJoin(Join):
    """join() on the collectives, by a vote at each exchange (DDP's): before an exchange's first bucket every rank
    still training all-reduces a ballot (one slot per rank, then a terminate flag) with its own slot 1; every
    joined rank answers the same all-reduce with its slot 0, then runs the exchange's collectives on zero buckets
    (compressed ones through every round, as DDP's join runs its comm hook on zero buckets) and takes part in
    the buffers' sync. Once a vote finds no rank training, one more ballot finds the last joiners, and every rank
    takes the highest one's model."""

    def __init__(self, ex: CollectiveExchanger, options: JoinOptions):
        super().__init__(options)
        self.ex, self.opts = ex, options
        self.vote: Handle | None = None  # this exchange's tally of the ranks still training
        self.active: list[int] = []  # the ranks still training at this exchange, once counted
        self.shadows: list[torch.Tensor] = []  # a joined rank's zeros, one per bucket

    # ----- a rank still training -----------------------------------------------------------
    def exchange_begins(self) -> None:
        self.vote, self.active = self._vote(self._ballot(True, False)), []
        if self.opts.throw_on_early_termination:
            self._count()  # before any bucket: a rank that ran out makes every rank raise here

    def exchange_ends(self) -> None:
        self._count()
        n, world = len(self.active), self.ex.world_size
        if n and n < world and not self.opts.divide_by_initial_world_size:
            for b in self.ex.buckets:  # the sum over the ranks still training of grad / N: their mean instead
                b.grads.mul_(world / n)

    def _count(self) -> None:
        if self.vote is None or self.active:
            return
        active, terminate = self._tally(self.vote)
        if terminate:
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        self.active = active

    def voters(self, world_size: int) -> Sequence[int]:
        return self.active or range(world_size)

    def buffer_source(self) -> int:
        return max(self.active) if self.active else 0

    # ----- a joined rank ---------------------------------------------------------------------
    def wait_out(self) -> None:
        ex = self.ex
        if ex.world_size == 1:
            return
        self._leaving()
        rendezvous.heartbeat(ex.store, ex.rank, ex._step)  # in the next exchange, with the others
        last = True
        while True:
            active, _ = self._tally(self._vote(self._ballot(False, self.opts.throw_on_early_termination)))
            if not active:
                break
            if self.opts.throw_on_early_termination:
                raise RuntimeError(f"Rank {ex.rank_info.global_rank()} exhausted all inputs.")
            last = False
            self.active = active
            self._shadow_exchange()
        candidates, _ = self._tally(self._vote(self._final_ballot(last)))
        ex._take_model_from(max(candidates))
        self._taken_from(max(candidates))

    def _leaving(self) -> None:
        """A rank whose loop ended, before its first vote (local steps: what is in flight lands)."""

    def _final_ballot(self, last: bool) -> torch.Tensor:
        """The ballot that finds the last joiners: ``last``, whether this rank was still training at the end."""
        return self._ballot(last, False)

    def _taken_from(self, src: int) -> None:
        """After every rank took rank ``src``'s model (local steps: its step count too). Collective."""

    def _shadow_exchange(self) -> None:
        """A joined rank's part in one exchange of the ranks still training (:attr:`active`): zeros for every
        bucket, then the buffers of :meth:`buffer_source`. Collective."""
        ex = self.ex
        if not self.shadows:
            self.shadows = [torch.zeros_like(b.buffer) for b in ex.buckets]
        handles = []
        for b, zeros in zip(ex.buckets, self.shadows):
            zeros.zero_()
            what = f"{ex.scheme}:// zeros of joined {ex.rank_info.who()} for bucket {b.index}"
            if ex.compressor is None:
                handles.append(ex.allreduce_async(zeros, what))
            else:  # as DDP's join runs its comm hook on zero buckets: every round, error feedback's residual included
                handles.append(ex._start_compressed(replace(b, buffer=zeros), what))
        deadline = time.monotonic() + ex.options.timeout
        for h in handles:
            h.wait(max(1e-3, deadline - time.monotonic()))
        if ex.options.buffers != "none" and ex.module_buffers:
            ex._sync_buffers(ex.options.buffers)
        ex._step += 1  # the exchange's index, as on the ranks still training (a stall report compares them)
        rendezvous.heartbeat(ex.store, ex.rank, ex._step)

    # ----- the ballot ------------------------------------------------------------------------
    def _ballot(self, active: bool, terminate: bool) -> torch.Tensor:
        ex = self.ex
        flat = torch.zeros(ex.world_size + 1, device=ex.buckets[0].buffer.device)
        flat[ex.rank] = float(active)
        flat[-1] = float(terminate)
        return flat

    def _vote(self, flat: torch.Tensor) -> Handle:
        """Sum ``flat`` over every rank (does not block)."""
        what = f"join tally of {self.ex.rank_info.who()} at step {self.ex._step}"
        return GroupHandle([self.ex.allreduce_async(flat, what)], what, then=lambda _: flat)

    def _tally(self, handle: Handle) -> tuple[list[int], bool]:
        """(ranks that voted, whether any asked to terminate) from a finished :meth:`_vote`."""
        counts = handle.wait(self.ex.options.timeout).tolist()
        return [r for r, c in enumerate(counts[:-1]) if c > 0.5], counts[-1] > 0.5


class LocalVoteJoin(VoteJoin):
    """join() under local steps (``sync_every=H``, docs/localsteps.md) on the collectives: the vote is taken at
    each sync point of the schedule instead of at each backward (the warm-up's gradient exchanges vote as
    :class:`VoteJoin`), and its ballot carries the voters' step count. A rank still training waits for the vote
    (one small all-reduce) before its first fragment's exchange, and the fragment's pseudo-gradients are averaged
    over the ranks still training (:meth:`sync_point`'s factor). A joined rank answers every vote; at a sync of the
    others it takes the step count from the ballot and runs the same exchanges on zeros (error feedback's residual
    included, as the collectives' join does) and the same outer steps, so its anchor and outer state stay the same
    bits as theirs, and the buffers' average (over the ranks still training). When no rank trains any more,
    every rank takes the last joiner's model and step count. A rank that runs out during ``warmup=`` is refused."""

    def _ballot(self, active: bool, terminate: bool, steps: int = 0) -> torch.Tensor:
        ex = self.ex
        flat = torch.zeros(ex.world_size + 2, dtype=torch.float64, device=ex.buckets[0].buffer.device)
        flat[ex.rank] = float(active)
        flat[-2] = float(terminate)
        flat[-1] = float(steps) if active else 0.0  # summed over the voters: exact in float64
        return flat

    def _ballots(self, handle: Handle) -> tuple[list[int], bool, int]:
        """(ranks that voted, whether any asked to terminate, the voters' step count)."""
        counts = handle.wait(self.ex.options.timeout).tolist()
        active = [r for r, c in enumerate(counts[:-2]) if c > 0.5]
        return active, counts[-2] > 0.5, round(counts[-1] / len(active)) if active else 0

    def _tally(self, handle: Handle) -> tuple[list[int], bool]:
        active, terminate, self.voted_steps = self._ballots(handle)
        return active, terminate


    def sync_point(self, steps: int) -> float:
        active, terminate, _ = self._ballots(self._vote(self._ballot(True, False, steps)))
        if terminate:
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        self.active = active
        return self.ex.world_size / len(active)

    @property
    def talk(self) -> localsteps.LocalSteps:
        talk = self.ex.talk
        assert isinstance(talk, localsteps.LocalSteps)
        return talk

    def _leaving(self) -> None:
        self.talk.leave(self.ex.rank_info.who())  # every fragment exchange in flight lands and is merged now

    def _shadow_exchange(self) -> None:
        """The others' sync at their step count (the vote's): the same exchanges on zeros and the same outer steps."""
        self.talk.shadow(self.voted_steps, self.ex.world_size / len(self.active))

    def _final_ballot(self, last: bool) -> torch.Tensor:
        return self._ballot(last, False, self.talk.steps)

    def _taken_from(self, src: int) -> None:
        self.talk.take_steps_from(src)
