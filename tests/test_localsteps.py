"""Local steps with an outer optimizer (sync_every=H, DiLoCo): every regime against a single-process reference.

The reference is written here, apart from commlab: K model copies, each with its own inner optimizer; at each
sync the mean of the copies' changes from the anchor is the outer gradient of ``torch.optim.SGD(nesterov=True)``
over the anchor (per tensor), and every copy takes the new anchor. Fragments follow the rule of
docs/localsteps.md (restated below); BatchNorm buffers are averaged at the end of each H.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localsteps_driver import batch, make_inner, make_model  # noqa: E402

from commlab.base.config import ExchangerURL, parse_options  # noqa: E402
from commlab.base.errors import ConfigError  # noqa: E402
from commlab.regimes.allreduce import AllReduceOptions  # noqa: E402
from commlab.core.localsteps import fragments, offsets, parse_outer  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "localsteps_driver.py"
PROGRAM = f"import runpy; runpy.run_path({str(DRIVER)!r}, run_name='__main__')"
N = 2


def reference(steps: int, H: int, outer: dict | None, inner: str = "adamw", bn: bool = False, parts: int = 1,
              combined: bool = False, T: int = 0, alpha: float = 0.0, W: int = 0,
              lengths: list[int] | None = None, quant=None,
              ef: dict | None = None, merge: str = "lerp",
              pull: torch.dtype = torch.float32, by: str = "tensors") -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """K = N copies trained apart, synced every H steps (fragment p at t = floor(H(p+1)/P) mod H) by
    ``SGD(**outer)`` on the mean change; with overlap T the new anchor is mixed in T steps later as
    alpha x local + (1 - alpha) x anchor (``merge="delta"``: anchor + local - local at the push); the first W steps synchronous (every copy steps on the mean gradient),
    the anchor taken after them; ``combined``: one model on all N batches (synchronous SGD). ``lengths``: copy r
    stops after lengths[r] steps (uneven inputs, join()): a sync averages the changes of the copies still going,
    and at the end every copy takes the model of the highest copy among those that went longest. ``quant``
    (compress=, one fragment): copy r's change x = (anchor - theta_r) / N, flat in model order, goes through
    ``quant`` with error feedback (c = e_r + x, e_r := c - quant(c)) and the outer gradient is the sum of the
    decodings in copy order; ``ef`` receives each copy's final residual and the sums of its inputs and decodings.
    ``pull`` (ps:// anchor_dtype=): the copies receive the new anchor rounded to it, and their next changes are
    taken against what they received, while the outer optimizer's anchor stays exact. ``by="slices"``: every
    tensor's elements cut into ``parts`` contiguous runs (the first ``n % parts`` one longer), run p in fragment p;
    the anchor is kept per run (a unit), each stepped only when its fragment is due."""
    if combined:
        model = make_model(bn)
        opt = make_inner(model, inner)
        for step in range(steps):
            xs, ys = zip(*(batch(r, step) for r in range(N)))
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
        return [(model, opt)]
    models = [make_model(bn) for _ in range(N)]
    opts = [make_inner(m, inner) for m in models]
    # the units of the anchor: (tensor, first element, end, fragment); whole tensors, or each cut in runs
    units: list[tuple[int, int, int, int]] = []
    load, last = [0] * parts, parts - 1
    for i, q in enumerate(models[0].parameters()):
        n = q.numel()
        if by == "slices":
            first = 0
            for p in range(parts):
                size = n // parts + (1 if p < n % parts else 0)
                if size:
                    units.append((i, first, first + size, p))
                first += size
            continue
        # each tensor to the fragment with the fewest bytes, ties to the one after the last used
        p = min([(last + 1 + k) % parts for k in range(parts)], key=lambda f: load[f])
        units.append((i, 0, n, p))
        load[p] += n * 4
        last = p

    def view(m: nn.Module, u: tuple[int, int, int, int]) -> torch.Tensor:
        i, a, b, _ = u
        return list(m.parameters())[i].detach().view(-1)[a:b]

    anchor = [view(models[0], u).clone() for u in units]
    outer_opt = torch.optim.SGD(anchor, **(outer or {}))
    base = [a.clone() for a in anchor]  # the anchor as the copies hold it (pull=: rounded on its way to them)
    joined, lengths = lengths is not None, lengths or [steps] * N
    at_push: dict[tuple[int, int], torch.Tensor] = {}  # (copy, unit) -> its value at its fragment's push
    for step in range(max(lengths)):
        live = [r for r in range(N) if step < lengths[r]]
        for r in live:
            m, o = models[r], opts[r]
            x, y = batch(r, step)
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        if step < W:  # synchronous: the mean gradient on every copy
            for grads in zip(*([p.grad for p in m.parameters()] for m in models)):
                mean = sum(grads) / N
                for g in grads:
                    g.copy_(mean)
        for r in live:
            opts[r].step()
        if step + 1 == W:
            with torch.no_grad():
                for a, b, u in zip(anchor, base, units):
                    a.copy_(view(models[0], u))
                    b.copy_(view(models[0], u))
        if step < W:
            continue
        t = step + 1 - W
        due = {p for p in range(parts) if t % H == (H * (p + 1) // parts) % H}
        land = {p for p in range(parts) if t > T and (t - T) % H == (H * (p + 1) // parts) % H}
        with torch.no_grad():
            if due and quant is not None:  # per due fragment, its units in model order (one shard: one push)
                for a in anchor:
                    a.grad = None
                for p in sorted(due):
                    ks = [k for k, u in enumerate(units) if u[3] == p]
                    whole = torch.cat([base[k] for k in ks])
                    total = torch.zeros_like(whole)
                    for r in live:
                        x = (whole - torch.cat([view(models[r], units[k]) for k in ks])) * (1.0 / N)
                        mine = ef.setdefault(r if parts == 1 else (r, p),
                                             {"e": None, "inputs": torch.zeros_like(x), "sent": torch.zeros_like(x)})
                        c = x if mine["e"] is None else mine["e"] + x
                        d = quant(c)
                        mine["e"] = c - d
                        mine["inputs"] += x
                        mine["sent"] += d
                        total += d
                    offset = 0
                    for k in ks:
                        anchor[k].grad = total[offset:offset + anchor[k].numel()].view_as(anchor[k]).clone()
                        offset += anchor[k].numel()
                outer_opt.step()
            elif due:
                for k, (a, u) in enumerate(zip(anchor, units)):
                    a.grad = None
                    if u[3] in due:
                        a.grad = sum(base[k] - view(models[r], u) for r in live) / len(live)
                        at_push.update({(r, k): view(models[r], u).clone() for r in live})
                outer_opt.step()
            for k, (a, u) in enumerate(zip(anchor, units)):
                if u[3] in due:
                    base[k] = a.to(pull).float()
            for k, (a, u) in enumerate(zip(base, units)):
                if u[3] in land:
                    for r in live:
                        q = view(models[r], u)
                        q.copy_(a + (q - at_push[r, k]) if merge == "delta" else alpha * q + (1 - alpha) * a)
            if t % H == 0:
                for bufs in zip(*(models[r].buffers() for r in live)):
                    if bufs[0].is_floating_point():
                        mean = sum(bufs) / len(live)
                        for b in bufs:
                            b.copy_(mean)
    if not joined:
        return list(zip(models, opts))
    src = max(r for r in range(N) if lengths[r] == max(lengths))
    with torch.no_grad():
        for m in models:
            for q, want in zip([*m.parameters(), *m.buffers()], [*models[src].parameters(), *models[src].buffers()]):
                q.copy_(want)
    return list(zip(models, opts))


def run(run_ranks, tmp_path, url, steps, check=True, **cfg):
    out = str(tmp_path / "ls")
    env = {"LS_CFG": json.dumps(dict(cfg, url=url, steps=steps)), "LS_OUT": out}
    res = run_ranks(PROGRAM, N, timeout=90, check=check, env=env)
    if not check:
        return res
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(N)]


def max_diff(got: dict, model: nn.Module) -> float:
    ref = dict(model.named_parameters()) | dict(model.named_buffers())
    return max(float((got[n].double() - ref[n].detach().double()).abs().max()) for n in got)


def check_ranks(saved: list[dict], ref: list[tuple[nn.Module, torch.optim.Optimizer]], tol: float) -> None:
    """Every rank's parameters, buffers and inner optimizer state (rank r's batches are copy r's; each rank
    keeps its own AdamW moments across syncs) equal its reference copy's."""
    for r, s in enumerate(saved):
        m, opt = ref[r % len(ref)]
        assert max_diff(s["params"], m) < tol, f"rank {r}: parameters differ by {max_diff(s['params'], m)}"
        if s["buffers"]:
            assert max_diff(s["buffers"], m) < tol, f"rank {r}: buffers differ by {max_diff(s['buffers'], m)}"
        want = opt.state_dict()["state"]
        assert s["opt"]["state"].keys() == want.keys()
        for k, st in want.items():
            for name, value in st.items():
                diff = float((s["opt"]["state"][k][name].double() - value.double()).abs().max())
                assert diff < tol, f"rank {r}: inner optimizer's {name} of parameter {k} differs by {diff}"


