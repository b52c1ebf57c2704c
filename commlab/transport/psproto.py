"""The parameter-server protocol: its ops, its consistency modes, and how parameters are sharded.

Both sides import this module: the ``ps://`` client regime
(:mod:`commlab.regimes.ps`) and the server process (:mod:`servers`). Neither
imports the other.

One DEALER socket per shard on each worker, one ROUTER socket per server.
Every request carries ``meta["id"]``; every reply echoes it. A request names
its key space in ``meta["space"]`` (absent: ``""``, a job's first exchanger):
each exchanger of a job has its own (ps-lite's applications), made by its
first hello and freed by the last bye of its job. Replies are
``ok``, ``params`` (with data frames) or ``error`` (``meta["reason"]``, raised
on the client as :class:`~commlab.base.errors.RemoteError`)::

    worker                                   shard k (holds its pieces, an optimizer over them)
      hello {rank, world, mode?, manifest,  ->  checks manifest/mode/shard/optimizer against the
             pieces, shard, optim}          <-  first worker's; ok {initialized, next_step, version}
      init  [frames: every piece]           ->  rank 0's sets the values (others are refused)
      pull  {after_step: -1, start: true}   <-  params [frames] {version}   (the start gate: once rank 0's
                                                init is in and every rank made this pull)
      pull  {after_step: -1, what: buffers} <-  params [module buffers] (shard 0 holds them)
      --- each step t ---
      push  step=t {base, absent, hyper?} [frames]  ->  acknowledged on arrival; folded once per (rank, t)
      update=worker (sync):
        pull {after_step: t, keys, what: sum}   <-  params [the keys' averages] {absent}, once N are in
      update=server, sync:
        pull {after_step: t, what: report}      <-  ok {report: {sumsq, finite}}, once every push is in
        commit step=t {factor, hyper} | {skip}  ->  the N-th commit applies one update (skip: dropped)
      update=server:
        pull  {after_step: t}               <-  params, once the mode allows (see below)
      update=outer (local steps, sync_every=H; docs/localsteps.md): no push in backward; every H-th step
        push step=k {base} [the pseudo-gradient]  ->  sync: averaged, then report and commit as update=server
                                            (the N-th commit steps the outer optimizer); async: applied alone
        pull {after_step: k}                <-  params [the new anchor]
      compress= (servers.compressed): per unit (a bucket's pieces on this shard) and round r
        push step=t {unit, round, cmeta, absent} [payload frames U/i]  ->  sync: held until every worker's is
                                            in, then summed in rank order; async, ssp: decoded alone, applied
        pull {after_step: t, what: csum, unit, round}  <-  params [the round's float32 sum] {absent, sparse?}
                                            (sync: update=worker, or a compressor whose payloads do not decode
                                            alone, e.g. PowerSGD)
      buffers step=t {how} [frames]         ->  rank 0's (broadcast) or every rank's (average)
      pull  {after_step: t, what: buffers}  <-  params [buffers], once step t's are complete (sync)
      state                                 <-  params [key/name: optimizer state] {shapes, scalars}
      load  [key or key/name frames] {shapes, scalars}  ->  parameters / optimizer state replaced
      stats                                 <-  ok {updates, bytes_in, bytes_out, queue, staleness}
      --- ex.join(): a worker whose loop ended before step t ---
      join  step=t {divide} [update=worker: its pieces]  ->  it pushes no more (sync: zeros from step t on;
                                            async, ssp: off the clock); buffers then come from the highest
                                            rank still training (every such worker sends them, {joining})
      pull  {what: final, version}          <-  params once every worker joined (update=worker: the last
                                            joiner's), else ok {final: false} once the version moved on
      bye                                   ->  the rank stops counting for ssp's slowest worker; the
                                                last rank's frees the key space
      blob step=t {put: true} [uint8 frame]  ->  ex.commit_state: this rank's opaque bytes, kept (shard 0)
      blob                                  <-  params [blob] step=t (ex.restored_state), or ok {none: true}
      --- a restarted job (torchrun's --max-restarts): every hello and push carries {attempt} ---
      the first hello of attempt a > the shard's: the step in flight is dropped (its pushes are made
      again by the new attempt), pulls, joins and byes go, the start gate closes again; pushes of an
      earlier attempt are refused. Applied steps stay: the hello's next_step says where to resume.
      Its world may differ (torchrun --nnodes MIN:MAX): the new attempt's ranks replace the old.
      --- keep-going (hello {min_workers: M > 0, fresh, epoch}; servers.membership) ---
      a rank whose connection closes leaves: its partial step is taken out, the step completes over the
      others. A process of a lost rank is refused (stale epoch); a fresh hello for a lost rank (a
      replacement) is answered with {enter: soonest step}, then
      enter step=E                          <-  ok {entered: true, epoch} | {entered: false, enter: sooner}
      live (heartbeat_s=; on a second connection that then carries only zmq's PINGs, whose TTL makes the
            shard close it once the worker falls silent: zmq arms the TTL at a PING, so a connection whose
            last traffic was data would never time out)  ->  its closing counts as the rank's
      and its start pull (after_step E-1) gets the parameters after step E-1. Fewer than M ranks left:
      every request is refused with the line naming the ranks lost.
      update=worker (the shards hold sums only; servers.relay): a reply of step E-1's sums to the lowest
      rank pushing that step carries {donate: {step: E, ranks}}; that rank, after its optimizer step, sends
      each shard its range of the state (keepgoing.pack_heal: parameters, buffers, optimizer state):
      donate step=E {entry, ranks, size, range: [lo, hi]} [uint8 frames "heal"]  ->  ok (or {dropped})
      pull {after_step: E-1, what: heal}    <-  params [this shard's range] {step, donor, size, range}, once
                                                the shard holds all of it; error if the donor left first

Modes (the server's; a worker that names another one is refused):

* ``sync`` (bulk-synchronous): step t's gradients from all N workers are
  summed as they arrive and averaged. update=worker: each key's average goes
  back to every worker once its N gradients are in, and the workers' own
  optimizers step. update=server: one optimizer step once every worker
  committed; ``pull(after_step=t)`` waits for it. Either way the same result as
  one process on the combined batch.
* ``async``: each worker's step is applied as soon as all of its pieces for
  this shard arrived. Staleness of an update = server version when it lands
  minus the version the worker computed it on (``base``).
* ``ssp`` (stale-synchronous, bound S): updates as in async, but
  ``pull(after_step=t)`` blocks while ``t + 1 - slowest > S``, where
  ``slowest`` is the number of steps the slowest attached worker completed.
  A gradient can then miss at most ``2S + 1`` updates of each other worker
  (the other worker may be S steps behind when it is pulled, and S ahead
  when it lands), so its recorded staleness is at most ``(N - 1)(2S + 1)``;
  see :func:`ssp_staleness_bound`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where a step's update runs (``update=`` in the worker's URL), as both sides read it.

    ``shards_step``: the shards run an optimizer over their pieces, so a step's pull carries the new
    parameters and a restarted job resumes from the shards (they hold the trained model and its optimizer
    state); else the shards only average, a step's pull carries the averaged gradients (``what=sum``) and
    the workers' own optimizers step (a restarted job's rank 0 initialises the shards again). The client's
    behaviour per placement is :mod:`commlab.regimes.ps_steps`, the shard's :mod:`servers.modes`.
    """

    name: str
    shards_step: bool

    @property
    def step_reply(self) -> str:
        """What a step's pull carries back: ``params`` (the shards stepped) or ``sum`` (the averages)."""
        return "params" if self.shards_step else "sum"


