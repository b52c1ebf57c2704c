"""What a DDP script expects of ps:// at setup: rank 0's start, state loaded before setup, clipping said.

Ranks are threads of this process (each with its own client and connections) against real server
processes, so that the cases cost server starts, not interpreters importing torch.

- Ranks seeded differently: after ``ex.setup`` every rank holds rank 0's parameters and buffers, in
  every mode and placement, with rank 0 made to arrive last (a delay), so the race that a rank which
  reached the servers first used to win is forced.
- ``optimizer.load_state_dict`` before ``ex.setup`` under ``update=server``: the resumed run equals the
  uninterrupted one (the state went to the shards, where the update runs).
- A clip in the loop under ``update=server`` is said once; GradScaler alone, or no clipping, says nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import time
import warnings
import zlib

import pytest
import torch
from torch import nn

import commlab
from commlab.transport.rendezvous import RankInfo
from faultkit import Procs

pytestmark = pytest.mark.multiproc

N = 2
LATE_S = 1.5  # rank 0 reaches setup this long after the others


@pytest.fixture
def servers(tmp_path):
    """``servers(k, mode) -> "ps://a,b,..."``: K shards on loopback, killed at the end."""
    procs = Procs(tmp_path)

    def start(k: int, mode: str = "sync") -> str:
        return "ps://" + ",".join(procs.server("--mode", mode, "--shard", f"{i}/{k}").address for i in range(k))

    yield start
    procs.close()


def on_ranks(fn, n: int = N, timeout: float = 90.0, errors: bool = False) -> list:
    """``fn(rank)`` on n threads at once; their results in rank order. A rank's error is raised, the first
    to happen (the others' are often its consequences), with every rank's said; ``errors``: each rank's
    exception (or None) is returned instead."""
    failed_at: dict[int, float] = {}

    def timed(rank: int):
        try:
            return fn(rank)
        except BaseException:
            failed_at[rank] = time.monotonic()
            raise

    with cf.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(timed, r) for r in range(n)]
        done, late = cf.wait(futures, timeout)
        assert not late, f"rank(s) {[futures.index(f) for f in late]} still running after {timeout:g}s"
        failed = [f.exception() for f in futures]
        if errors:
            return failed
        order = sorted((failed_at.get(r, 0.0), r) for r, e in enumerate(failed) if e is not None)
        if order:
            said = "; ".join(f"rank {r}: {type(failed[r]).__name__}: {failed[r]}" for _, r in order)
            raise AssertionError(f"the ranks failed, first to last: {said}") from failed[order[0][1]]
        return [f.result() for f in futures]


def connect(url: str, rank: int, n: int = N):
    return commlab.connect(url, RankInfo(rank, n, rank, "127.0.0.1", 0, "flags"))


def seeded_model(rank: int, bn: bool = True) -> nn.Module:
    torch.manual_seed(1337 + rank)  # as many DDP scripts do: every rank differently
    layers = [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)] if bn else [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)]
    model = nn.Sequential(*layers)
    if bn:
        with torch.no_grad():
            model[1].running_mean.fill_(float(rank))
            model[1].num_batches_tracked.fill_(rank)
    return model


def snapshot(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# (mode, update, K): every mode and placement, K = 1 and 3; the gate is the servers' whatever the mode, so
# the default run takes one placement of each kind and the rest run under `make test-full`
START_CASES = [("sync", "worker", 1), ("async", "server", 3)] + [
    pytest.param(*case, marks=pytest.mark.full)
    for case in [("sync", "worker", 3), ("sync", "server", 1), ("sync", "server", 3), ("async", "server", 1),
                 ("ssp", "server", 1), ("ssp", "server", 3)]]


@pytest.mark.parametrize("mode,update,k", START_CASES)
def test_every_rank_starts_from_rank0_even_when_rank0_arrives_last(servers, monkeypatch, mode, update, k):
    """Also forced: rank 1 lingers after its start pull while rank 0 trains on (its step posts its buffers). The
    buffers come with the start pull's reply, as of the same moment; a pull of its own after it (as before) got
    rank 0's buffers after its first step under async (CI saw it once)."""
    from commlab.regimes import ps

    url = f"{servers(k, mode)}?mode={mode}&update={update}&timeout=30&transport=tcp" + ("&piece_mb=0.00002" if k > 1 else "")
    models = [seeded_model(r) for r in range(N)]  # here: torch's global RNG is not the threads' to share
    rank0 = snapshot(models[0])
    start = ps._Shard.start

    def lingering(self, *args, **kw):
        out = start(self, *args, **kw)
        if self.rank == 1:
            time.sleep(LATE_S)
        return out

    monkeypatch.setattr(ps._Shard, "start", lingering)

    def rank_main(rank: int) -> dict:
        model = models[rank]
        if rank == 0:
            time.sleep(LATE_S)
        with connect(url, rank) as ex:
            ex.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            held = snapshot(model)
            # a step right away: under async nobody's update may reach a rank still in setup
            ex.zero_grad()
            model(torch.randn(4, 4)).pow(2).mean().backward()
            ex.step()
        return held

    for rank, held in enumerate(on_ranks(rank_main)):
        for key, want in rank0.items():
            assert torch.equal(held[key], want), f"rank {rank}'s {key} after setup is not rank 0's"


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(url: str, steps: range, resume: dict | None = None, stop_at: int | None = None) -> list[dict]:
    """N ranks of AdamW; ``resume`` (the per-rank snapshot of a run stopped earlier) is loaded before
    ``ex.setup``, as DDP scripts load a checkpoint before wrapping the model. Returns each rank's
    parameters and optimizer state at the end (and at ``stop_at``, under "stop")."""
    models = [seeded_model(r, bn=False) for r in range(N)]  # here: torch's global RNG is not the threads' to share

    def rank_main(rank: int) -> dict:
        model = models[rank]
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        if resume is not None:
            model.load_state_dict(resume[rank]["model"])
            optimizer.load_state_dict(resume[rank]["optim"])
        out = {}
        with connect(url, rank) as ex:
            ex.setup(model, optimizer)
            if resume is not None:
                ex.load_state_dict(resume[rank]["ex"])
            for step in steps:
                if step == stop_at:
                    out["stop"] = copy.deepcopy({"model": snapshot(model), "optim": optimizer.state_dict(),
                                                 "ex": ex.state_dict()})  # (torch's state_dict holds live tensors)
                ex.zero_grad()
                model(_batch(rank, step)).pow(2).mean().backward()
                optimizer.step()
            out["end"] = {"model": snapshot(model), "optim": optimizer.state_dict()}
        return out

    return on_ranks(rank_main)


@pytest.mark.parametrize("update,k", [("server", 1), pytest.param("server", 3, marks=pytest.mark.full),
                                      pytest.param("worker", 1, marks=pytest.mark.full)])
def test_optimizer_state_loaded_before_setup_resumes_exactly(servers, update, k):
    def url() -> str:
        return f"{servers(k)}?update={update}&timeout=30&transport=tcp" + ("&piece_mb=0.00002" if k > 1 else "")

    whole = _train(url(), range(6), stop_at=3)
    assert whole[0]["stop"]["optim"]["state"], "the optimizer had state to carry at the stop"
    resumed = _train(url(), range(3, 6), resume=[r["stop"] for r in whole])
    for rank in range(N):
        for key, want in whole[rank]["end"]["model"].items():
            got = resumed[rank]["end"]["model"][key]
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), f"rank {rank}: {key} differs after the resume"
        for index, state in whole[rank]["end"]["optim"]["state"].items():
            for name, want in state.items():
                got = resumed[rank]["end"]["optim"]["state"][index][name]
                assert torch.allclose(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-6, atol=1e-7), \
                    f"rank {rank}: optimizer state {index}/{name} differs after the resume"