REGIMES = ["allreduce://?timeout=30&bucket_mb=0.0005", "ring://?timeout=30&transport=tcp&bucket_mb=0.0005"]


@pytest.mark.multiproc
@pytest.mark.parametrize("url", REGIMES)
def test_h1_plain_averaging_is_synchronous_sgd(run_ranks, tmp_path, url):
    saved = run(run_ranks, tmp_path, url + "&sync_every=1&outer=sgd:lr=1", 5, inner="sgd")
    check_ranks(saved, reference(5, 1, dict(lr=1.0), inner="sgd", combined=True), 1e-6)


@pytest.mark.multiproc
@pytest.mark.parametrize("url", [REGIMES[0], pytest.param(REGIMES[1], marks=pytest.mark.full)])
def test_h4_nesterov_matches_reference(run_ranks, tmp_path, url):
    saved = run(run_ranks, tmp_path, url + "&sync_every=4", 10)
    ref = reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True))
    check_ranks(saved, ref, 1e-5)
    # the last sync was at step 8; two local steps since: the ranks differ, as their copies do
    assert max_diff(saved[0]["params"], ref[1][0]) > 1e-4
    # bytes per sync: one all-reduce of the float32 pseudo-gradient, 2(N-1)/N x 4 x numel; nothing else
    numel = sum(p.numel() for p in ref[0][0].parameters())
    assert saved[0]["sent"] == [0, 0, 0, 4 * numel] * 2 + [0, 0]


@pytest.mark.multiproc
def test_compressed_pseudo_gradient(run_ranks, tmp_path):
    """compress=fp16 on the ring: the pseudo-gradient travels at 2 bytes an element, summed per hop
    (2(N-1)/N x 2 x n per sync), and lands within fp16's rounding of the reference, not on it."""
    saved = run(run_ranks, tmp_path, REGIMES[1] + "&sync_every=4&compress=fp16", 8)
    ref = reference(8, 4, dict(lr=0.7, momentum=0.9, nesterov=True))
    numel = sum(p.numel() for p in ref[0][0].parameters())
    assert saved[0]["sent"] == [0, 0, 0, 2 * numel] * 2
    check_ranks(saved, ref, 2e-3)
    assert max_diff(saved[0]["params"], ref[0][0]) > 1e-7
    # the run ends on a sync: every rank holds the same bits (the anchor)
    assert all(torch.equal(saved[0]["params"][n], saved[1]["params"][n]) for n in saved[0]["params"])


