"""Uneven inputs: ``with ex.join():`` around a loop whose ranks have different numbers of batches, compared
rank by rank with DistributedDataParallel's ``with ddp.join():`` on the same data (tests/userloop.py's
``uneven_main``: the BatchNorm model, SGD with momentum, two micro-steps, the first under no_sync).

A rank that runs out contributes zeros to the others' exchanges (divided by the initial world size, as
DDP does by default) and receives their buffers; when every rank is out, all hold the last joiner's
parameters and buffers. Every rank's parameters, buffers and optimizer state are compared (a joined
rank's optimizer state stays where its last step left it, under DDP as here).
"""

from __future__ import annotations

import pytest

from faultkit import Procs
from test_user_loop import assert_close, run_loop

pytestmark = pytest.mark.multiproc

BATCHES = {2: [10, 14], 3: [10, 12, 14]}
PARTS = ("params", "buffers", "state")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """``ddp(n, divide=True)``: every rank's result under DDP's join (run once per case, kept for the module)."""
    runs: dict = {}

    def get(n: int, divide: bool = True) -> list[dict]:
        if (n, divide) not in runs:
            out = run_loop(tmp_path_factory.mktemp("ddp"), n, ddp=True, batches=BATCHES[n], divide=divide)
            runs[n, divide] = sorted(out, key=lambda r: r["rank"])
        return runs[n, divide]

    return get


@pytest.fixture
def servers(tmp_path):
    """``servers(k, mode, *args) -> "ps://a,b,..."``: K shards on loopback, killed at the end."""
    procs = Procs(tmp_path)

    def start(k: int, mode: str = "sync", *args: str) -> str:
        return "ps://" + ",".join(procs.server("--mode", mode, "--shard", f"{i}/{k}", *args).address
                                  for i in range(k))

    yield start
    procs.close()


def assert_equals_ddp(results: list[dict], want: list[dict], what: str, state_of_all: bool = True) -> None:
    """Every rank against DDP's same rank. ``state_of_all`` False (ps:// update=server, where the optimizer
    state lives on the servers, so a joined rank reads the final one): only the last joiner's state."""
    results = sorted(results, key=lambda r: r["rank"])
    for got, ref in zip(results, want):
        parts = PARTS if state_of_all or got is results[-1] else ("params", "buffers")
        assert_close(got, ref, f"{what} rank {got['rank']} against DDP's", parts=parts)
    last = results[-1]  # the last joiner: every rank ends with its parameters and buffers
    for got in results:
        assert got["params"] == last["params"] and got["buffers"] == last["buffers"], f"{what} rank {got['rank']}"
        assert state_of_all or got["state"] == last["state"], f"{what} rank {got['rank']}: not the shards' state"


def assert_counts(results: list[dict], batches: list[int]) -> None:
    for res in results:
        mine = batches[res["rank"]]
        assert res["exchanges"] == mine and res["steps"] == mine  # a joined rank's zeros are not its exchanges


@pytest.mark.parametrize("url,n", [("allreduce://?timeout=60", 2), ("ring://?timeout=60", 3)])
def test_uneven_inputs_under_join_equal_ddps_join(tmp_path, ddp, url, n):
    results = run_loop(tmp_path, n, url=url, batches=BATCHES[n])
    assert_equals_ddp(results, ddp(n), url)
    assert_counts(results, BATCHES[n])


@pytest.mark.full
@pytest.mark.parametrize("url,n", [("allreduce://?timeout=60", 3), ("ring://?timeout=60", 2),
                                   ("ring://?transport=torch&timeout=60", 2)])
def test_uneven_inputs_under_join_equal_ddps_join_further_cases(tmp_path, ddp, url, n):
    results = run_loop(tmp_path, n, url=url, batches=BATCHES[n])
    assert_equals_ddp(results, ddp(n), url)


@pytest.mark.parametrize("url", ["allreduce://?timeout=60&compress=powersgd:4,start_iter=1000",
                                 "ring://?timeout=60&compress=fp16",
                                 pytest.param("ring://?timeout=60&compress=powersgd:1,start_iter=1,min_rate=0.01",
                                              marks=pytest.mark.full)])
def test_uneven_inputs_under_join_with_compression(tmp_path, ddp, url):
    """A joined rank runs every compressed round on zeros (its error feedback's residual included), as DDP's join
    runs a comm hook on zero buckets; before, the ranks still training waited for it until the timeout.
    PowerSGD in its uncompressed warm-up is the exact exchange through every round of the seam: DDP's join to
    1e-5. fp16 rounds each exchange: within 1e-2 of DDP's. A rank-1 PowerSGD (``full``): the ranks agree."""
    results = run_loop(tmp_path, 2, url=url, batches=BATCHES[2])
    assert_counts(results, BATCHES[2])
    last = max(results, key=lambda r: r["rank"])
    for got in results:  # every rank ends with the last joiner's parameters and buffers
        assert got["params"] == last["params"] and got["buffers"] == last["buffers"], f"{url} rank {got['rank']}"
    if "start_iter=1000" in url:
        assert_equals_ddp(results, ddp(2), url)
    elif "fp16" in url:
        for got, ref in zip(sorted(results, key=lambda r: r["rank"]), ddp(2)):
            assert_close(got, ref, f"{url} rank {got['rank']}", tol=1e-2, parts=("params",))


