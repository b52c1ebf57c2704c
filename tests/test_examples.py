"""The examples run as users run them: ``commlab run`` under each regime, and plain ``torchrun``.

Every run goes through a pipe (no terminal), so each also checks the launcher's summary line.
Sizes are tiny and steps few: these prove the scripts and the launcher work together, and that
the language model learns (its loss falls, read from the metrics the script reports).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, run_group

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180

SMALL_LM = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32", "--batch-size", "8",
            "--eval-batches", "2", "--log-every", "1", "--threads", "1"]
EXAMPLES = {"charlm": ["--steps", "3", *SMALL_LM],
            "resnet_digits": ["--steps", "3", "--batch-size", "16", "--width", "8", "--log-every", "1"]}
REGIMES = ["allreduce://?backend=gloo", "ring://", "ps://?shards=1&mode=sync"]
# The examples under every regime, and the LM (AdamW in two groups, a LambdaLR schedule) with its optimizer
# on the servers too: the class, groups and scheduled lr travel to the shard.
CASES = [(example, url) for example in sorted(EXAMPLES) for url in REGIMES] + [
    ("charlm", "ps://?shards=2&mode=sync&update=server")]


def commlab_run(args: list[str], timeout: float = TIMEOUT, **env) -> subprocess.CompletedProcess:
    return run_group([sys.executable, "-m", "commlab.tools.cli", "run", *args], timeout, "commlab run " + " ".join(args),
                     cwd=ROOT, env=child_env(**env), capture_output=True, text=True)


def summary(out: str, name: str = "commlab run") -> str:
    lines = [line for line in out.splitlines() if line.startswith(f"{name}: ")]
    assert lines, f"no summary line in:\n{out}"
    return lines[-1]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.parametrize("example, url", CASES)
def test_example_runs_on_two_ranks_under_each_regime(example, url, tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = commlab_run(["--workers", "2", "--exchanger", url, "--metrics", str(metrics),
                     f"examples/{example}.py", *EXAMPLES[example]])
    assert r.returncode == 0, r.stderr[-4000:]
    line = summary(r.stdout)
    assert line.startswith(f"commlab run: 2 ranks of examples/{example}.py, {url}: 3 steps in "), line
    assert "final loss" in line and "test accuracy" in line, line
    # every rank reported every step to its own file: rank 0 to PATH, rank 1 to PATH.rank1
    for rank, path in ((0, metrics), (1, Path(f"{metrics}.rank1"))):
        steps = [row["step"] for row in rows(path) if "test_acc" not in row]
        assert steps == [0, 1, 2] and {row["rank"] for row in rows(path)} == {rank}, rows(path)


@pytest.mark.multiproc
def test_example_under_torchrun_with_commlab_exchanger(tmp_path):
    metrics = tmp_path / "m.jsonl"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "examples/resnet_digits.py", *EXAMPLES["resnet_digits"]]
    r = run_group(argv, TIMEOUT, "torchrun examples/resnet_digits.py", cwd=ROOT, capture_output=True, text=True,
                  env=child_env(COMMLAB_EXCHANGER="allreduce://?backend=gloo", COMMLAB_METRICS=metrics,
                                OMP_NUM_THREADS=1))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "test accuracy" in r.stdout, r.stdout
    assert [row["step"] for row in rows(Path(f"{metrics}.rank1"))] == [0, 1, 2]


LM_URL = "allreduce://?backend=gloo"
LM_RUN = ["examples/charlm.py", "--steps", "12", "--lr", "1e-2", "--warmup", "3", *SMALL_LM]


def lm_losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in rows(path) if "test_acc" not in row}


@pytest.fixture(scope="module")
def lm_whole(tmp_path_factory) -> Path:
    """The metrics of one uninterrupted 12-step run of the language model on 2 ranks."""
    metrics = tmp_path_factory.mktemp("lm") / "whole.jsonl"
    r = commlab_run(["--workers", "2", "--exchanger", LM_URL, "--metrics", str(metrics), *LM_RUN])
    assert r.returncode == 0, r.stderr[-4000:]
    return metrics


@pytest.mark.multiproc
def test_language_model_loss_falls(lm_whole):
    from pydoc_data.topics import topics

    losses = list(lm_losses(lm_whole).values())
    assert len(losses) == 12
    # guessing uniformly costs ln(vocabulary); 12 steps of two ranks learn letter frequencies at least
    vocab_guess = math.log(len(set("".join(topics.values()))))
    assert losses[0] > vocab_guess - 0.3, losses
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8, losses
    final = rows(lm_whole)[-1]
    assert final["test_loss"] < vocab_guess - 0.8, final


@pytest.mark.multiproc
def test_language_model_resumes_from_its_checkpoint_exactly(lm_whole, tmp_path):
    """Stopped after 6 of 12 steps and resumed from the checkpoint (model, AdamW, LambdaLR, scaler,
    exchanger), the run reports the very losses of the run that never stopped."""
    ckpt, first, second = tmp_path / "lm.pt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    for metrics, extra in ((first, ["--checkpoint", str(ckpt), "--stop-after", "6"]),
                           (second, ["--checkpoint", str(ckpt), "--resume"])):
        r = commlab_run(["--workers", "2", "--exchanger", LM_URL, "--metrics", str(metrics), *LM_RUN, *extra])
        assert r.returncode == 0, r.stderr[-4000:]
    losses = {path: lm_losses(path) for path in (first, second)}
    assert sorted(losses[first]) == list(range(6)) and sorted(losses[second]) == list(range(6, 12)), losses
    assert {**losses[first], **losses[second]} == lm_losses(lm_whole)


@pytest.mark.multiproc
def test_compressed_language_model_resumes_with_every_rank_s_own_residuals(tmp_path):
    """Under compress=topk with error feedback each rank's residual is its own: the checkpoint keeps every
    rank's exchanger state (rank r > 0 beside rank 0's file), so the resumed run reports the losses of the run
    that never stopped (with rank 0's residual on rank 1, its payloads and so everyone's steps would differ)."""
    url = "ring://?compress=topk:0.05"
    whole, first, second, ckpt = (tmp_path / "whole.jsonl", tmp_path / "first.jsonl", tmp_path / "second.jsonl",
                                  tmp_path / "lm.pt")
    for metrics, extra in ((whole, []), (first, ["--checkpoint", str(ckpt), "--stop-after", "6"]),
                           (second, ["--checkpoint", str(ckpt), "--resume"])):
        r = commlab_run(["--workers", "2", "--exchanger", url, "--metrics", str(metrics), *LM_RUN, *extra])
        assert r.returncode == 0, r.stderr[-4000:]
    assert Path(f"{ckpt}.rank1").exists()
    assert {**lm_losses(first), **lm_losses(second)} == lm_losses(whole)