WORKER = Placement("worker", shards_step=False)
SERVER = Placement("server", shards_step=True)
# local steps (``sync_every=H``): the shards hold the anchor and the outer optimizer (its spec travels in the
# hello's ``optim["outer"]`` as data), a push is a pseudo-gradient and a pull the new anchor; the workers'
# own optimizers take the inner steps (docs/localsteps.md). The URL asks for it with ``sync_every=``.
OUTER = Placement("outer", shards_step=True)
PLACEMENTS = {p.name: p for p in (WORKER, SERVER, OUTER)}


@dataclass(frozen=True)
class Consistency:
    """A consistency mode as both sides read it (the rules themselves: :mod:`servers.modes`).

    ``gathers``: a step is one update over every worker's push (sync: averages, a report, commits);
    else each worker's push is applied alone as it completes, carrying its own hyperparameters.
    ``placements``: where the update may run, the default first.
    """

    name: str
    gathers: bool
    placements: tuple[Placement, ...]

    def placement(self, update: str) -> Placement:
        """The placement ``update`` names under this mode ("" : the mode's default); ValueError if the mode
        does not allow it."""
        if not update:
            return self.placements[0]
        chosen = PLACEMENTS.get(update)
        if chosen is None:
            raise ValueError(f"update={update!r}: known placements are {sorted(PLACEMENTS)}")
        if chosen not in self.placements:
            named = [p.name + "s" for p in self.placements if p is not OUTER]  # what update= can name
            raise ValueError(f"mode={self.name} updates on the {' or '.join(named)} only")
        return chosen


