"""Exchangers over a group of the job's ranks (``commlab.connect(url, group=...)``, issue 29).

One 4-rank job carries most checks, since 4 processes on 2 cores are slow to start: the replica
groups are {0, 2} and {1, 3} (interleaved, so a position in a group is not the global rank and a
message naming positions would name the wrong rank). Every regime exchanges, per group, parameters
of the same shapes with different closed-form gradients: rank r's gradient of every element is
(r + 1) x (1 + 2 + 3) over three micro-batches, so group {0, 2} averages 12, group {1, 3} 18, and
after two SGD steps (lr 1, from zeros) the parameters are exactly -24 and -36. A crossing of the
groups would give -30 (a wrong value, not a shape error).
"""

from __future__ import annotations

import pytest

import commlab
from commlab.base.errors import ConfigError
from commlab.transport.rendezvous import RankInfo

GROUPS_JOB = """
import json, os, sys, time
import torch
from torch import nn
import commlab
from commlab.base.errors import CommError, ConfigError

r = int(os.environ["RANK"])
server = os.environ["PS_SERVER"]
group = [0, 2] if r % 2 == 0 else [1, 3]
out = {"regimes": {}}
URLS = ["allreduce://?backend=gloo&timeout=30", "ring://?transport=shm&timeout=30", "ring://?transport=tcp&timeout=30",
        f"ps://{server}?mode=sync&update=worker&transport=tcp&timeout=30",
        f"ps://{server}?mode=sync&update=server&transport=tcp&timeout=30"]
for url in URLS:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ex = commlab.connect(url, group=group)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ex.setup(model, opt)
    per_step = []
    for step in range(2):
        opt.zero_grad()
        before = ex.stats.exchanges
        for m in range(3):  # micro-batches: exchanged once, after the last
            loss = sum((p * (r + 1) * (m + 1)).sum() for p in model.parameters())
            if m < 2:
                with ex.no_sync():
                    loss.backward()
            else:
                loss.backward()
        per_step.append(ex.stats.exchanges - before)
        opt.step()
    out["regimes"][url.split("?")[0].split(":")[0] + "?" + url.split("?")[1]] = {
        "values": sorted({round(float(v), 6) for p in model.parameters() for v in p.detach().reshape(-1)}),
        "exchanges_per_step": per_step, "rank": ex.rank, "world": ex.world_size}
    ex.close()

# groups that disagree: rank 0 says [0, 1] while rank 1 says [1, 2] (and rank 2 agrees with rank 1)
bad = {0: [0, 1], 1: [1, 2], 2: [1, 2], 3: [3]}[r]
try:
    ex = commlab.connect("allreduce://?backend=gloo&timeout=20", group=bad)
    model = nn.Linear(2, 2)
    ex.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ex.close()
    out["disagree"] = "ok"
except ConfigError as exc:
    out["disagree"] = str(exc)

# a member that stalls: in group [1, 3] (positions 0 and 1), rank 3 never runs its backward
if r in (1, 3):
    model = nn.Linear(2, 2)
    ex = commlab.connect(os.environ["STALL_URL"], group=[1, 3])
    ex.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if r == 1:
        try:
            model(torch.ones(1, 2)).sum().backward()
            out["stall"] = "no error"
        except CommError as exc:
            out["stall"] = str(exc)
        ex.close()
    else:
        time.sleep(float(os.environ["STALL_S"]))
print(json.dumps(out))
"""

STALL_URLS = {"allreduce": "allreduce://?backend=gloo&timeout=3", "ring": "ring://?transport=tcp&timeout=3"}


@pytest.mark.multiproc
@pytest.mark.parametrize("stall", ["ring", pytest.param("allreduce", marks=pytest.mark.full)])
def test_two_groups_in_one_job_do_not_cross_under_every_regime(run_ranks, procs, stall):
    server = procs.server("--mode", "sync")
    results = run_ranks(GROUPS_JOB, 4, timeout=240,
                        env={"PS_SERVER": server.address, "STALL_URL": STALL_URLS[stall], "STALL_S": "8"})
    outs = [res.json() for res in results]
    for r, out in enumerate(outs):
        expect = -24.0 if r % 2 == 0 else -36.0  # -(2 steps x 6 x mean(r + 1) over the group)
        assert len(out["regimes"]) == 5
        for url, got in out["regimes"].items():
            assert got["values"] == [expect], (r, url, got)
            assert got["exchanges_per_step"] == [1, 1], (r, url, got)
            assert (got["rank"], got["world"]) == (r // 2, 2), (r, url, got)
    # disagreeing groups: the rank that sees it names both global ranks and both groups; the others go on
    assert outs[0]["disagree"].startswith("rank 0 names group [0, 1] but rank 1 names [1, 2]"), outs[0]
    assert [o["disagree"] for o in outs[1:]] == ["ok"] * 3
    # the stall: rank 1 (position 0) names rank 3 (position 1), never "rank 1" as the culprit
    assert "waiting for rank 3 (never seen)" in outs[1]["stall"] and " on rank 1 " in outs[1]["stall"], outs[1]


def test_a_group_naming_a_rank_outside_the_job_is_one_clear_error():
    info = RankInfo(1, 4, 1, "127.0.0.1", 1, "flags")
    with pytest.raises(ConfigError, match=r"^group \[1, 5\] names rank\(s\) \[5\], outside the job of 4 ranks"):
        commlab.connect("allreduce://", info, group=[1, 5])
    with pytest.raises(ConfigError, match=r"^rank 1 is not in its own group \[0, 2\]$"):
        commlab.connect("ring://", info, group=[0, 2])
    with pytest.raises(ConfigError, match=r"^group \[1, 1\] names a rank twice$"):
        commlab.connect("ps://", info, group=[1, 1])
    with pytest.raises(ConfigError, match=r"^group= takes a list of the job's global ranks or a 1-D DeviceMesh"):
        commlab.connect("allreduce://", info, group="0,1")
    with pytest.raises(ConfigError, match=r"^ring://\?transport=torch does not run over a group"):
        commlab.connect("ring://?transport=torch", info, group=[1, 3])


def test_a_group_view_names_global_ranks_and_keeps_the_job_view():
    info = RankInfo(3, 4, 3, "127.0.0.1", 1, "flags").within([1, 3])
    assert (info.rank, info.world_size, info.members, info.namespace) == (1, 2, (1, 3), "g1-3/")
    assert (info.who(), info.who(0), info.job.rank, info.job.world_size) == ("rank 3", "rank 1", 3, 4)
    ex = commlab.connect("allreduce://", RankInfo(3, 4, 3, "127.0.0.1", 1, "flags"), group=[1, 3])
    assert (ex.rank, ex.world_size, ex.grad_scale) == (1, 2, 0.5)
