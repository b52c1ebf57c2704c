"""commlab under DistributedDataParallel: DDP users keep DDP and swap its transport with one line::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(*commlab.ddp_hook())   # URL from $COMMLAB_EXCHANGER, or ddp_hook(url)

Each of DDP's gradient buckets then goes through a commlab regime that sums, and through its compressor:

* ``allreduce://`` (torch.distributed, in DDP's own default group, never destroyed here) and ``ring://``
  (its own links, meeting in that group's store): the hook divides the bucket by N and sums it in place,
  started in the hook itself, so buckets overlap backward as under DDP. ``allreduce://?compress=SPEC``
  moves the bucket through the compressor (:mod:`commlab.compress.seam`), its state keyed by the bucket's
  parameters, not by ``bucket.index()``: DDP rebuilds its buckets after the first iteration (a rebuilt
  bucket takes its parameters' parts of the old buckets' error-feedback residuals).
* ``ps://`` with ``mode=sync`` and ``update=worker``: the servers average. At the end of the first
  iteration the hook knows every parameter (DDP's buckets cover them all) and sets up a ps:// exchanger
  on a mirror of them (zero tensors of the same shapes, a key per parameter); from then on, once the
  last bucket of a step arrives, every bucket's gradients are pushed and their averages pulled back.
  No overlap with backward (the step's exchange runs after its last bucket), and one copy of the model
  in the mirror.

The hook uses only what the regime declares (:mod:`commlab.core.exchanger`): a :class:`~commlab.core.exchanger.Collective`
(``meet``, ``allreduce_async``, ``begin_exchange``), or an :class:`~commlab.core.exchanger.AveragesSteps`
(``check_averages``, ``setup``, ``exchange_step``).

Uncompressed, the result equals plain DDP's (up to the order of the sums). The hook returns a
``torch.futures.Future`` at once; a thread of the state's completes it from the regime's handle, always
within the URL's ``timeout`` (else with the error, which DDP raises out of ``backward()``). Every rank
issues its collectives in the same order: a bucket's first round in the hook (DDP calls the hook in
bucket order on every rank), later rounds (PowerSGD's Q) only once the step's last bucket is in.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commlab import compress
from commlab.compress.seam import CompressState
from commlab.base.config import ExchangerURL
from commlab.base.errors import CommError, ConfigError
from commlab.core.exchanger import AveragesSteps, CollectiveExchanger
from commlab.base.handles import Handle
from commlab.core.registry import resolve, url_from_env
from commlab.transport.rendezvous import RankInfo, from_env

SUMMING = "allreduce://, ring:// or ps://?mode=sync&update=worker"


@dataclass
class _Job:
    """One DDP bucket of one step: its buffer (the future's result), parameters and the handle summing it."""

    buffer: torch.Tensor
    params: list[torch.Tensor]
    future: torch.futures.Future
    handle: Handle | None = None


class DDPHookState:
    """What :func:`ddp_hook` hands to ``register_comm_hook``: the regime, connected on the first bucket.

    ``close()`` stops its thread and closes the regime (sockets, threads; a process group only if the
    regime made it, never DDP's). ``state_dict()`` / ``load_state_dict()``: the compressor's state.
    """

    def __init__(self, url: str | ExchangerURL | None = None, rank: RankInfo | None = None):
        text = url_from_env(url)
        parsed = text if isinstance(text, ExchangerURL) else ExchangerURL.parse(text)
        cls, checked = resolve(parsed)  # a bad URL or compress= spec: ConfigError, one line naming the option
        self.scheme = parsed.scheme
        if not issubclass(cls, (CollectiveExchanger, AveragesSteps)):
            raise ConfigError(f"ddp_hook: {self.scheme}:// does not sum gradients over ranks; use {SUMMING}")
        ex = cls(checked, rank if rank is not None else from_env())
        self.ex: Any = ex  # a CollectiveExchanger or an AveragesSteps (the abilities the hook uses)
        # a regime that sums a whole step (ps://) gets it after the step's last bucket, through a mirror of DDP's
        # parameters; a collective sums each bucket as DDP hands it over
        self._whole: _WholeStep | None = _WholeStep(ex) if isinstance(ex, AveragesSteps) else None
        self.timeout: float = ex.options.timeout
        # the hook compresses a collective's buckets itself; ps:// compresses inside its own exchange_step
        self.compressor: compress.Compressor | None = ex.compressor
        self._keys: dict[tuple[int, ...], int] = {}  # a bucket's parameters (identities) -> compressor key
        self._sizes: dict[int, list[int]] = {}  # compressor key -> its parameters' sizes
        self._orphans: dict[int, torch.Tensor] = {}  # id(parameter) -> its residual from a bucket DDP rebuilt
        self._connected = False
        # the compressed step's state (commlab.compress.seam), as the exchanger's regimes keep it
        self._compress = CompressState(self.compressor) if self.compressor is not None else None
        self._step_jobs: list[_Job] = []  # this step's buckets, until its last (multi-round compressors, ps://)
        self._step = 0
        self._first = True  # the next bucket is its step's first
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self.ex.rank

    # ----- on DDP's thread ---------------------------------------------------------------------
    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self._closed:
            raise ConfigError("ddp_hook: the hook's state was closed; register a new ddp_hook()")
        if self._thread is None:
            self._thread = threading.Thread(target=self._drive, name=f"commlab-ddp-rank{self.rank}", daemon=True)
            self._thread.start()
        buffer, params = bucket.buffer(), list(bucket.parameters())
        # on CUDA, the future's result carries an event of the stream that completed it: DDP's stream waits for it
        job = _Job(buffer, params, torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda
                   else torch.futures.Future())
        last = bucket.is_last()
        if self._whole is not None:  # the whole step at once, after its last bucket (the servers average: no 1/N)
            self._step_jobs.append(job)
        else:
            self._connect_collective()
            buffer.div_(self.ex.world_size)
            if self._first:  # the stall report reads how far each rank got (and the regime's step)
                self.ex.begin_exchange(self._step)
            what = f"{self.scheme}:// DDP bucket {bucket.index()} ({len(params)} parameters) at step {self._step}"
            if self._compress is None:
                job.handle = self.ex.allreduce_async(buffer, what)
            else:
                shapes = tuple(p.shape for p in params)
                if sum(p.numel() for p in params) != buffer.numel():
                    shapes = (buffer.shape,)
                job.handle = self._compress.start(self._key(params), buffer, shapes, None, self.ex, what,
                                                  first=self._first)
            if self.compressor is None or self.compressor.rounds == 1:
                self._jobs.put((self._wait_for, [job]))  # nothing more to issue: wait for it now
            else:
                self._step_jobs.append(job)
        self._first = last
        if last:
            if self._step_jobs:
                self._jobs.put((self._whole.run if self._whole is not None else self._wait_for, self._step_jobs))
            self._step_jobs = []
            self._step += 1
        # DDP reads the result in C++, which cannot unwrap a Python exception set on the future: a failure
        # raised by ``then``'s callback marks the chained future failed, and DDP raises it out of backward()
        return job.future.then(_result)

    def _key(self, params: list[torch.Tensor]) -> int:
        """The compressor's key for a bucket of these parameters: numbered in order of first appearance,
        which is the same on every rank (DDP's buckets, and their rebuilt ones, come in the same order)."""
        ident = tuple(id(p) for p in params)
        key = self._keys.get(ident)
        if key is None:
            key = self._keys[ident] = len(self._keys)
            self._sizes[key] = [p.numel() for p in params]
            self._carry_residuals(key, ident)
        return key

    def _carry_residuals(self, key: int, ident: tuple[int, ...]) -> None:
        """Error feedback across DDP's rebuild: a new bucket starts from what its parameters' earlier buckets
        had not sent yet. A bucket that shares a parameter with the new one is gone for good (a parameter is
        in one bucket at a time): its residual is cut per parameter, the new bucket takes its parameters'
        pieces, the rest wait for theirs."""
        comp = self.compressor
        if comp is None or not comp.keeps_residuals:
            return
        mine = set(ident)
        for old_ident, old in list(self._keys.items()):
            if old != key and mine.intersection(old_ident):
                residual = comp.take_residual(old)
                if residual is None:
                    continue
                if residual.numel() != sum(self._sizes[old]):  # not cut per parameter (a bucket of another shape)
                    comp.put_residual(old, residual)
                    continue
                for pid, piece in zip(old_ident, torch.split(residual, self._sizes[old])):
                    self._orphans[pid] = piece
        if any(pid in self._orphans for pid in ident):
            like = next(self._orphans[pid] for pid in ident if pid in self._orphans)
            comp.put_residual(key, torch.cat([self._orphans.pop(pid) if pid in self._orphans else like.new_zeros(n)
                                              for pid, n in zip(ident, self._sizes[key])]))

    def _connect_collective(self) -> None:
        if self._connected:
            return
        if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != (self.rank, self.ex.world_size):
            raise ConfigError(f"ddp_hook: DDP's process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                              f"the launcher's environment rank {self.rank} of {self.ex.world_size}")
        self.ex.meet()  # allreduce://: DDP's group; ring://: its own links, met in that group's store
        if self.compressor is not None:
            compress.agree(self.ex.store, self.ex.rank_info, self.ex.options, self.timeout)
        self._connected = True

    # ----- on the state's thread -------------------------------------------------------------------
    def _drive(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            run, jobs = item
            try:
                run(jobs)
            except BaseException as exc:  # noqa: BLE001 - DDP raises it out of backward()
                if not isinstance(exc, (CommError, ConfigError)) or f"rank {self.rank}" not in str(exc):
                    exc = CommError(f"rank {self.rank}: DDP hook over {self.scheme}://: {exc}")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)

    def _wait_for(self, jobs: list[_Job]) -> None:
        """A collective's buckets, started in the hook: their sums, in order."""
        deadline = time.monotonic() + self.timeout
        for i, job in enumerate(jobs):  # a multi-round exchange's first wait brings the later ones along
            assert job.handle is not None
            job.handle.wait(self.timeout if i == 0 else max(1e-3, deadline - time.monotonic()))
            job.future.set_result(job.buffer)

    # ----- the rest ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"scheme": self.scheme, "steps": self._step,
                **({"compress": self.compressor.state_dict()} if self.compressor is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self._step = int(state.get("steps", 0))
        if self.compressor is not None and "compress" in state:
            self.compressor.load_state_dict(state["compress"])

    def close(self) -> None:
        """Stop the thread and close the regime. Idempotent; not collective."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.timeout)
            self._thread = None
        self.ex.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _WholeStep:
    """A regime that averages a whole step (:class:`~commlab.core.exchanger.AveragesSteps`, ps://): at the end of the
    first step the hook knows every parameter (DDP's buckets cover them all) and sets the regime up on a mirror
    of them; each step then hands it every bucket's gradients (as the mirror's ``grad``) and copies the averages
    back. Runs on the hook state's thread, the only one that drives this exchanger."""

    def __init__(self, ex: Any):  # an AveragesSteps (an Exchanger: setup)
        ex.check_averages()  # the URL's mode= and update=: a bad one fails here, in one line naming it
        self.ex = ex
        self.mirror: dict[int, nn.Parameter] = {}  # id(DDP parameter) -> its mirror

    def run(self, jobs: list[_Job]) -> None:
        """Push every bucket's gradients (through the mirror's ``grad``), pull the averages back."""
        if not self.mirror:
            self._setup([p for job in jobs for p in job.params])
        for job in jobs:
            for p, g in zip(job.params, _views(job)):
                self.mirror[id(p)].grad = g
        self.ex.exchange_step()  # every bucket of the mirror pushed, and its average pulled
        for job in jobs:
            for p, g in zip(job.params, _views(job)):
                avg = self.mirror[id(p)].grad
                if avg is None:  # no rank had it (never, as DDP hands every gradient): DDP's zeros
                    g.zero_()
                else:
                    g.copy_(avg)
        for job in jobs:
            job.future.set_result(job.buffer)

    def _setup(self, params: list[torch.Tensor]) -> None:
        seen: dict[int, torch.Tensor] = {}
        for p in params:
            seen.setdefault(id(p), p)
        mirror = _Mirror(list(seen.values()))
        self.ex.setup(mirror, torch.optim.SGD(mirror.parameters(), lr=0.0))  # never stepped: the servers average
        self.ex.check_averages()  # now the servers' mode and update
        self.mirror = {k: m for k, m in zip(seen, mirror.grads)}


class _Mirror(nn.Module):
    """ps://: a zero tensor per DDP parameter (same shape, dtype, device): the keys the servers hold."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.grads = nn.ParameterList([nn.Parameter(torch.zeros_like(p, memory_format=torch.contiguous_format))
                                       for p in params])


def _views(job: _Job) -> list[torch.Tensor]:
    """Each parameter's gradient in a DDP bucket's buffer (its parameters' gradients back to back)."""
    out, offset = [], 0
    flat = job.buffer.view(-1)
    for p in job.params:
        out.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    if offset != flat.numel():
        raise ConfigError(f"a DDP bucket holds {flat.numel()} elements, its parameters {offset}")
    return out


def _result(future: torch.futures.Future) -> torch.Tensor:
    return future.value()  # raises the exception the state's thread set


def hook(state, bucket):  # no annotations: DDP compares them with the classes, and this module's are strings
    """DDP's communication hook (``state``: a :class:`DDPHookState`, ``bucket``: a ``dist.GradBucket``): a
    ``torch.futures.Future`` of the bucket averaged through ``state``'s regime."""
    return state.exchange(bucket)


def ddp_hook(url: str | ExchangerURL | None = None) -> tuple[DDPHookState, Any]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``; the regime ``url`` names
    (default ``$COMMLAB_EXCHANGER``): one of allreduce:// (with compress=), ring://, ps:// (sync,
    update=worker). A bad URL raises :class:`ConfigError` here, in one line naming the option."""
    return DDPHookState(url), hook
