"""A collective regime's step as a transaction, and a replacement's heal (``min_workers=M``, :mod:`commlab.core.quorum`).

:class:`KeepGoing` is mixed into :class:`commlab.core.exchanger.CollectiveExchanger`; it does nothing unless the
options ask to keep going. Then:

- **Each bucket's gradient is kept** as it enters its collective (one copy of the gradients per step): a step
  whose exchange failed anywhere is exchanged again from these copies, rescaled from 1/N to 1/N' (the new
  membership's size), over the re-formed ring or group. The module buffers are kept before their sync too.
- **The step's decision** (:meth:`commlab.core.quorum.Quorum.decide`) comes after every bucket and the
  buffers' sync, before ``p.grad`` is handed to the optimizer: an abort anywhere makes every member redo the
  exchange over the survivors, so no member ever applies a step another member discarded.
- **A replacement** (a process started for a lost rank) joins at a committed step: once that step's update
  ran on the members (the optimizer's step hook, or the next exchange's start if no update ran), every member
  re-forms with it and the lowest rank of the old membership sends it, over the regime's own collective (an
  all-reduce of raw bytes, viewed as int32, to which every other member adds zeros: x + 0 is exact for
  integers, so the replacement gets the bits), the model's parameters and buffers, the optimizer's state and
  hyperparameters, and the exchanger's step counters. Its ``start_step`` is the optimizer steps taken.
  What it takes is described once (:func:`heal_manifest`, :func:`heal_take`): ``ps://`` under update=worker
  relays the same, packed as bytes (:func:`pack_heal`), through its shards (:mod:`servers.relay`).

A regime supplies :meth:`_reform_links` (tear its links or process group down and meet again as
``self.rank_info`` now says, under :meth:`_epoch_ns`) and calls :meth:`_start_quorum` when it meets.
"""

from __future__ import annotations

import json
import struct
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from commlab.base.errors import CommError, ConfigError, ModelMismatch, ProtocolError
from commlab.core.quorum import Quorum
from commlab.transport import rendezvous

if TYPE_CHECKING:  # the mixin's host (exchanger.py imports this module)
    from commlab.core.exchanger import BucketedExchanger as _Host
else:
    _Host = object


