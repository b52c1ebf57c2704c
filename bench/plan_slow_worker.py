"""``python -m bench.plan_slow_worker``: the training worker, with one rank deliberately slow.

Rank ``$PLAN_SLOW_RANK`` sleeps ``$PLAN_SLOW_S`` seconds at the start of every step (inside
``zero_grad``, so the time counts as its compute), which is what the planner's straggler
``slow:SECONDS`` models. Every other rank is the plain worker (``python -m workers``). Used by
:mod:`bench.plan_validate` to compare the predicted and measured staleness of async servers.
"""

from __future__ import annotations

import os
import sys
import time

import commlab
from workers import loop


def main(argv: list[str] | None = None) -> int:
    slow_rank = int(os.environ.get("PLAN_SLOW_RANK", "-1"))
    delay = float(os.environ.get("PLAN_SLOW_S", "0"))
    connect = commlab.connect

    def connect_slowed(*args, **kwargs):
        ex = connect(*args, **kwargs)
        if int(os.environ.get("RANK", "-2")) == slow_rank and delay > 0:
            zero_grad = ex.zero_grad

            def slow_zero_grad():
                time.sleep(delay)
                zero_grad()
            ex.zero_grad = slow_zero_grad
        return ex

    commlab.connect = connect_slowed  # the loop calls commlab.connect(...) by attribute
    return loop.main(argv)


if __name__ == "__main__":
    sys.exit(main())