SYNC = Consistency("sync", gathers=True, placements=(WORKER, SERVER, OUTER))
ASYNC = Consistency("async", gathers=False, placements=(SERVER, OUTER))
SSP = Consistency("ssp", gathers=False, placements=(SERVER,))
CONSISTENCIES = {c.name: c for c in (SYNC, ASYNC, SSP)}
MODES = tuple(CONSISTENCIES)


def consistency(name: str) -> Consistency:
    """The mode ``name`` names; ValueError listing the known ones."""
    try:
        return CONSISTENCIES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; known: {list(MODES)}") from None

REQUESTS = frozenset({"hello", "init", "push", "pull", "commit", "buffers", "state", "load", "stats", "join",
                      "bye", "blob", "enter", "live", "donate"})
REPLIES = frozenset({"ok", "params", "error"})
# a backup shard's link to its primary (servers.replication): it attaches, then acknowledges the stream
REPLICATION = frozenset({"attach", "ack"})
BLOB_MAX = 1 << 20  # bytes of one rank's committed state (ex.commit_state: a scheduler, a scaler, a data position)


def relay_limit(shard_bytes: int) -> int:
    """The most bytes of a replacement's state (update=worker: parameters, buffers, optimizer state) a shard
    holding ``shard_bytes`` of pieces and buffers relays: 16 times those (Adam's state in float32 beside
    bfloat16 parameters is 5 times) and 1 MiB (the layout, small parameters)."""
    return 16 * shard_bytes + (1 << 20)


def ssp_staleness_bound(workers: int, staleness: int) -> int:
    """The largest version gap an ssp server with bound ``staleness`` can record."""
    return (workers - 1) * (2 * staleness + 1)


@dataclass(frozen=True)
class Piece:
    """A contiguous range ``[start, start + count)`` of the flattened parameter ``param``.

    ``key`` is the name a server stores it under: the parameter's name when the
    piece is the whole tensor, ``name#start`` when the tensor was split.
    """

    key: str
    param: str
    dtype: str
    start: int
    count: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}


def assign_shards(manifest: list, shards: int, max_piece: int | None = None) -> list[list[Piece]]:
    """Spread parameters over ``shards`` servers so each carries about 1/K of the bytes.

    ``manifest`` is ``[(name, shape, dtype), ...]`` (see
    :func:`commlab.core.manifest.model_manifest`). A tensor larger than the fair
    share ``ceil(total / K)``, or than ``max_piece`` bytes, is cut into equal
    ranges no larger than that; then the pieces, largest first (ties in
    manifest order), each go to the least-loaded shard (ties to the lowest
    index). Pure and deterministic: every worker computes the same assignment
    from the same manifest. Returns, per shard, its pieces in manifest order.

    Why ``max_piece``: a piece is what a server reduces, updates and sends back
    as a unit, so a 64 MiB tensor cut in four pipelines (the server updates and
    returns the first quarter while the next one is still arriving).
    """
    if shards < 1:
        raise ValueError(f"need at least one shard, got {shards}")
    items: list[tuple[int, int, Piece]] = []  # (order, start, piece)
    total = sum(math.prod(s) * _itemsize(d) for _, s, d in manifest)
    share = max(1, math.ceil(total / shards))
    if max_piece is not None:
        share = max(1, min(share, max_piece))
    for order, (name, shape, dtype) in enumerate(manifest):
        numel, size = math.prod(shape), _itemsize(dtype)
        parts = max(1, math.ceil(numel * size / share)) if numel else 1
        per = math.ceil(numel / parts) if numel else 0
        starts = range(0, numel, per) if numel else [0]
        for start in starts:
            count = min(per, numel - start)
            key = name if parts == 1 else f"{name}#{start}"
            items.append((order, start, Piece(key, name, dtype, start, count, size)))
    loads = [0] * shards
    out: list[list[tuple[int, int, Piece]]] = [[] for _ in range(shards)]
    for item in sorted(items, key=lambda it: (-it[2].nbytes, it[0], it[1])):
        k = min(range(shards), key=lambda i: (loads[i], i))
        loads[k] += item[2].nbytes
        out[k].append(item)
    return [[p for _, _, p in sorted(pieces, key=lambda it: (it[0], it[1]))] for pieces in out]


def _itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be served; supported: {sorted(_ITEMSIZE)}") from None
