"""The script comparison and the workload driver: real ``commlab run`` jobs on loopback, tiny sizes.

They prove: the comparison of a user's script gives one row per regime, and two synchronous
regimes (the same arithmetic) end at the same loss; the workload driver's check that a
synchronous regime reproduces local:// on the combined batch passes for a short LM run and
fails for a curve that is not the reference's. Counts and values only, never a time.
"""

from __future__ import annotations

import copy
import json
import sys
import textwrap
from pathlib import Path

import pytest

from bench import curves
from bench import script_compare as sc
from bench import workloads as wl
from conftest import child_env, run_group

ROOT = Path(__file__).resolve().parents[1]

# A user's script: least squares on fixed data, each rank its own half of every batch; reports
# the loss the way docs/bench.md says (commlab.report), nothing else.
TINY = """
import torch
import commlab

ex = commlab.connect()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ex.setup(model, opt)
g = torch.Generator().manual_seed(1)
X, w = torch.randn(64, 4, generator=g), torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
Y = X @ w
for step in range(4):
    rows = torch.arange(8 * step, 8 * step + 8).chunk(ex.world_size)[ex.rank]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X[rows]), Y[rows])
    loss.backward()
    opt.step()
    commlab.report(step, loss=loss.item())
ex.close()
"""


def test_regime_lists_keep_a_ps_host_list_in_one_url():
    assert sc.split_regimes("local://, ps://a:1,b:2?mode=sync,ring://") == ["local://", "ps://a:1,b:2?mode=sync",
                                                                             "ring://"]
    assert [sc.kind_of(u) for u in ("local://", "noop://", "ps://?mode=ssp&staleness=2", "ps://?mode=sync",
                                    "ring://")] == ["reference", "floor", "async", "sync", "sync"]


def test_curve_averages_the_ranks_and_adds_up_bytes():
    ranks = [[{"step": 0, "loss": 1.0, "time_s": 1.0, "bytes_sent": 10}, {"step": 1, "loss": 3.0, "time_s": 3.0,
                                                                          "bytes_sent": 10},
              {"step": 1, "loss": 3.0, "test_loss": 2.5}],
             [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 5.0}]]
    pts = curves.curve(ranks)
    assert [(p["step"], p["loss"], p["bytes"]) for p in pts] == [(0, 1.5, 10), (1, 4.0, 20)]
    assert curves.step_times(pts) == [2.0]
    row = sc.summarize(sc.Outcome(sc.Regime("x", "ring://", 2, ()), "ok", ranks=ranks), target=2.0)
    assert row["test_loss"] == 2.5 and row["steps_to_target"] == 1 and row["bytes_per_step"] == 10


def test_coincidence_check_fails_for_a_curve_that_is_not_the_reference():
    ref = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(10)]
    same = [dict(p, loss=p["loss"] + 1e-4) for p in ref]
    assert curves.coincidence(ref, same, wl.COINCIDE_TOL)["coincides"] is True
    off = copy.deepcopy(same)
    off[7]["loss"] += 2 * wl.COINCIDE_TOL
    v = curves.coincidence(ref, off, wl.COINCIDE_TOL)
    assert v["coincides"] is False and v["at_step"] == 7
    # stopped early: not the reference's curve
    assert curves.coincidence(ref, same[:5], wl.COINCIDE_TOL)["coincides"] is False
    assert curves.coincidence(ref, [{"step": 99, "loss": 1.0}], wl.COINCIDE_TOL)["coincides"] is None


