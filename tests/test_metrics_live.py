"""Live metrics (``--metrics-port``, commlab.launch.exporter and servers/metrics.py): the launcher's one
endpoint answers while a job runs, and what it shows of the servers is exactly what their ``stats`` say,
what it shows of the ranks exactly what their metrics lines say."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict

import pytest

import zygote
from commlab.launch import launcher
from commlab.tools import cli

from conftest import child_env

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="live metrics need the prometheus-client package: pip install 'commlab[metrics]' "
                                "(the test extra has it)")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

STEPS = 6
SCRIPT = """
import os, pathlib, sys, time
import torch
import commlab
from commlab.launch.exiting import exit_now

rank, folder = int(os.environ["RANK"]), pathlib.Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ex = commlab.connect()
ex.setup(model, opt)
for step in range(%(steps)d):
    t0 = time.perf_counter()
    ex.zero_grad()
    loss = model(torch.full((4, 64), rank + 1.0)).square().mean()
    loss.backward()
    report = ex.step()
    commlab.report(step, loss=loss.item(), step_s=time.perf_counter() - t0, exchange=report)
ex.close()  # the key space is freed on the servers: nothing moves from here on
(folder / f"closed{rank}").touch()
deadline = time.monotonic() + 120  # the job runs on (its servers too) until the test has looked
while not (folder / "release").exists():
    assert time.monotonic() < deadline, "the test never released the job"
    time.sleep(0.05)
