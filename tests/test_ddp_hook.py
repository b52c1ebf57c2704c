"""``ddp.register_comm_hook(*commlab.ddp_hook(url))``: DDP's buckets through commlab's regimes.

Plain DDP and DDP with the hook train the same model on the same data side by side in every rank
(tests/userloop.py ``ddp_hook_main``), with small buckets so that DDP rebuilds them after the first
iteration. Uncompressed, the hooked model equals plain DDP's; compressed, every rank holds the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import commlab
from commlab.errors import ConfigError
from conftest import collect, start_ranks
from faultkit import Procs
from test_user_loop import rel_diff

HERE = Path(__file__).resolve().parent
STEPS = 6


def run_hooked(tmp_path: Path, urls: list[str], n: int = 2, timeout: float = 120) -> list[dict]:
    cfg = {"urls": urls, "steps": STEPS}
    program = f"import sys; sys.path.insert(0, {str(HERE)!r}); import userloop; userloop.ddp_hook_main({cfg!r})"
    return [res.json() for res in collect(start_ranks(program, n, tmp_path), timeout)]


@pytest.mark.multiproc
def test_uncompressed_hook_over_ring_sync_ps_and_allreduce_equals_plain_ddp(tmp_path):
    procs = Procs(tmp_path)
    try:
        ps = "ps://" + procs.server("--mode", "sync", "--shard", "0/1").address
        urls = ["ring://?timeout=60", f"{ps}?update=worker&timeout=60", "allreduce://?timeout=60"]
        results = run_hooked(tmp_path, urls)
    finally:
        procs.close()
    for res in results:
        for url in urls:
            got, want = res[url]["hooked"], res[url]["plain"]
            for name in want:
                d = rel_diff(got[name], want[name])
                assert d <= 1e-5, f"rank {res['rank']}, {url}: {name} differs from plain DDP's by {d:.2e}"


@pytest.mark.multiproc
def test_compressed_hook_leaves_every_rank_the_same_parameters(tmp_path):
    urls = ["allreduce://?compress=powersgd:1,start_iter=2&timeout=60", "allreduce://?compress=topk:0.3&timeout=60"]
    results = run_hooked(tmp_path, urls)
    for url in urls:
        for res in results[1:]:
            assert res[url]["hooked"] == results[0][url]["hooked"], f"{url}: rank {res['rank']} differs from rank 0"
        moved = max(rel_diff(results[0][url]["hooked"][k], v) for k, v in results[0][url]["plain"].items())
        assert moved > 1e-4, f"{url}: the hooked model equals plain DDP's: was anything compressed?"


@pytest.mark.parametrize("url, option", [
    ("allreduce://?compress=topk:2", "compress"),
    ("allreduce://?compress=nope", "compress"),
    ("ring://?compress=fp16", "compress"),
    ("ps://127.0.0.1:1?update=server", "update"),
    ("ps://127.0.0.1:1?mode=async", "mode"),
    ("allreduce://?bucket_mb=-1", "bucket_mb"),
])
def test_a_bad_url_fails_in_one_line_naming_the_option(url, option):
    with pytest.raises(ConfigError) as info:
        commlab.ddp_hook(url)
    text = str(info.value)
    assert "\n" not in text and option in text, text


def test_a_regime_that_does_not_sum_is_refused():
    with pytest.raises(ConfigError, match="does not sum"):
        commlab.ddp_hook("local://")
