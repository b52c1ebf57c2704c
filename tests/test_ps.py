"""Parameter servers: real server processes on loopback, real workers, arithmetic checked exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import commlab
from commlab.launch import launcher
from commlab.transport import psproto, wire
from commlab.base.errors import ConfigError, RemoteError
from commlab.core.manifest import model_manifest
from commlab.regimes.ps import PSExchanger
from commlab.transport.rendezvous import RankInfo
from commlab.base.config import ExchangerURL
from workers.models import build_model

from conftest import GroupTimeout
from faultkit import DRIVER, ENV, REPO, START_TIMEOUT, Procs, Raw, setup_beside_raw

RUN_TIMEOUT = 150.0
TRANSPORTS = ["tcp", "shm"]  # payloads in zmq frames, or through shared memory (commlab.transport.psshm): same results


@pytest.fixture
def start_server(tmp_path):
    """Start ``python -m servers`` on loopback, port 0 (each reports what it bound); every one is killed
    at the end."""
    procs = Procs(tmp_path)
    yield procs.server
    procs.close()


def run_all(cmds: list[list[str]], timeout: float = RUN_TIMEOUT) -> list[str]:
    """Run processes concurrently; return their stdouts; kill all and raise if one fails or hangs.

    Each runs in a session of its own, so that killing a 'commlab train' kills its servers and ranks too."""
    procs = [launcher.start_group(c, ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    outs = []
    try:
        for cmd, p in zip(cmds, procs):
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as exc:  # every group is killed below, on the way out
                raise GroupTimeout(' '.join(cmd[-8:]), cmd, timeout, exc.output, exc.stderr) from None
            if p.returncode != 0:
                raise AssertionError(f"{' '.join(cmd[-8:])} exited {p.returncode}:\n{err[-3000:]}")
            outs.append(out)
    finally:
        launcher.kill_groups([p for p in procs if p.poll() is None], grace=0)
    return outs


def driver(url: str, rank: int, workers: int, steps: int, *extra: str) -> list[str]:
    return [sys.executable, DRIVER, url, "--rank", str(rank), "--workers", str(workers), "--steps", str(steps), *extra]


def attach(server_or_url, model: nn.Module, optim=None, rank: int = 0, world: int = 1,
           transport: str = "tcp") -> PSExchanger:
    url = server_or_url if isinstance(server_or_url, str) else f"ps://{server_or_url.address}?timeout=20"
    if "transport=" not in url:  # said every time: tcp is not the default (auto is)
        url += f"&transport={transport}"
    ex = commlab.connect(url, RankInfo(rank, world, rank, "127.0.0.1", 0, "flags"))
    ex.setup(model, optim or commlab.OptimizerSpec("sgd", lr=0.5))
    if transport == "shm":  # the payloads really take the shared-memory path
        assert set(ex.facts()["transport"]["payloads"].values()) == {"shm"}
    elif transport == "tcp":  # and here they really do not
        assert "transport" not in ex.facts()
    return ex


# ----- sharding (one process) -------------------------------------------------------------------

@pytest.mark.parametrize("model,shards", [("tiny", 1), ("tiny", 3), ("mlp", 2), ("mlp-25m", 3), ("tiny", 7)])
def test_assignment_covers_every_element_once_and_balances_bytes(model, shards):
    manifest = model_manifest(build_model(model, 0)[0])
    pieces = psproto.assign_shards(manifest, shards)
    assert pieces == psproto.assign_shards(manifest, shards)  # deterministic
    for name, shape, _ in manifest:
        ranges = sorted((p.start, p.count) for shard in pieces for p in shard if p.param == name)
        at = 0
        for start, count in ranges:
            assert start == at
            at += count
        assert at == math.prod(shape)
    keys = [p.key for shard in pieces for p in shard]
    assert len(keys) == len(set(keys))
    total = sum(math.prod(s) * 4 for _, s, _ in manifest)
    loads = [sum(p.nbytes for p in shard) for shard in pieces]
    biggest_unsplit = max(p.nbytes for shard in pieces for p in shard if p.count * p.itemsize <= total / shards)
    assert max(loads) <= total / shards + biggest_unsplit
    if model == "mlp-25m":  # one 64 MiB tensor among 100 MiB: split, and within 2% of a third
        assert max(loads) <= 1.02 * total / shards


def test_pieces_are_capped_so_big_tensors_pipeline():
    manifest = model_manifest(build_model("mlp-25m", 0)[0])
    pieces = psproto.assign_shards(manifest, 1, max_piece=16 * 2**20)[0]
    assert max(p.nbytes for p in pieces) <= 16 * 2**20
    assert [p.key for p in pieces if p.param == "1.weight"] == [f"1.weight#{i * 2**22}" for i in range(4)]
    assert sum(p.nbytes for p in pieces) == sum(math.prod(s) * 4 for _, s, _ in manifest)


def test_plan_local_starts_k_servers_and_hands_workers_their_endpoints(tmp_path):
    def no_folder():
        raise AssertionError("only an ipc plan needs a folder")

    url, argvs = PSExchanger.plan_local(ExchangerURL.parse("ps://?shards=3&mode=ssp&staleness=1"), 2, no_folder)
    assert len(argvs) == 3 and all("--mode" in a and "ssp" in a for a in argvs)
    assert [a[a.index("--shard") + 1] for a in argvs] == ["0/3", "1/3", "2/3"]
    opts = PSExchanger.from_url(ExchangerURL.parse(url), RankInfo.single()).options
    assert opts.endpoint_list == [a[a.index("--bind") + 1] for a in argvs] and opts.mode == "ssp"
    same, none = PSExchanger.plan_local(ExchangerURL.parse("ps://127.0.0.1:5000?mode=sync"), 2, no_folder)
    assert none == [] and same == "ps://127.0.0.1:5000?mode=sync"
    url, argvs = PSExchanger.plan_local(ExchangerURL.parse("ps://?shards=2&transport=ipc"), 2, lambda: str(tmp_path))
    assert [a[a.index("--bind") + 1] for a in argvs] == [f"ipc://{tmp_path}/shard{i}" for i in range(2)]
    assert PSExchanger.from_url(ExchangerURL.parse(url), RankInfo.single()).options.transport == "ipc"
    url, _ = PSExchanger.plan_local(ExchangerURL.parse("ps://?shards=2&transport=tcp"), 2, no_folder)
    assert PSExchanger.from_url(ExchangerURL.parse(url), RankInfo.single()).options.transport == "tcp"
    assert list(tmp_path.iterdir()) == []  # the caller's folder; the plan makes nothing itself
    url, argvs = PSExchanger.plan_local(ExchangerURL.parse("ps://?shards=2&transport=shm"), 2, lambda: str(tmp_path))
    assert [a[a.index("--bind") + 1] for a in argvs] == [f"ipc://{tmp_path}/shard{i}" for i in range(2)]
    assert PSExchanger.from_url(ExchangerURL.parse(url), RankInfo.single()).options.transport == "shm"
    for given in ("&transport=auto", ""):  # auto, the default: loopback tcp, which a benchmark can move into namespaces
        url, argvs = PSExchanger.plan_local(ExchangerURL.parse(f"ps://?shards=2{given}"), 2, no_folder)
        assert [a[a.index("--bind") + 1] for a in argvs] == ["tcp://127.0.0.1:0"] * 2
        assert PSExchanger.from_url(ExchangerURL.parse(url), RankInfo.single()).options.transport == "auto"
    with pytest.raises(ConfigError, match="names no servers"):
        attach("ps://?mode=sync", nn.Linear(2, 2))


# ----- reference equivalence (commlab train, real servers) -----------------------------------------

OPTIMIZERS = {"sgd-momentum": ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"],
              "adam": ["--optimizer", "adam", "--lr", "0.01"]}
CASES = [(opt, k) for opt in OPTIMIZERS for k in (1, 3)]
PIECES = {1: "", 3: "&piece_mb=0.002"}  # K=3 also cuts the 8 KiB weight into 2 KiB pieces


@pytest.fixture(scope="module", params=TRANSPORTS)
def sync_runs(tmp_path_factory, request):
    """All four `commlab train` runs at once (2 workers each, K servers): their final state_dicts."""
    tmp = tmp_path_factory.mktemp("sync")
    cmds, paths = [], {}
    for opt, k in CASES:
        paths[opt, k] = tmp / f"{opt}-{k}.pt"
        url = f"ps://?shards={k}&mode=sync&bucket_mb=0.004{PIECES[k]}&transport={request.param}"
        cmds.append([sys.executable, "-m", "commlab.tools.cli", "train", "--exchanger", url,
                     "--workers", "2", "--model", "tiny", "--steps", "20", "--batch-size", "16", "--no-progress",
                     "--save-params", str(paths[opt, k]), *OPTIMIZERS[opt]])
    run_all(cmds)
    return {case: torch.load(path) for case, path in paths.items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("opt,shards", CASES)
def test_sync_matches_one_process_on_the_combined_batch(sync_runs, opt, shards, tmp_path):
    from workers.loop import config_from_args, parser, train

    ref_path = tmp_path / "local.pt"
    a = parser().parse_args(["--exchanger", "local://", "--model", "tiny", "--steps", "20", "--batch-size", "32",
                             "--no-progress", "--save-params", str(ref_path), *OPTIMIZERS[opt]])
    train(config_from_args(a), RankInfo.single())
    ref, got = torch.load(ref_path), sync_runs[opt, shards]
    assert set(ref) == set(got)
    start = build_model("tiny", 0)[0].state_dict()
    for name in ref:
        assert not torch.equal(ref[name], start[name])  # training moved it
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-5 * ref[name].abs().max().item())


# ----- async and ssp (driver workers with constant gradients) ----------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_applies_every_push_exactly_once_and_ends_at_the_closed_form(start_server, transport):
    server = start_server("--mode", "async")
    url = f"ps://{server.address}?mode=async&timeout=60&transport={transport}"
    outs = run_all([driver(url, r, 4, 200, "--grad", "0.25", "--lr", "0.5", "--final-version", "800")
                    for r in range(4)])
    stats = server.stats()
    assert stats["updates"] == 800 and stats["version"] == 800 and stats["duplicates"] == 0
    assert sum(stats["staleness"].values()) == 800
    # 800 updates of -0.5 * 0.25, all exact in float32, pulled by every rank once all were applied
    assert [json.loads(out)["param"] for out in outs] == [[-100.0] * 5] * 4


@pytest.mark.multiproc
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ssp_keeps_staleness_within_its_bound_and_async_does_not(start_server, transport):
    s = 2
    bound = psproto.ssp_staleness_bound(2, s)
    ssp = start_server("--mode", "ssp", "--staleness", str(s))
    asy = start_server("--mode", "async")
    cmds = []
    for server, mode in ((ssp, "ssp"), (asy, "async")):
        url = f"ps://{server.address}?mode={mode}&timeout=60&transport={transport}"
        # rank 0 is slow: its first gradient waits until 10 more updates landed (async lets rank 1
        # run that far ahead, so there the wait always ends that way, however loaded the machine; ssp
        # blocks rank 1, so there it ends after 3 s), then 20 ms per step
        lag = "60" if mode == "async" else "3"
        slow = ["--sleep", "0.02", "--lag-until-version", "10", "--lag-timeout", lag, "--barrier"]
        cmds += [driver(url, 0, 2, 20, *slow), driver(url, 1, 2, 20, "--barrier")]
    run_all(cmds)
    st_ssp, st_async = ssp.stats(), asy.stats()
    assert st_ssp["updates"] == st_async["updates"] == 40
    assert 0 < st_ssp["max_staleness"] <= bound, st_ssp["staleness"]
    assert st_async["max_staleness"] >= 10 > bound, st_async["staleness"]


# ----- the protocol refuses bad input and keeps serving (raw DEALER) ---------------------------------

@pytest.mark.multiproc
def test_bad_requests_get_reasons_and_change_nothing(start_server):
    server = start_server("--mode", "sync")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ex = attach(server, model)
    raw = Raw(server.endpoint)
    try:
        raw.send([b"\x93garbage"])
        assert raw.reply()[0].meta["reason"].startswith("header is not msgpack")
        assert "unknown op 'steal'" in raw.request("steal").meta["reason"]
        stranger = Raw(server.endpoint, "rank9")
        assert "rank9 sent push before hello" in stranger.request("push", 0).meta["reason"]
        stranger.close()
        w = torch.ones(6)
        assert "holds no key 'nope'" in raw.request("push", 0, wire.split("nope", w), base=0).meta["reason"]
        too_big = wire.split("weight", torch.ones(6, dtype=torch.float64))
        assert "limit 32" in raw.request("push", 0, too_big, base=0).meta["reason"]  # bigger than the shard
        bad_dtype = wire.split("weight", torch.ones(6, dtype=torch.float16))
        assert "weight is float32 on shard 0/1, frame is float16" in raw.request("push", 0, bad_dtype,
                                                                                 base=0).meta["reason"]
        short = wire.split("weight", torch.ones(5))
        assert "has 6 elements" in raw.request("push", 0, short, base=0).meta["reason"]
        assert "expects step 0" in raw.request("push", 3, wire.split("weight", w), base=0).meta["reason"]
        other = [["weight", [2, 4], "float32"], ["bias", [2], "float32"]]
        reason = raw.request("hello", rank=0, world=1, mode="sync", manifest=other, pieces=[], shard=[0, 1],
                             optim=ex.shards[0].hello_meta["optim"]).meta["reason"]
        assert "parameter 'weight' is float32[2, 3] here but float32[2, 4]" in reason
        stats = server.stats()
        assert stats["refused"] == 9 and stats["updates"] == 0 and stats["version"] == 0

        # a correct push from "rank0", sent twice (as after a reconnect), is applied once
        grads = {"weight": torch.full((6,), 0.5), "bias": torch.full((2,), -1.0)}
        parts = [p for k, g in grads.items() for p in wire.split(k, g)]
        assert raw.request("push", 0, parts, base=0).op == "ok"
        assert raw.request("push", 0, parts, base=0).meta["duplicate"] is True
        stats = server.stats()
        assert stats["updates"] == 1 and stats["duplicates"] == 1
        # the exchanger's own step 0 is that same (worker, step): a duplicate; its pull sees the update
        ex.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        ex.step()
        assert server.stats()["updates"] == 1
        for k, g in grads.items():
            torch.testing.assert_close(model.state_dict()[k].view(-1), start[k].view(-1) - 0.5 * g, rtol=0, atol=0)
    finally:
        raw.close()
        ex.close()


@pytest.mark.multiproc
def test_a_worker_asking_for_another_mode_is_refused_by_name(start_server):
    server = start_server("--mode", "sync")
    with pytest.raises(RemoteError, match=r"shard 0/1 at tcp://.*refused hello: shard 0/1 runs mode 'sync', "
                                          r"worker rank0 asked for 'async'"):
        attach(f"ps://{server.address}?mode=async&timeout=20", nn.Linear(2, 2))


@pytest.mark.multiproc
def test_a_second_model_that_differs_is_refused_naming_the_parameter(start_server):
    server = start_server("--mode", "async")
    first = attach(server, nn.Linear(4, 3), rank=0, world=1)  # (the hello refuses it before any world check)
    try:
        with pytest.raises(RemoteError, match=r"model mismatch on shard 0/1: parameter 'weight' is "
                                              r"float32\[3, 4\] here but float32\[3, 5\] on worker rank1"):
            attach(f"ps://{server.address}?timeout=20", nn.Linear(5, 3), rank=1, world=2)
    finally:
        first.close()


# ----- durability ----------------------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_checkpoint_on_stop_and_resume_continue_exactly(start_server, tmp_path, transport):
    ckpt = tmp_path / "ckpt"
    server = start_server("--mode", "async", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    model = nn.Linear(3, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optim = commlab.OptimizerSpec("sgd", lr=0.25, momentum=0.5)
    ex = attach(server, model, optim, transport=transport)

    def step(ex, model):
        ex.zero_grad()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        ex.step()

    for _ in range(3):
        step(ex, model)
    ex.close()
    assert server.stop() == 0
    assert (ckpt / "shard-0-of-1.pt").exists() and not list(ckpt.glob("*.tmp*"))

    resumed = start_server("--mode", "async", "--resume", str(ckpt))
    fresh = nn.Linear(3, 2)  # other initial values: the server's win
    ex2 = attach(resumed, fresh, optim, transport=transport)
    try:
        step(ex2, fresh)
        assert resumed.stats()["updates"] == 4 and resumed.stats()["last_step"] == {"0": 3}
        # momentum 0.5, grad 1: velocity 1, 1.5, 1.75, 1.875 -> moved by 0.25 * 6.125
        for k, v in fresh.state_dict().items():
            torch.testing.assert_close(v, start[k] - 0.25 * 6.125, rtol=0, atol=1e-6)
        raw = Raw(resumed.endpoint)
        parts = [p for k, v in fresh.state_dict().items() for p in wire.split(k, torch.ones(v.numel()))]
        assert raw.request("push", 2, parts, base=0).meta["duplicate"] is True
        raw.close()
        assert resumed.stats()["updates"] == 4
    finally:
        ex2.close()


@pytest.mark.multiproc
def test_a_parameter_no_worker_has_a_gradient_for_is_not_updated(start_server):
    server = start_server("--mode", "sync")
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    start = {k: v.clone() for k, v in model.state_dict().items()}
    # weight decay would move a parameter whose gradient were taken as zero
    ex = attach(server, model, commlab.OptimizerSpec("sgd", lr=0.5, momentum=0.9, weight_decay=0.1))
    try:
        for _ in range(2):
            ex.zero_grad()
            model["used"](torch.ones(4, 3)).sum().backward()
            ex.step()
        after = model.state_dict()
        for k in start:
            assert torch.equal(after[k], start[k]) == k.startswith("unused"), k
    finally:
        ex.close()


def test_a_server_refuses_to_bind_beyond_loopback_without_keys():
    out = subprocess.run([sys.executable, "-m", "servers", "--bind", "tcp://0.0.0.0:0", "--log-every", "0"],
                         capture_output=True, text=True, timeout=START_TIMEOUT, env=ENV, cwd=REPO)
    assert out.returncode == 2
    assert "refusing to bind tcp://0.0.0.0:0 without authentication" in out.stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_pull_async_is_one_step_of_a_bare_vector(start_server, transport):
    """The benchmark hook: after setup on a one-parameter model, push a tensor as its gradient, pull it."""
    server = start_server("--mode", "async")
    model = nn.ParameterList([nn.Parameter(torch.zeros(3 * 2**20 + 1))])  # not a multiple of anything
    ex = attach(server, model, commlab.OptimizerSpec("sgd", lr=0.5), transport=transport)
    try:
        grad = torch.full((3 * 2**20 + 1,), 0.25)
        for k in range(1, 4):
            param = ex.push_pull_async(grad).wait(30)
            assert param is model[0] and torch.equal(param.detach(), torch.full_like(grad, -0.125 * k))
        assert server.stats()["updates"] == 3
        with pytest.raises(ValueError, match="one parameter shaped like the tensor"):
            ex.push_pull_async(torch.zeros(5))
    finally:
        ex.close()


@pytest.fixture
def short_tmp():
    """A folder with a short path: an ipc socket's path must fit sockaddr_un's 107 characters, which pytest's
    tmp_path under pytest-xdist (``.../popen-gw0/test_name0/``) plus the servers' folder does not."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="cl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_launcher_over_ipc_trains_and_leaves_no_socket_folder(tmp_path, short_tmp):
    import glob

    from conftest import commlab_train

    tmp = short_tmp  # the launcher's TMPDIR: only this run's folders are in it
    proc = commlab_train(["--exchanger", "ps://?shards=2&transport=ipc&mode=sync", "--workers", "2", "--model", "tiny",
                          "--steps", "3", "--metrics", str(tmp_path / "m.jsonl")], env={"TMPDIR": tmp})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"listening on ipc://{tmp}/commlab-ps-" in proc.stdout + proc.stderr, \
        "the servers did not use ipc in TMPDIR: nothing to clean up"
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert glob.glob(str(tmp / "commlab-ps-*")) == []