exit_now(0)
""" % {"steps": STEPS}


def scrape(url: str) -> dict[str, list]:
    """name -> samples (every family's, ``_total``/``_bucket``/... names as exposed)."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append(s)
    return out


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.multiproc
def test_the_job_endpoint_answers_while_it_runs_and_equals_the_servers_stats_and_the_ranks_reports(tmp_path):
    from commlab.regimes.ps import server_stats

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    lines: list[str] = []
    argv = [sys.executable, "-m", "commlab.tools.cli", "run", "--workers", "2", "--exchanger",
            "ps://?shards=2&mode=async&piece_mb=0.004&timeout=60", "--metrics-port", "0", "--metrics",
            str(tmp_path / "m.jsonl"), str(script), str(tmp_path)]
    proc = launcher.start_group(argv, child_env(), starter=zygote.start, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    pump = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    pump.start()
    try:
        def wait_for(what, found, timeout=120):
            deadline = time.monotonic() + timeout
            while not (got := found()):
                assert proc.poll() is None, f"the job ended before {what}: {''.join(lines)[-3000:]}"
                assert time.monotonic() < deadline, f"no {what} within {timeout}s: {''.join(lines)[-3000:]}"
                time.sleep(0.05)
            return got

        said = lambda pattern: [m for line in list(lines) if (m := re.search(pattern, line))]
        url = wait_for("metrics URL", lambda: said(r"commlab run: metrics on (http://\S+)"))[0].group(1)
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        servers = wait_for("servers", lambda: len(found := said(r"shard (\d)/2 mode=async listening on (\S+)")) == 2
                           and found)
        endpoints = {int(m.group(1)): m.group(2) for m in servers}
        first = scrape(url)  # while the ranks train (or start): it answers, the job's own families are there
        assert total(first, "commlab_job_workers") == 2 and total(first, "commlab_job_restarts_total") == 0
        wait_for("both ranks closing", lambda: all((tmp_path / f"closed{r}").exists() for r in range(2)))

        got = scrape(url)
        for i, endpoint in endpoints.items():
            stats = server_stats(endpoint)
            shard = str(i)
            assert total(got, "commlab_job_server_up", server=shard) == 1
            for key in ("updates", "pushes", "pulls", "duplicates", "refused", "dropped", "nonfinite", "skipped",
                        "replaced", "resized", "bytes_in", "bytes_out", "copies_on_write"):
                assert total(got, f"commlab_server_{key}_total", shard=shard) == stats[key], (i, key, stats)
            assert stats["updates"] == 2 * STEPS and stats["bytes_in"] > 0  # async: each push is an update
            # the staleness histogram (the job's first key space, freed by now): the server's counts exactly
            hist = {int(k): v for k, v in stats["staleness"].items()}
            labels = {"shard": shard, "space": "(first)"}
            assert total(got, "commlab_server_staleness_count", **labels) == sum(hist.values()) == 2 * STEPS
            assert total(got, "commlab_server_staleness_sum", **labels) == sum(k * v for k, v in hist.items())
            for le in ("0", "1", "2", "4"):
                assert total(got, "commlab_server_staleness_bucket", le=le, **labels) == sum(
                    v for k, v in hist.items() if k <= int(le)), le
            assert total(got, "commlab_server_live", **labels) == 0  # every rank closed it
            assert total(got, "commlab_server_world", **labels) == 2
        for r in range(2):  # the ranks: their metrics lines, summed
            records = [json.loads(line) for line in
                       (tmp_path / ("m.jsonl" if r == 0 else f"m.jsonl.rank{r}")).read_text().splitlines()]
            rank = str(r)
            assert len(records) == STEPS
            assert total(got, "commlab_rank_step", rank=rank) == STEPS - 1
            assert total(got, "commlab_rank_up", rank=rank) == 1
            assert total(got, "commlab_rank_sent_bytes_total", rank=rank) == sum(x["bytes_sent"] for x in records)
            assert total(got, "commlab_rank_received_bytes_total", rank=rank) == sum(
                x["bytes_received"] for x in records)
            assert total(got, "commlab_rank_step_seconds_count", rank=rank) == STEPS
            assert total(got, "commlab_rank_step_seconds_sum", rank=rank) == pytest.approx(
                sum(x["step_s"] for x in records), rel=1e-12)
        (tmp_path / "release").touch()
        assert proc.wait(timeout=60) == 0, "".join(lines)[-3000:]
    finally:
        launcher.kill_groups([proc], grace=0)


def test_an_off_loopback_metrics_address_needs_the_explicit_choice(tmp_path, capsys):
    """Refused in one line naming the option, before anything starts (in process: nothing is started)."""
    code = cli.main(["run", "--exchanger", "local://", "--metrics-port", "0", "--metrics-addr", "0.0.0.0",
                     str(tmp_path / "never_run.py")])
    err = capsys.readouterr().err
    assert code == 2 and "--metrics-addr 0.0.0.0" in err and "--metrics-insecure" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_job_collector_reads_each_ranks_new_lines_once_and_a_cut_line_when_it_is_whole(tmp_path):
    """In process: the rank families from metrics files written piecemeal (a line cut short, then finished;
    a file that appears later), the restarts and the ranks' liveness as the launcher sets them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from commlab.launch.exporter import JobCollector

    base = tmp_path / "m.jsonl"
    up = {0: True, 1: False}
    collector = JobCollector(str(base), 2, up=lambda: up)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    read = lambda: {s.name + str(sorted(s.labels.items())): s.value
                    for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}

    lines = [{"step": 0, "step_s": 0.5, "bytes_sent": 100, "bytes_received": 40, "comm_s": 0.25, "loss": 2.0},
             {"step": 1, "step_s": 0.25, "bytes_sent": 100, "bytes_received": 40, "comm_s": 0.125, "loss": 1.5}]
    whole, cut = json.dumps(lines[0]) + "\n", json.dumps(lines[1]) + "\n"
    base.write_text(whole + cut[:10])  # rank 0: one line and the start of the next; rank 1: no file yet
    got = read()
    r0 = str([("rank", "0")])
    assert got["commlab_rank_reports_total" + r0] == 1 and got["commlab_rank_step" + r0] == 0
    assert got["commlab_rank_sent_bytes_total" + r0] == 100 and got["commlab_rank_loss" + r0] == 2.0
    assert got["commlab_rank_up" + r0] == 1 and got["commlab_rank_up" + str([("rank", "1")])] == 0
    assert got["commlab_job_restarts_total[]"] == 0 and got["commlab_job_workers[]"] == 2
    with base.open("a") as fh:
        fh.write(cut[10:])
    (tmp_path / "m.jsonl.rank1").write_text(whole)
    collector.restarts = 1
    got = read()
    assert got["commlab_rank_reports_total" + r0] == 2 and got["commlab_rank_step" + r0] == 1
    assert got["commlab_rank_sent_bytes_total" + r0] == 200 and got["commlab_rank_received_bytes_total" + r0] == 80
    assert got["commlab_rank_exposed_comm_seconds_total" + r0] == 0.375
    assert got["commlab_rank_step_seconds_count" + r0] == 2 and got["commlab_rank_step_seconds_sum" + r0] == 0.75
    assert got["commlab_rank_step_seconds_bucket" + str([("le", "0.25"), ("rank", "0")])] == 1
    assert got["commlab_rank_step_seconds_bucket" + str([("le", "0.5"), ("rank", "0")])] == 2
    assert got["commlab_rank_last_step_seconds" + r0] == 0.25
    assert got["commlab_rank_reports_total" + str([("rank", "1")])] == 1
    assert got["commlab_job_restarts_total[]"] == 1
