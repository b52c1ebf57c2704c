"""``allreduce://?backend=gloo|nccl[&compress=SPEC&ef=0|1]``: gradients averaged by torch.distributed.

Each bucket is all-reduced (sum) as soon as backward fills it; ``step()``
waits for the last one (gradients were scaled by 1/N as they entered their bucket)
and steps the worker's own optimizer, exactly like single-process SGD on the combined batch. gloo runs on
CPU tensors and on CUDA tensors (which it copies through host memory
itself); NCCL needs CUDA tensors and a GPU per rank, and moves data with
GPUDirect RDMA where the hardware offers it (``commlab doctor`` records
whether it did). Nothing falls back: asking for NCCL without CUDA raises.

``compress=`` (:mod:`commlab.compress`): each bucket goes through the compressor instead, moved as its
declaration allows (:mod:`commlab.compress.seam`): float32 payloads that sum (PowerSGD's P and Q,
random-k's values) by all-reduce, one per round; gather-only payloads (top-k, sign) by all-gather. fp16
and bf16 are gathered too and added in float32 on every rank: gloo's all-reduce adds a half tensor in
half precision, rounding every partial sum, which the issue's "sums in float32" rules out. That costs
(N-1) x n x 2 bytes sent per rank against 2(N-1)/N x n x 4 for an uncompressed float32 all-reduce: less
for N < 4, more beyond (ring:// can cast per hop instead). Bytes counted are those sent and received.

``min_workers=M`` (or ``commlab run --replace``): the survivors keep going when a rank dies
(:mod:`commlab.core.keepgoing`): the exchanger all-reduces on a gloo group of its own, made anew for each
membership under a fresh store prefix (``allreduce/e<epoch>/``, as torchft's ``ProcessGroupGloo.configure``);
a wait on a gloo operation also ends when the step was discarded elsewhere or a member stopped beating.

Under DDP (or any code that made the default process group first) the exchanger uses that group and
its store, and never destroys it: only a group it created itself. Over a group of the job's ranks
(``commlab.connect(url, group=...)``, :mod:`commlab.core.groups`) it all-reduces on a DeviceMesh
dimension's process group when given one, else on a process group of the group's members that it makes
(the other ranks call nothing) and shuts down on close; it never makes or destroys the default group then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from commlab import compress
from commlab.transport import rendezvous
from commlab.base.config import option
from commlab.core.quorum import KeepGoingOptions
from commlab.base.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, PeerLost
from commlab.core.exchanger import CollectiveExchanger
from commlab.base.handles import Handle, WorkHandle


@dataclass(frozen=True)
class AllReduceOptions(KeepGoingOptions):
    backend: str = option("gloo", "torch.distributed backend", choices=("gloo", "nccl"))

    def check_keep_going(self) -> None:
        super().check_keep_going()
        if self.backend != "gloo":
            raise ConfigError("option 'min_workers' (keep going) needs backend=gloo")


def nccl_version() -> str | None:
    """The NCCL torch carries, or None (CPU build, or torch without NCCL)."""
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return None
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    if isinstance(v, int):  # older torch: one integer, e.g. 2708 or 21803
        major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    return ".".join(map(str, v))



class AllReduceExchanger(CollectiveExchanger):
    scheme = "allreduce"
    Options = AllReduceOptions

    group = None  # the process group, once connected (``store`` is CollectiveExchanger's)
    owns_group = False  # False when the default group was there already (DDP's): close() leaves it

    def _connect(self, model, optimizer):
        params = [p for b in self.buckets for p in b.params]
        if self.options.backend == "nccl" and not all(p.is_cuda for p in params):
            raise ConfigError("backend=nccl needs CUDA parameters; move the model with .to('cuda') before setup()")
        self.meet()
        if self._joined is not None:  # a replacement: the state of a live rank, over the new group
            self._heal(self._joined)
            return
        compress.agree(self.store, self.rank_info, self.options, self.options.timeout)
        self._agree_and_equalise(model, optimizer)

    def meet(self) -> None:
        """Meet the other ranks (store + process group). Collective; idempotent; setup() calls it.
        Call it directly to use :meth:`allreduce_async` without a model (benchmarks)."""
        if self.group is not None:
            return
        backend = self.options.backend
        if backend == "nccl" and not torch.cuda.is_available():
            raise BackendUnavailable("allreduce://?backend=nccl needs CUDA, and torch sees no CUDA device here; "
                                     "use backend=gloo for CPU tensors")
        if backend == "nccl" and not dist.is_nccl_available():
            raise BackendUnavailable("allreduce://?backend=nccl: this torch build has no NCCL")
        if self.options.keep_going:
            self._meet_keep_going()
            return
        if self.rank_info.members:
            self._meet_group()
            return
        if dist.is_initialized():
            self._borrow_default_group()
            return
        self.store = rendezvous.exchanger_store(rendezvous.connect_store(self.rank_info, self.options.timeout),
                                                self.rank_info, self.options.timeout)
        if backend == "nccl":
            torch.cuda.set_device(self.rank_info.local_rank % torch.cuda.device_count())
        try:
            dist.init_process_group(backend, store=dist.PrefixStore("allreduce/", self.store), rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=self.options.timeout))
        except RuntimeError as exc:  # gloo: connectFullMesh; NCCL: its init; the cause says which peer and why
            raise CommError(f"rank {self.rank}: the {backend} process group of {self.world_size} ranks did not form "
                            f"(rendezvous {self.rank_info.master_addr}:{self.rank_info.master_port}): a peer died "
                            f"at start, or cannot reach the address {backend} listens on (GLOO_SOCKET_IFNAME / "
                            f"NCCL_SOCKET_IFNAME choose the interface); cause: {exc}") from exc
        self.group, self.owns_group = dist.group.WORLD, True

    def _meet_keep_going(self) -> None:
        """``min_workers=``: a gloo group of this exchanger's own (never the default one), made anew for each
        membership epoch under a fresh store prefix (:meth:`_reform_links`); a replacement waits in
        ``_start_quorum`` until the running job admits it."""
        if dist.is_initialized() or self.torch_group is not None:
            raise ConfigError("allreduce://?min_workers= makes process groups of its own, one per membership: use "
                              "it without a default process group made before it (DDP's, init_process_group)")
        job = rendezvous.connect_store(self.rank_info, self.options.timeout)
        self.store = self._start_quorum(job, job)
        self._old_groups: list = []
        self._meet_first(self._new_group)  # a replacement re-forms if a member dies while its group forms
        self._started()

    def _new_group(self) -> None:
        from commlab.core.groups import new_process_group
        store = dist.PrefixStore(self._epoch_ns("allreduce/"), self.store)
        try:
            self.group = new_process_group(store, self.rank_info, "gloo", self.options.timeout)
        except RuntimeError as exc:
            raise CommError(f"{self.rank_info.who()}: the gloo group of membership {list(self.quorum.members)} did "
                            f"not form: {exc}") from exc
        self.owns_group = True

    def _reform_links(self) -> None:
        """Keeping going: a new gloo group of the membership ``rank_info`` names, under this epoch's prefix. The
        old one is kept until close (an operation still hung in it ends by its timeout; dropping it now could
        block on that)."""
        if self.group is not None:
            self._old_groups.append(self.group)
        self.group = None
        self._new_group()  # collective: gloo connects every pair

    def _meet_group(self) -> None:
        """``connect(group=...)``: a DeviceMesh dimension's process group (borrowed), else one of the group's
        members alone that this exchanger makes and owns (:func:`commlab.core.groups.new_process_group`: the other
        ranks of the job call nothing). The default group, if there is one (a pipeline's), is only read for
        its store; none is made here."""
        from commlab.core.groups import new_process_group
        timeout = self.options.timeout
        self.store = rendezvous.exchanger_store(rendezvous.job_store(self.rank_info, timeout), self.rank_info, timeout)
        if self.torch_group is not None:
            ranks = dist.get_process_group_ranks(self.torch_group)
            if list(ranks) != list(self.rank_info.members):
                raise ConfigError(f"the DeviceMesh's process group has ranks {ranks}, the group given "
                                  f"{list(self.rank_info.members)}")
            self.group, self.owns_group = self.torch_group, False
            return
        self.group, self.owns_group = new_process_group(self.store, self.rank_info, self.options.backend, timeout), True

    def _borrow_default_group(self) -> None:
        """The default process group exists (DDP's, the user's): use it and its store, as they are."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) != (self.rank, self.world_size):
            raise ConfigError(f"the default process group has rank {rank} of {world}, but the launcher's "
                              f"environment says rank {self.rank} of {self.world_size}")
        backend = str(dist.get_backend())  # "gloo", or per device type: "cpu:gloo,cuda:nccl"
        if self.options.backend not in backend.replace(",", ":").split(":"):
            raise ConfigError(f"the default process group runs {backend}, not backend={self.options.backend}")
        self.store = rendezvous.exchanger_store(rendezvous.default_group_store(self.rank_info, self.options.timeout), self.rank_info, self.options.timeout)
        self.group, self.owns_group = dist.group.WORLD, False

    def _stalled(self) -> str:
        return rendezvous.stall_report(self.store, self.world_size, self._step, skip=self.rank,
                                       members=self.rank_info.members)

    def allreduce_async(self, tensor: torch.Tensor, what: str = "all-reduce") -> Handle:
        """Sum ``tensor`` in place over all ranks. Collective (same order on every rank); don't touch
        ``tensor`` until the handle is done. Needs :meth:`meet` (or setup) first."""
        n = self.world_size
        moved = 2 * (n - 1) * tensor.numel() * tensor.element_size() // n  # each way, by a ring's count
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved
        work = dist.all_reduce(tensor, async_op=True, group=self.group)
        if self.quorum is not None:
            return QuorumWorkHandle(work, f"{what} on {self.rank_info.who()}", self)
        return WorkHandle(work, f"{what} on {self.rank_info.who()}", on_timeout=self._stalled)

    def allgather_async(self, tensor: torch.Tensor, what: str = "all-gather") -> Handle:
        """Every rank's ``tensor`` (the same size on each): the handle's result is the list, in rank order."""
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        moved = (self.world_size - 1) * tensor.numel() * tensor.element_size()
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved
        work = dist.all_gather(gathered, tensor, async_op=True, group=self.group)
        return WorkHandle(work, f"{what} on {self.rank_info.who()}", on_timeout=self._stalled, then=lambda: gathered)

    @staticmethod
    def sums_exactly(dtype: torch.dtype) -> bool:
        """gloo and NCCL add in the tensor's own dtype: only float32 and wider are summed as float32 is."""
        return dtype in (torch.float32, torch.float64)

    def facts(self) -> dict:
        facts = {"scheme": self.scheme, "backend": self.options.backend, **self._heap_facts(),
                 **self._keep_going_facts()}
        if self.compressor is not None:
            facts["compress"] = self.compressor.describe()
        if self.options.backend == "nccl" and torch.cuda.is_available():
            facts["nccl_version"] = nccl_version()
            facts["data_path"] = "GPU memory, moved by NCCL (transport and GPUDirect RDMA: see commlab doctor's probe)"
        elif any(b.buffer.is_cuda for b in self.buckets):
            facts["data_path"] = "gloo copies CUDA tensors through host memory itself; no GPUDirect"
        return facts

    def close(self):
        super().close()
        if self.quorum is not None:
            self.quorum.close()
            if self.group is not None:
                rendezvous.leave(self.store, self.rank_info, min(self.options.timeout, 30.0),
                                 f"leave/e{self.quorum.epoch}")
                self.group.shutdown()
            self.group, self._old_groups = None, []
            return
        if self.group is not None and self.owns_group and self.rank_info.members:
            # the group's own process group (never registered with torch): every member checks out before
            # it goes, as below; the default group, a pipeline's, is not touched
            rendezvous.leave(self.store, self.rank_info, min(self.options.timeout, 30.0))
            self.group.shutdown()
        elif self.group is not None and self.owns_group and dist.is_initialized():
            rendezvous.leave(self.store, self.rank_info, min(self.options.timeout, 30.0))
            dist.destroy_process_group()
        self.group = None


class QuorumWorkHandle(WorkHandle):
    """A gloo operation while keeping going: its wait also ends when the step was discarded elsewhere, or a member
    went silent (a hung operation would otherwise hold the survivors until ``timeout``)."""

    def __init__(self, work, what: str, ex: AllReduceExchanger):
        super().__init__(work, what, on_timeout=ex._stalled)
        self.ex = ex

    def _wait(self, timeout: float):
        import time

        q, ex = self.ex.quorum, self.ex
        deadline = time.monotonic() + timeout
        next_look = time.monotonic() + 0.05
        while not self._work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise CommTimeout(f"{self.what} did not complete within {timeout:g}s")
            time.sleep(0.001)
            if now < next_look:
                continue
            next_look = now + 0.05
            d = q.aborted(ex._step)
            if d is not None:
                raise PeerLost(f"{self.what}: the step was discarded: {d.reason}",
                               peer=d.lost[0] if d.lost else None, op="relay")
            quiet = [r for r in q.members if r != q.me and (q.gone(r) or q.silent(r))]
            if quiet:
                raise CommTimeout(f"{self.what}: rank(s) {quiet} sent no heartbeat for {q.hb_s:g}s", peer=quiet[0],
                                  op="receive")
        return super()._wait(max(1e-3, deadline - time.monotonic()))
