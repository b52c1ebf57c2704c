"""``python -m bench.launch_job``: the library's launcher, placed for a benchmark.

Runs ``commlab.launcher.launch`` with a per-rank module (the training worker or
:mod:`bench.bw_worker`) and, for ``--link``, each rank inside its namespace of a
:class:`commlab.netns.Links` topology the parent already built (found again by its tag).
"""

from __future__ import annotations

import argparse
import sys

from commlab import launcher
from commlab.netns import Links


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
    kwargs = {}
    if a.link_tag:
        links = Links(a.workers, a.link, tag=a.link_tag)  # not entered: the parent owns the namespaces
        kwargs = {"master_addr": links.addr(0), "rank_prefix": links.prefix}
    return launcher.launch(a.url, a.workers, rest, module=a.module, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
