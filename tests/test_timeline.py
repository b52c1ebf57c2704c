"""One step's timeline as a picture (bench.plots.plot_step_timeline): the bars drawn are the merged trace's
spans of that step, clipped to it, on the right rows (docs/trace.md's format; a trace built here)."""

from __future__ import annotations

import pytest

from bench import plots


def span(pid, tid, cat, name, start_ms, end_ms, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "cat": cat, "name": name, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


def trace() -> dict:
    """Two ranks (training threads 10 and 20, rank 0's comm thread 11) and a shard, steps 0 and 1 (ms)."""
    ev = [{"ph": "M", "pid": p, "tid": 0, "name": "process_name", "args": {"name": n}}
          for p, n in ((0, "rank 0"), (1, "rank 1"), (1000, "shard 0"))]
    ev += [span(0, 10, "step", "step", 0, 100, step=0), span(0, 10, "compute", "forward", 0, 20),
           span(0, 10, "compute", "backward", 20, 60), span(0, 10, "blocked", "blocked", 60, 90),
           span(0, 10, "compute", "optimizer", 90, 100), span(0, 10, "step", "step", 100, 200, step=1),
           span(0, 10, "compute", "forward", 100, 130),  # step 1: not drawn
           span(0, 11, "comm", "collective", 30, 95), span(0, 11, "comm", "send", 95, 120),  # the latter cut at 100
           span(0, 10, "bucket", "start bucket", 40, 41),  # not a bar
           span(1, 20, "step", "step", 10, 120, step=0), span(1, 20, "compute", "forward", 10, 30),
           span(1, 20, "compute", "backward", 30, 80), span(1, 20, "blocked", "blocked", 80, 110),
           span(1, 20, "compute", "optimizer", 110, 120), span(1, 20, "bucket", "encode", 40, 45),
           span(1000, 5, "server", "receive", -5, 5), span(1000, 5, "server", "apply", 50, 70),
           span(1000, 5, "request", "push", 50, 75)]  # the request span holds the others: not drawn again
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def test_the_bars_are_the_steps_spans_clipped_to_it_on_their_rows(tmp_path):
    rows, length = plots.step_timeline_bars(trace(), 0)
    approx = lambda bars: [(pytest.approx(s), pytest.approx(d), k) for s, d, k in bars]
    assert length == pytest.approx(120)
    assert [label for label, _ in rows] == ["rank 0", "rank 0 comm", "rank 1", "rank 1 comm", "shard 0"]
    got = dict(rows)
    assert got["rank 0"] == approx([(0, 20, "forward"), (20, 40, "backward"), (60, 30, "blocked"), (90, 10, "optimizer")])
    assert got["rank 0 comm"] == approx([(30, 65, "comm"), (95, 5, "comm")])
    assert got["rank 1"] == approx([(10, 20, "forward"), (30, 50, "backward"), (40, 5, "codec"), (80, 30, "blocked"),
                                    (110, 10, "optimizer")])
    assert got["rank 1 comm"] == []
    assert got["shard 0"] == approx([(0, 5, "server"), (50, 20, "server")])
    png = plots.plot_step_timeline(trace(), 0, tmp_path / "timeline.png", title="synthetic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no step 7"):
        plots.step_timeline_bars(trace(), 7)


@pytest.mark.full
@pytest.mark.multiproc
def test_bench_train_step_with_trace_draws_each_regimes_step(tmp_path):
    """``commlab bench train-step --trace DIR`` ends with DIR/timeline.png: a panel per regime, each rank (and
    ps://'s shard) a row, read from that regime's last traced round."""
    import json
    import sys

    from conftest import child_env, run_group

    out = tmp_path / "traces"
    r = run_group([sys.executable, "-m", "bench", "train-step", "--model", "tiny", "--workers", "2", "--steps", "2",
                   "--warmup", "1", "--rounds", "1", "--peers", "none", "--regimes", "ring://",
                   "ps://?shards=1&mode=sync", "--trace", str(out)], 400, env=child_env(), capture_output=True,
                  text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"wrote {out / 'timeline.png'}" in r.stderr, r.stderr[-3000:]
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    for i, shard_rows in ((0, []), (1, ["shard 0"])):
        (last,) = sorted(out.glob(f"regime{i}-run*/trace.json"))
        rows = dict(plots.step_timeline_bars(json.loads(last.read_text()), 2)[0])
        assert list(rows) == ["rank 0", "rank 0 comm", "rank 1", "rank 1 comm", *shard_rows], list(rows)
        for r_ in (0, 1):  # every rank computed, and communicated, in that step
            assert {k for _, _, k in rows[f"rank {r_}"]} >= {"forward", "backward", "optimizer"}
            assert rows[f"rank {r_} comm"], (i, r_)
