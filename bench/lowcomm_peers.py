"""The peers of ``commlab bench lowcomm``, as entries of :mod:`bench.compress_worker`: the same loop, the user's
optimizer untouched, the exchange done by somebody else's local-steps code.

Each is a :class:`Peer` made from an entry's fields (``H``, ``P``, ``T``, ``alpha``): after the user's
``optimizer.step()`` the loop calls :meth:`Peer.after_step`, which says the bytes this rank sent in that step
(a closed form of what the peer all-reduces, counted as a ring counts: 2(N-1)/N of each tensor).

``alone``
    No exchange at all (H = infinity): the inner step time every utilization is measured against.
``postlocal``
    torch's ``PostLocalSGDOptimizer(optim, PeriodicModelAverager(period=H, warmup_steps=0))`` on the default
    gloo group: every H-th step the parameters are averaged (one all-reduce per parameter), no outer
    optimizer: commlab's ``outer=sgd:lr=1`` at equal H. torch's averager counts steps from 0 and averages
    when ``step % H == 0`` after warm-up, so at step 0 too: one more average than commlab's (steps H, 2H, ...).
``torchft``
    torchft's ``DiLoCo`` (``torchft-nightly``, the ``.[peers]`` extra): each rank is a replica group of one,
    with a torchft ``Manager`` and a ``ProcessGroupGloo``; the Lighthouse (quorum) is started by rank 0 in
    its own process, bound to the address the others reach it on (loopback without capped links). Outer
    optimizer SGD(lr=1) (plain averaging, as commlab's ``outer=sgd:lr=1``), ``P`` fragments (parameters taken
    strided, as commlab's default), ``fragment_sync_delay=T``, ``fragment_update_alpha=alpha``,
    ``pin_memory=False`` (no accelerator), fp32 (its quantization needs CUDA and Triton). It requires H
    divisible by P and T < H/P; its bytes: fragment ``k mod P`` all-reduced at step ``k H/P``.
"""

from __future__ import annotations

import os
import socket
import types
from datetime import timedelta

import torch
from torch import nn


def ring_bytes(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


class Peer:
    """An exchange around the user's model and optimizer; ``forward`` is what the loop calls the model through."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, entry: dict, world: int):
        self.model, self.world = model, world
        self.numel = sum(p.numel() for p in model.parameters())
        self.opt = opt
        self.forward = model

    def step(self) -> None:
        """The user's ``optimizer.step()`` (through the peer's wrapper where it has one)."""
        self.opt.step()

    def after_step(self, step: int) -> tuple[int, int]:
        """(bytes this rank sent in ``step``, the synchronous ring's bytes for one step)."""
        return 0, ring_bytes(4 * self.numel, self.world)

    def close(self) -> None:
        pass


class Alone(Peer):
    """H = infinity: no exchange."""


class PostLocal(Peer):
    def __init__(self, model, opt, entry, world):
        super().__init__(model, opt, entry, world)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        self.period = int(entry["H"])
        self.wrapped = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=self.period, warmup_steps=0))

    def step(self):
        self.wrapped.step()

    def after_step(self, step):
        raw = ring_bytes(4 * self.numel, self.world)
        return (raw if step % self.period == 0 else 0), raw


def advertise(host: str) -> None:
    """Make torchft's process groups (their rendezvous store) and its checkpoint server (the recovery of a
    joining replica) name ``host``: they take ``socket.gethostname()``, which resolves outside this rank's
    network namespace, so the other rank waited 300 s and torchft dropped the sync. Only those torchft
    modules see the change (their own ``socket`` name)."""
    from torchft import process_group
    from torchft.checkpointing import http_transport

    shim = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if not k.startswith("__")})
    shim.gethostname = lambda: host
    process_group.socket = shim  # type: ignore[attr-defined]
    http_transport.socket = shim  # type: ignore[attr-defined]


def strided(params: list[nn.Parameter], parts: int) -> list[nn.Module]:
    """``parts`` modules holding the parameters taken strided (parameter i in fragment i mod parts)."""
    out = []
    for p in range(parts):
        m = nn.Module()
        m.params = nn.ParameterList(params[p::parts])
        out.append(m)
    return out


class TorchFT(Peer):
    def __init__(self, model, opt, entry, world):
        super().__init__(model, opt, entry, world)
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        self.H, self.P = int(entry["H"]), int(entry.get("P", 1))
        rank = dist.get_rank()
        host = os.environ.get("BENCH_ADDR", "127.0.0.1")  # the address this rank's namespace is reached on
        advertise(host)
        self.lighthouse = None
        address = [None]
        if rank == 0:
            from torchft._torchft import LighthouseServer

            self.lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=world)
            # its address() names the machine's hostname, which other namespaces cannot reach: the bound address
            address = [f"http://{host}:{self.lighthouse.address().rsplit(':', 1)[1]}"]
        dist.broadcast_object_list(address, src=0)  # a bench-internal string between its own ranks
        self.store = dist.TCPStore(host, 0, 1, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=300)), load_state_dict=lambda s: None,
                               state_dict=lambda: {}, min_replica_size=world, use_async_quorum=False,
                               replica_id=f"lowcomm{rank}", store_addr=host, store_port=self.store.port, rank=0,
                               world_size=1, lighthouse_addr=address[0], hostname=host, port=0,
                               timeout=timedelta(seconds=300), quorum_timeout=timedelta(seconds=300),
                               connect_timeout=timedelta(seconds=60))
        params = list(model.parameters())
        self.fragments = strided(params, self.P)
        outer = [torch.optim.SGD(f.parameters(), lr=1.0) for f in self.fragments]
        self.diloco = DiLoCo(self.manager, self.fragments, opt, outer, sync_every=self.H,
                             backup_device=torch.device("cpu"), pin_memory=False,
                             fragment_sync_delay=int(entry.get("T", 0)),
                             fragment_update_alpha=float(entry.get("alpha", 0.0)))
        self.diloco.__enter__()
        self.sizes = [sum(p.numel() for p in f.parameters()) for f in self.fragments]

    def after_step(self, step):
        every = self.H // self.P
        sent = ring_bytes(4 * self.sizes[(step // every) % self.P], self.world) if (step + 1) % every == 0 else 0
        return sent, ring_bytes(4 * self.numel, self.world)

    def close(self):
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


PEERS = {"alone": Alone, "postlocal": PostLocal, "torchft": TorchFT}
