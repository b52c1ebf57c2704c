"""The job's rendezvous store, hosted on a port the operating system picks.

:func:`host` is torch's ``TCPStore`` bound to port 0 (``store.port`` says which it got), served by
the calling process as torchrun's agent serves it: every rank, rank 0 included, connects as a
client (``TORCHELASTIC_USE_AGENT_STORE=True``). No port is picked and released before the store
binds it.

``python -m commlab.transport.store --bind ADDR`` hosts it in a process of its own, for ranks that cannot
reach the launcher (started in other network namespaces: the launcher starts this module there,
with the same prefix as rank 0). It prints ``listening on tcp://ADDR:PORT`` once bound, as servers
do (:func:`commlab.launch.launcher.start_servers` reads that line), and serves until it is signalled.
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta


def host(addr: str, timeout: float):
    """torch's TCPStore, served by this process on ``addr`` and a port of the kernel's choosing
    (``store.port``); ``timeout`` bounds each of its waits. Does not block."""
    import torch.distributed as dist

    return dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False, use_libuv=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commlab.transport.store", description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", required=True, help="the address to listen on (the port is the kernel's choice)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound of each store wait, seconds")
    a = p.parse_args(argv)
    store = host(a.bind, a.timeout)
    print(f"commlab store: listening on tcp://{a.bind}:{store.port}", flush=True)
    while True:  # until SIGTERM or SIGKILL (the launcher's stop), or the launcher's death (childexec)
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
