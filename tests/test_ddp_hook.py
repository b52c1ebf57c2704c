"""``ddp.register_comm_hook(*commlab.ddp_hook(url))``: DDP's buckets through commlab's regimes.

Plain DDP and DDP with the hook train the same model on the same data side by side in every rank
(tests/userloop.py ``ddp_hook_main``), with small buckets so that DDP rebuilds them after the first
iteration. Uncompressed, the hooked model equals plain DDP's; compressed, every rank holds the same bits.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

import commlab
from commlab.base.errors import ConfigError
from conftest import collect, start_ranks
from faultkit import Procs
from test_user_loop import rel_diff

HERE = Path(__file__).resolve().parent
STEPS = 6


UNCOMPRESSED = ["ring://?timeout=60", "{ps}?update=worker&timeout=60", "allreduce://?timeout=60"]
COMPRESSED = ["allreduce://?compress=powersgd:1,start_iter=2&timeout=60", "allreduce://?compress=topk:0.3&timeout=60",
              "ring://?compress=powersgd:1,start_iter=2&timeout=60"]


def launch(tmp: Path, n: int, bucket_view: bool = False) -> tuple[list[str], list[dict]]:
    """(URLs, each rank's result): one launch of N ranks runs every URL in turn, a sync PS server beside."""
    procs = Procs(tmp)
    try:
        ps = "ps://" + procs.server("--mode", "sync", "--shard", "0/1").address
        urls = [u.format(ps=ps) for u in UNCOMPRESSED] + COMPRESSED
        cfg = {"urls": urls, "steps": STEPS, "bucket_view": bucket_view}
        program = f"import sys; sys.path.insert(0, {str(HERE)!r}); import userloop; userloop.ddp_hook_main({cfg!r})"
        return urls, [res.json() for res in collect(start_ranks(program, n, tmp), 120)]
    finally:
        procs.close()


def assert_equals_plain_ddp(urls: list[str], results: list[dict]) -> None:
    for res in results:
        for url in urls[:len(UNCOMPRESSED)]:
            got, want = res[url]["hooked"], res[url]["plain"]
            for name in want:
                d = rel_diff(got[name], want[name])
                assert d <= 1e-5, f"rank {res['rank']}, {url}: {name} differs from plain DDP's by {d:.2e}"


def assert_compressed_ranks_identical(results: list[dict]) -> None:
    for url in COMPRESSED:
        for res in results[1:]:
            assert res[url]["hooked"] == results[0][url]["hooked"], f"{url}: rank {res['rank']} differs from rank 0"
        moved = max(rel_diff(results[0][url]["hooked"][k], v) for k, v in results[0][url]["plain"].items())
        assert moved > 1e-4, f"{url}: the hooked model equals plain DDP's: was anything compressed?"


@pytest.fixture(scope="module")
def hooked(tmp_path_factory) -> tuple[list[str], list[dict]]:
    return launch(tmp_path_factory.mktemp("ddp_hook"), 2)


@pytest.mark.multiproc
def test_uncompressed_hook_over_ring_sync_ps_and_allreduce_equals_plain_ddp(hooked):
    assert_equals_plain_ddp(*hooked)


@pytest.mark.multiproc
def test_compressed_hook_leaves_every_rank_the_same_parameters(hooked):
    assert_compressed_ranks_identical(hooked[1])


@pytest.mark.full
@pytest.mark.multiproc
def test_three_ranks_with_gradients_as_bucket_views_equal_plain_ddp_and_agree_compressed(tmp_path):
    urls, results = launch(tmp_path, 3, bucket_view=True)  # and gradients that are views of DDP's buckets
    assert_equals_plain_ddp(urls, results)
    assert_compressed_ranks_identical(results)


STALL = """
import sys, time
sys.path.insert(0, {here!r})
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import commlab, userloop
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, opt = userloop.build("mlp")
ddp = DDP(model)
state, hook = commlab.ddp_hook("ring://?timeout=2")
ddp.register_comm_hook(state, hook)
for step in range(3):
    x, y = userloop.data(step, world)
    if rank == 1 and step == 2:
        time.sleep(5)  # stalls (past the buckets' rebuild, a collective of DDP's own)
        sys.exit(0)
    started = time.monotonic()
    try:
        F.mse_loss(ddp(x[rank, 0]), y[rank, 0]).backward()
    except RuntimeError as exc:
        print(f"{{time.monotonic() - started:.1f}} {{exc}}".splitlines()[0], flush=True)
        break
    opt.step()
state.close()
"""


@pytest.mark.multiproc
def test_a_stalled_rank_makes_backward_raise_within_the_timeout_naming_it(tmp_path):
    results = collect(start_ranks(STALL.format(here=str(HERE)), 2, tmp_path), 60)
    line = results[0].out.strip().splitlines()[-1]
    waited, text = float(line.split()[0]), line.split(" ", 1)[1]
    assert waited < 4, line
    assert "did not complete within 2s" in text and "waiting for rank 1" in text, line


@pytest.mark.parametrize("url, option", [
    ("allreduce://?compress=topk:2", "compress"),
    ("allreduce://?compress=nope", "compress"),
    ("ring://?compress=powersgd:0", "compress"),
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


def test_ring_meets_in_the_store_of_a_default_group_made_before_it():
    """Under DDP without torchrun's agent (Slurm, mpirun), rank 0's default group already hosts the store on
    MASTER_PORT: the ring must meet there, not host a second one (which could not bind the port)."""
    import torch.distributed as dist
    from commlab.regimes.ring import RingExchanger
    from commlab.core.registry import resolve
    from torch.distributed import distributed_c10d

    from commlab.transport.rendezvous import RankInfo

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=2))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        _, options = resolve("ring://?timeout=5")
        ex = RingExchanger(options, RankInfo(0, 1, 0, "127.0.0.1", 1, "flags"))  # port 1: nobody may host there
        ex.meet()
        ex.store.set("probe", "here")
        ex.close()
        assert dist.is_initialized(), "the ring destroyed a group it did not create"
        # the ring's namespace is the first exchanger's in that store; a missing key would raise after 2 s
        default = distributed_c10d._get_default_store()
        assert dist.PrefixStore("1", dist.PrefixStore("commlab/", default)).get("probe") == b"here"
    finally:
        dist.destroy_process_group()


def test_error_feedback_residuals_follow_their_parameters_into_rebuilt_buckets():
    """DDP's first iteration has one bucket; the rebuilt ones split it: each starts from its parameters'
    part of the first one's residual (nothing a rank did not send is lost at the rebuild)."""
    import torch
    state, _ = commlab.ddp_hook("allreduce://?compress=topk:0.5")
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    first = state._key([a, b, c])
    state.compressor.residuals[first] = torch.arange(9.0)
    later = state._key([c])
    assert state.compressor.residuals[later].tolist() == [5.0, 6.0, 7.0, 8.0]
    assert first not in state.compressor.residuals  # the first bucket is gone for good
    rest = state._key([b, a])
    assert state.compressor.residuals[rest].tolist() == [2.0, 3.0, 4.0, 0.0, 1.0]
    assert state._key([c]) == later and state._key([a, b, c]) == first  # keyed by parameters, stably
    state.close()


def test_a_compressor_without_error_feedback_declares_no_residual_to_carry():
    """The hook asks the compressor (keeps_residuals), never probes it: without error feedback a rebuilt bucket
    starts from nothing, and handing such a compressor a residual is refused."""
    import torch
    state, _ = commlab.ddp_hook("allreduce://?compress=topk:0.5&ef=0")
    assert not state.compressor.keeps_residuals
    a, b = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3))
    assert (state._key([a, b]), state._key([b])) == (0, 1)  # DDP's rebuild: nothing to carry
    with pytest.raises(ConfigError, match="keeps no residual"):
        state.compressor.put_residual(0, torch.zeros(5))
    state.close()


def test_exchange_step_is_refused_before_setup_and_where_the_servers_update():
    from commlab.regimes.ps import PSExchanger
    from commlab.core.registry import resolve
    from commlab.transport.rendezvous import RankInfo

    _, options = resolve("ps://127.0.0.1:1?mode=sync")
    ex = PSExchanger(options, RankInfo.single())
    with pytest.raises(ConfigError, match=r"call setup\(model, optimizer\) before exchange_step\(\)"):
        ex.exchange_step()
    ex.check_averages()  # mode=sync, update left to the servers: not refused before they say
    ex._take_placement({"mode": "sync", "update": "server"})  # what a hello from servers that update sets
    with pytest.raises(ConfigError, match="option 'update'"):
        ex.check_averages()
