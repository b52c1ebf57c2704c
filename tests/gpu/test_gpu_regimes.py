"""Every regime on CUDA tensors reproduces the single-process CPU reference; host staging is ordered right.

Skipped without CUDA. ``COMMLAB_TEST_DEVICE=cpu pytest tests/gpu`` runs the
same tests on CPU tensors: a dry run of this file's harness on a machine
without a GPU (staging passes through there, and the NCCL cases skip).

The zmq regimes' workers may share one GPU (rank r uses GPU r % count); NCCL
needs one GPU per rank, so its cases run as many workers as there are GPUs.
Regimes not merged yet (not in ``commlab.core.registry.REGIMES``) skip by name.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from commlab.launch import launcher
from commlab.base.handles import FutureHandle
from commlab.core.optim import OptimizerSpec
from commlab.regimes.local import LocalExchanger
from commlab.core.registry import REGIMES, regime_class
from commlab.transport.rendezvous import RankInfo
from commlab.core.staging import HostStaging
from workers.data import load_digits
from workers.models import build_model

DEVICE = os.environ.get("COMMLAB_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                 reason="needs CUDA (COMMLAB_TEST_DEVICE=cpu dry-runs these tests on CPU)")]

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
STEPS, BATCH, LR = 4, 8, 0.1
ATOL, RTOL = 2e-5, 1e-4  # float32 kernels on the GPU against the CPU's: rounding only


def gpus() -> int:
    return torch.cuda.device_count() if ON_CUDA else 0


# ----- host staging: ordering against real kernels and threads ------------------------------------
def slow_result(device: torch.device, n: int = 1024) -> torch.Tensor:
    """A tensor at the end of a long chain of kernels (still running when this returns, on a GPU)."""
    torch.manual_seed(1)
    x = torch.randn(n, n, device=device) / n**0.5
    y = x
    for _ in range(30):
        y = torch.tanh(y @ x)
    return y.reshape(-1)


def test_staging_copies_to_host_only_after_the_gradient_is_written():
    dev = torch.device(DEVICE)
    y = slow_result(dev)
    buf = torch.zeros(y.numel() + 3, device=dev)
    cpu_slot = torch.arange(5.0)
    stage = HostStaging([buf, cpu_slot])
    buf[: y.numel()].copy_(y)  # queued behind the chain; to_host_async must not overtake it
    buf[y.numel():].fill_(7.0)
    host, event = stage.to_host_async(0)
    got = stage.wait(0, timeout=60)
    assert got is host and got.device.type == "cpu"
    assert got.is_pinned() == ON_CUDA and (event is not None) == ON_CUDA
    assert torch.equal(got, buf.cpu())
    assert stage.to_host_async(1)[0] is cpu_slot and stage.wait(1, timeout=1) is cpu_slot
    assert stage.pinned_bytes == (buf.numel() * 4 if ON_CUDA else 0)


def test_staging_result_reaches_the_training_stream_from_a_comm_thread():
    dev = torch.device(DEVICE)
    buf = slow_result(dev).clone()
    expected = buf.cpu() * 2 + 1
    other = torch.zeros_like(buf)
    stage = HostStaging([buf])
    stage.to_host_async(0)

    def comm():  # what a regime's comm thread does: wait, reduce in host memory, copy back
        h = stage.wait(0, timeout=60)
        h.mul_(2).add_(1)
        stage.to_device(0)
        stage.to_device(0, dst=other)

    t = threading.Thread(target=comm)
    t.start()
    t.join(60)
    assert not t.is_alive(), "comm thread did not finish within 60 s"
    # The training thread's stream waits for the copies: no synchronize needed before reading.
    assert torch.equal(buf.cpu(), expected) and torch.equal(other.cpu(), expected)
    facts = stage.facts()
    assert ("pinned host memory" in facts["data_path"]) == ON_CUDA


def test_staging_in_chunks_hands_out_the_first_chunk_and_copies_back_ranges():
    dev = torch.device(DEVICE)
    y = slow_result(dev)  # 2**20 floats
    buf = torch.empty_like(y).copy_(y)
    stage = HostStaging([buf], chunk_bytes=2**16)  # 64 chunks
    stage.to_host_async(0)
    head = stage.wait(0, timeout=60, upto=100)[:100].clone()
    assert torch.equal(head, y[:100].cpu())
    host = stage.wait(0, timeout=60)
    assert torch.equal(host, y.cpu())
    host[: 2**19].fill_(-1.0)
    host[2**19:].fill_(-2.0)
    stage.to_device(0, start=0, stop=2**19)  # as a ring would, a finished range at a time
    stage.to_device(0, start=2**19)
    want = torch.cat([torch.full((2**19,), -1.0), torch.full((2**19,), -2.0)])
    assert torch.equal(buf.cpu(), want)
    param = torch.zeros(8, 16, device=dev)  # a parameter pulled in its bucket's layout
    stage.to_device(0, dst=param, start=2**19 - 64, stop=2**19 + 64)
    assert torch.equal(param.cpu().view(-1), want[2**19 - 64: 2**19 + 64])


class StagedDoubling(LocalExchanger):
    """A one-rank regime that sends every bucket through HostStaging and a comm thread, which
    doubles it in host memory: the model's step must equal a step on twice the loss."""

    scheme = "staged-doubling-test"

    def _connect(self, model, optim):
        super()._connect(model, optim)
        self.staging = HostStaging.for_buckets(self.buckets, chunk_bytes=1024)  # several chunks per bucket
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="comm")

    def _start_bucket(self, bucket):  # on autograd's thread, in the backward hook
        self.staging.to_host_async(bucket.index)
        return FutureHandle(self.pool.submit(self._exchange, bucket.index), f"bucket {bucket.index}")

    def _exchange(self, i):
        self.staging.wait(i, timeout=60).mul_(2)
        self.staging.to_device(i)

    def close(self):
        super().close()
        self.pool.shutdown(wait=True)