def test_server_plans_remove_their_ipc_folder_also_on_errors(tmp_path, monkeypatch):
    import glob
    import tempfile

    from commlab.launch.launcher import server_plan

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # only this test's folders are counted
    pattern = str(tmp_path / "commlab-ps-*")
    with pytest.raises(RuntimeError, match="the caller failed"):
        with server_plan("ps://?shards=2&transport=ipc", 2) as (url, argvs):
            folders = glob.glob(pattern)
            assert len(folders) == 1
            assert [a[a.index("--bind") + 1] for a in argvs] == [f"ipc://{folders[0]}/shard{i}" for i in range(2)]
            raise RuntimeError("the caller failed")
    assert glob.glob(pattern) == []
    with server_plan("ps://?shards=2", 2) as (url, argvs):  # tcp: no folder at all
        assert len(argvs) == 2 and list(tmp_path.iterdir()) == []
    with server_plan("ps://127.0.0.1:5000?mode=sync", 2) as planned:  # names its servers: none to start
        assert planned == ("ps://127.0.0.1:5000?mode=sync", [])
    with server_plan("noop://", 2) as planned:  # a regime without plan_local
        assert planned == ("noop://", [])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiproc
def test_bench_servers_over_ipc_leave_no_socket_folder(short_tmp, monkeypatch):
    """A caller of plan_local other than the launcher: the GPU sweep's run_case, on CPU tensors."""
    import glob
    import tempfile

    from bench import gpu_sweep

    tmp_path = short_tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # run_case plans in this process
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # and its ranks inherit the environment
    out = gpu_sweep.run_case("ps://?shards=2&transport=ipc", "cpu", numel=1000, workers=1, steps=2, warmup=1,
                             timeout=RUN_TIMEOUT)
    assert "error" not in out, out.get("error")
    servers = out["facts"]["servers"]
    assert len(servers) == 2 and all(s.startswith(f"ipc://{tmp_path}/commlab-ps-") for s in servers), servers
    assert glob.glob(str(tmp_path / "commlab-ps-*")) == []