@pytest.mark.multiproc
def test_fragments_and_batchnorm(run_ranks, tmp_path):
    url = REGIMES[0] + "&sync_every=4&fragments=2"
    saved = run(run_ranks, tmp_path, url, 9, bn=True)
    check_ranks(saved, reference(9, 4, dict(lr=0.7, momentum=0.9, nesterov=True), bn=True, parts=2), 1e-5)
    # each sync moves one fragment; the buffers (float64 on the wire, num_batches_tracked too) at the end of H
    model = make_model(True)
    sizes = [p.numel() for p in model.parameters()]
    parts = fragments([s * 4 for s in sizes], 2)
    per = [sum(sizes[i] for i in idx) * 4 for idx in parts]
    buffers = sum(b.numel() for b in model.buffers()) * 8
    assert offsets(4, 2) == [2, 0]
    assert saved[0]["sent"] == [0, per[0], 0, per[1] + buffers, 0, per[0], 0, per[1] + buffers, 0]
    assert max(s for s in saved[0]["sent"] if s) - buffers <= max(per)


@pytest.mark.multiproc
def test_fragments_of_slices_balance_and_match_reference(run_ranks, tmp_path):
    """fragment_by=slices on the ring with an overlap: each tensor cut into 3 runs (torch.tensor_split), run p in
    fragment p. Every rank equals the reference (which keeps its anchor per run) to 1e-5, and each sync moves
    its fragment's bytes: the closed form sum over tensors of ceil/floor(numel / 3), at most one element per
    tensor apart between fragments, where whole tensors cannot balance this model (one tensor is 2/3 of it)."""
    url = REGIMES[1] + "&sync_every=6&fragments=3&fragment_by=slices&overlap=1&merge=delta"
    saved = run(run_ranks, tmp_path, url, 13)
    check_ranks(saved, reference(13, 6, dict(lr=0.7, momentum=0.9, nesterov=True), parts=3, T=1, merge="delta",
                                 by="slices"), 1e-5)
    sizes = [q.numel() for q in make_model(False).parameters()]
    per = [sum(n // 3 + (p < n % 3) for n in sizes) * 4 for p in range(3)]
    assert max(per) - min(per) <= 4 * len(sizes)
    whole = [sum(sizes[i] for i in idx) * 4 for idx in fragments([n * 4 for n in sizes], 3)]
    assert max(whole) > 1.3 * max(per)  # whole tensors: a fragment over 1.3x the balanced one
    assert offsets(6, 3) == [2, 4, 0]
    ring = 2 * (N - 1) / N  # a float32 ring all-reduce of B bytes sends 2 (N - 1) / N x B per rank
    want = [0, per[0], 0, per[1], 0, per[2], 0, per[0], 0, per[1], 0, per[2], 0]  # 0-based step s: t = s + 1
    assert saved[0]["sent"] == pytest.approx([w * ring for w in want], abs=4 * N), saved[0]["sent"]


@pytest.mark.multiproc
@pytest.mark.parametrize("merge", ["alpha=0.25", "merge=delta"])
def test_overlap_merges_t_steps_later(run_ranks, tmp_path, merge):
    """fragments=2, overlap=1: fragment p's exchange starts at its step and lands one inner step later, mixed
    with the local parameters by alpha, or (merge=delta) the new anchor plus the local change since the push
    (the ring: its all-reduce runs on the ring's own thread). The training thread does not wait on the link:
    rank 1 joins the exchange of step 5 (0-based) only after rank 0 has computed step 6 (forced through the
    store; with overlap=0 rank 0 would wait at step 5 and the run hang)."""
    url = REGIMES[1] + f"&sync_every=4&fragments=2&overlap=1&{merge}&outer=sgd:lr=0.5,momentum=0.8,nesterov=1"
    saved = run(run_ranks, tmp_path, url, 10, ahead=5)
    mix = dict(merge="delta") if merge == "merge=delta" else dict(alpha=0.25)
    check_ranks(saved, reference(10, 4, dict(lr=0.5, momentum=0.8, nesterov=True), parts=2, T=1, **mix), 1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("url", [REGIMES[0], pytest.param(REGIMES[1], marks=pytest.mark.full)])
def test_join_uneven_inputs_averages_over_the_ranks_still_training(run_ranks, tmp_path, url):
    """join() under local steps: rank 1 runs out after 5 steps (between the syncs at steps 4 and 8); the sync at
    8 is rank 0's change alone (the mean over the ranks still training), rank 1 answering it with zeros, and at
    the end both take rank 0's model. Every rank equals the reference to 1e-5 (rank 1's inner AdamW state is its
    own, of 5 steps), and both hold the same anchor bits and step count."""
    saved = run(run_ranks, tmp_path, url + "&sync_every=4", 0, lengths=[10, 5])
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), lengths=[10, 5]), 1e-5)
    a, b = (s["ex"]["talk"] for s in saved)
    assert a["steps"] == b["steps"] == 10
    assert all(torch.equal(x, y) for x, y in zip(a["outer"]["anchors"], b["outer"]["anchors"]))


