"""``python -m bench.launch_job``: the library's launcher, placed for a benchmark.

Runs ``commlab.launcher.launch`` with a per-rank module (the training worker or
:mod:`bench.bw_worker`). With ``--link-tag``, the parent already built a
:class:`commlab.netns.Links` topology (found again by its tag): rank r runs in host r's
namespace, and servers a regime would start on loopback (``plan_local``, e.g. ``ps://``)
run in hosts N, N+1, ... instead, bound to their namespace's address (``--insecure``:
the address exists only inside namespaces this benchmark created).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from commlab import launcher
from commlab.netns import Links

LOOPBACK_TCP = re.compile(r"tcp://127\.0\.0\.1:(\d+)")


def place_servers(url: str, server_argvs: list[list[str]], links: Links, first_host: int) -> tuple[str, list[list[str]]]:
    """Move the loopback endpoints of a ``plan_local`` plan onto hosts ``first_host``, ``first_host + 1``, ...

    Server i's ``tcp://127.0.0.1:P`` becomes ``tcp://<address of host first_host + i>:P`` in its argv
    and in the workers' URL. A plan whose servers are not on loopback tcp cannot be placed.
    """
    moved = {}
    out = []
    for i, argv in enumerate(server_argvs):
        text = " ".join(argv)
        ports = LOOPBACK_TCP.findall(text)
        if len(ports) != 1:
            raise ValueError(f"server {i}'s plan {argv} does not bind one loopback tcp endpoint: cannot place it "
                             f"in a namespace")
        addr = links.addr(first_host + i)
        moved[ports[0]] = addr
        out.append([LOOPBACK_TCP.sub(f"tcp://{addr}:\\1", a) for a in argv] + ["--insecure"])
    url = LOOPBACK_TCP.sub(lambda m: f"tcp://{moved.get(m.group(1), '127.0.0.1')}:{m.group(1)}", url)
    return url, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launch_job")
    p.add_argument("--url", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--module", default="workers")
    p.add_argument("--link", help="tc rate of the parent's Links topology")
    p.add_argument("--link-tag", help="tag of the parent's Links topology")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the per-rank arguments")
    a = p.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    if not a.link_tag:
        return launcher.launch(a.url, a.workers, rest, module=a.module)
    links = Links(a.workers, a.link, tag=a.link_tag)  # not entered: the parent owns the namespaces
    with launcher.planned_servers(a.url, a.workers) as (url, argvs):
        url, argvs = place_servers(url, argvs, links, first_host=a.workers)
        servers = []
        try:
            for i, argv in enumerate(argvs):
                cmd = [*links.prefix(a.workers + i), sys.executable, "-m", "servers", *argv]
                servers.append(launcher.Proc(f"server {i}", subprocess.Popen(cmd)))
            return launcher.launch(url, a.workers, rest, module=a.module, master_addr=links.addr(0),
                                   rank_prefix=links.prefix)
        finally:
            launcher.stop_all(servers)


if __name__ == "__main__":
    sys.exit(main())
