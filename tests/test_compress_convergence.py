"""Compression keeps the built-in MLP's accuracy, with error feedback; without it, top-k at 1% falls behind.

``commlab train --model mlp --steps 200`` (seed 1, batch 32 a rank, N=2) from the same code the train path
runs (workers/: the model, the data and its sharding, the optimizer, the evaluation), with the exchange
done in this one process: each rank's gradient is computed on its own batch, scaled by 1/N into the
exchanger's buckets (commlab.core.exchanger.make_buckets, the default bucket size) and combined by
:func:`commlab.compress.simulate.exchange`, which tests/test_compress_allreduce.py holds bitwise equal to
the real exchange at N=2. Uncompressed, the average of the ranks' gradients is one process on the combined
batch (workers/data.py shards it so), which is how the reference runs. PowerSGD starts after a warm-up of
``START_ITER`` steps (torch's default of 1000 would never compress in 200). Under ``full``: top-k without
error feedback (what error feedback buys), and all of it through ``commlab train`` itself, two processes
over gloo per compressor.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

from commlab.compress import CompressOptions, build
from commlab.compress.simulate import exchange
from commlab.core.exchanger import make_buckets
from commlab.core.optim import OptimizerSpec
from workers.data import load_digits
from workers.loop import evaluate
from workers.models import build_model

STEPS, WORLD, BATCH, SEED, START_ITER = 200, 2, 32, 1, 5
WITHIN = 0.02  # powersgd:4 and topk:0.01 with error feedback: this close to uncompressed test accuracy
WORSE = 0.03  # topk:0.01 without error feedback: at least this far below both
SPECS = {"powersgd:4": (f"powersgd:4,start_iter={START_ITER}", True), "topk:0.01": ("topk:0.01", True),
         "topk:0.01&ef=0": ("topk:0.01", False)}


@functools.cache  # each run once per session: the tests below share them
def train(spec: str | None, ef: bool = True) -> float:
    """Test accuracy after ``STEPS`` steps of ``commlab train --model mlp`` with ``WORLD`` ranks compressing by
    ``spec`` (None: uncompressed), simulated in this process."""
    torch.set_num_threads(1)
    model, side = build_model("mlp", SEED)
    data = load_digits(side, SEED)
    opt = OptimizerSpec("sgd", lr=0.05).build(model.parameters())
    buckets = make_buckets(list(model.named_parameters()), int(CompressOptions().bucket_mb * 2**20), False)
    comps = [build(spec, ef) for _ in range(WORLD)] if spec else []
    for c in comps:
        c.bind(WORLD)
    for step in range(STEPS):
        if not comps:  # the ranks' average gradient: one process on their combined batch
            x, y = data.batch(step, 0, 1, WORLD * BATCH)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            continue
        flats = []
        for rank in range(WORLD):
            x, y = data.batch(step, rank, WORLD, BATCH)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            flats.append([torch.cat([p.grad.reshape(-1) * (1.0 / WORLD) for p in b.params]) for b in buckets])
        for b in buckets:
            agg = exchange(comps, b.index, [f[b.index] for f in flats], tuple(p.shape for p in b.params))[0]
            for p, offset in zip(b.params, b.offsets):
                p.grad.copy_(agg[offset:offset + p.numel()].view_as(p))
        opt.step()
    return evaluate(model, data.test_x, data.test_y)[1]


@pytest.mark.parametrize("name", ["powersgd:4", "topk:0.01"])
def test_compressed_with_error_feedback_ends_within_two_points_of_uncompressed(name):
    plain, acc = train(None), train(*SPECS[name])
    assert plain > 0.85, plain  # the uncompressed run learned the task
    assert acc >= plain - WITHIN, f"{name}: test accuracy {acc:.4f}, uncompressed {plain:.4f}"


def test_topk_without_error_feedback_ends_measurably_worse():
    plain, with_ef, without = train(None), train(*SPECS["topk:0.01"]), train(*SPECS["topk:0.01&ef=0"])
    assert without < min(plain, with_ef) - WORSE, (without, with_ef, plain)


def run_train(tmp_path, query: str | None) -> float:
    from conftest import commlab_train
    metrics = tmp_path / f"{query or 'none'}.jsonl"
    url = "allreduce://" + (f"?compress={query}" if query else "")
    proc = commlab_train(["--exchanger", url, "--workers", str(WORLD), "--model", "mlp", "--steps", str(STEPS),
                          "--batch-size", str(BATCH), "--seed", str(SEED), "--metrics", str(metrics)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()][-1]["test_acc"]


@pytest.mark.full
@pytest.mark.multiproc
def test_commlab_train_with_each_compressor_ends_where_the_simulation_says(tmp_path):
    """Two real processes per compressor: the same criteria as above, from ``commlab train`` itself."""
    plain = run_train(tmp_path, None)
    got = {name: run_train(tmp_path, spec + ("&ef=0" if not ef else "")) for name, (spec, ef) in SPECS.items()}
    for name in ("powersgd:4", "topk:0.01"):
        assert got[name] >= plain - WITHIN, (name, got, plain)
    assert got["topk:0.01&ef=0"] < min(plain, got["topk:0.01"]) - WORSE, (got, plain)
