"""commlab doctor and host staging on any machine (no GPU needed).

What needs CUDA is in tests/gpu/. Here: the doctor runs and tells the truth
about this machine, its readers of sysfs, /proc/modules and NCCL's log are
right on known inputs, and staging passes CPU buckets through untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from commlab.tools import doctor
from commlab.base.errors import BackendUnavailable, ConfigError
from commlab.core.exchanger import make_buckets
from commlab.core.staging import CPU_RESIDENT, HostStaging, resolve_device

from conftest import run_group

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_group([sys.executable, *argv], timeout, cwd=ROOT, env=ENV, capture_output=True, text=True)


# ----- the doctor, end to end ---------------------------------------------------------------------
def test_doctor_runs_and_reports_cuda_plainly():
    out = run("-m", "commlab.tools.doctor", "--no-probe")
    assert out.returncode == 0, out.stderr
    if torch.cuda.is_available():
        assert "CUDA: yes" in out.stdout
    else:
        assert "CUDA: NO." in out.stdout
        assert "GPUs: 0" in out.stdout
        assert "GPUDirect RDMA: not used: no CUDA here" in out.stdout


def test_doctor_json_through_the_cli_matches_this_process():
    out = run("-m", "commlab.tools.cli", "doctor", "--json", "--no-probe")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["cuda"]["cuda_available"] == torch.cuda.is_available()
    assert facts["cuda"]["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert facts["cuda"]["torch_cuda"] == torch.version.cuda
    assert facts["nccl_probe"]["ran"] is False
    assert "pinned host memory" in facts["zmq_regimes"]
    # GPUDirect is never claimed without NCCL's word: the probe did not run
    assert facts["gpudirect_rdma"]["used"] is (False if not torch.cuda.is_available() else None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_transport_facts_without_cuda_do_not_probe():
    facts = doctor.transport_facts(run_nccl_probe=True)
    assert facts["nccl_probe"]["ran"] is False
    assert "no CUDA" in facts["nccl_probe"]["reason"] or "sees no GPU" in facts["nccl_probe"]["reason"]
    assert facts["nccl_version"] is None
    assert facts["gpudirect_rdma"] == {"used": False, "why": "no CUDA here", "rdma_nic_and_peer_memory_module":
                                       bool(facts["rdma_devices"]) and bool(facts["peer_memory_modules"])}
    json.dumps(facts)  # a manifest must serialise


# ----- readers of the machine, on known inputs ---------------------------------------------------
def test_rdma_devices_read_link_layer_as_ib_or_roce(tmp_path):
    for dev, link in (("mlx5_0", "InfiniBand"), ("mlx5_1", "Ethernet")):
        port = tmp_path / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(link + "\n")
        (port / "state").write_text("4: ACTIVE\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    found = doctor.rdma_devices(tmp_path)
    assert [(d["device"], d["port"], d["kind"], d["state"]) for d in found] == [
        ("mlx5_0", "1", "InfiniBand", "4: ACTIVE"), ("mlx5_1", "1", "RoCE", "4: ACTIVE")]
    assert doctor.rdma_devices(tmp_path / "absent") == []


def test_peer_memory_modules_from_proc_modules(tmp_path):
    mods = tmp_path / "modules"
    mods.write_text("nvidia_uvm 1523712 0 - Live 0x0\nnvidia_peermem 16384 0 - Live 0x0\n"
                    "ib_core 442368 9 nvidia_peermem, Live 0x0\n")
    assert doctor.peer_memory_modules(mods) == ["nvidia_peermem"]
    mods.write_text("nv_peer_mem 16384 0 - Live 0x0\n")
    assert doctor.peer_memory_modules(mods) == ["nv_peer_mem"]
    mods.write_text("nvidia 56598528 147 - Live 0x0\n")
    assert doctor.peer_memory_modules(mods) == []
    assert doctor.peer_memory_modules(tmp_path / "absent") == []


# Lines in the shape NCCL 2.x prints them with NCCL_DEBUG=INFO (host:pid:tid [dev] NCCL INFO ...).
NCCL_IB_GDR = """\
node1:100:100 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
node1:100:100 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>
node1:100:100 [0] NCCL INFO Using network IB
NCCL version 2.21.5+cuda12.4
node1:100:120 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'
node1:100:120 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
node1:100:120 [0] NCCL INFO Channel 01/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
node1:100:120 [0] NCCL INFO Channel 01/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA
"""
NCCL_SINGLE_HOST = """\
h:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:172.17.0.2<0>
h:1:1 [0] NCCL INFO Using network Socket
NCCL version 2.27.3+cuda12.8
h:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h:1:9 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct
h:1:9 [1] NCCL INFO Ring 02 : 1[1] -> 0[0] via P2P/IPC
"""
NCCL_NO_GDR = """\
a:2:2 [2] NCCL INFO NET/IB : GPU Direct RDMA Disabled for GPU 2[2] / HCA 0 (distance 3 >= 2)
a:2:2 [2] NCCL INFO Ring 00 : 6 -> 2 [receive] via NET/IB/0
a:2:2 [2] NCCL INFO Channel 00/0 : 2[2] -> 7[3] [send] via NET/Socket/1
"""


def test_nccl_log_with_gpudirect_rdma():
    got = doctor.parse_nccl_log(NCCL_IB_GDR)
    assert got["nccl_version_logged"] == "2.21.5+cuda12.4"
    assert got["network"] == ["IB"]
    assert got["transports"] == ["NET/IB/0/GDRDMA", "P2P/IPC/read"]
    assert got["kinds"] == ["NET/IB", "P2P"]
    assert got["gdrdma_used"] is True and len(got["gdrdma_channel_lines"]) == 2
    assert got["gdr_enabled_lines"] == ["node1:100:120 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'"]


def test_nccl_log_on_one_host_uses_no_network_and_no_gdr():
    got = doctor.parse_nccl_log(NCCL_SINGLE_HOST)
    assert got["kinds"] == ["P2P", "SHM"]
    assert got["transports"] == ["P2P/CUMEM/read", "P2P/IPC", "SHM/direct/direct"]
    assert got["gdrdma_used"] is False
    verdict = doctor.gpudirect_verdict(dict(got, ran=True, ok=True), [], [], cuda_available=True)
    assert verdict["used"] is False
    assert verdict["why"] == "NCCL used no network transport (P2P, SHM), so GPUDirect RDMA did not come into play"


def test_nccl_log_network_without_gdr_is_not_gdr():
    got = doctor.parse_nccl_log(NCCL_NO_GDR)
    assert got["kinds"] == ["NET/IB", "NET/Socket"]
    assert got["gdrdma_used"] is False
    assert len(got["gdr_disabled_lines"]) == 1 and got["gdr_enabled_lines"] == []


def test_gpudirect_is_claimed_only_on_a_gdrdma_channel_line():
    enabled_but_unused = doctor.parse_nccl_log(NCCL_IB_GDR.replace("/GDRDMA", ""))
    assert enabled_but_unused["gdr_enabled_lines"] and not enabled_but_unused["gdrdma_used"]
    unused = doctor.gpudirect_verdict(dict(enabled_but_unused, ran=True, ok=True), [{}], ["nvidia_peermem"], True)
    assert unused["used"] is False and "do not say GDRDMA" in unused["why"]
    assert unused["rdma_nic_and_peer_memory_module"] is True
    failed = dict(doctor.parse_nccl_log(NCCL_IB_GDR), ran=True, ok=False, error="rank 1 failed")
    verdict = doctor.gpudirect_verdict(failed, [{}], ["nvidia_peermem"], cuda_available=True)
    assert verdict["used"] is None and verdict["why"] == "the NCCL probe failed (rank 1 failed)"
    ok = dict(doctor.parse_nccl_log(NCCL_IB_GDR), ran=True, ok=True)
    assert doctor.gpudirect_verdict(ok, [{}], ["nvidia_peermem"], cuda_available=True)["used"] is True
    not_run = doctor.gpudirect_verdict({"ran": False, "reason": "x"}, [], [], cuda_available=False)
    assert not_run == {"used": False, "why": "no CUDA here", "rdma_nic_and_peer_memory_module": False}


# ----- staging: CPU buckets pass through -----------------------------------------------------------
def cpu_buckets():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return make_buckets(list(model.named_parameters()), bucket_bytes=64, carry_presence=True)


def test_staging_passes_cpu_buckets_through():
    buckets = cpu_buckets()
    assert len(buckets) > 1
    stage = HostStaging.for_buckets(buckets)
    assert len(stage) == len(buckets) and stage.pinned_bytes == 0
    for b in buckets:
        b.buffer.copy_(torch.arange(b.buffer.numel(), dtype=b.buffer.dtype))
        host, event = stage.to_host_async(b.index)
        assert event is None and host is b.buffer and not stage.is_staged(b.index)
        got = stage.wait(b.index, timeout=1.0)
        assert got is b.buffer
        got.mul_(3)  # what a regime does: reduce in the host tensor...
        stage.to_device(b.index)  # ...and the result is already in place
        assert torch.equal(b.buffer, 3 * torch.arange(b.buffer.numel(), dtype=b.buffer.dtype))
        for j, p in enumerate(b.params):  # a parameter's elements, out of the bucket's layout
            other = torch.zeros_like(p)
            stage.to_device(b.index, dst=other, start=b.offsets[j], stop=b.offsets[j] + p.numel())
            assert torch.equal(other, b.view(j))
    facts = stage.facts()
    assert facts["data_path"] == CPU_RESIDENT and facts["staged_buckets"] == 0 and facts["devices"] == ["cpu"]


def test_staging_refuses_misuse_with_the_slot_named():
    stage = HostStaging([torch.zeros(4), torch.zeros(6)])
    with pytest.raises(ValueError, match=r"staging slot 1: wait\(\) before to_host_async\(\)"):
        stage.wait(1, timeout=1.0)
    with pytest.raises(ValueError, match="staging slot 2 does not exist"):
        stage.host(2)
    with pytest.raises(ValueError, match=r"staging slot 0: destination is torch.float32\[5\], "
                                         r"range \[0, 4\) is torch.float32\[4\]"):
        stage.to_device(0, dst=torch.zeros(5))
    with pytest.raises(ValueError, match=r"destination is torch.float32\[4\] \(not contiguous\)"):
        stage.to_device(0, dst=torch.zeros(2, 2).t())
    stage.to_host_async(0)
    with pytest.raises(ValueError, match=r"staging slot 0: upto=5 is outside \[0, 4\]"):
        stage.wait(0, timeout=1.0, upto=5)
    with pytest.raises(ValueError, match=r"staging slot 0: range \[3, 2\) is outside \[0, 4\)"):
        stage.to_device(0, start=3, stop=2)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        HostStaging([torch.zeros(2)], chunk_bytes=0)
    with pytest.raises(ValueError, match="must be flat and contiguous"):
        HostStaging([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="index order"):
        HostStaging.for_buckets(list(reversed(cpu_buckets())))


def test_resolve_device():
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="not a torch device"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="runs on cpu or cuda"):
        resolve_device("meta")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert resolve_device("cuda", n + 1) == torch.device("cuda", (n + 1) % n)
        with pytest.raises(ConfigError, match=f"only {n} CUDA device"):
            resolve_device(f"cuda:{n}")
    else:
        with pytest.raises(BackendUnavailable, match="device 'cuda' asked for, but torch .*(no CUDA|sees no GPU)"):
            resolve_device("cuda")


def test_worker_refuses_cuda_without_it_by_name():
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA answer")
    out = run("-m", "workers", "--model", "tiny", "--steps", "1", "--device", "cuda", "--no-progress")
    assert out.returncode == 2
    assert "BackendUnavailable: device 'cuda' asked for" in out.stderr


def test_gpu_sweep_skips_plainly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA answer")
    out = run("-m", "commlab.tools.cli", "bench", "gpu-sweep", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "commlab bench gpu-sweep: skipped: no CUDA" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_probe_answers_survive_nccl_lines_around_them():
    text = ('h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n'
            'COMMLAB_PROBE {"rank": 0, "correct": true}\n'
            'h:1:2 [1] NCCL INFO Connected all rings COMMLAB_PROBE {"rank": 1, "correct": false}\n'
            'COMMLAB_PROBE {"rank": 2, "corr\n')
    assert doctor.probe_answers(text) == [{"rank": 0, "correct": True}, {"rank": 1, "correct": False}]