@pytest.mark.multiproc
def test_restart_in_the_middle_of_h(run_ranks, tmp_path):
    """Two synchronous warm-up steps, then syncs at steps 5 and 9 (0-based). Rank 0 is killed after step 7:
    both resume from the state committed at step 5 (anchor, outer momentum, position within H, inner AdamW
    state), redo steps 6 and 7 once, and end where an uninterrupted run ends."""
    url = "allreduce://?timeout=15&bucket_mb=0.0005&sync_every=4&warmup=2"
    dead = run(run_ranks, tmp_path, url, 11, check=False, kill_at=7)
    assert dead[0].code != 0
    saved = run(run_ranks, tmp_path, url, 11, kill_at=7, resume=True)
    check_ranks(saved, reference(11, 4, dict(lr=0.7, momentum=0.9, nesterov=True), W=2), 1e-5)
    assert [s["redone"] for s in saved] == [2, 2]  # steps 6 and 7, once
    assert saved[0]["ex"]["talk"]["steps"] == 11


@pytest.mark.multiproc
def test_restart_with_an_exchange_in_flight_keeps_its_merge(run_ranks, tmp_path):
    """overlap=2&merge=delta: the sync of step 3 (0-based) lands at step 5. Rank 0 is killed after step 6: both
    resume from the state committed at step 3, whose exchange was in flight (the state carries its outer step
    and each rank's parameters at the push, for the merge at step 5), and end where an uninterrupted run ends."""
    url = "allreduce://?timeout=15&bucket_mb=0.0005&sync_every=4&overlap=2&merge=delta"
    assert run(run_ranks, tmp_path, url, 10, check=False, kill_at=6)[0].code != 0
    saved = run(run_ranks, tmp_path, url, 10, kill_at=6, resume=True)
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), T=2, merge="delta"), 1e-5)
    assert [s["redone"] for s in saved] == [3, 3]  # steps 4 to 6, once


def test_options_refused_in_one_line():
    def parse(q):
        return parse_options(AllReduceOptions, ExchangerURL.parse("allreduce://?" + q))

    assert parse("sync_every=8&outer=adamw:lr=0.1,betas=0.9/0.95").sync_every == 8
    for q, name in [("sync_every=-1", "sync_every"), ("outer=sgd:lr=1", "outer"),
                    ("sync_every=4&outer=nope", "outer"), ("sync_every=4&outer=sgd:lr=1,bogus=2", "outer"),
                    ("sync_every=4&outer=sgd:lr=-1", "outer"), ("sync_every=4&outer=sgd:lr", "outer"),
                    ("sync_every=4&warmup=-2", "warmup"), ("sync_every=4&fragments=5", "fragments"),
                    ("sync_every=4&fragments=2&overlap=2", "overlap"), ("sync_every=4&overlap=1&alpha=2", "alpha"),
                    ("sync_every=4&merge=delta", "merge=delta needs overlap"), ("sync_every=4&overlap=1&merge=x", "merge"),
                    ("sync_every=4&overlap=1&merge=delta&alpha=0.5", "merge=delta takes no alpha"),
                    ("merge=delta", "merge needs sync_every"), ("sync_every=4&fragment_by=slices", "fragment_by=slices needs"),
                    ("sync_every=4&fragments=2&fragment_by=rows", "fragment_by"), ("fragment_by=slices", "needs sync_every")]:
        with pytest.raises(ConfigError, match=name):
            parse(q)
    cls, kwargs = parse_outer("sgd:lr=0.7,momentum=0.9,nesterov=1")
    assert cls is torch.optim.SGD and kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_fragment_rule():
    assert fragments([4] * 6, 3) == [[0, 3], [1, 4], [2, 5]]  # equal layers: strided
    assert fragments([100, 1, 1, 1, 50, 50], 2) == [[0], [1, 2, 3, 4, 5]]  # balanced by bytes
    assert offsets(48, 4) == [12, 24, 36, 0] and offsets(5, 2) == [2, 0]


# ----- ps:// (the shards own the anchor and the outer optimizer) --------------------------------------------------

def ps_url(server, mode: str = "sync") -> str:
    return f"ps://{server.address}?timeout=30&transport=tcp&update=server&mode={mode}"


@pytest.mark.multiproc
def test_ps_h1_plain_averaging_is_synchronous_sgd(run_ranks, tmp_path, procs):
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=1&outer=sgd:lr=1", 5, inner="sgd")
    check_ranks(saved, reference(5, 1, dict(lr=1.0), inner="sgd", combined=True), 1e-6)


@pytest.mark.multiproc
def test_ps_h4_nesterov_matches_reference(run_ranks, tmp_path, procs):
    """The shards step SGD(nesterov) over the anchor; each rank keeps its inner AdamW. Bytes per sync: the
    float32 pseudo-gradient pushed once to the shards and the anchor pulled once, 4 x numel each way."""
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=4", 10)
    ref = reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True))
    check_ranks(saved, ref, 1e-5)
    assert max_diff(saved[0]["params"], ref[1][0]) > 1e-4
    numel = sum(p.numel() for p in ref[0][0].parameters())
    assert saved[0]["sent"] == [0, 0, 0, 4 * numel] * 2 + [0, 0]
    assert server.stats()["updates"] == 2  # one outer step per sync, on the shard


@pytest.mark.multiproc
def test_ps_anchor_pulled_in_float16(run_ranks, tmp_path, procs):
    """anchor_dtype=float16: the new anchor comes back in float16 (2 x numel bytes a sync, the push still float32),
    each rank's next change is taken against what it received, and the shard's anchor stays exact: the reference
    that rounds what the copies receive, to 1e-5, and not the float32 one."""
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=4&anchor_dtype=float16", 10)
    outer = dict(lr=0.7, momentum=0.9, nesterov=True)
    check_ranks(saved, reference(10, 4, outer, pull=torch.float16), 1e-5)
    assert max_diff(saved[0]["params"], reference(10, 4, outer)[0][0]) > 1e-4  # (the rounding shows)
    numel = sum(p.numel() for p in make_model(False).parameters())
    assert saved[0]["sent"] == [0, 0, 0, 4 * numel] * 2 + [0, 0]
    assert saved[0]["received"] == [0, 0, 0, 2 * numel] * 2 + [0, 0]


