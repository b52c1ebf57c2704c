"""``python -m bench.launch_job``: the library's launcher, placed for a benchmark.

Runs the launcher's job (:func:`commlab.launcher.worker_job`, :func:`commlab.launcher.run_job`) with a
per-rank module (the training worker or :mod:`bench.bw_worker`). With ``--link-tag``, the parent
already built a :class:`bench.netns.Links` topology (found again by its tag): rank r runs in
host r's namespace, the rendezvous store beside rank 0, and servers a regime would start on
loopback (``plan_local``, e.g. ``ps://``) run in hosts N, N+1, ... instead, bound to their
namespace's address and port 0 (``--insecure``: the address exists only inside namespaces this
benchmark created); each reports what it bound, as on loopback.
"""

from __future__ import annotations

import argparse
import re
import sys

from commlab import launcher
from bench.netns import Links

LOOPBACK_TCP = re.compile(r"^tcp://127\.0\.0\.1:(\d+)$")


def place_servers(url: str, server_argvs: list[list[str]], links: Links, first_host: int) -> tuple[str, list[list[str]]]:
    """Move the loopback endpoints of a ``plan_local`` plan onto hosts ``first_host``, ``first_host + 1``, ...

    Server i's ``--bind tcp://127.0.0.1:P`` (P is 0 in a plan: the server reports what it bound)
    becomes ``tcp://<address of host first_host + i>:P`` in its argv and in the workers' URL
    template, in server order (:func:`commlab.launcher.with_endpoints`). A plan whose servers are
    not on loopback tcp cannot be placed.
    """
    binds, placed, out = [], [], []
    for i, argv in enumerate(server_argvs):
        bind = launcher.bind_of(argv)
        m = LOOPBACK_TCP.match(bind)
        if m is None:
            raise ValueError(f"server {i}'s plan {argv} does not bind one loopback tcp endpoint: cannot place it "
                             f"in a namespace")
        binds.append(bind)
        placed.append(f"tcp://{links.addr(first_host + i)}:{m.group(1)}")
        out.append([placed[-1] if a == bind else a for a in argv] + ["--insecure"])
    return launcher.with_endpoints(url, binds, placed), out


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
    n = a.workers
    return launcher.run_job(launcher.worker_job(
        a.url, n, rest, module=a.module, master_addr=links.addr(0), rank_prefix=links.prefix,
        server_prefix=lambda i: links.prefix(n + i),
        place_servers=lambda url, argvs: place_servers(url, argvs, links, first_host=n)))


if __name__ == "__main__":
    sys.exit(main())