def test_divide_by_the_ranks_still_training_equals_ddps(tmp_path, ddp):
    results = run_loop(tmp_path, 2, url="ring://?timeout=60", batches=BATCHES[2], divide=False)
    assert_equals_ddp(results, ddp(2, divide=False), "divide_by_initial_world_size=False")


def test_throw_on_early_termination_raises_on_every_rank(tmp_path):
    """The first rank to run out raises; every other rank raises at its next exchange, before any bucket."""
    results = sorted(run_loop(tmp_path, 2, url="allreduce://?timeout=60", batches=[2, 4], throw=True),
                     key=lambda r: r["rank"])
    assert results[0] == {"rank": 0, "raised": "Rank 0 exhausted all inputs.", "steps": 2}
    assert results[1]["raised"] == "Detected at least one rank that exhausted inputs. Throwing across all ranks."
    assert results[1]["steps"] == 2


@pytest.mark.parametrize("update,n,k", [("worker", 2, 1), ("server", 2, 1),
                                        pytest.param("worker", 3, 2, marks=pytest.mark.full),
                                        pytest.param("server", 3, 2, marks=pytest.mark.full)])
def test_ps_sync_uneven_inputs_under_join_equal_ddps_join(tmp_path, ddp, servers, update, n, k):
    """The shards count a joined worker as zeros (divided by N) and take buffers from the highest worker still
    training; update=worker: the last joiner's parameters reach every worker through the shards."""
    url = f"{servers(k)}?update={update}&timeout=60" + ("&piece_mb=0.0001" if k > 1 else "")
    results = run_loop(tmp_path, n, url=url, batches=BATCHES[n])
    assert_equals_ddp(results, ddp(n), f"ps update={update} K={k}", state_of_all=update == "worker")
    assert_counts(results, BATCHES[n])
    for res in results:
        assert res["updates"] == [max(BATCHES[n])] * k  # one per step of the longest loop, on every shard


@pytest.mark.full
def test_ps_divide_by_the_workers_still_training_equals_ddps(tmp_path, ddp, servers):
    url = f"{servers(2)}?update=worker&timeout=60&piece_mb=0.0001"
    results = run_loop(tmp_path, 2, url=url, batches=BATCHES[2], divide=False)
    assert_equals_ddp(results, ddp(2, divide=False), "ps divide_by_initial_world_size=False")


@pytest.mark.parametrize("mode", [pytest.param("async", marks=pytest.mark.full), "ssp"])
def test_async_and_ssp_workers_that_run_out_leave_the_clock(tmp_path, servers, mode):
    """Rank 0 runs 3 steps, rank 1 ten: under ssp with bound 1 rank 1 would wait for rank 0's clock from its
    fifth step on; joined, rank 0 is off the clock, rank 1 finishes, and the shards applied every push once.
    Every rank ends with the shards' final parameters."""
    batches = [3, 10]
    results = run_loop(tmp_path, 2, url=f"{servers(1, mode, '--staleness', '1')}?timeout=30", batches=batches)
    assert_counts(results, batches)
    for res in results:
        assert res["updates"] == [sum(batches)]
    assert results[0]["params"] == results[1]["params"] and results[0]["buffers"] == results[1]["buffers"]


@pytest.mark.full
def test_ps_throw_on_early_termination_raises_on_every_rank(tmp_path, servers):
    results = sorted(run_loop(tmp_path, 2, url=f"{servers(1)}?update=worker&timeout=60", batches=[2, 4], throw=True),
                     key=lambda r: r["rank"])
    assert results[0] == {"rank": 0, "raised": "Rank 0 exhausted all inputs.", "steps": 2}
    assert "rank 0 exhausted all inputs" in results[1]["raised"] and results[1]["steps"] == 2


def test_join_needs_setup_is_not_nested_and_enable_false_does_nothing():
    import torch
    import commlab
    from commlab.base.errors import ConfigError
    from commlab.transport.rendezvous import RankInfo

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ex = commlab.connect("local://", RankInfo.single())
    with pytest.raises(ConfigError, match=r"call setup\(model, optimizer\) before join\(\)"):
        with ex.join():
            pass
    ex.setup(model, opt)
    with ex.join(enable=False):
        assert not ex._join.joining
    with ex.join():
        with pytest.raises(ConfigError, match=r"join\(\) inside join\(\)"):
            with ex.join():
                pass
        model(torch.ones(3, 2)).sum().backward()
        opt.step()
    assert ex.stats.exchanges == 1 and ex.stats.steps == 1 and not ex._join.joining