def test_a_clip_in_the_loop_under_update_server_is_said_once_and_gradscaler_alone_never(servers):
    """One rank, one shard, three loops one after another (each a new exchanger of the same model)."""
    url = f"{servers(1)}?update=server&timeout=30&transport=tcp"

    def said(clip: bool, scaler: bool) -> list[str]:
        model = seeded_model(0, bn=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
        with warnings.catch_warnings(record=True) as caught, connect(url, 0, n=1) as ex:
            warnings.simplefilter("always")
            ex.setup(model, optimizer)
            for step in range(4):
                ex.zero_grad()
                loss = model(_batch(0, step)).pow(2).mean() * 100  # norms well above the clip
                (amp.scale(loss) if amp else loss).backward()
                if amp:
                    amp.unscale_(optimizer)
                if clip:
                    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)) > 0.1
                if amp:
                    amp.step(optimizer)
                    amp.update()
                else:
                    optimizer.step()
        return [str(w.message) for w in caught if "ps://" in str(w.message)]

    clipped = said(clip=True, scaler=False)
    assert len(clipped) == 1 and "local clipping" in clipped[0] and "clip_norm" in clipped[0], clipped
    assert len(said(clip=True, scaler=True)) == 1
    assert said(clip=False, scaler=True) == []
    assert said(clip=False, scaler=False) == []