@pytest.mark.parametrize("update", ["worker", "server"])
def test_a_scheduler_made_after_setup_drives_the_update(start_server, update):
    """update=server takes over optimizer.step(); torch's LR schedulers wrap that method when they are
    made (after setup, as in most scripts), and the wrapped step must still reach the server, with the
    scheduled learning rate (it travels with the commit). update=worker: the user's optimizer steps."""
    server = start_server("--mode", "sync")
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ex = attach(f"ps://{server.address}?timeout=20&update={update}", model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    try:
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(1, 3)).sum().backward()  # gradient 1 for every weight
            opt.step()
            sched.step()
        # SGD with lr 0.5, then the scheduled 0.25: 1 - 0.5 - 0.25
        assert model.weight.tolist() == [[0.25, 0.25, 0.25]]
        assert opt.param_groups[0]["lr"] == 0.125 and ex.stats.steps == 2
        assert server.stats()["updates"] == 2 and server.stats()["update"] == update
    finally:
        ex.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nan_and_inf_are_summed_in_sync_and_refused_in_async(start_server, transport):
    """Sync: a non-finite gradient is summed, so every worker sees it (and every GradScaler skips); its
    frames are still checked like any other. Async: refused, counted, nothing applied."""
    for mode in ("sync", "async"):
        server = start_server("--mode", mode)
        model = nn.Linear(3, 2)
        ex = commlab.connect(f"ps://{server.address}?timeout=20&mode={mode}&transport={transport}",
                             RankInfo(0, 2, 0, "127.0.0.1", 0, "flags"))
        raw = Raw(server.endpoint, "rank1")
        try:
            setup_beside_raw(ex, model, commlab.OptimizerSpec("sgd", lr=0.5), raw)
            g = torch.ones(6)
            g[4] = math.nan if mode == "sync" else math.inf
            parts = [*wire.split("weight", g), *wire.split("bias", torch.ones(2))]
            short = raw.request("push", 0, wire.split("weight", g[:5]), base=0)  # a wrong length: still refused
            assert "weight has 6 elements on shard 0/1, the frames carry 5" in short.meta["reason"]
            reply = raw.request("push", 0, parts, base=0)
            if mode == "async":
                assert "weight holds NaN or Inf; refused, nothing applied" in reply.meta["reason"]
                assert server.stats()["nonfinite"] == 1 and server.stats()["updates"] == 0
                continue
            assert reply.op == "ok"
            ex.zero_grad()
            model(torch.ones(1, 3)).sum().backward()  # rank 0's gradient: finite
            assert math.isnan(model.weight.grad.view(-1)[4]) and math.isfinite(model.weight.grad.view(-1)[3])
            assert server.stats()["nonfinite"] == 0
        finally:
            raw.close()
            ex.close()
