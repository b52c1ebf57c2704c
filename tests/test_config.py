"""URL parsing, the registry, and launcher environments: bad configuration fails fast, by name."""

import re

import pytest
import torch

import commlab
from commlab.base.config import ExchangerURL, parse_options
from commlab.base.errors import BackendUnavailable, ConfigError
from commlab.regimes.allreduce import AllReduceOptions
from commlab.transport.rendezvous import RankInfo, first_slurm_host, from_env


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
    with pytest.raises(ConfigError, match=r"allreduce:// does not know option 'backnd'; known options: alpha, backend, bucket_mb, buffers, compress, ef, fragment_by, fragments, heap, heartbeat_s, merge, min_workers, outer, overlap, sync_every, timeout, warmup"):
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


# ---- every number is checked where it is parsed (issue 35) ------------------------------------------------

BAD_URLS = [  # (URL, the option its one-line refusal names, the value it says it got)
    ("ring://?chunk_mb=nan", "chunk_mb", "nan"), ("ring://?chunk_mb=inf", "chunk_mb", "inf"),
    ("ring://?chunk_mb=4096", "chunk_mb", "4096.0"), ("ring://?chunk_mb=-1", "chunk_mb", "-1.0"),
    ("ps://?bucket_mb=nan", "bucket_mb", "nan"), ("ps://?piece_mb=nan", "piece_mb", "nan"),
    ("ps://?piece_mb=0", "piece_mb", "0.0"), ("allreduce://?bucket_mb=inf", "bucket_mb", "inf"),
    ("allreduce://?bucket_mb=-1", "bucket_mb", "-1.0"), ("local://?bucket_mb=nan", "bucket_mb", "nan"),
    ("noop://?timeout=nan", "timeout", "nan"), ("ps://?timeout=nan", "timeout", "nan"),
    ("ring://?timeout=inf", "timeout", "inf"), ("ring://?timeout=-inf", "timeout", "-inf"),
    ("allreduce://?timeout=1e300", "timeout", "1e+300"), ("ps://?timeout=0", "timeout", "0.0"),
    ("ps://?update=server&clip_norm=nan", "clip_norm", "nan"), ("ps://?update=server&clip_norm=-1", "clip_norm", "-1.0"),
    ("ps://?shards=1000000", "shards", "1000000"), ("ps://?shards=-1", "shards", "-1"),
    ("ps://?staleness=-2", "staleness", "-2"), ("ps://?retries=-1", "retries", "-1"),
    ("ps://?retries=1000", "retries", "1000"), ("ring://?sndbuf_kb=-1", "sndbuf_kb", "-1"),
    ("ring://?sndbuf_kb=4000000", "sndbuf_kb", "4000000"), ("ring://?swap_kb=-1", "swap_kb", "-1"),
]


@pytest.mark.parametrize("url, name, got", BAD_URLS)
def test_every_bad_number_in_a_url_is_one_line_naming_the_option(url, name, got):
    """The check the CLI makes before anything starts (commlab.tools.cli.check_url: the registry's resolve)."""
    from commlab.tools.cli import check_url

    problem = check_url(url)
    assert problem is not None and "\n" not in problem, problem
    assert re.fullmatch(rf"--exchanger {re.escape(repr(url))}: {name} must be [^,]+, got {re.escape(got)}", problem), \
        problem


def test_every_number_of_every_regime_declares_its_range():
    """A new numeric option cannot skip the check: each says its range where it is declared."""
    import dataclasses
    import typing

    from commlab.core.registry import REGIMES, regime_class

    for scheme in REGIMES:
        options = regime_class(scheme).Options
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            if hints[f.name] in (int, float) and not f.metadata.get("choices"):
                assert any(f.metadata["range"][k] is not None for k in ("gt", "ge", "lt", "le")), \
                    f"{scheme}://?{f.name}= declares no range"


def test_options_built_in_code_are_checked_too():
    from commlab.regimes.ps import PSOptions

    with pytest.raises(ConfigError, match=r"^piece_mb must be a finite number > 0 and <= 1048576, got nan$"):
        PSOptions(piece_mb=float("nan"))
    with pytest.raises(ConfigError, match=r"^timeout must be a number, got '5'$"):
        PSOptions(timeout="5")


CLI_CASES = [  # (command line, the option named): through the real command, a few of each kind
    (["train", "--exchanger", "ring://?chunk_mb=nan"], "chunk_mb"),
    (["train", "--exchanger", "ps://?shards=1000000"], "shards"),
    (["train", "--exchanger", "ps://?update=server&clip_norm=nan"], "clip_norm"),
    (["train", "--deadline", "inf"], "--deadline"),
    (["run", "--deadline", "-5", "SCRIPT"], "--deadline"),
    (["run", "--deadline", "nan", "SCRIPT"], "--deadline"),
    (["run", "--workers", "0", "SCRIPT"], "--workers"),
]


@pytest.mark.multiproc
def test_bad_numbers_on_the_command_line_exit_2_with_one_line_and_start_nothing(tmp_path):
    """``commlab train|run`` as a user types it: exit 2, one line naming the option, and nothing started: the
    launcher never made its log folder (the first thing it does, before any process) nor a scratch folder."""
    import sys

    from conftest import child_env, run_group

    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('started')\n")
    for i, (argv, name) in enumerate(CLI_CASES):
        logs, tmp = tmp_path / f"logs{i}", tmp_path / f"tmp{i}"
        tmp.mkdir()
        argv = [str(script) if a == "SCRIPT" else a for a in argv]
        cmd = [sys.executable, "-m", "commlab.tools.cli", argv[0], "--log-dir", str(logs), *argv[1:]]
        r = run_group(cmd, 60, env=child_env(TMPDIR=str(tmp)), capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (argv, r.returncode, r.stderr)
        assert re.fullmatch(rf"commlab {argv[0]}: .*{re.escape(name)}\b.* must be .*, got \S+", lines[0]), lines
        assert not logs.exists() and not any(tmp.iterdir()), f"{argv}: the launcher started"


@pytest.mark.multiproc
def test_a_hello_whose_optimizer_settings_are_not_numbers_is_refused_and_the_server_serves_on(tmp_path):
    """lr="x" (or betas of one number, maximize="yes") in a hello is refused with a reason naming it, before the
    shard fixes anything; the same hello with numbers is then served."""
    from faultkit import Procs, Raw

    from commlab.core.manifest import describe_optimizer, model_manifest

    model = torch.nn.Linear(3, 2)
    optim = describe_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    hello = {"rank": 0, "world": 1, "mode": "async", "shard": [0, 1], "update": "server",
             "manifest": [[n, list(s), d] for n, s, d in model_manifest(model)],
             "pieces": [["weight", "float32", 6], ["bias", "float32", 2]]}
    procs = Procs(tmp_path)
    try:
        server = procs.server("--mode", "async")
        raw = Raw(server.endpoint, "rank0")
        for key, bad, said in [("lr", "x", "lr must be a number, got 'x'"), ("betas", [0.9], "betas must be 2 numbers"),
                               ("maximize", "yes", "maximize must be true or false"), ("eps", float("nan"), "eps must be a finite")]:
            groups = [{**g, "hyper": {**g["hyper"], key: bad}} for g in optim["groups"]]
            reply = raw.request("hello", **hello, optim={**optim, "groups": groups})
            assert reply.op == "error" and f"param group 0's {said}" in reply.meta["reason"], reply.meta
        assert server.stats()["refused"] == 4
        assert raw.request("hello", **hello, optim=optim).op == "ok"
        raw.close()
    finally:
        procs.close()
