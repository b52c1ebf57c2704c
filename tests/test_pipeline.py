"""Hybrid parallelism under ``commlab run --workers 4``: the pipeline-parallel LM (examples/pipeline_lm.py,
2 stages x 2 replicas) and the tensor-parallel one (examples/tp_lm.py, a 2 x 2 mesh, dp x tp).

Gradients are exchanged by commlab within each replica group ({0, 2} and {1, 3}); a run must equal one
process running the whole model on the combined batch (examples/plain/pipeline_lm.py with both
replicas' windows), the replicas of each stage or shard must hold the same parameters, and each step
must exchange once per replica group however many micro-batches run. SGD with momentum, float32: two
runs then agree to rounding (see the scripts' ``--optimizer``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import child_env, max_rel_diff, run_group

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240
STEPS = 10
MODEL = ["--d-model", "32", "--layers", "2", "--heads", "2", "--context", "32", "--threads", "1",
         "--optimizer", "sgd", "--lr", "0.1", "--warmup", "3", "--steps", str(STEPS), "--log-every", "1"]
BATCH = 8  # per replica


@pytest.fixture(scope="module")
def whole_model(tmp_path_factory):
    """``whole_model(clip)``: the plain script's parameters after STEPS steps on both replicas' windows
    (2 x BATCH), run once per clip value."""
    runs: dict[str, dict] = {}

    def run(clip: str) -> dict:
        if clip not in runs:
            path = tmp_path_factory.mktemp("plain") / "plain.pt"
            r = run_group([sys.executable, "examples/plain/pipeline_lm.py", *MODEL, "--batch-size", str(2 * BATCH),
                           "--data-shards", "2", "--clip", clip, "--save", str(path)], TIMEOUT, cwd=ROOT,
                          env=child_env(), capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-4000:]
            runs[clip] = torch.load(path)
        return runs[clip]

    return run


# (URL, schedule, micro-batches, clip): update=server steps on the servers with the gradients pushed at the
# flush, before the loop could clip them (ps:// says so once), so it runs unclipped, as its reference does
CASES = [("allreduce://?backend=gloo", "1f1b", 4, "1.0"),
         pytest.param("ring://?transport=shm", "gpipe", 2, "1.0", marks=pytest.mark.full),
         pytest.param("ring://?transport=tcp", "1f1b", 2, "1.0", marks=pytest.mark.full),
         pytest.param("ps://?shards=1&mode=sync&update=worker", "1f1b", 4, "1.0", marks=pytest.mark.full),
         pytest.param("ps://?shards=2&mode=sync&update=server", "gpipe", 2, "0", marks=pytest.mark.full)]


@pytest.mark.multiproc
@pytest.mark.parametrize("url, schedule, microbatches, clip", CASES)
def test_pipeline_lm_equals_one_process_on_the_combined_batch(whole_model, tmp_path, url, schedule, microbatches,
                                                              clip):
    save, metrics = tmp_path / "pp", tmp_path / "m.jsonl"
    r = commlab_run(url, metrics, "examples/pipeline_lm.py", "--schedule", schedule, "--microbatches",
                    str(microbatches), "--clip", clip, "--save", str(save))
    assert r.returncode == 0, r.stderr[-4000:]
    whole = whole_model(clip)
    stages = {(s, rep): torch.load(f"{save}.stage{s}.replica{rep}") for s in (0, 1) for rep in (0, 1)}
    assert sorted(stages[0, 0].keys() | stages[1, 0].keys()) == sorted(whole)  # the stages cover the model
    for s in (0, 1):
        mine = stages[s, 0]
        assert all(torch.equal(mine[k], stages[s, 1][k]) for k in mine), f"stage {s}'s replicas differ"
        assert max_rel_diff(mine, {k: whole[k] for k in mine}) < 1e-5, f"stage {s}"
    assert_one_exchange_per_step(metrics)


@pytest.mark.multiproc
@pytest.mark.parametrize("url", ["allreduce://?backend=gloo", pytest.param("ring://", marks=pytest.mark.full)])
def test_tensor_parallel_lm_equals_one_process_on_the_combined_batch(whole_model, tmp_path, url):
    """The MLPs split over tp (column- then row-wise), commlab over mesh["dp"]: the exchange moves the DTensors'
    local shards, and the whole model (gathered) is the plain script's."""
    save, metrics = tmp_path / "tp.pt", tmp_path / "m.jsonl"
    r = commlab_run(url, metrics, "examples/tp_lm.py", "--microbatches", "4", "--save", str(save))
    assert r.returncode == 0, r.stderr[-4000:]
    whole, gathered = whole_model("1.0"), torch.load(save)
    assert sorted(gathered) == sorted(whole)
    assert max_rel_diff(gathered, whole) < 1e-5
    shards = [torch.load(f"{save}.rank{rank}") for rank in range(4)]
    assert shards[0]["blocks.0.mlp.0.weight"].shape == (64, 32)  # half of the 4 x 32 hidden units
    for a, b in ((0, 2), (1, 3)):  # replicas of the same shards
        assert all(torch.equal(shards[a][k], shards[b][k]) for k in shards[a]), (a, b)
    assert_one_exchange_per_step(metrics)


@pytest.mark.multiproc
@pytest.mark.full
def test_tensor_parallel_parameters_under_ps_are_refused_in_one_line(tmp_path):
    r = commlab_run("ps://?shards=1&mode=sync", tmp_path / "m.jsonl", "examples/tp_lm.py")
    assert r.returncode != 0
    assert "ps:// serves whole tensors, and blocks.0.mlp.0.weight is a DTensor (tensor parallel)" in r.stdout + r.stderr


def commlab_run(url: str, metrics: Path, script: str, *extra: str):
    """``commlab run --workers 4 --exchanger URL SCRIPT`` with the small model, BATCH per replica."""
    args = ["--workers", "4", "--exchanger", url, "--metrics", str(metrics), script, *MODEL,
            "--batch-size", str(BATCH), *extra]
    return run_group([sys.executable, "-m", "commlab.tools.cli", "run", *args], TIMEOUT, cwd=ROOT, env=child_env(),
                     capture_output=True, text=True)


def assert_one_exchange_per_step(metrics: Path) -> None:
    for rank in range(4):
        path = Path(f"{metrics}.rank{rank}") if rank else metrics
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(STEPS))
        assert {row["exchanges"] for row in rows} == {1}, rows  # one per step, whatever the micro-batches