@pytest.mark.multiproc
@pytest.mark.full
@pytest.mark.parametrize("merge", ["alpha=0.25", "merge=delta"])
def test_ps_fragments_and_overlap_match_reference(run_ranks, tmp_path, procs, merge):
    """Streaming on two shards: fragments=2 (each sync pushes one fragment's pieces to the shards holding any,
    the shard's other keys absent, and pulls that fragment's anchor back), overlap=1, alpha=0.25 or merge=delta: the same
    reference as the collectives' overlap test, to 1e-5. Rank 1 joins the exchange of step 5 only after rank 0
    has computed step 6 (forced): rank 0's training thread did not wait on the shards. Bytes: each sync pushes
    exactly its fragment's float32 pseudo-gradient."""
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/2") for i in range(2)]
    url = (f"ps://{servers[0].address},{servers[1].address}?timeout=30&transport=tcp&update=server&mode=sync"
           f"&sync_every=4&fragments=2&overlap=1&{merge}&outer=sgd:lr=0.5,momentum=0.8,nesterov=1")
    saved = run(run_ranks, tmp_path, url, 10, ahead=5)
    mix = dict(merge="delta") if merge == "merge=delta" else dict(alpha=0.25)
    check_ranks(saved, reference(10, 4, dict(lr=0.5, momentum=0.8, nesterov=True), parts=2, T=1, **mix), 1e-5)
    sizes = [p.numel() for p in make_model(False).parameters()]
    per = [sum(sizes[i] for i in idx) * 4 for idx in fragments([s * 4 for s in sizes], 2)]
    assert saved[0]["sent"] == [0, per[0], 0, per[1], 0, per[0], 0, per[1], 0, per[0]]


@pytest.mark.multiproc
def test_ps_batchnorm_buffers_averaged_at_every_sync(run_ranks, tmp_path, procs):
    """BatchNorm on ps://: the buffers are averaged through shard 0 at the end of every H (steps 3 and 7), each
    a buffer round of its own, as on the collectives; the reference to 1e-5."""
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=4", 9, bn=True)
    check_ranks(saved, reference(9, 4, dict(lr=0.7, momentum=0.9, nesterov=True), bn=True), 1e-5)


@pytest.mark.multiproc
@pytest.mark.full
def test_ps_warmup_matches_reference(run_ranks, tmp_path, procs):
    """warmup=2 on ps://: two synchronous steps (the shard averages the gradients, the inner AdamW steps on the
    average), then rank 0's parameters become the shard's anchor and the local steps begin; the collectives'
    reference to 1e-5. Bytes: each warm-up step pushes the float32 gradient, each sync the pseudo-gradient."""
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=4&warmup=2", 10)
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), W=2), 1e-5)
    n = 4 * sum(p.numel() for p in make_model(False).parameters())
    assert saved[0]["sent"] == [n, n, 0, 0, 0, n, 0, 0, 0, n]
    assert server.stats()["updates"] == 4  # two averages, two outer steps


@pytest.mark.multiproc
def test_ps_shard_killed_and_resumed_keeps_the_outer_momentum(tmp_path, procs):
    """The shard checkpoints after every outer step; rank 0 kills it (SIGKILL) after step 5, between the syncs
    at steps 3 and 7 (0-based); it comes back with --resume on the same port, and the workers' second sync
    reaches it. The run ends where the uninterrupted reference ends: the anchor and the Nesterov momentum
    (after the first sync: nonzero) came back from the checkpoint."""
    from conftest import collect, start_ranks
    from faultkit import kill9  # noqa: F401  (the same forced kill the fault tests use, here from rank 0)

    ckpt = tmp_path / "ckpt"
    server = procs.server("--mode", "sync", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    url = ps_url(server).replace("timeout=30", "timeout=8") + "&sync_every=4"
    out = str(tmp_path / "ls")
    cfg = dict(url=url, steps=10, kill_server_at=5, server_pid=server.proc.pid)
    ranks = start_ranks(PROGRAM, N, tmp_path, {"LS_CFG": json.dumps(cfg), "LS_OUT": out})
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:  # killed by rank 0, at its step 5
        if any(p.poll() not in (None, 0) for p in ranks.procs):
            collect(ranks, 1)  # a rank failed first: its error
        time.sleep(0.05)
    assert server.proc.poll() is not None, "rank 0 never killed the shard"
    resumed = procs.server("--mode", "sync", "--resume", str(ckpt), "--checkpoint-every", "1",
                           bind=f"tcp://127.0.0.1:{server.port}")
    collect(ranks, 90)
    saved = [torch.load(f"{out}.{r}", weights_only=False) for r in range(N)]
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True)), 1e-5)
    assert resumed.stats()["updates"] == 2


