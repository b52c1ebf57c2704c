"""``python -m commlab.launch.spare ASSIGN CMD...``: an idle rank of ``commlab run --spares S``.

It pays what a rank's start costs before any rank dies (the interpreter, torch, commlab, the first
optimizer's lazy imports: :func:`commlab.core.optim.warm_up`), then waits for the launcher to write ``ASSIGN``
(JSON: ``rank``, ``since`` the death was noticed, ``args`` the rank's own arguments, ``url`` the workers' URL as of now;
written to a temporary name and renamed, so it is read whole). Then it takes the rank's environment (``RANK``, ``LOCAL_RANK``,
``$COMMLAB_REPLACEMENT``) and runs ``CMD`` in this process: a script path, or ``-m MODULE``, with the
arguments, as ``python CMD...`` would. The launcher stops an idle spare with its process group at the end of
the job (and it dies with the launcher: childexec).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

from commlab.transport.rendezvous import REPLACEMENT


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m commlab.launch.spare ASSIGN SCRIPT|-m MODULE [ARGS...]")
    assign, cmd = argv[0], argv[1:]
    import torch  # noqa: F401  (what a start costs: paid while idle)
    import commlab  # noqa: F401
    from commlab.core.optim import warm_up
    from commlab.core.registry import ENV_URL, regime_class
    from commlab.base.config import ExchangerURL

    url = os.environ.get(ENV_URL, "")
    if url:
        regime_class(ExchangerURL.parse(url).scheme)  # its module imported too
    warm_up()
    while not os.path.exists(assign):
        time.sleep(0.005)
    with open(assign) as fh:
        job = json.load(fh)
    os.environ.update(RANK=str(job["rank"]), LOCAL_RANK=str(job["rank"]), **{REPLACEMENT: f"{job['since']:.6f}"})
    if job.get("url") and url:  # the servers alive now (replicated ones may have moved): in the env and the flag
        cmd = [job["url"] if a == url else a for a in cmd]
        os.environ[ENV_URL] = job["url"]
    rest = [str(a) for a in job.get("args", [])]
    if cmd[0] == "-m":
        sys.argv = [cmd[1], *cmd[2:], *rest]
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [*cmd, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(cmd[0])))
        runpy.run_path(cmd[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