def test_the_training_comparison_judges_its_test_loss_curves_with_the_same_check():
    """convergence's evaluations (step = steps done) go through bench.curves like a workload's curve:
    a sync regime 2e-3 off local's test loss at its second evaluation does not coincide (tolerance 1e-3),
    one 1e-4 off does, and the step named is the evaluation's."""
    from bench import convergence, report
    evals = lambda losses: [{"step": 10 * (i + 1), "time_s": float(i), "test_loss": l, "test_acc": 0.5 + 0.1 * i}
                            for i, l in enumerate(losses)]
    ref = [2.0, 1.5, 1.0]
    summaries = [{"regime": "local", "kind": "reference", "evals": evals(ref)},
                 {"regime": "near", "kind": "sync", "evals": evals([x + 1e-4 for x in ref])},
                 {"regime": "off", "kind": "sync", "evals": evals([2.0, 1.502, 1.0])}]
    convergence.compare_with_reference(summaries)
    assert [s["coincides_with_local"] for s in summaries] == [None, True, False]
    assert summaries[2]["vs_local"]["at_step"] + 1 == 20 and summaries[2]["vs_local"]["steps_compared"] == 3
    lines = report.sync_check(summaries)
    assert lines[0].startswith("- near: **coincides** with local:// (max |test-loss difference| 0.0001 at step")
    assert lines[1].startswith("- off: **does NOT coincide** with local:// (max |test-loss difference| 0.002 at step 20")
    hit = curves.reach(convergence.test_loss_curve(summaries[0]), [e["test_acc"] for e in summaries[0]["evals"]],
                       lambda a: a >= 0.6)
    assert hit == {"steps_to_target": 20, "time_to_target_s": 1.0}


@pytest.mark.multiproc
def test_script_comparison_gives_a_row_per_regime_and_equal_sync_losses(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent(TINY))
    out = tmp_path / "cmp"
    argv = [sys.executable, "-m", "commlab.tools.cli", "bench", "script", "--regimes",
            "allreduce://?backend=gloo,ring://,gone://", "--workers", "2", "--timeout", "120", "--out", str(out),
            "--", str(script)]
    done = run_group(argv, 300, "commlab bench script", env=child_env(), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "script.json").read_text())["regimes"]
    assert [(r["regime"], r["status"], r["workers"], r.get("steps")) for r in rows] == [
        ("allreduce://?backend=gloo", "ok", 2, 4), ("ring://", "ok", 2, 4), ("gone://", "unavailable", 2, None)]
    gloo, ring, gone = rows
    assert "unknown exchanger scheme" in gone["error"]
    assert gloo["final_loss"] == pytest.approx(ring["final_loss"], abs=1e-6)
    assert [p["loss"] for p in gloo["curve"]] == pytest.approx([p["loss"] for p in ring["curve"]], abs=1e-6)
    md = (out / "script.md").read_text()
    assert md.count("| `allreduce://?backend=gloo` |") == 1 and md.count("| `ring://` |") == 1
    assert md.count("| `gone://` |") == 1 and "unavailable: " in md
    assert (out / "script.png").stat().st_size > 10_000


@pytest.mark.multiproc
def test_lm_sync_regime_coincides_with_local_on_the_combined_batch(tmp_path):
    cfg = wl.WorkloadsConfig(["charlm"], [("gloo", "allreduce://?backend=gloo"), ("local", "local://")],
                             workers=2, steps={"charlm": 6}, job_timeout=150)
    results = wl.run(cfg, tmp_path, budget_s=300)
    rows = {r["regime"]: r for r in results["charlm"]["rows"]}
    assert [rows[n]["status"] for n in ("local", "gloo")] == ["ok", "ok"], {n: r["error"] for n, r in rows.items()}
    assert rows["local"]["workers"] == 1 and rows["gloo"]["workers"] == 2
    check = rows["gloo"]["vs_local"]
    assert check["coincides"] is True and check["steps_compared"] == 6, check
    assert any("**coincides**" in line for line in wl.sync_verdict(results["charlm"]))
    # the same check, handed a curve that drifts off local's at one step, says so
    drifted = copy.deepcopy(rows["gloo"]["curve"])
    drifted[3]["loss"] += 3 * wl.COINCIDE_TOL
    assert curves.coincidence(rows["local"]["curve"], drifted, wl.COINCIDE_TOL)["coincides"] is False
    rows["gloo"]["vs_local"] = curves.coincidence(rows["local"]["curve"], drifted, wl.COINCIDE_TOL)
    assert any("**does NOT coincide**" in line for line in wl.sync_verdict(results["charlm"]))