@pytest.mark.multiproc
@pytest.mark.full  # ~10 s each: rank 1 waits out timeout=6 at the sync rank 0 never reaches
@pytest.mark.parametrize("k", [1, 2])
def test_ps_worker_killed_between_syncs_resumes_where_an_uninterrupted_run_ends(run_ranks, tmp_path, procs, k):
    """A ps:// WORKER (not a shard) restarted under local steps. K=1: syncs at steps 3 and 7 (0-based); rank 0 is
    killed after step 5, between them (rank 1 then times out at the second sync, its push alone on the shard).
    The job restarts against the same shard from the checkpoints of step 3 (ex.state_dict: the position within
    H, the syncs sent): steps 4 and 5 are redone once, the second sync is the shard's second outer step
    (numbered from the servers and the saved state once, not twice), and the run ends where an uninterrupted
    one ends; the step-3 checkpoints loaded once more, after the shards applied every sync, are refused on every
    rank (their outer steps cannot be redone). K=2 shards, fragments=2: fragment 0 syncs at steps 1, 5, 9, fragment 1 at 3, 7, each shard counting
    its own; rank 0 is killed after step 6 and the job resumes from step 5's checkpoints."""
    servers = [procs.server("--mode", "sync", "--shard", f"{i}/{k}") for i in range(k)]
    url = (f"ps://{','.join(s.address for s in servers)}?timeout=6&transport=tcp&update=server&mode=sync"
           f"&sync_every=4" + ("&fragments=2" if k > 1 else ""))
    kill_at = 5 if k == 1 else 6
    dead = run(run_ranks, tmp_path, url, 10, check=False, kill_at=kill_at)
    assert dead[0].code != 0
    first = [(tmp_path / f"ls.ckpt{r}").read_bytes() for r in range(N)]
    saved = run(run_ranks, tmp_path, url, 10, kill_at=kill_at, resume=True)
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), parts=k), 1e-5)
    assert [s["redone"] for s in saved] == [2, 2] if k == 1 else [1, 1]
    assert saved[0]["ex"]["talk"]["steps"] == 10
    if k == 1:
        assert servers[0].stats()["updates"] == 2  # one outer step per sync, none twice
    # the first checkpoints again, now that the shards applied every sync: their outer steps cannot be redone
    for r in range(N):
        (tmp_path / f"ls.ckpt{r}").write_bytes(first[r])
    refused = run(run_ranks, tmp_path, url, 10, check=False, kill_at=kill_at, resume=True)
    for res in refused:
        assert res.code != 0 and "resume from the checkpoint of their last sync" in res.err, res.err[-2000:]


@pytest.mark.multiproc
def test_ps_async_applies_every_pseudo_gradient_once(run_ranks, tmp_path, procs):
    """mode=async: each worker pushes its pseudo-gradient when its own H steps are done and pulls the newest
    anchor; rank 1 is slow. 2 workers x 6 steps / H=2: exactly 6 outer updates on the shard, each push once;
    bytes per sync: the float32 pseudo-gradient once, 4 x numel."""
    server = procs.server("--mode", "async")
    saved = run(run_ranks, tmp_path, ps_url(server, "async") + "&sync_every=2&outer=sgd:lr=0.7", 6, slow=0.05)
    stats = server.stats()
    assert stats["updates"] == stats["pushes"] == 6 and stats["duplicates"] == 0
    assert stats["last_step"] == {"0": 2, "1": 2}  # each rank's syncs 0, 1, 2, each applied once
    numel = sum(p.numel() for p in make_model(False).parameters())
    assert all(s["sent"] == [0, 4 * numel] * 3 for s in saved)
    # the rule, x -= (lr / N) g per push, adds up whatever the order: the rank that pushed last pulled
    # x0 - (lr / N) x the sum of all six pseudo-gradients
    x0 = torch.cat([p.detach().reshape(-1) for p in make_model(False).parameters()])
    want = x0 - 0.7 / N * sum(g for s in saved for g in s["pushed"])
    got = [torch.cat([s["params"][n].reshape(-1) for n in s["params"]]) for s in saved]
    assert min(float((g - want).abs().max()) for g in got) < 1e-5


def delayed_nesterov_reference(order: list[int], H: int, lr: float, beta: float) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """Async DiLoCo on one process: copy r takes its next H inner steps, pushes anchor_r - theta_r (anchor_r: the
    anchor it last pulled) and pulls the servers' anchor x, in ``order``. The servers' rule, Delayed Nesterov,
    written out: every push x -= (lr/N) g; the pushes summed in D; every N-th push m = beta m + D/N and
    x -= lr beta m (Nesterov's look-ahead), D = 0."""
    models = [make_model(False) for _ in range(N)]
    opts = [make_inner(m, "adamw") for m in models]
    x = [p.detach().clone() for p in models[0].parameters()]
    anchors = [[a.clone() for a in x] for _ in range(N)]
    taken = [0] * N
    m = [torch.zeros_like(a) for a in x]
    acc = [torch.zeros_like(a) for a in x]
    for k, r in enumerate(order, 1):
        model, opt = models[r], opts[r]
        for _ in range(H):
            xb, yb = batch(r, taken[r])
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            taken[r] += 1
        with torch.no_grad():
            for i, q in enumerate(model.parameters()):
                g = anchors[r][i] - q
                x[i] -= lr / N * g
                acc[i] += g
                if k % N == 0:
                    m[i] = beta * m[i] + acc[i] / N
                    x[i] -= lr * beta * m[i]
                    acc[i].zero_()
            for i, q in enumerate(model.parameters()):
                q.copy_(x[i])
            anchors[r] = [a.clone() for a in x]
    return list(zip(models, opts))


@pytest.mark.multiproc
def test_ps_async_delayed_nesterov_matches_reference(run_ranks, tmp_path, procs):
    """mode=async with the Nesterov outer spec: the syncs reach the shard in a forced uneven order (rank 0
    twice, as a worker twice as fast would), so the momentum's windows of N=2 arrivals mix ranks and staleness:
    {r0, r0}, {r1, r0}, {r1, r1}. Exactly 6 updates, each push once; every rank's parameters and inner AdamW state
    equal the single-process reference of the rule to 1e-5."""
    order, H = [0, 0, 1, 0, 1, 1], 2
    server = procs.server("--mode", "async")
    url = ps_url(server, "async") + f"&sync_every={H}&outer=sgd:lr=0.7,momentum=0.9,nesterov=1"
    saved = run(run_ranks, tmp_path, url, 0, order=order, every=H)
    stats = server.stats()
    assert stats["updates"] == stats["pushes"] == 6 and stats["duplicates"] == 0
    assert stats["last_step"] == {"0": 2, "1": 2}
    check_ranks(saved, delayed_nesterov_reference(order, H, 0.7, 0.9), 1e-5)
    # rank 1 pushed last: it holds the anchor, which no plain-SGD rule (momentum dropped) would give
    plain = delayed_nesterov_reference(order, H, 0.7, 0.0)
    assert max_diff(saved[1]["params"], plain[1][0]) > 1e-4


