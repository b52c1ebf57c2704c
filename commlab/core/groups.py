"""Exchangers over a group of the job's ranks (hybrid parallelism).

A pipeline- or tensor-parallel model is replicated for data parallelism; the replicas of a stage
exchange gradients among themselves only, as ``DistributedDataParallel(stage, process_group=dp)``
does. ``commlab.connect(url, group=...)`` takes that group as a list of the job's global ranks (this
rank's replica group) or as a 1-D ``DeviceMesh`` (``mesh["dp"]``)::

    ranks 0 1 | 2 3        stage 0 on ranks 0, 2; stage 1 on ranks 1, 3
    group of rank 0: [0, 2]   rank 1: [1, 3]   rank 2: [0, 2]   rank 3: [1, 3]

The exchanger's ``rank`` and ``world_size`` are then the position in the group and its size; its
rendezvous keys live under the group's namespace (:attr:`RankInfo.namespace`, ``"g0-2/"``); its
failure messages name global ranks (:meth:`RankInfo.who`). At setup every member checks through
the store that its members name the same group (:func:`commlab.transport.rendezvous.check_group`): groups
that overlap or disagree are one ConfigError naming the ranks, a member that never comes a
CommTimeout naming it. One process may hold several exchangers over different groups.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn

from commlab.base.errors import ConfigError
from commlab.transport.rendezvous import RankInfo


def resolve(group, info: RankInfo) -> tuple[RankInfo, object | None]:
    """(this process's view of ``group``, the torch process group a DeviceMesh gave or None).

    ``group``: a sequence of the job's global ranks, or a 1-D ``DeviceMesh`` (a dimension of a bigger
    one: ``mesh["dp"]``), whose ranks (``mesh.mesh``, in mesh order) and process group are taken.
    Does not block; raises ConfigError in one line for a rank outside the job, a repeated rank, a
    group this process is not in, or a mesh of more than one dimension."""
    from torch.distributed.device_mesh import DeviceMesh

    pg = None
    if isinstance(group, DeviceMesh):
        if group.mesh.dim() != 1:
            names = getattr(group, "mesh_dim_names", None)
            raise ConfigError(f"group= takes a 1-D DeviceMesh (one dimension: mesh['dp']), got a "
                              f"{group.mesh.dim()}-D mesh{f' with dimensions {list(names)}' if names else ''}")
        members = [int(r) for r in group.mesh.flatten().tolist()]
        pg = group.get_group()
    elif isinstance(group, (list, tuple, range)):
        members = list(group)
    else:
        raise ConfigError(f"group= takes a list of the job's global ranks or a 1-D DeviceMesh, "
                          f"not {type(group).__name__}")
    return info.within(members), pg


def new_process_group(store, info: RankInfo, backend: str, timeout: float):
    """A torch process group of ``info``'s group alone, made by its members only (no other rank of the
    job calls anything, unlike ``dist.new_group``), over ``store`` (already the group's namespace).
    It is not registered with torch's default group: the caller owns it, uses it with the
    ``torch.distributed`` functions' ``group=``, and drops it on close; the default group (a
    pipeline's) is neither needed nor touched. Collective over the group; blocks at most ``timeout``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("pg/", store)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, info.rank, info.world_size, options)
    return dist.ProcessGroupGloo(prefixed, info.rank, info.world_size, timedelta(seconds=timeout))


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (a tensor-parallel parameter or its
    gradient; the exchange moves shards, and the replicas of a shard hold the same shapes), else ``t``."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:  # the hot path: no tensor subclass to look into
        return t
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()