def local_steps(cls, device: str, loss_scale: float, bucket_mb: float = 0.0005) -> dict[str, torch.Tensor]:
    model, side = build_model("tiny", 0)
    model.to(device)
    data = load_digits(side, 0)
    options = dataclasses.replace(cls.Options(), bucket_mb=bucket_mb)
    with cls(options, RankInfo.single()) as ex:
        ex.setup(model, OptimizerSpec("sgd", lr=LR, momentum=0.9))
        assert len(ex.buckets) > 1  # several buckets, so some start while backward still runs
        for step in range(STEPS):
            x, y = (t.to(device) for t in data.batch(step, 0, 1, BATCH))
            ex.zero_grad()
            (loss_scale * F.cross_entropy(model(x), y)).backward()
            ex.step(timeout=60)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def assert_same_params(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}, {k}: {m}")


def test_bucketed_exchange_through_staging_equals_the_reference():
    want = local_steps(LocalExchanger, "cpu", loss_scale=2.0)
    got = local_steps(StagedDoubling, DEVICE, loss_scale=1.0)
    assert_same_params(got, want, f"staged exchange on {DEVICE}")


def test_local_on_device_equals_cpu_reference():
    assert_same_params(local_steps(LocalExchanger, DEVICE, 1.0), local_steps(LocalExchanger, "cpu", 1.0),
                       f"local:// on {DEVICE}")


# ----- every regime, several processes -----------------------------------------------------------
def train(url: str, workers: int, device: str, batch: int, out: Path) -> dict[str, torch.Tensor]:
    params = out / "params.pt"
    args = ["--model", "tiny", "--steps", str(STEPS), "--batch-size", str(batch), "--lr", str(LR), "--seed", "0",
            "--device", device, "--save-params", str(params), "--no-progress"]
    rc = launcher.launch(url, workers, args, env=ENV)
    assert rc == 0, f"{url} with {workers} workers on {device} exited {rc} (the failing process is named above)"
    return torch.load(params)


@functools.lru_cache(maxsize=None)
def reference(workers: int) -> dict[str, torch.Tensor]:
    """One CPU worker on the union of the workers' batches: what every synchronous regime must reproduce."""
    with tempfile.TemporaryDirectory() as tmp:
        return train("local://", 1, "cpu", BATCH * workers, Path(tmp))


def needs(url: str, workers: int, nccl: bool) -> None:
    scheme = url.split("://")[0]
    if scheme not in REGIMES:
        pytest.skip(f"{scheme}:// is not registered in commlab.core.registry.REGIMES yet")
    query = url.split("?", 1)[1] if "?" in url else ""
    fields = {f.name for f in dataclasses.fields(regime_class(scheme).Options)}
    for key in (kv.split("=")[0] for kv in query.split("&") if kv):
        if key not in fields:
            pytest.skip(f"{scheme}:// has no option {key!r} yet")
    if nccl and not ON_CUDA:
        pytest.skip("NCCL needs CUDA tensors")
    if nccl and workers < 1:
        pytest.skip("no GPU")
    if nccl and scheme == "ring" and workers < 2:
        pytest.skip(f"{url} needs >= 2 GPUs (one per rank); {workers} here")


# (url, workers or "gpus": one worker per GPU, moves data with NCCL)
CASES = [
    ("allreduce://?backend=gloo", 2, False),
    ("allreduce://?backend=nccl", "gpus", True),
    ("ring://", 2, False),
    ("ring://", 3, False),
    ("ring://?transport=torch", "gpus", True),
    ("ps://", 2, False),  # update=worker: averages back through the mirrors
    ("ps://?shards=2", 3, False),
    ("ps://?shards=2&update=server&piece_mb=0.001", 2, False),  # parameters back through the mirrors, in pieces
    ("ps://?transport=shm", 2, False),
    ("ring://?transport=tcp", 2, False),
]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("url,workers,nccl", CASES, ids=[f"{u}-x{w}" for u, w, _ in CASES])
def test_regime_on_device_equals_reference(url, workers, nccl, tmp_path):
    n = gpus() if workers == "gpus" else workers
    needs(url, n, nccl)
    got = train(url, n, DEVICE, BATCH, tmp_path)
    assert_same_params(got, reference(n), f"{url} x{n} on {DEVICE}")

