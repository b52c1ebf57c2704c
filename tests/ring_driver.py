"""A ring rank for tests/test_multihost.py whose sums are known in closed form.

``python tests/ring_driver.py URL --rank R --workers N --master-addr A --master-port P --rounds K``

Rank r holds (r + 1) x base for every size below (base: small integers, so any order of float32
additions gives the exact sum), all-reduces it ``rounds`` times and counts the elements that differ
from N(N+1)/2 x base. With ``--await KEY`` it first waits until KEY is in the rendezvous store (a
stranger has started knocking). Prints one JSON line: wrong elements, the links' transports, facts.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

import torch

import commlab
from commlab.transport.rendezvous import from_env, leave

SIZES = (0, 1, 7, 300_001, 4 * 2**20 + 5)  # the last: 16 MiB of float32 and 5 elements, in 1 MiB chunks


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--await", dest="wait_for", default="", help="store key to wait for before the rounds")
    a = p.parse_args()
    torch.set_num_threads(1)
    info = from_env({}, rank=a.rank, world_size=a.workers, master_addr=a.master_addr, master_port=a.master_port)
    n = a.workers
    wrong = 0
    with commlab.connect(a.url, info) as ex:
        ex.meet()
        if a.wait_for:
            ex.store.wait([a.wait_for], timedelta(seconds=60))
        for _ in range(a.rounds):
            for size in SIZES:
                base = (torch.arange(size, dtype=torch.float32) % 7) - 3
                x = base * (a.rank + 1)
                ex.allreduce(x, what=f"{size} elements")
                wrong += int((x != base * (n * (n + 1) // 2)).sum())
        facts = ex.facts()
        leave(ex.store, info, 60, "driver/done")  # rank 0 hosts the store: it stays until everyone is through
    print(json.dumps({"rank": a.rank, "wrong": wrong, "links": facts["links"],
                      "authentication": facts["authentication"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
