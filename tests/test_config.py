"""URL parsing, the registry, and launcher environments: bad configuration fails fast, by name."""

import pytest

import commlab
from commlab.config import ExchangerURL, parse_options
from commlab.errors import BackendUnavailable, ConfigError
from commlab.regimes.allreduce import AllReduceOptions
from commlab.rendezvous import RankInfo, first_slurm_host, from_env


def test_url_parse_endpoints_and_query():
    u = ExchangerURL.parse("ps://h1:5000,h2:5001?mode=sync&staleness=2")
    assert u.scheme == "ps" and u.endpoints == ("h1:5000", "h2:5001")
    assert dict(u.query) == {"mode": "sync", "staleness": "2"}


def test_unknown_scheme_lists_known():
    with pytest.raises(ConfigError, match=r"unknown exchanger scheme 'bogus://'; known: .*allreduce://.*local://"):
        commlab.connect("bogus://", RankInfo.single())


def test_missing_scheme():
    with pytest.raises(ConfigError, match="has no scheme"):
        ExchangerURL.parse("allreduce")


def test_unknown_option_lists_known():
    with pytest.raises(ConfigError, match=r"allreduce:// does not know option 'backnd'; known options: backend, bucket_mb, buffers, compress, ef, heap, timeout"):
        commlab.connect("allreduce://?backnd=gloo", RankInfo.single())


@pytest.mark.parametrize("query, message", [
    ("backend=mpi", r"'mpi' is not one of \['gloo', 'nccl'\]"),
    ("timeout=soon", r"'soon' is not a valid float"),
    ("timeout=-1", r"timeout must be > 0"),
    ("bucket_mb=0", r"bucket_mb must be > 0"),
    ("timeout=1&timeout=2", r"repeats query key"),
])
def test_bad_option_values(query, message):
    with pytest.raises(ConfigError, match=message):
        parse_options(AllReduceOptions, ExchangerURL.parse(f"allreduce://?{query}"))


def test_options_are_frozen_and_typed():
    o = parse_options(AllReduceOptions, ExchangerURL.parse("allreduce://?bucket_mb=4.5&timeout=3"))
    assert (o.bucket_mb, o.timeout, o.backend) == (4.5, 3.0, "gloo")
    with pytest.raises(Exception):
        o.timeout = 5


def test_nccl_without_cuda_says_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ex = commlab.connect("allreduce://?backend=nccl", RankInfo.single())
    with pytest.raises(BackendUnavailable, match="needs CUDA"):
        ex.meet()


def test_local_refuses_several_workers():
    import torch
    ex = commlab.connect("local://", RankInfo(1, 2, 1, "127.0.0.1", 1, "test"))
    with pytest.raises(ConfigError, match=r"local:// runs one worker, but the launcher started 2 \(rank 1\)"):
        ex.setup(torch.nn.Linear(2, 2), commlab.OptimizerSpec())


# ---- launcher environments ----------------------------------------------------------------------

def test_torchrun_env():
    info = from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "2950"})
    assert info == RankInfo(1, 4, 1, "10.0.0.5", 2950, "torchrun")


def test_slurm_env_takes_first_node_as_master():
    info = from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                     "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1", "MASTER_PORT": "29500"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.source) == (3, 8, 1, "gpu07", "slurm")


def test_openmpi_env():
    info = from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                     "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (info.rank, info.world_size, info.source) == (2, 3, "openmpi")


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "9", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    assert from_env(env).source == "torchrun"


def test_flags_when_no_launcher():
    assert from_env({}, rank=1, world_size=2, master_addr="h", master_port=7) == RankInfo(1, 2, 1, "h", 7, "flags")
    assert from_env({}) == RankInfo.single()


def test_worker_count_must_match_environment():
    with pytest.raises(ConfigError, match=r"--workers 3 does not match torchrun's world size 2"):
        from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, world_size=3)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"rank 2 is outside world size 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"no rendezvous address"),
])
def test_bad_environments(env, message):
    with pytest.raises(ConfigError, match=message):
        from_env(env)


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("n[3-5]", "n3"), ("a[10,12-13],b2", "a10")])
def test_slurm_nodelist(nodelist, first):
    assert first_slurm_host(nodelist) == first