def test_pipeline_figures_take_each_ranks_median_bubble_past_the_first_step():
    rank0 = [{"step": 0, "pipeline_s": 1.0, "bubble_s": 0.9, "activation_bytes": 4096},  # warm-up: left out
             *({"step": s, "pipeline_s": 1.0, "bubble_s": b} for s, b in ((1, 0.1), (2, 0.3), (3, 0.2)))]
    rank1 = [{"step": s, "pipeline_s": 2.0, "bubble_s": b} for s, b in ((0, 0.0), (1, 1.0), (2, 0.0), (3, 0.2))]
    got = wl.pipeline_figures([rank0, rank1, [{"step": 0, "loss": 1.0}]])  # a rank without the fields: skipped
    assert got == {"bubble_per_rank": [0.2, 0.1], "bubble": pytest.approx(0.15), "activation_bytes_per_step": 4096}
    assert wl.pipeline_figures([[{"step": 0, "loss": 1.0}]]) == {}


@pytest.mark.multiproc
@pytest.mark.full
def test_pipeline_workload_coincides_with_local_and_reports_both_dimensions(tmp_path):
    """2 stages on 2 ranks (one replica) against one process with one stage: the same arithmetic; rank 0
    sends 4 micro-batches x 2 sequences x 64 positions x 64 floats of activations per step (stage 0: forward
    only), its replica group moves nothing."""
    cfg = wl.WorkloadsConfig(["pipeline"], [("gloo", "allreduce://?backend=gloo"), ("local", "local://")],
                             workers=2, steps={"pipeline": 6}, job_timeout=150)
    results = wl.run(cfg, tmp_path, budget_s=300)
    rows = {r["regime"]: r for r in results["pipeline"]["rows"]}
    assert [rows[n]["status"] for n in ("local", "gloo")] == ["ok", "ok"], {n: r["error"] for n, r in rows.items()}
    assert rows["gloo"]["vs_local"]["coincides"] is True, rows["gloo"]["vs_local"]
    assert rows["gloo"]["activation_bytes_per_step"] == 4 * 2 * 64 * 64 * 4 and rows["gloo"]["bytes_per_step"] == 0
    assert rows["local"]["activation_bytes_per_step"] == 0
    assert len(rows["gloo"]["bubble_per_rank"]) == 2 and all(0 <= b <= 1 for b in rows["gloo"]["bubble_per_rank"])
    md = "\n".join(wl.section(results))
    assert "(p-1)/(m+p-1) = 1/5 = 20%" in md and "| 128 KiB |" in md


def test_the_workloads_section_goes_before_the_reports_files(tmp_path):
    report = tmp_path / "report.md"
    report.write_text("# r\n\n## Convergence\n\nx\n\n## Files\n\n- `a`\n")
    res = {"workload": "charlm", "script": "examples/charlm.py", "what": "LM", "steps": 2, "workers": 2,
           "batch_per_rank": 8, "args": [], "reference_args": [], "coincide": True, "why_not": "",
           "tolerance": wl.COINCIDE_TOL, "target_loss": None,
           "rows": [{"regime": "gloo", "url": "allreduce://?backend=gloo", "kind": "sync", "workers": 2,
                     "status": "failed", "error": "rank 1 failed first", "curve": [], "vs_local": None}]}
    wl.append_section(report, {"charlm": res}, {})
    text = report.read_text()
    assert text.index("## Convergence") < text.index("## Real workloads") < text.index("## Files")
    assert "| gloo | sync | 2 |" in text and "failed: rank 1 failed first" in text
    assert "local:// did not run" in text