@pytest.mark.multiproc
@pytest.mark.parametrize("first", ["join", "push"])
def test_ps_join_uneven_inputs_averages_over_the_workers_still_training(run_ranks, tmp_path, procs, first):
    """join() on ps:// local steps, the collectives' rule: rank 1 runs out after 5 steps (between the syncs at steps
    4 and 8) and joins before the shard's second sync; that sync is rank 0's change alone (the shard's mean over the
    workers still training), one outer step; at the end rank 0, the last to join, sent its parameters with its
    join and every rank takes them. Every rank equals the collectives' reference to 1e-5 (rank 1's inner AdamW
    state is its own, of 5 steps). Which reaches the shard first is forced by a pause: rank 1's join (rank 0 pauses
    before its sync) or rank 0's push of that sync (rank 1 pauses before joining). Before the fix the first joiner's
    parameters replaced the shard's anchor at its join, and the sync rank 0 made after it stepped from them (1e-2 off)."""
    server = procs.server("--mode", "sync")
    pause = [0, 6, 1.0] if first == "join" else [1, 4, 1.0]
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=4", 0, lengths=[10, 5], pause=pause)
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), lengths=[10, 5]), 1e-5)
    assert server.stats()["updates"] == 2  # one outer step per sync, the second over rank 0 alone
    numel = sum(p.numel() for p in make_model(False).parameters())
    assert saved[0]["sent"] == [0, 0, 0, 4 * numel] * 2 + [0, 0] and saved[1]["sent"] == [0, 0, 0, 4 * numel, 0]