def test_a_rank_that_never_reaches_setup_is_named(servers):
    from commlab.base.errors import CommTimeout

    model = seeded_model(0)
    with connect(f"{servers(1)}?timeout=2&retries=0&transport=tcp", 0) as ex:
        with pytest.raises(CommTimeout, match=r"its start waits for every rank's setup, from rank\(s\) \[1\]"):
            ex.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


# ----- key spaces: more than one model on the same servers ----------------------------------------

def _mlp(rank: int, widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(7 + 31 * rank + sum(widths))
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


MODELS = {"first": (4, 3), "second": (4, 5, 1), "beside": (4, 2, 2)}  # one after another, then two at once
STEPS = {"first": 3, "second": 4, "beside": 4}


def _loss(name: str, model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(zlib.crc32(f'{name}/{rank}/{step}'.encode())))
    return model(x).pow(2).mean()


def _reference(name: str) -> dict:
    """One process: rank 0's start, each step on the average of the N ranks' gradients."""
    model = _mlp(0, MODELS[name])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS[name]):
        optimizer.zero_grad()
        (sum(_loss(name, model, r, step) for r in range(N)) / N).backward()
        optimizer.step()
    return snapshot(model)


@pytest.mark.parametrize("update,k", [("worker", 1), ("server", 3), pytest.param("worker", 3, marks=pytest.mark.full),
                                      pytest.param("server", 1, marks=pytest.mark.full)])
def test_models_one_after_another_and_two_at_once_each_get_a_key_space(servers, update, k):
    from commlab.regimes.ps import server_stats

    base = servers(k)
    url = f"{base}?update={update}&timeout=30&transport=tcp" + ("&piece_mb=0.00002" if k > 1 else "")

    built = [{name: _mlp(r, widths) for name, widths in MODELS.items()} for r in range(N)]  # (global RNG: here)

    def rank_main(rank: int) -> dict:
        def start(name):
            model = built[rank][name]
            ex = connect(url, rank)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ex.setup(model, optimizer)
            return model, ex, optimizer

        def step(name, model, ex, optimizer, t):
            optimizer.zero_grad()
            _loss(name, model, rank, t).backward()
            optimizer.step()

        out = {}
        model, ex, optimizer = start("first")
        for t in range(STEPS["first"]):
            step("first", model, ex, optimizer, t)
        out["first"] = snapshot(model)
        ex.close()  # the first model is done: a second one (a new head, the next run of a sweep) follows
        runs = {name: start(name) for name in ("second", "beside")}  # two exchangers at once
        for t in range(STEPS["second"]):
            for name, (model, ex, optimizer) in runs.items():
                step(name, model, ex, optimizer, t)
        for name, (model, ex, _) in runs.items():
            out[name] = snapshot(model)
            out[name + "/space"] = ex.space
            ex.close()
        return out

    results = on_ranks(rank_main)
    for name in MODELS:
        want = _reference(name)
        for rank, got in enumerate(results):
            for key in want:
                assert torch.allclose(got[name][key], want[key], rtol=1e-5, atol=1e-6), \
                    f"{name} model, rank {rank}: {key} differs from one process on the combined batch"
    assert [r["second/space"] for r in results] == ["model2"] * N and results[0]["beside/space"] == "model3"
    for address in base.removeprefix("ps://").split(","):
        stats = server_stats(address)
        spaces = stats["spaces"]
        assert set(spaces) == {"", "model2", "model3"}, spaces
        assert not any(sp["live"] for sp in spaces.values()), "a closed exchanger's key space was not freed"
        assert [spaces[s]["updates"] for s in ("", "model2", "model3")] == [3, 4, 4], spaces
        assert stats["updates"] == 11  # the counters add up every space the shard served


def test_ranks_at_the_start_of_different_key_spaces_are_told_where_the_other_is(servers):
    """Rank 1 names another key space (``space=``) than rank 0's: each start gate waits for the other rank
    until the timeout, and each error names the space the other rank is at, not "dead or stalled"."""
    url = f"{servers(1)}?timeout=2&retries=0&transport=tcp"
    models = [seeded_model(r, bn=False) for r in range(N)]

    def rank_main(rank: int) -> None:
        with connect(url + ("&space=model2" if rank == 1 else ""), rank) as ex:
            ex.setup(models[rank], torch.optim.SGD(models[rank].parameters(), lr=0.1))

    errors = on_ranks(rank_main, errors=True)
    for rank, other, space, theirs in [(0, 1, "", "model2"), (1, 0, "model2", "")]:
        said = str(errors[rank])
        assert f"its start (key space {space!r}) waits for rank(s) [{other}], which are at the start of key " \
               f"space(s) {theirs!r} (rank {other})" in said, f"rank {rank}: {said}"
