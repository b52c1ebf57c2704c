"""The GPU data path of ring:// and ps://, run on a machine without a GPU.

A CUDA bucket goes through :class:`commlab.core.staging.HostStaging`: the copy to its host mirror starts in
the backward hook, the regime reads (pushes, the ring) and writes (averages, pulled parameters, the
ring's sum) the mirror only, and each written range is copied back to the bucket or the parameter.
``COMMLAB_STAGE_CPU=1`` gives CPU buckets such a mirror, copied synchronously, so every index and
every copy of that path runs here: a range read from the bucket instead of the mirror, or one not
copied back, leaves the ranks away from the reference. What it cannot check is the CUDA streams and
events themselves; tests/gpu does, on a GPU (docs/gpu.md).

The reference is the same as for the unstaged paths: one process on the combined batch, every rank
compared, parameters and optimizer state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commlab.core.exchanger import make_buckets
from commlab.core.staging import CPU_MIRRORED, STAGE_CPU_ENV, HostStaging
from test_ps_update import STEPS, ps_url, servers  # noqa: F401 (a fixture)
from test_user_loop import assert_close, assert_inf_step_skipped, assert_ranks_identical, run_loop

import userloop

STAGED = {STAGE_CPU_ENV: "1"}


def test_a_mirrored_cpu_bucket_is_copied_both_ways_and_by_range():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    buckets = make_buckets(list(model.named_parameters()), bucket_bytes=64, carry_presence=True)
    stage = HostStaging.for_buckets(buckets, mirror_cpu=True)
    for b in buckets:
        b.buffer.copy_(torch.arange(b.buffer.numel(), dtype=b.buffer.dtype))
        host, event = stage.to_host_async(b.index)
        assert stage.is_staged(b.index) and event is None
        assert host.data_ptr() != b.buffer.data_ptr() and torch.equal(host, b.buffer)
        b.buffer.zero_()  # the mirror is a copy: what the bucket does now does not reach it
        assert stage.wait(b.index, timeout=1.0) is host and host.any()
        host.mul_(3)
        half = host.numel() // 2
        stage.to_device(b.index, start=0, stop=half)  # a finished range back, as a ring or a pull would
        want = 3 * torch.arange(b.buffer.numel(), dtype=b.buffer.dtype)
        assert torch.equal(b.buffer[:half], want[:half]) and not b.buffer[half:].any()
        stage.to_device(b.index, start=half)
        assert torch.equal(b.buffer, want)
        for j, p in enumerate(b.params):  # a parameter's elements, out of the bucket's layout
            other = torch.zeros_like(p)
            stage.to_device(b.index, dst=other, start=b.offsets[j], stop=b.offsets[j] + p.numel())
            assert torch.equal(other.view(-1), want[b.offsets[j]:b.offsets[j] + p.numel()])
    facts = stage.facts()
    assert facts["data_path"] == CPU_MIRRORED and facts["mirrored_cpu_buckets"] == len(buckets)
    assert stage.pinned_bytes == 0 and facts["staged_buckets"] == 0


def assert_equals_reference(results: list[dict], n: int, what: str, loop_clips: bool = True) -> None:
    want = userloop.reference("mlp", n, STEPS)
    assert_ranks_identical(results)
    for res in results:
        assert res["staging"]["data_path"] == CPU_MIRRORED, f"{what}: the staged path was not taken"
        assert res["staging"]["mirrored_cpu_buckets"] >= 2, f"{what}: the loop's model should fill several buckets"
        assert_close(res, want, f"{what} rank {res['rank']} of {n}")
        if loop_clips:
            assert res["seen"]["norms"] == pytest.approx(want["seen"]["norms"], rel=1e-5)
        assert res["exchanges"] == STEPS and res["steps"] == STEPS


@pytest.mark.multiproc
@pytest.mark.parametrize("update,k,transport", [("worker", 3, "tcp"), ("server", 2, "shm")])
def test_ps_through_host_mirrors_equals_one_process(tmp_path, servers, update, k, transport):  # noqa: F811
    """update=worker: pushes read the mirrors, averages land in them and go back by range; update=server:
    pulled parameters land in the mirrors and go to the parameters. K > 1: a parameter in pieces."""
    url = ps_url(servers(k), update, k, transport) + "&bucket_mb=0.0002"
    results = run_loop(tmp_path, 2, url=url, variant="mlp", steps=STEPS, clip=update == "worker", env=STAGED)
    assert_equals_reference(results, 2, f"ps update={update} K={k} {transport}, staged", loop_clips=update == "worker")


@pytest.mark.multiproc
def test_ring_through_host_mirrors_equals_one_process(tmp_path):
    results = run_loop(tmp_path, 3, url="ring://?timeout=60&bucket_mb=0.0002", variant="mlp", steps=STEPS,
                       env=STAGED)
    assert_equals_reference(results, 3, "ring:// x3, staged")


@pytest.mark.multiproc
def test_an_inf_through_the_mirrors_skips_the_step_on_every_rank(tmp_path, servers):  # noqa: F811
    steps = 8
    url = ps_url(servers(1), "server", 1, "tcp") + "&bucket_mb=0.0002"
    results = run_loop(tmp_path, 2, url=url, variant="amp", steps=steps, env=STAGED)
    assert all(r["staging"]["data_path"] == CPU_MIRRORED for r in results)
    assert_inf_step_skipped(results, steps)
