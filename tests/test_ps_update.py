"""ps:// with the update on the workers (the servers average) or on the servers (their copy of the
user's optimizer), under the user's own loop (tests/userloop.py), every rank compared.

Closed under equality with one process on the combined batch: AdamW in two param groups, a warm-up +
cosine schedule, GradScaler, clipping that really clips (clip_grad_norm_ in the loop for update=worker,
``clip_norm=`` for update=server) and two micro-steps of accumulation end 20 steps with parameters *and
optimizer state* equal to the reference, on every rank. An inf on one rank skips the step on every rank;
stop at step 10 + resume (fresh servers) equals the uninterrupted run; BatchNorm buffers are equal on
every rank after every step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import commlab
from commlab.base.errors import ConfigError, RemoteError
from commlab.core.metrics import metrics_path
from commlab.transport.rendezvous import RankInfo
from faultkit import Procs
from test_user_loop import (BN_RANKS, BN_STEPS, assert_close, assert_inf_step_skipped, assert_ranks_identical,  # noqa: F401
                            ddp_rank0, run_loop)  # noqa: F401 (a fixture)

import userloop

pytestmark = pytest.mark.multiproc

STEPS = 20
TRANSPORTS = ["tcp", "shm"]  # payloads in zmq frames, or through shared memory (commlab.transport.psshm)


@pytest.fixture
def servers(tmp_path):
    """``servers(k, mode="sync") -> "ps://a,b,..."``: K shards on loopback, killed at the end."""
    procs = Procs(tmp_path)

    def start(k: int, mode: str = "sync") -> str:
        shards = [procs.server("--mode", mode, "--shard", f"{i}/{k}") for i in range(k)]
        return "ps://" + ",".join(s.address for s in shards)

    yield start
    procs.close()


def ps_url(base: str, update: str, k: int, transport: str = "tcp") -> str:
    query = f"update={update}&timeout=60&transport={transport}" + ("&piece_mb=0.0001" if k > 1 else "")  # K > 1: pieces
    if update == "server":
        query += f"&clip_norm={userloop.CLIP}"
    return f"{base}?{query}"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("update", ["worker", "server"])
def test_users_loop_equals_one_process_on_the_combined_batch(tmp_path, servers, update, k, n, transport):
    url = ps_url(servers(k), update, k, transport)
    results = run_loop(tmp_path, n, url=url, variant="mlp", steps=STEPS, clip=update == "worker")
    want = userloop.reference("mlp", n, STEPS)
    assert min(want["seen"]["norms"]) > userloop.CLIP  # clipping acted at every step of the reference
    assert_ranks_identical(results)
    for res in results:
        assert_close(res, want, f"ps update={update} K={k} rank {res['rank']} of {n}")
        if update == "worker":  # the loop's clip saw the averaged gradient
            assert res["seen"]["norms"] == pytest.approx(want["seen"]["norms"], rel=1e-5)
        assert sum(res["seen"]["lrs"], []) == pytest.approx(sum(want["seen"]["lrs"], []))
        assert res["exchanges"] == STEPS and res["steps"] == STEPS
        assert len(res["state"]) == 3 * len(res["params"])  # step, exp_avg, exp_avg_sq of every parameter


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("update", ["worker", "server"])
def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, servers, update, transport):
    steps = 8
    assert_inf_step_skipped(run_loop(tmp_path, 2, url=ps_url(servers(1), update, 1, transport), variant="amp",
                                     steps=steps, clip=update == "worker"), steps)


@pytest.mark.parametrize("load", ["after", "before"])  # the model's and optimizer's state: before ex.setup or after
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("update,k", [("worker", 1), ("server", 2)])
def test_stop_and_resume_on_fresh_servers_equals_the_uninterrupted_run(tmp_path, servers, update, k, transport, load):
    """Stopped at step 10 (model, optimizer, scheduler, scaler and exchanger state_dicts saved), resumed by
    new ranks against new servers: with update=server the optimizer state was gathered from the shards
    into a torch state_dict and is scattered to the new ones."""
    ck = str(tmp_path / "ck")
    n = 2
    run_loop(tmp_path, n, url=ps_url(servers(k), update, k, transport), variant="mlp", steps=STEPS, stop_at=10, save=ck,
             clip=update == "worker")
    saved = torch.load(metrics_path(ck, 0), weights_only=False)
    assert len(saved["optimizer"]["state"]) == len(saved["model"])  # a torch state_dict, every parameter
    resumed = run_loop(tmp_path, n, url=ps_url(servers(k), update, k, transport), variant="mlp", steps=STEPS, resume=ck,
                       clip=update == "worker", load=load)
    want = userloop.reference("mlp", n, STEPS)
    assert_ranks_identical(resumed)
    for res in resumed:
        assert_close(res, want, f"ps update={update} resumed rank {res['rank']}")
        assert res["exchanges"] == STEPS  # the exchanger's own counters carried over


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("update,how", [("worker", "broadcast"), ("server", "broadcast"), ("worker", "average")])
def test_batchnorm_buffers_are_equal_on_every_rank_after_every_step(tmp_path, servers, update, how, transport,
                                                                   ddp_rank0):
    """Every rank's buffers equal after every step; with buffers=broadcast (the default, DDP's), rank 0's
    parameters, buffers and optimizer state equal rank 0's under DistributedDataParallel on the same data."""
    url = f"{servers(1)}?update={update}&buffers={how}&timeout=60&transport={transport}"
    results = run_loop(tmp_path, BN_RANKS, url=url, variant="bn", steps=BN_STEPS)
    for res in results[1:]:  # after every step, not only the last
        assert res["seen"]["buffers_equal"] == results[0]["seen"]["buffers_equal"]
    assert_ranks_identical(results)
    start = dict(userloop.build("bn")[0].named_buffers())
    assert results[0]["buffers"]["mid.0.num_batches_tracked"] == [2.0 * BN_STEPS]  # 2 micro-steps a step, rank 0's
    assert results[0]["buffers"]["mid.0.running_mean"] != start["mid.0.running_mean"].double().tolist()
    if how == "broadcast":
        assert_close(results[0], ddp_rank0, f"ps update={update} rank 0 against DDP rank 0",
                     parts=("params", "buffers", "state"))


