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

A regime supplies :meth:`_reform_links` (tear its links or process group down and meet again as
``self.rank_info`` now says, under :meth:`_epoch_ns`) and calls :meth:`_start_quorum` when it meets.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from commlab.base.errors import CommError, ModelMismatch
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

    def _epoch_ns(self, base: str) -> str:
        """The store namespace of the links of this membership epoch (``base`` itself for the first)."""
        epoch = self.quorum.epoch if self.quorum is not None else 0
        return base if epoch == 0 else f"{base}e{epoch}/"

    def _enter_epoch(self) -> None:
        """``rank_info`` and the gradient scale as the quorum's membership now says."""
        q = self.quorum
        self.rank_info = self._job_info.within(q.members)
        self.grad_scale = 1.0 / len(q.members)

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
            since = rendezvous.replacement_since()
            print(f"commlab {self.scheme}:// rank {q.me}: a replacement, entered at step {self.start_step}"
                  + (f", {time.time() - since:.2f} s after its predecessor's death was noticed" if since else "")
                  + f" (healed from rank {self._donor}, membership {list(q.members)})", flush=True)
        self._joined = None

    def _heal_tensors(self) -> list[torch.Tensor]:
        """What a replacement takes besides the optimizer's state: every parameter (frozen ones too), the buffers."""
        assert self.model is not None
        return [p.data for p in self.model.parameters()] + [b for _, b in self.module_buffers]

    def _transfer(self, donor: int, pending: dict) -> None:
        """One heal: ``donor`` publishes what it sends (the optimizer state's layout, hyperparameters and the step
        counters) in the store, then every member all-reduces one byte buffer to which only the donor
        contributes; the joiners unpack it. Collective over the membership."""
        q, opt = self.quorum, self.optimizer
        assert opt is not None  # setup gave one
        key = f"e{q.epoch}/heal"
        me = q.me
        if me == donor:
            sd = opt.state_dict()
            layout, tensors = [], []
            for i, st in sd["state"].items():
                entry = {}
                for k, v in st.items():
                    if torch.is_tensor(v):
                        entry[k] = {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                        tensors.append(v)
                    else:
                        entry[k] = {"value": v}
                layout.append([int(i), entry])
            groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            manifest = {"state": layout, "groups": groups, "step": self._step, "steps": self.stats.steps,
                        "exchanges": self.stats.exchanges,
                        "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in self._heal_tensors()]}
            q.store.set(key, json.dumps(manifest))
            payload = _pack(self._heal_tensors() + tensors)
        else:
            manifest = q._poll(lambda: q._read(key), f"no state from rank {donor} to heal rank(s) {sorted(pending)}")
            mine = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in self._heal_tensors()]
            if me in pending and manifest["tensors"] != mine:
                raise ModelMismatch(f"rank {me} joins a job whose model differs: rank {donor} sends "
                                    f"{manifest['tensors']}, this rank has {mine}")
            sizes = [_nbytes(shape, dtype) for shape, dtype in manifest["tensors"]]
            sizes += [_nbytes(e["shape"], e["dtype"]) for _, st in manifest["state"] for e in st.values() if "shape" in e]
            payload = torch.zeros(-(-sum(sizes) // 4), dtype=torch.int32)
        cast(Any, self).allreduce_async(payload, f"heal of rank(s) {sorted(pending)} from rank {donor}").wait(self.options.timeout)
        if me in pending:
            self._unpack(manifest, payload)

    def _unpack(self, manifest: dict, payload: torch.Tensor) -> None:
        raw, off = payload.view(torch.uint8), 0

        def take(shape, dtype):
            nonlocal off
            n = _nbytes(shape, dtype)
            t = raw[off:off + n].clone().view(getattr(torch, dtype)).reshape(shape)
            off += n
            return t

        with torch.no_grad():
            for t in self._heal_tensors():
                t.copy_(take(list(t.shape), str(t.dtype).removeprefix("torch.")).to(t.device))
            opt = self.optimizer
            assert opt is not None  # setup gave one
            sd = opt.state_dict()
            state = {}
            for i, entry in manifest["state"]:
                state[i] = {k: take(e["shape"], e["dtype"]) if "shape" in e else e["value"] for k, e in entry.items()}
            groups = []
            for mine, theirs in zip(sd["param_groups"], manifest["groups"]):
                g = dict(mine)
                for k, v in theirs.items():
                    g[k] = tuple(v) if isinstance(mine.get(k), tuple) else v
                groups.append(g)
            opt.load_state_dict({"state": state, "param_groups": groups})
        self._step, self.stats.steps, self.stats.exchanges = manifest["step"], manifest["steps"], manifest["exchanges"]
        self.start_step = manifest["steps"]


def _nbytes(shape, dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after another, zero-padded to whole int32 elements, viewed as int32."""
    parts = [t.detach().reshape(-1).contiguous().cpu().view(torch.uint8) for t in tensors]
    total = sum(p.numel() for p in parts)
    out = torch.zeros(-(-total // 4) * 4, dtype=torch.uint8)
    off = 0
    for p in parts:
        out[off:off + p.numel()] = p
        off += p.numel()
    return out.view(torch.int32)
