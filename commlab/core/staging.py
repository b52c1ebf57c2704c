"""Host staging: how the zmq regimes move CUDA buckets, and where tensors live.

Sockets read and write host memory, so a regime that speaks zmq (``ring://``
over zmq, ``ps://``) must copy a CUDA bucket to the host before it sends and
copy the result back after it receives. :class:`HostStaging` is written to do
that once for every such regime::

    training thread (backward hook)        copy stream              comm thread
    ───────────────────────────────        ───────────              ───────────
    bucket ready: to_host_async(b) ──────► wait for grads ─► D2H ─► event
                                                                      │
                                                  wait(b, timeout) ◄──┘  send host(b)
                                                                         receive into host(b)
    _apply ◄── compute stream waits ◄────── H2D ◄─────────────────────── to_device(b)

* Each CUDA bucket gets a **pinned** host buffer, allocated once, so the
  copies are true DMA that runs while backward goes on computing earlier
  layers (pageable memory would make the copy synchronous and go through a
  bounce buffer).
* All copies run on **one dedicated stream** per device. The device->host copy
  first waits on an event recorded on the stream that produced the gradient
  (the one current in the backward hook), so it never reads a half-written
  gradient; the host->device copy is followed by an event the compute stream
  waits on, so the optimizer never reads a half-written result. Because one
  stream carries both directions, a bucket's next device->host copy cannot
  overtake its previous host->device copy.
* The comm thread blocks in :meth:`HostStaging.wait` (with a deadline; CUDA
  events themselves have none) before it touches the host buffer.
* Copies go in chunks (4 MiB by default), each with its event, so a regime
  that sends in chunks may send the first one while the rest is still
  crossing PCIe (``wait(i, timeout, upto=end)``), and may copy a finished
  range back while it still works on the next (``to_device(i, start=, stop=)``).
* CPU buckets pass through: :meth:`HostStaging.host` is the bucket's own
  buffer, nothing is copied and nothing waits, so a regime calls the same
  three methods whatever the device.

Who uses it: ``ring://`` over zmq or shared memory stages each CUDA bucket
(the copy to the host starts in the backward hook, the ring runs on the host
mirror, the result goes back on the copy stream), and ``ps://`` pushes from
the mirrors, receives averages (``update=worker``) or parameters
(``update=server``) into them, and copies each received range to the GPU as
it arrives. Neither is GPUDirect: :meth:`HostStaging.facts` says so for the
run's manifest. Only NCCL moves GPU memory without the host, and only
``commlab doctor``'s NCCL probe may say whether it used GPUDirect RDMA.

``mirror_cpu`` (``COMMLAB_STAGE_CPU=1`` for the regimes) gives CPU buckets a
mirror of their own that is copied synchronously, so the regimes' staged path
runs, and is tested, on a machine without a GPU.

How a regime uses it (``BucketedExchanger`` subclass)::

    def _connect(self, model, optim):
        self.staging = HostStaging.for_buckets(self.buckets)
    def _start_bucket(self, bucket):                 # training thread, in the hook
        self.staging.to_host_async(bucket.index)
        return FutureHandle(self.pool.submit(self._exchange, bucket), ...)
    def _exchange(self, bucket):                     # comm thread
        host = self.staging.wait(bucket.index, self.options.timeout)
        ... send/receive/reduce in ``host`` ...
        self.staging.to_device(bucket.index)

Heavy CUDA calls happen only for CUDA buffers, so importing this module and
staging CPU buckets needs no GPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from commlab.base.errors import BackendUnavailable, CommTimeout, ConfigError

if TYPE_CHECKING:
    from commlab.core.exchanger import Bucket

STAGE_CPU_ENV = "COMMLAB_STAGE_CPU"

# What a manifest records about each data path (worded once, here).
HOST_STAGED = "staged through pinned host memory (device->host and host->device copies on a dedicated CUDA stream)"
CPU_RESIDENT = "CPU tensors: nothing to stage"
CPU_MIRRORED = (f"CPU tensors copied through a host mirror as CUDA ones would be ({STAGE_CPU_ENV}=1: the staged "
                f"path's arithmetic, tested without a GPU)")
NOT_GPUDIRECT = "no: zmq moves host memory; GPUDirect RDMA is used only by NCCL, where commlab doctor's probe reports it"


def stage_cpu_asked() -> bool:
    """Whether this process was asked (``COMMLAB_STAGE_CPU=1``) to send CPU buckets through a mirror, as
    CUDA buckets go: the regimes' staged path (mirror ranges, copies back, the order of both) then runs
    and is tested on a machine without a GPU. Only the CUDA streams and events themselves are left out."""
    return os.environ.get(STAGE_CPU_ENV, "") not in ("", "0")


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """The device a worker trains on: ``cpu``, ``cuda`` (GPU ``local_rank % count``, the rule
    ``allreduce://?backend=nccl`` also uses) or an explicit ``cuda:K``.

    Raises :class:`BackendUnavailable` when CUDA is asked for and torch sees none: no silent CPU.
    """
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device {spec!r} is not a torch device; use cpu, cuda or cuda:K") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device {spec!r}: commlab runs on cpu or cuda")
    if not torch.cuda.is_available():
        built = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else \
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
        raise BackendUnavailable(f"device {spec!r} asked for, but {built}; run `commlab doctor`")
    count = torch.cuda.device_count()
    if device.index is None:
        return torch.device("cuda", local_rank % count)
    if device.index >= count:
        raise ConfigError(f"device {spec!r}: only {count} CUDA device(s) visible")
    return device


@dataclass
class _Slot:
    """One staged tensor: the device buffer, its pinned host mirror, and the copy events."""

    device_buf: torch.Tensor
    host: torch.Tensor  # pinned mirror, or device_buf itself for a CPU tensor
    # (end element, event) per chunk of the last device->host copy, in stream order
    to_host_done: list = field(default_factory=list)
    started: bool = False

    @property
    def staged(self) -> bool:
        return self.host is not self.device_buf

    @property
    def pinned(self) -> bool:
        """A CUDA tensor's pinned mirror (not a CPU tensor's mirror_cpu one)."""
        return self.staged and self.device_buf.is_cuda


class HostStaging:
    """Pinned host mirrors of a fixed list of flat tensors (a regime's buckets).

    Thread-safety: :meth:`to_host_async` and :meth:`to_device` may be called
    from any thread (the backward hook runs on autograd's device thread, the
    exchange on a comm thread); each slot is driven by one exchange at a time,
    in the order to_host_async -> wait -> to_device. The host buffer of a slot
    belongs to the caller from :meth:`wait` until its next
    :meth:`to_host_async`, which overwrites it: a zero-copy send from it must
    have left the process by then.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], chunk_bytes: int = 4 * 2**20, mirror_cpu: bool = False):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._slots: list[_Slot] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._consumers: dict[torch.device, torch.cuda.Stream] = {}
        for i, t in enumerate(tensors):
            if t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"staged tensor {i} must be flat and contiguous, got shape {list(t.shape)}")
            if not t.is_cuda:  # passes through, or (mirror_cpu) a plain mirror copied synchronously
                self._slots.append(_Slot(t, torch.empty_like(t) if mirror_cpu else t))
                continue
            if t.device not in self._streams:
                self._streams[t.device] = torch.cuda.Stream(device=t.device)
                # The stream whose work reads the results: the caller's current one (the
                # training thread's), captured here because comm threads have their own.
                self._consumers[t.device] = torch.cuda.current_stream(t.device)
            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            self._slots.append(_Slot(t, host))

    @classmethod
    def for_buckets(cls, buckets: Iterable["Bucket"], chunk_bytes: int = 4 * 2**20,
                    mirror_cpu: bool | None = None) -> "HostStaging":
        """Stage each bucket's whole buffer (gradients and presence flags), indexed by ``bucket.index``.
        ``mirror_cpu`` None: as :func:`stage_cpu_asked` says (the environment)."""
        buckets = list(buckets)
        if [b.index for b in buckets] != list(range(len(buckets))):
            raise ValueError("buckets must be given in index order 0..n-1")
        return cls([b.buffer for b in buckets], chunk_bytes, stage_cpu_asked() if mirror_cpu is None else mirror_cpu)

    @property
    def any_staged(self) -> bool:
        return any(s.staged for s in self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def pinned_bytes(self) -> int:
        return sum(s.host.numel() * s.host.element_size() for s in self._slots if s.pinned)

    def is_staged(self, i: int) -> bool:
        """True if slot ``i`` has a host mirror of its own: a CUDA tensor's pinned one, or (mirror_cpu) a CPU
        tensor's."""
        return self._slot(i).staged

    def host(self, i: int) -> torch.Tensor:
        """The host tensor of slot ``i`` (the tensor itself for CPU). Does not wait: see :meth:`wait`."""
        return self._slot(i).host

    def to_host_async(self, i: int) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """Start copying slot ``i`` to its host mirror, after the work already queued on the
        calling thread's current stream (the kernels that wrote the gradient). Does not block.

        Returns the host tensor and the event that marks the whole copy done (None for CPU)."""
        slot = self._slot(i)
        slot.started = True
        if not slot.staged:
            return slot.host, None
        if not slot.device_buf.is_cuda:  # mirror_cpu: what the GPU's copy would do, done now
            slot.host.copy_(slot.device_buf)
            slot.to_host_done = []
            return slot.host, None
        dev = slot.device_buf.device
        stream = self._streams[dev]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))
        n, step = slot.host.numel(), max(1, self.chunk_bytes // slot.host.element_size())
        events = []
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for start in range(0, n, step):
                stop = min(n, start + step)
                slot.host[start:stop].copy_(slot.device_buf[start:stop], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                events.append((stop, done))
        slot.to_host_done = events
        return slot.host, events[-1][1] if events else None

    def wait(self, i: int, timeout: float, upto: int | None = None) -> torch.Tensor:
        """Block until slot ``i``'s device->host copy finished (only elements ``[0, upto)`` if
        ``upto`` is given); return the whole host tensor.

        Raises :class:`CommTimeout` naming the slot after ``timeout`` seconds (a copy stuck
        behind a hung kernel), ``ValueError`` if :meth:`to_host_async` was not called."""
        slot = self._slot(i)
        if not slot.started:
            raise ValueError(f"staging slot {i}: wait() before to_host_async()")
        need = slot.host.numel() if upto is None else upto
        if not 0 <= need <= slot.host.numel():
            raise ValueError(f"staging slot {i}: upto={need} is outside [0, {slot.host.numel()}]")
        # chunks complete in stream order: the first chunk ending at or after `need` covers it
        event = next((e for end, e in slot.to_host_done if end >= need), None)
        if event is None or event.query():
            return slot.host
        deadline = time.monotonic() + timeout
        pause = 0.0
        while not event.query():  # polled: cudaEventSynchronize has no deadline
            if time.monotonic() > deadline:
                raise CommTimeout(f"device->host copy of bucket {i} (first {need} of {slot.host.numel()} elements on "
                                  f"{slot.device_buf.device}) did not finish within {timeout:g}s")
            time.sleep(pause)
            pause = min(1e-3, pause * 2 + 2e-5)
        return slot.host

    def to_device(self, i: int, dst: torch.Tensor | None = None, start: int = 0, stop: int | None = None) -> None:
        """Copy elements ``[start, stop)`` of slot ``i``'s host tensor to the same elements of the
        staged tensor, or, given ``dst`` (contiguous, ``stop - start`` elements), into all of
        ``dst``: e.g. a parameter pulled into its bucket's layout,
        ``to_device(b.index, dst=p.data, start=b.offsets[j], stop=b.offsets[j] + p.numel())``.

        Does not block: the copy runs on the copy stream, and the consumer stream (the one
        current when this staging was built) waits for it, so work queued there afterwards
        (the optimizer step) sees the result. The host tensor must not change until the
        slot's next :meth:`to_host_async`. For a CPU slot: a plain copy, or nothing if ``dst``
        is the tensor itself."""
        slot = self._slot(i)
        stop = slot.host.numel() if stop is None else stop
        if not 0 <= start <= stop <= slot.host.numel():
            raise ValueError(f"staging slot {i}: range [{start}, {stop}) is outside [0, {slot.host.numel()})")
        src = slot.host[start:stop]
        if dst is None:
            target, out = slot.device_buf, slot.device_buf[start:stop]
        else:
            if dst.numel() != stop - start or dst.dtype != src.dtype or not dst.is_contiguous():
                raise ValueError(f"staging slot {i}: destination is {dst.dtype}[{dst.numel()}]"
                                 f"{'' if dst.is_contiguous() else ' (not contiguous)'}, "
                                 f"range [{start}, {stop}) is {src.dtype}[{stop - start}]")
            target, out = dst, dst.view(-1)
        if not target.is_cuda:
            if out.data_ptr() != src.data_ptr():
                out.copy_(src)
            return
        stream = self._streams.get(target.device)
        if stream is None:
            raise ValueError(f"staging slot {i}: destination on {target.device}, which this staging has no stream for")
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            out.copy_(src, non_blocking=True)
            done.record(stream)
        self._consumers[target.device].wait_event(done)

    def synchronize(self) -> None:
        """Block until every copy queued so far finished (tests, shutdown)."""
        for stream in self._streams.values():
            stream.synchronize()

    def facts(self) -> dict:
        """For the run's manifest: how this regime's tensors reach the wire."""
        staged = [s for s in self._slots if s.pinned]
        mirrored = [s for s in self._slots if s.staged and not s.pinned]
        return {
            "data_path": HOST_STAGED if staged else (CPU_MIRRORED if mirrored else CPU_RESIDENT),
            "gpudirect": NOT_GPUDIRECT if staged else "no (CPU tensors)",
            "mirrored_cpu_buckets": len(mirrored),
            "staged_buckets": len(staged),
            "pinned_bytes": self.pinned_bytes,
            "devices": sorted({str(s.device_buf.device) for s in self._slots}),
        }

    def _slot(self, i: int) -> _Slot:
        if not 0 <= i < len(self._slots):
            raise ValueError(f"staging slot {i} does not exist (have {len(self._slots)})")
        return self._slots[i]