def test_update_worker_with_async_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^ps:// mode=async updates on the servers only: drop update=worker"):
        commlab.connect("ps://127.0.0.1:1?mode=async&update=worker", RankInfo.single())
    with pytest.raises(ConfigError, match="clip_norm= needs update=server and mode=sync"):
        commlab.connect("ps://127.0.0.1:1?mode=sync&clip_norm=1", RankInfo.single())


def test_an_optimizer_the_servers_cannot_build_is_refused_with_a_way_out(servers):
    class Mine(torch.optim.SGD):
        pass

    model = torch.nn.Linear(2, 2)
    ex = commlab.connect(f"{servers(1)}?update=server&timeout=20", RankInfo.single())
    with pytest.raises(ConfigError, match=r"test_ps_update.*Mine is not one of its classes: use update=worker"):
        ex.setup(model, Mine(model.parameters(), lr=0.1))
    ex.close()


def test_every_mode_and_placement_pair_has_one_object_on_each_side():
    """The protocol's table (commlab.transport.psproto) is what both sides build from: each mode's default placement,
    the placements it refuses, and for every allowed pair one client object (commlab.regimes.ps_steps) and
    one shard object (servers.modes), whose declared abilities agree with the protocol's."""
    from commlab.transport import psproto
    from commlab.regimes import ps_steps
    from servers import modes

    assert [c.placement("").name for c in psproto.CONSISTENCIES.values()] == ["worker", "server", "server"]
    for name in ("async", "ssp"):
        with pytest.raises(ValueError, match=f"mode={name} updates on the servers only"):
            psproto.consistency(name).placement("worker")
    with pytest.raises(ValueError, match="unknown mode 'bsp'"):
        psproto.consistency("bsp")
    pairs = [(c, p) for c in psproto.CONSISTENCIES.values() for p in c.placements]
    assert len(pairs) == 6  # sync: worker, server, outer; async: server, outer; ssp: server
    for mode, placement in pairs:
        client = ps_steps.for_servers(None, mode, placement)  # type: ignore[arg-type]
        shard = modes.PLACEMENTS[placement.name]()
        assert client.spec is placement is shard.spec
        # local steps (outer): the shards step the outer optimizer, the workers' own optimizers the inner steps
        local = placement is psproto.OUTER
        assert client.updates_remotely == client.keeps_state == (placement.shards_step and not local)
        assert client.clips == (placement.shards_step and mode.gathers and not local)  # clip_norm=: one commit over the average
        assert shard.step_pull == ("report" if placement.shards_step else "sum")
        assert modes.MODES[mode.name].spec is mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_reports_sum_of_squares_equals_float64_and_keeps_its_finite_verdict(dtype):
    """The step report's squared norm (clip_norm=, the skip of a non-finite step), computed row-wise: equal to the
    float64 sum of squares to 1e-6 at every size (a tail past whole rows included), and non-finite exactly when an
    element is: a row whose float32 norm overflows (elements near float32's largest) falls back to float64."""
    from servers.modes import ROW, sum_of_squares

    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, ROW - 1, ROW, ROW + 3, 3 * ROW + 17, 1_000_003):
        buf = (torch.randn(n, generator=gen) * 3).to(dtype)
        want = float(buf.to(torch.float64).square().sum())
        assert sum_of_squares(buf) == pytest.approx(want, rel=1e-6, abs=1e-300), n
    if dtype != torch.bfloat16:
        huge = torch.full((2 * ROW,), 3e38, dtype=dtype)
        assert sum_of_squares(huge) == pytest.approx(2 * ROW * 9e76, rel=1e-6)  # finite: the step is not skipped
    for bad in (math.inf, math.nan):
        buf = torch.randn(2 * ROW + 5, generator=gen).to(dtype)
        buf[ROW + 1] = bad
        assert not math.isfinite(sum_of_squares(buf))
