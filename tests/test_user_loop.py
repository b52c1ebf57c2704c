"""A user's own training loop (tests/userloop.py) under every synchronous regime, every rank compared.

Closed under equality: 20 steps of AdamW in two param groups, a warm-up + cosine schedule,
GradScaler, clipping that really clips and two micro-steps of accumulation end with parameters
*and optimizer state* equal to one process on the combined batch, on every rank, and the ranks
equal to each other. BatchNorm buffers are compared with DistributedDataParallel (the oracle for
user-loop semantics); AMP skips, checkpoint/resume and torch.utils.checkpoint are covered too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import commlab
from commlab.base.errors import ConfigError
from commlab.transport.rendezvous import RankInfo
from conftest import child_env, collect, start_ranks

import userloop

HERE = Path(__file__).resolve().parent
STEPS = 20

# Every synchronous regime a user's loop must survive (a PS placement is one more line here).
SYNC_REGIMES = {
    "allreduce": "allreduce://?timeout=60",
    "ring-tcp": "ring://?timeout=60",
    "ring-torch": "ring://?transport=torch&timeout=60",
}


def run_loop(tmp_path: Path, n: int, timeout: float = 150, env: dict | None = None, **cfg) -> list[dict]:
    main = "uneven_main" if "batches" in cfg else "ddp_main" if cfg.get("ddp") else "rank_main"
    program = f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import userloop; userloop.{main}({cfg!r})"
    results = collect(start_ranks(program, n, tmp_path, extra_env=env), timeout)
    return [res.json() for res in results]


def rel_diff(a: list, b: list) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((ta - tb).abs().max() / tb.abs().max().clamp_min(1e-12)) if tb.numel() else 0.0


def assert_close(got: dict, want: dict, what: str, tol: float = 1e-5, parts=("params", "state")) -> None:
    for part in parts:
        assert got[part].keys() == want[part].keys(), f"{what}: {part} keys differ"
        for key in want[part]:
            d = rel_diff(got[part][key], want[part][key])
            assert d <= tol, f"{what}: {part} {key} differs from the reference by {d:.2e} (relative)"


def assert_ranks_identical(results: list[dict], parts=("params", "buffers", "state")) -> None:
    for res in results[1:]:
        for part in parts:
            assert res[part] == results[0][part], f"rank {res['rank']}'s {part} differ from rank 0's"


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("regime", sorted(SYNC_REGIMES))
def test_users_loop_equals_one_process_on_the_combined_batch(tmp_path, regime, n):
    results = run_loop(tmp_path, n, url=SYNC_REGIMES[regime], variant="mlp", steps=STEPS)
    want = userloop.reference("mlp", n, STEPS)
    assert min(want["seen"]["norms"]) > userloop.CLIP  # clipping acted at every step
    assert_ranks_identical(results)
    for res in results:
        assert_close(res, want, f"{regime} rank {res['rank']} of {n}")
        assert res["seen"]["norms"] == pytest.approx(want["seen"]["norms"], rel=1e-5)  # clip saw the averaged grads
        assert sum(res["seen"]["lrs"], []) == pytest.approx(sum(want["seen"]["lrs"], []))
        assert res["exchanges"] == STEPS and res["steps"] == STEPS
        assert len(res["state"]) == 3 * len(res["params"])  # step, exp_avg, exp_avg_sq of every parameter


@pytest.mark.multiproc
@pytest.mark.parametrize("accumulate", ["flag", pytest.param("flag-compiled", marks=pytest.mark.full), "flag-wrapper",
                                        "every"])
def test_require_backward_grad_sync_false_on_the_micro_steps_is_no_sync(tmp_path, accumulate):
    """nanoGPT's accumulation: ``model.require_backward_grad_sync = (micro_step == last)`` before each forward,
    on the model given to setup, on the torch.compile wrapper given to setup (passed on to the model), or kept
    on the wrapper itself (torch versions whose wrapper keeps attributes): one exchange per step and the result
    of the no_sync() loop (the reference). ``every``: neither flag nor no_sync, so every micro-step is exchanged
    (the same result): the step's report, which the launcher's summary prints per step, counts both exchanges."""
    steps, n = 6, 2
    results = run_loop(tmp_path, n, url=SYNC_REGIMES["allreduce"], variant="mlp", steps=steps, accumulate=accumulate)
    want = userloop.reference("mlp", n, steps)
    assert_ranks_identical(results)
    model, _ = userloop.build("mlp")
    per_exchange = 4 * sum(p.numel() + 1 for p in model.parameters())  # N = 2: each rank sends its buckets once
    per_step = 1 if accumulate != "every" else userloop.MICRO
    for res in results:
        assert_close(res, want, f"{accumulate} rank {res['rank']}")
        assert res["exchanges"] == per_step * steps and res["steps"] == steps
        assert res["report"] == [per_step, per_step * per_exchange, per_step * per_exchange]


@pytest.mark.multiproc
@pytest.mark.parametrize("variant", ["ckpt", "ckpt-reentrant"])
def test_activation_checkpointing_fires_each_hook_once(tmp_path, variant):
    """A block under torch.utils.checkpoint (the reentrant form runs a nested backward): every hook fires
    once per backward, the exchange still ends when the outer backward does, the result is the reference."""
    results = run_loop(tmp_path, 2, url=SYNC_REGIMES["allreduce"], variant=variant, steps=8)
    want = userloop.reference(variant, 2, 8)
    assert_ranks_identical(results)
    for res in results:
        assert_close(res, want, f"{variant} rank {res['rank']}")
        assert res["exchanges"] == 8


BN_RANKS, BN_STEPS = 2, 6


@pytest.fixture(scope="module")
def ddp_rank0(tmp_path_factory) -> dict:
    """Rank 0 of the BatchNorm loop under DistributedDataParallel(broadcast_buffers=True): one run for
    every regime compared with it."""
    ddp = run_loop(tmp_path_factory.mktemp("ddp"), BN_RANKS, ddp=True, steps=BN_STEPS)
    return next(d for d in ddp if d["rank"] == 0)


@pytest.mark.multiproc
@pytest.mark.parametrize("regime", sorted(SYNC_REGIMES))
def test_batchnorm_buffers_equal_on_every_rank_and_rank0_equals_ddp(tmp_path, regime, ddp_rank0):
    results = run_loop(tmp_path, BN_RANKS, url=SYNC_REGIMES[regime], variant="bn", steps=BN_STEPS)
    for res in results[1:]:  # after every step, not only the last
        assert res["seen"]["buffers_equal"] == results[0]["seen"]["buffers_equal"]
    assert_ranks_identical(results)
    rank0 = ddp_rank0
    assert_close(results[0], rank0, f"{regime} rank 0 against DDP rank 0", parts=("params", "buffers", "state"))


@pytest.mark.multiproc
@pytest.mark.parametrize("regime", sorted(SYNC_REGIMES))
def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, regime):
    steps = 8
    assert_inf_step_skipped(run_loop(tmp_path, 2, url=SYNC_REGIMES[regime], variant="amp", steps=steps), steps)


def assert_inf_step_skipped(results: list[dict], steps: int) -> None:
    """The inf on one rank at userloop.INF_STEP: that step skipped on every rank, every scale halved there
    and kept, the ranks identical and finite."""
    assert_ranks_identical(results)
    for res in results:
        scales = res["seen"]["scales"]
        before = scales[userloop.INF_STEP - 1]
        assert scales[userloop.INF_STEP] == before * 0.5, f"rank {res['rank']}: the scale was not lowered"
        assert all(s == scales[userloop.INF_STEP] for s in scales[userloop.INF_STEP:])
        assert res["exchanges"] == steps and res["steps"] == steps - 1  # one step skipped
        assert all(math.isfinite(v) for vals in res["params"].values() for v in vals)


@pytest.mark.multiproc
@pytest.mark.parametrize("load", ["after", "before"])  # the model's and optimizer's state: before ex.setup or after
@pytest.mark.parametrize("regime", sorted(SYNC_REGIMES))
def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path, regime, load):
    ck = str(tmp_path / "ck")
    n = 2
    run_loop(tmp_path, n, url=SYNC_REGIMES[regime], variant="mlp", steps=STEPS, stop_at=10, save=ck)
    resumed = run_loop(tmp_path, n, url=SYNC_REGIMES[regime], variant="mlp", steps=STEPS, resume=ck, load=load)
    want = userloop.reference("mlp", n, STEPS)
    assert_ranks_identical(resumed)
    for res in resumed:
        assert_close(res, want, f"{regime} resumed rank {res['rank']}")
        assert res["exchanges"] == STEPS  # the exchanger's own counters carried over


@pytest.mark.multiproc
def test_ranks_whose_optimizers_differ_fail_at_setup_naming_the_difference(tmp_path):
    program = f"""