class KeepGoing(_Host):
    """See the module's docstring. Mixed in before :class:`commlab.core.exchanger.BucketedExchanger`."""

    quorum: Any = None  # a Quorum while keeping going
    _job_info: Any = None  # the whole job's RankInfo (rank_info follows the membership)
    _snaps: dict
    _admit: dict
    _handles: list
    _joined: dict | None = None  # a replacement: the ranks admitted with it, until healed
    _donor = -1  # the rank the last heal came from
    _comp_kept: dict = {}  # the compressor's state as the step began (error feedback's residuals, PowerSGD's Q)
    healed: dict | None = None  # a replacement, once healed: {step, seconds} (rendezvous.announce_entry)

    # ----- meeting -------------------------------------------------------------------------
    def _start_quorum(self, store, job_store):
        """With ``min_workers``: this exchanger's namespace of ``store`` (the job's, under commlab's prefix) and its
        quorum, heartbeat started; a replacement (the job runs already) waits here until a committed step
        admits it. Without: ``None``, and the caller takes its usual namespace."""
        if not getattr(self.options, "keep_going", False):
            return None
        ns = Quorum.namespace(store)
        self.quorum = q = Quorum(ns, self.rank_info, self.options, self.scheme)
        self._job_info, self._snaps, self._admit = self.rank_info, {}, {}
        if q.running():  # a replacement: it beats once admitted (its rank's heartbeat is the dead process's until then)
            _, self._joined = q.join()
            self.entered_running = True
            self._enter_epoch()
        q.start(job_store)
        return ns

    def _meet_first(self, meet) -> None:
        """``meet()``: the links of the epoch this process starts in. A replacement is a member of that epoch as it
        meets (admitted), so if another member dies meanwhile the others wait for it in the next epoch: it re-forms
        with them, as a member would, instead of failing its setup."""
        try:
            meet()
        except CommError as exc:
            if self.quorum is None or self._joined is None:
                raise
            peer = getattr(exc, "peer", None)
            self._regroup(lambda: self.quorum.reform((peer,) if isinstance(peer, int) else ()))

    def _epoch_ns(self, base: str) -> str:
        """The store namespace of the links of this membership epoch (``base`` itself for the first)."""
        epoch = self.quorum.epoch if self.quorum is not None else 0
        return base if epoch == 0 else f"{base}e{epoch}/"

    def _enter_epoch(self) -> None:
        """``rank_info`` and the gradient scale as the quorum's membership now says."""
        q = self.quorum
        self.rank_info = self._job_info.within(q.members)
        self.grad_scale = 1.0 / len(q.members)
        if self.compressor is not None:
            self.compressor.bind(len(q.members))

    def _keep_going_facts(self) -> dict:
        """What a manifest records about keeping going (nothing when off)."""
        q = self.quorum
        if q is None:
            return {}
        return {"keep_going": {"min_workers": q.min_workers, "heartbeat_s": q.hb_s, "epoch": q.epoch,
                               "members": list(q.members), "lost": sorted(q.lost),
                               **({"healed": self.healed} if self.healed else {})}}

    def _reform_links(self) -> None:
        """Meet again as ``self.rank_info`` says (every member calls it; collective)."""
        raise NotImplementedError

    def _started(self) -> None:
        """Every rank of the job met (the first time): a replacement from now on joins."""
        if self.quorum is not None and not self.entered_running:
            self.quorum.started()

    # ----- the step ------------------------------------------------------------------------
    def _keep_gradient(self, bucket) -> None:
        """Keep ``bucket``'s gradient as it enters its collective (the step may have to be exchanged again)."""
        if self.quorum is not None:
            snap = self._snaps.get(bucket.index)
            if snap is None:
                self._snaps[bucket.index] = snap = torch.empty_like(bucket.grads)
            snap.copy_(bucket.grads)

    def _exchange(self, timeout: float) -> None:
        if self.quorum is None:
            return super()._exchange(timeout)
        kept = [b.detach().clone() for _, b in self.module_buffers] if self.options.buffers != "none" else []
        while True:
            failure = None
            try:
                super()._exchange(timeout)
            except CommError as exc:
                failure = exc
                self.quorum.abort(self._step, exc)  # first: the others' waits end on it
                self._drain(timeout)
            decision = self.quorum.decide(self._step, failure)
            if decision.commit:
                self._admit = decision.admit
                return
            self._redo(decision.lost, kept)

    def _drain(self, timeout: float) -> None:
        """Every collective of the failed exchange has ended (each fails fast once its ring or group broke)."""
        deadline = time.monotonic() + timeout
        for h in self._handles:
            try:
                h.wait(max(1e-3, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the failure that counts was caught already
                pass

    def _redo(self, blamed, kept) -> None:
        """The step was discarded: re-form over the survivors and start its exchange again from the kept
        gradients (and buffers), rescaled to the new membership."""
        before = len(self.quorum.members)
        self._regroup(lambda: self.quorum.reform(blamed))
        ratio = before / self.world_size
        if self.compressor is not None:
            self.compressor.load_state_dict(self._comp_kept)
        with torch.no_grad():
            for b in self.buckets:
                snap = self._snaps.get(b.index)
                if snap is not None:
                    b.grads.copy_(snap.double().mul_(ratio) if ratio != 1 else snap)
            for (_, buf), old in zip(self.module_buffers, kept):
                buf.copy_(old)
        self._handles, self._next = [], 0
        self._launch_until(len(self.buckets))

    def _regroup(self, agree) -> None:
        """``agree()`` (the quorum's next epoch), then the links of it; a failure while meeting re-forms again."""
        blamed: tuple[int, ...] = ()
        while True:
            if agree is not None:
                agree()
            else:
                self.quorum.reform(blamed)
            self._enter_epoch()
            try:
                self._reform_links()
                return
            except CommError as exc:
                blamed, agree = tuple(p for p in [getattr(exc, "peer", None)] if isinstance(p, int)), None

    # ----- replacements --------------------------------------------------------------------
    def _after_step(self) -> None:
        super()._after_step()
        self._admit_waiting()

    def _exchange_begins(self) -> None:
        self._admit_waiting()  # a step no update followed (a GradScaler skipped it): admit before the next one
        if self.quorum is not None and self.compressor is not None:  # a redone step starts from the same state
            self._comp_kept = self.compressor.state_dict()

    def _admit_waiting(self) -> None:
        if self.quorum is None or not self._admit:
            return
        joiners, self._admit = self._admit, {}
        self._regroup(lambda: self.quorum.admit(joiners))
        self._heal(joiners)

    def _heal(self, joiners: dict) -> None:
        """Send (or, on a replacement, receive) the state, until every joiner still in the membership has it; a
        failure on the way re-forms and heals again."""
        while True:
            q = self.quorum
            pending = {r: n for r, n in joiners.items() if r in q.members}
            if not pending or len(pending) == len(q.members):
                break
            try:
                self._donor = min(r for r in q.members if r not in pending)
                self._transfer(self._donor, pending)
                break
            except CommError as exc:
                peer = getattr(exc, "peer", None)
                self._regroup(lambda: q.reform(tuple([peer]) if isinstance(peer, int) else ()))
        if q.me not in joiners:
            q.admitted(joiners)
        elif q.me in q.members:  # the launcher reads this line (commlab run --replace: how long healing took)
            self.healed = rendezvous.announce_entry(f"commlab {self.scheme}:// rank {q.me} (healed from rank "
                                                    f"{self._donor})", self.start_step)
        self._joined = None

    def _heal_tensors(self) -> list[torch.Tensor]:
        """What a replacement takes besides the state tree (:func:`heal_tensors`)."""
        return heal_tensors(self)

    def _heal_tree(self) -> dict:
        """The rest of what a replacement takes: the optimizer's state and hyperparameters, the compressor's shared
        state (not error feedback's residuals: those are each rank's own, and a new rank has none), the step
        counters."""
        assert self.optimizer is not None  # setup gave one
        return {"optim": self.optimizer.state_dict(),
                "compress": self.compressor.shared_state_dict() if self.compressor is not None else None,
                "counters": {"step": self._step, "steps": self.stats.steps, "exchanges": self.stats.exchanges}}

    def _transfer(self, donor: int, pending: dict) -> None:
        """One heal: ``donor`` publishes the layout of what it sends (:func:`heal_manifest`: JSON, tensors by shape
        and dtype) in the store, then every member all-reduces one byte buffer to which only the donor
        contributes; the joiners unpack it. Collective over the membership."""
        q, me = self.quorum, self.quorum.me
        key = f"e{q.epoch}/heal"
        mine = [_spec(t) for t in self._heal_tensors()]
        if me == donor:
            manifest, tensors = heal_manifest(self._heal_tensors(), self._heal_tree())
            q.store.set(key, json.dumps(manifest))
            payload = _pack(tensors)
        else:
            q.wait_key(q.store, key, donor, f"state from rank {donor} to heal rank(s) {sorted(pending)}")
            manifest = q._read(key)
            if me in pending and manifest["tensors"] != mine:
                raise ModelMismatch(f"rank {me} joins a job whose model differs: rank {donor} sends "
                                    f"{manifest['tensors']}, this rank has {mine}")
            payload = torch.zeros(-(-heal_nbytes(manifest) // 4), dtype=torch.int32)
        cast(Any, self).allreduce_async(payload, f"heal of rank(s) {sorted(pending)} from rank {donor}").wait(
            self.options.timeout)
        if me in pending:
            self._unpack(manifest, payload)

    def _unpack(self, manifest: dict, payload: torch.Tensor) -> None:
        tree = heal_take(manifest, payload.view(torch.uint8), self._heal_tensors())
        assert self.optimizer is not None  # setup gave one
        with torch.no_grad():
            self.optimizer.load_state_dict(tree["optim"])
            if self.compressor is not None and tree["compress"] is not None:
                self.compressor.load_state_dict(tree["compress"])
        counters = tree["counters"]
        self._step, self.stats.steps, self.stats.exchanges = counters["step"], counters["steps"], counters["exchanges"]
        self.start_step = counters["steps"]


# ----- what a replacement takes, one mechanism for every regime that heals one --------------------------
#
# ring:// and allreduce:// (above) send it over their own collective, the manifest through the store; ps://
# under update=worker (commlab.regimes.ps) relays it through the shards as opaque bytes (pack_heal).

def heal_tensors(ex) -> list[torch.Tensor]:
    """What a replacement takes besides a state tree: every parameter of ``ex``'s model (frozen ones too), then
    the module buffers."""
    assert ex.model is not None
    return [p.data for p in ex.model.parameters()] + [b for _, b in ex.module_buffers]


def heal_manifest(tensors: list[torch.Tensor], tree) -> tuple[dict, list[torch.Tensor]]:
    """The layout of what a replacement takes (JSON-able: ``tensors`` by shape and dtype, ``tree`` as
    :func:`_flatten` writes it) and every tensor to send, in the order :func:`heal_take` reads them. ConfigError
    for what cannot travel (``tree`` holds something other than tensors, numbers, strings, lists and dicts)."""
    out = list(tensors)
    return {"tensors": [_spec(t) for t in tensors], "tree": _flatten(tree, out)}, out


def heal_nbytes(manifest: dict) -> int:
    """The bytes of the tensors a :func:`heal_manifest` describes."""
    return sum(_nbytes(*sp) for sp in manifest["tensors"] + _specs(manifest["tree"]))


def heal_take(manifest: dict, raw: torch.Tensor, targets: list[torch.Tensor]):
    """Copy each of ``targets`` (a replacement's own parameters and buffers, as :func:`heal_manifest` listed the
    sender's) from ``raw`` (uint8: the tensors' bytes one after another); the tree, its tensors rebuilt."""
    off = 0

    def take(shape, dtype):
        nonlocal off
        n = _nbytes(shape, dtype)
        t = raw[off:off + n].clone().view(getattr(torch, dtype)).reshape(shape)
        off += n
        return t

    with torch.no_grad():
        for t in targets:
            t.copy_(take(*_spec(t)).to(t.device))
        return _unflatten(manifest["tree"], take)


HEAL_MAGIC = b"CLHEAL1\0"
_HEAL_HEAD = len(HEAL_MAGIC) + 8


def pack_heal(tensors: list[torch.Tensor], tree) -> torch.Tensor:
    """What a replacement takes as one uint8 tensor, for a regime that relays it as opaque bytes: a magic, the
    manifest's length (8 bytes), the manifest (:func:`heal_manifest`) as JSON, the tensors' bytes. ConfigError
    for what cannot travel."""
    manifest, out = heal_manifest(tensors, tree)
    head = json.dumps(manifest).encode()
    return _pack(out, HEAL_MAGIC + struct.pack("<Q", len(head)) + head).view(torch.uint8)


def unpack_heal(raw: torch.Tensor, targets: list[torch.Tensor], sender: str):
    """:func:`pack_heal`'s bytes (``raw``, uint8, from ``sender``, which the errors name) into ``targets``; the
    tree. ModelMismatch when the sender's parameters and buffers are not shaped as ``targets``; ProtocolError
    for bytes :func:`pack_heal` could not have made."""
    head = bytes(raw[:_HEAL_HEAD].numpy())
    if len(head) < _HEAL_HEAD or head[:len(HEAL_MAGIC)] != HEAL_MAGIC:
        raise ProtocolError(f"the state from {sender} was not made by commlab.core.keepgoing.pack_heal")
    (size,) = struct.unpack("<Q", head[len(HEAL_MAGIC):])
    try:
        if size > raw.numel() - _HEAL_HEAD:
            raise ValueError(f"a manifest of {size} bytes in {raw.numel()}")
        manifest = json.loads(bytes(raw[_HEAL_HEAD:_HEAL_HEAD + size].numpy()))
        need = heal_nbytes(manifest)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ProtocolError(f"the state from {sender} holds no readable manifest ({exc!r:.200})") from None
    mine = [_spec(t) for t in targets]
    if manifest["tensors"] != mine:
        at = next((i for i, (a, b) in enumerate(zip(manifest["tensors"], mine)) if a != b),
                  min(len(mine), len(manifest["tensors"])))
        raise ModelMismatch(f"a replacement takes the state of a model that differs: {sender} sends "
                            f"{len(manifest['tensors'])} parameters and buffers, this rank has {len(mine)}; the first "
                            f"difference at #{at}: {manifest['tensors'][at:at + 1]} there, {mine[at:at + 1]} here")
    body = raw[_HEAL_HEAD + size:]
    if need > body.numel():
        raise ProtocolError(f"the state from {sender} holds {body.numel()} bytes of tensors, its manifest says {need}")
    try:
        return heal_take(manifest, body, targets)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise ProtocolError(f"the state from {sender} does not match its manifest ({exc!r:.200})") from None


def _spec(t: torch.Tensor) -> list:
    return [list(t.shape), str(t.dtype).removeprefix("torch.")]


def _flatten(obj, tensors: list[torch.Tensor]):
    """``obj`` (dicts, lists, tuples, tensors, JSON scalars) as JSON, each tensor replaced by its shape and dtype
    and appended to ``tensors`` (in the order :func:`_unflatten` takes them). ConfigError for anything else."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return {"t": _spec(obj)}
    if isinstance(obj, dict):
        return {"d": [[k, isinstance(k, int), _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise ConfigError(f"keep going: cannot send a {type(obj).__name__} to a replacement (optimizer or compressor "
                      f"state holds {obj!r}; tensors, numbers, strings, lists and dicts only)")


def _unflatten(node: dict, take):
    (kind, value), = node.items()
    if kind == "t":
        return take(*value)
    if kind == "d":
        return {(int(k) if is_int else k): _unflatten(v, take) for k, is_int, v in value}
    if kind in ("l", "u"):
        items = [_unflatten(v, take) for v in value]
        return items if kind == "l" else tuple(items)
    return value


def _specs(node: dict) -> list:
    """The (shape, dtype) of every tensor in a :func:`_flatten` tree, in order."""
    (kind, value), = node.items()
    if kind == "t":
        return [value]
    if kind == "d":
        return [sp for _, _, v in value for sp in _specs(v)]
    if kind in ("l", "u"):
        return [sp for v in value for sp in _specs(v)]
    return []


def _nbytes(shape, dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _pack(tensors: list[torch.Tensor], head: bytes = b"") -> torch.Tensor:
    """``head``, then the tensors' bytes, one after another, zero-padded to whole int32 elements, viewed as int32."""
    parts = [t.detach().reshape(-1).contiguous().cpu().view(torch.uint8) for t in tensors]
    total = len(head) + sum(p.numel() for p in parts)
    out = torch.zeros(-(-total // 4) * 4, dtype=torch.uint8)
    if head:
        out[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    off = len(head)
    for p in parts:
        out[off:off + p.numel()] = p
        off += p.numel()
    return out.view(torch.int32)