def block_quant(top: float, block: int, cast=None):
    """The block quantizers of docs/lowcomm.md, written out: s = max|x_b| / top per block of ``block`` elements
    (0 for an all-zero block), x / s clamped to +-top, then rounded to the nearest integer (int8, int4) or cast to
    e4m3 (``cast``: fp8), times s."""
    def quant(x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        nb = -(-n // block)
        padded = torch.zeros(nb * block)
        padded[:n] = x
        s = (padded.view(nb, block).abs().amax(1) / top).repeat_interleave(block)[:n]
        v = torch.where(s > 0, x / s.masked_fill(s == 0, 1), torch.zeros(())).clamp(-top, top)
        return (torch.round(v) if cast is None else v.to(cast).float()) * s

    return quant


# spec -> (reference quantizer, bytes of one push of n elements: codes + one float32 scale per block)
QUANT = {"int8,block=32": (block_quant(127.0, 32), lambda n: n + 4 * -(-n // 32)),
         "int4,block=16": (block_quant(7.0, 16), lambda n: -(-n // 2) + 4 * -(-n // 16)),
         "fp8,block=64": (block_quant(448.0, 64, torch.float8_e4m3fn), lambda n: n + 4 * -(-n // 64))}


@pytest.mark.multiproc
@pytest.mark.parametrize("spec", ["int8,block=32", pytest.param("int4,block=16", marks=pytest.mark.full),
                                  pytest.param("fp8,block=64", marks=pytest.mark.full)])
def test_ps_compressed_pseudo_gradient_with_error_feedback_matches_reference(run_ranks, tmp_path, procs, spec):
    """compress= on ps:// local steps: at each sync every worker pushes its pseudo-gradient / N through the block
    quantizer with error feedback (the residual kept on the worker, in ex.state_dict()), the shard decodes each
    push and sums them in rank order (servers.compressed, as for gradients), the outer Nesterov step runs on that
    mean. Every rank's parameters and inner AdamW state equal the reference (the quantizer and error feedback
    written out above) to 1e-5; each rank's residual equals the reference's, and error feedback conserves the sum
    (inputs = decodings + residual); bytes per sync: the closed form of one push of the model's n elements."""
    quant, nbytes = QUANT[spec]
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + f"&sync_every=4&compress={spec}", 10)
    ef: dict = {}
    ref = reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), quant=quant, ef=ef)
    check_ranks(saved, ref, 1e-5)
    exact = reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True))  # without the quantizer: not this run
    assert max_diff(saved[0]["params"], exact[0][0]) > 1e-5
    numel = sum(p.numel() for p in ref[0][0].parameters())
    assert saved[0]["sent"] == [0, 0, 0, nbytes(numel)] * 2 + [0, 0]
    assert server.stats()["updates"] == 2
    for r, s in enumerate(saved):
        residual = s["ex"]["compress"]["residuals"][0]
        assert float((residual - ef[r]["e"]).abs().max()) < 1e-6, f"rank {r}: error feedback's residual differs"
        assert float(residual.abs().max()) > 0  # something was lost to rounding, and kept
        assert torch.allclose(ef[r]["inputs"], ef[r]["sent"] + ef[r]["e"], atol=1e-6)
        pushed = sum(s["pushed"]) / N  # what the rank's syncs put in: its changes from the anchor, / N
        assert float((pushed - ef[r]["inputs"]).abs().max()) < 1e-6


@pytest.mark.multiproc
def test_ps_compressed_fragments_match_reference(run_ranks, tmp_path, procs):
    """compress=int8 with fragments=2 on ps://: each sync pushes one fragment's pseudo-gradient / N through the
    quantizer, a unit of its own on the shard (error feedback per fragment), the shard's other unit named wholly
    absent, so its outer step moves that fragment alone. Every rank equals the reference (quantized per fragment,
    the blocks starting at each fragment's first element) to 1e-5; each sync moves its fragment's closed-form
    bytes; 5 updates; error feedback conserves each fragment's sum."""
    quant, nbytes = QUANT["int8,block=32"]
    server = procs.server("--mode", "sync")
    saved = run(run_ranks, tmp_path, ps_url(server) + "&sync_every=4&fragments=2&compress=int8,block=32", 10)
    ef: dict = {}
    check_ranks(saved, reference(10, 4, dict(lr=0.7, momentum=0.9, nesterov=True), parts=2, quant=quant, ef=ef), 1e-5)
    sizes = [q.numel() for q in make_model(False).parameters()]
    per = [sum(sizes[i] for i in idx) for idx in fragments([n * 4 for n in sizes], 2)]
    assert saved[0]["sent"] == [0, nbytes(per[0]), 0, nbytes(per[1])] * 2 + [0, nbytes(per[0])]  # t = 2, 4, ..., 10
    assert server.stats()["updates"] == 5
    for r in range(N):
        for p in range(2):
            assert torch.allclose(ef[r, p]["inputs"], ef[r, p]["sent"] + ef[r, p]["e"], atol=1e-6)


@pytest.mark.multiproc
@pytest.mark.full
def test_ps_async_compressed_pseudo_gradients_add_up_with_error_feedback(run_ranks, tmp_path, procs):
    """mode=async with compress=int8: each push is decoded alone and applied as it lands (x -= (lr / N) g, momentum
    0), so the rank that pushed last pulled x0 - (lr / N) x (the sum of every decoding), which error feedback makes
    the sum of the six pseudo-gradients minus the two ranks' residuals. Bytes per sync: int8's closed form."""
    server = procs.server("--mode", "async")
    url = ps_url(server, "async") + "&sync_every=2&outer=sgd:lr=0.7&compress=int8,block=32"
    saved = run(run_ranks, tmp_path, url, 6, slow=0.05)
    stats = server.stats()
    assert stats["updates"] == stats["pushes"] == 6 and stats["duplicates"] == 0
    numel = sum(p.numel() for p in make_model(False).parameters())
    assert all(s["sent"] == [0, QUANT["int8,block=32"][1](numel)] * 3 for s in saved)
    x0 = torch.cat([p.detach().reshape(-1) for p in make_model(False).parameters()])
    pushed = sum(d for s in saved for d in s["pushed"])
    want = x0 - 0.7 / N * (pushed - sum(s["ex"]["compress"]["residuals"][0] for s in saved))
    got = [torch.cat([s["params"][n].reshape(-1) for n in s["params"]]) for s in saved]
    assert min(float((g - want).abs().max()) for g in got) < 1e-5
    assert min(float((g - (x0 - 0.7 / N * pushed)).abs().max()) for g in got) > 1e-6  # rounding was kept back


@pytest.mark.multiproc
def test_ps_async_compressed_fragments_apply_every_push_once(run_ranks, tmp_path, procs):
    """mode=async, compress=int8, fragments=2 (H = 2: fragment 0 at t = 1, fragment 1 at t = 2), rank 1 slower:
    each rank's 6 syncs push one fragment each, a unit with the other named absent, and the shard applies every
    push once as it lands: 12 updates, 12 pushes, no duplicates; each sync moves its fragment's int8 bytes."""
    server = procs.server("--mode", "async")
    url = ps_url(server, "async") + "&sync_every=2&fragments=2&outer=sgd:lr=0.7&compress=int8,block=32"
    saved = run(run_ranks, tmp_path, url, 6, slow=0.05)
    stats = server.stats()
    assert stats["updates"] == stats["pushes"] == 12 and stats["duplicates"] == 0
    sizes = [q.numel() for q in make_model(False).parameters()]
    per = [sum(sizes[i] for i in idx) for idx in fragments([n * 4 for n in sizes], 2)]
    nbytes = QUANT["int8,block=32"][1]
    assert all(s["sent"] == [nbytes(per[0]), nbytes(per[1])] * 3 for s in saved)
    assert all(torch.isfinite(v).all() for s in saved for v in s["params"].values())


def test_ps_options_refused_in_one_line():
    from commlab.regimes.ps import PSOptions

    def parse(q):
        return parse_options(PSOptions, ExchangerURL.parse("ps://127.0.0.1:1?" + q))

    assert parse("sync_every=4&update=server&mode=async").placement.name == "outer"
    for q, name in [("sync_every=4&update=worker", "update=worker"), ("sync_every=4&mode=ssp", "mode=ssp"),
                    ("sync_every=4&warmup=2&mode=async", "warmup"), ("sync_every=4&compress=powersgd:2", "compress"),
                    ("sync_every=4&warmup=2&compress=int8", "warmup"),
                    ("sync_every=4&clip_norm=1", "clip_norm"),
                    ("sync_every=4&outer=sgd:lr=-1", "outer"), ("outer=sgd:lr=1", "outer"),
                    ("sync_every=4&mode=async&outer=adam:lr=0.1", "Delayed Nesterov"),
                    ("sync_every=4&mode=async&outer=sgd:lr=0.7,momentum=0.9,dampening=0.5", "dampening"),
                    ("anchor_dtype=float16", "anchor_dtype= needs sync_every"),
                    ("sync_every=4&anchor_dtype=int8", "anchor_dtype"),
                    ("sync_every=4&fragments=2&fragment_by=slices", "fragment_by=tensors only")]:
        with pytest.raises(ConfigError, match=name) as exc:
            parse(q)
        assert "\n" not in str(exc.value)
