"""Several hosts on one machine: network namespaces joined by veth pairs and a bridge, optionally capped.

:class:`Links` puts every host (a rank, a server) in a namespace of its own,
joined to a hub namespace that holds a bridge. ``bench --link 1gbit`` caps each
link with ``tc tbf``; the multi-host tests (tests/test_multihost.py) use it
uncapped (``rate=None``) to run servers and workers on real, non-loopback
addresses::

        ns h0 (10.77.0.1)        ns h1 (10.77.0.2)        ns h2 (10.77.0.3)
          cl0 [tbf RATE]           cl0 [tbf RATE]           cl0 [tbf RATE]
            |                        |                        |
          <tag>v0 [tbf RATE] ---- br0 (ns hub) ---- <tag>v1 [tbf RATE] ...

With a rate, each rank's link is capped in both directions (tbf on the rank's side caps what
it sends, tbf on the hub's side caps what it receives), so a rank can move RATE
out and RATE in at once, like a full-duplex NIC. Every interface, address and
qdisc lives inside namespaces created here (the host's own network is never
touched), and :meth:`Links.close` deletes them all, which also removes their
veths and qdiscs; it runs on normal exit, on failure and on Ctrl-C.

Processes join a rank's namespace through :meth:`Links.prefix`, a command
prefix for the launcher (``ip netns exec NS env BENCH_ADDR=... GLOO_SOCKET_IFNAME=cl0``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess

from commlab.plan.rates import parse_rate

SUBNET = "10.77.0"
IFNAME = "cl0"  # the rank side of every veth has this name inside its own namespace

def link_unavailable_reason() -> str | None:
    """Why namespaces (and capped links) cannot be built here, or None if they can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespaces need the '{tool}' command (iproute2), which is not installed"
    return None


class Links:
    """``hosts`` namespaces, each with one link to a bridge (capped at ``rate``, or not for None).
    A context manager; ``subnet`` is the first three octets of the hosts' addresses (only ever
    assigned inside these namespaces)."""

    def __init__(self, hosts: int, rate: str | None, tag: str | None = None, subnet: str = SUBNET):
        if hosts < 1:
            raise ValueError("Links needs at least one host")
        self.hosts, self.rate, self.subnet = hosts, rate, subnet
        self.rate_bytes = parse_rate(rate) if rate is not None else None
        self.tag = tag or f"cl{os.getpid() % 100000}"
        self.hub = f"{self.tag}hub"
        self.namespaces: list[str] = []  # every namespace created, in order, for close()
        self._closed = False

    def addr(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def ns(self, host: int) -> str:
        return f"{self.tag}h{host}"

    def prefix(self, host: int) -> list[str]:
        """Command prefix that runs a process inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), "env", f"BENCH_ADDR={self.addr(host)}",
                f"GLOO_SOCKET_IFNAME={IFNAME}"]

    def facts(self) -> dict:
        qdisc = f"tbf rate {self.rate} burst {self._burst()}" if self.rate is not None else None
        return {"link": "veth pairs through a bridge, in network namespaces", "rate": self.rate,
                "rate_bytes_per_s": self.rate_bytes, "qdisc": qdisc,
                "addresses": [self.addr(h) for h in range(self.hosts)]}

    def _burst(self) -> int:
        # at least one 64 KiB GSO segment, and about 2 ms at the rate
        return int(max(128 * 1024, (self.rate_bytes or 0) / 500))

    def _ip(self, *args: str) -> None:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {out.stderr.strip() or out.stdout.strip()}")

    def __enter__(self) -> "Links":
        atexit.register(self.close)
        try:
            self._add_ns(self.hub)
            self._ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("ip", "-n", self.hub, "link", "set", "br0", "up")
            burst = str(self._burst())
            for h in range(self.hosts):
                ns, hub_side = self.ns(h), f"{self.tag}v{h}"
                self._add_ns(ns)
                self._ip("ip", "link", "add", hub_side, "netns", self.hub, "type", "veth", "peer", "name", IFNAME,
                         "netns", ns)
                self._ip("ip", "-n", self.hub, "link", "set", hub_side, "master", "br0", "up")
                self._ip("ip", "-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", IFNAME)
                self._ip("ip", "-n", ns, "link", "set", IFNAME, "up")
                if self.rate is None:
                    continue
                for where, dev in ((self.hub, hub_side), (ns, IFNAME)):
                    self._ip("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                             "burst", burst, "latency", "50ms")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        self._ip("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._ip("ip", "-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Delete every namespace created (their veths, bridge and qdiscs go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        atexit.unregister(self.close)

    def __exit__(self, *exc) -> None:
        self.close()