import sys; sys.path.insert(0, {str(HERE)!r})
import os, torch, commlab, userloop
model, opt = userloop.build("mlp")
if os.environ["RANK"] == "1":
    opt.param_groups[1]["weight_decay"] = 0.01
ex = commlab.connect("allreduce://?timeout=20")
try:
    ex.setup(model, opt)
    print("setup passed")
except commlab.ConfigError as e:
    print("ConfigError:", e)
"""
    results = collect(start_ranks(program, 2, tmp_path), 60, check=False)
    assert "ConfigError: rank 1's optimizer differs from rank 0's: param group 1's weight_decay is 0.01 here " \
           "but 0.0 on rank 0" in results[1].out, results[1].out + results[1].err


def test_an_optimizer_over_tensors_that_are_not_the_models_is_refused():
    model, _ = userloop.build("mlp")
    stray = torch.nn.Parameter(torch.zeros(3))
    ex = commlab.connect("local://", RankInfo.single())
    with pytest.raises(ConfigError, match=r"param group 0 holds a tensor float32\[3\] that is not a parameter of the "
                                          r"model given to setup\(\)"):
        ex.setup(model, torch.optim.SGD([stray, *model.parameters()], lr=0.1))


def test_waiting_twice_on_a_step_returns_the_same_report_and_steps_once():
    model, opt = userloop.build("mlp")
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(model, opt)
    x, y = userloop.data(0, 1)
    torch.nn.functional.mse_loss(model(x[0, 0]), y[0, 0]).backward()
    handle = ex.step_async()
    with pytest.raises(ConfigError, match="step_async\\(\\) was called again before the last step's handle"):
        ex.step_async()
    first = handle.wait(10)
    assert handle.wait(10) is first and len(steps) == 1
    assert ex.step_async() is not handle  # the next step may start once this one was waited for


def test_gradients_are_final_when_backward_returns():
    """Between backward() and step() the exchange is over: the report of the step is already known and
    a clip in between reads gradients no later exchange will overwrite."""
    model, opt = userloop.build("mlp")
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(model, opt)
    x, y = userloop.data(0, 1)
    torch.nn.functional.mse_loss(model(x[0, 0]), y[0, 0]).backward()
    assert ex.stats.exchanges == 1 and ex.last_report is not None
    grads = [p.grad.clone() for p in model.parameters()]
    report = ex.step()
    assert report is ex.last_report and ex.stats.steps == 1
    assert all(g.abs().sum() > 0 for g in grads)


def test_commlab_connect_reads_the_url_from_the_environment(monkeypatch):
    monkeypatch.setenv("COMMLAB_EXCHANGER", "noop://?bucket_mb=2")
    ex = commlab.connect(rank=RankInfo.single())
    assert ex.scheme == "noop" and ex.options.bucket_mb == 2
    monkeypatch.delenv("COMMLAB_EXCHANGER")
    with pytest.raises(ConfigError, match=r"given no URL and \$COMMLAB_EXCHANGER is not set"):
        commlab.connect(rank=RankInfo.single())
