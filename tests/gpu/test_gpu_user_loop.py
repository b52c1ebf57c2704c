"""The user's own loop (tests/userloop.py) with the model on CUDA: equal to the CPU reference on the
combined batch, every rank identical; fp16 autocast + GradScaler skips a step on every rank when one
rank's gradient is inf. Skipped without CUDA; ``COMMLAB_TEST_DEVICE=cpu`` dry-runs it on CPU tensors.

With one GPU the ranks share it (gloo and the zmq ring may; NCCL needs a GPU per rank, so its case
runs only where there are at least two).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import userloop  # noqa: E402
from conftest import collect, start_ranks  # noqa: E402
from faultkit import Procs  # noqa: E402
from test_user_loop import assert_close, assert_ranks_identical  # noqa: E402

DEVICE = os.environ.get("COMMLAB_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                 reason="needs CUDA (COMMLAB_TEST_DEVICE=cpu dry-runs these tests on CPU)")]
RTOL = 1e-4  # GPU float32 kernels against the CPU's: rounding only

CASES = [
    ("allreduce-gloo", "allreduce://?backend=gloo&timeout=120", 1),
    ("ring", "ring://?timeout=120", 1),
    ("ring-tcp", "ring://?transport=tcp&timeout=120", 1),
    ("ps-worker", "ps://?shards=2&update=worker&timeout=120", 1),
    ("allreduce-nccl", "allreduce://?backend=nccl&timeout=120", 2),
    ("ring-torch-nccl", "ring://?transport=torch&backend=nccl&timeout=120", 2),
]
STAGED = ("ring", "ring-tcp", "ps-worker")  # CUDA buckets through commlab.core.staging's pinned mirrors


def run(tmp_path, n: int, **cfg) -> list[dict]:
    """``n`` ranks of the user's loop; a ``ps://`` URL without servers gets ``shards=K`` of them here
    (killed at the end), in place of the query's ``shards``."""
    url = cfg["url"]
    procs = None
    if url.startswith("ps://?"):
        query = dict(kv.split("=", 1) for kv in url.split("?", 1)[1].split("&"))
        k = int(query.pop("shards", "1"))
        procs = Procs(tmp_path)
        shards = [procs.server("--mode", "sync", "--shard", f"{i}/{k}") for i in range(k)]
        cfg = dict(cfg, url="ps://" + ",".join(sh.address for sh in shards) + "?" +
                   "&".join(f"{key}={v}" for key, v in query.items()))
    program = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import userloop; userloop.rank_main({cfg!r})"
    try:
        return [r.json() for r in collect(start_ranks(program, n, tmp_path), 300)]
    finally:
        if procs is not None:
            procs.close()


@pytest.mark.parametrize("name,url,gpus_needed", CASES, ids=[c[0] for c in CASES])
def test_users_loop_on_device_equals_cpu_reference(tmp_path, name, url, gpus_needed):
    if ON_CUDA and torch.cuda.device_count() < gpus_needed:
        pytest.skip(f"{name} needs {gpus_needed} GPUs (one per rank)")
    if not ON_CUDA and "nccl" in url:
        pytest.skip("NCCL needs CUDA")
    results = run(tmp_path, 2, url=url, variant="mlp", steps=10, device=DEVICE)
    want = userloop.reference("mlp", 2, 10)
    assert_ranks_identical(results)
    for res in results:
        assert_close(res, want, f"{name} on {DEVICE} rank {res['rank']}", tol=RTOL)
        if name in STAGED and ON_CUDA:  # the facts say which path the buckets took
            assert "pinned host memory" in res["staging"]["data_path"], res["staging"]
            assert res["staging"]["staged_buckets"] >= 1


AMP_CASES = [c for c in CASES if c[0] in ("allreduce-gloo", "ring", "ps-worker")]


@pytest.mark.parametrize("name,url,gpus_needed", AMP_CASES, ids=[c[0] for c in AMP_CASES])
def test_fp16_inf_on_one_rank_skips_the_step_everywhere(tmp_path, name, url, gpus_needed):
    results = run(tmp_path, 2, url=url, variant="amp", steps=6, device=DEVICE)
    assert_ranks_identical(results)
    for res in results:
        scales = res["seen"]["scales"]
        assert scales[userloop.INF_STEP] == scales[userloop.INF_STEP - 1] * 0.5
        assert res["steps"] == 5
