"""A shard's live metrics (``commlab server --metrics-port P``): its stats as Prometheus families.

The shard's state belongs to its one thread. A scrape (on the HTTP thread) asks that thread for a
snapshot through a :class:`StatsProbe`, which the serve loop answers between two messages (it polls
at least every 100 ms), so what a scrape shows is exactly what a ``stats`` request would have
answered at that moment. Without a metrics port there is no probe and the loop checks one ``None``.

The families (labels: ``shard``, the shard's index; ``space``, the key space, ``(first)`` for a job's
first exchanger and ``(none)`` for what no space could be charged with):

- counters ``commlab_server_<counter>_total`` for each of :attr:`ShardServer.COUNTERS` (updates,
  pushes, pulls, bytes_in, bytes_out, refused, ...): summed over ``space`` they equal ``stats``;
- histograms ``commlab_server_staleness`` (async/ssp: updates behind the newest, per applied push)
  and ``commlab_server_clock_gap`` (the pusher's step minus the slowest active worker's);
- membership and restarts: gauges ``commlab_server_world`` (ranks the job has), ``_workers`` (ranks
  that said hello), ``_attempt`` (TORCHELASTIC_RESTART_COUNT of the newest hello), ``_version``,
  ``_queue`` (pulls waiting), ``_live`` (0 once every rank closed the space), ``_last_step{rank}``;
- ``commlab_server_auth_*``: handshakes, failed ones, refused messages, closed connections;
- ``commlab_server_info{shard, shards, mode, boot}`` = 1.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from commlab.base.errors import CommTimeout
from commlab.launch.exporter import add_histogram

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
ANSWER_S = 5.0  # a scrape waits this long for the shard's thread (busy with one message at most)


class StatsProbe:
    """Snapshots of a shard's stats taken on its own thread for another thread (the HTTP server's)."""

    def __init__(self):
        self._asks: queue.SimpleQueue = queue.SimpleQueue()

    def ask(self, timeout: float = ANSWER_S) -> dict:
        """The shard's snapshot (any thread). Blocks until the serve loop answers, at most ``timeout``
        seconds; raises CommTimeout when it does not."""
        box: list = [None, threading.Event()]
        self._asks.put(box)
        if not box[1].wait(timeout):
            raise CommTimeout(f"the shard's thread did not answer a metrics scrape within {timeout:g}s")
        return box[0]

    def answer(self, snapshot: Callable[[], dict]) -> None:
        """Answer every scrape waiting (the shard's thread; cheap when none is)."""
        if self._asks.empty():
            return
        snap = snapshot()
        while True:
            try:
                box = self._asks.get_nowait()
            except queue.Empty:
                return
            box[0] = snap
            box[1].set()


def space_label(name: str) -> str:
    return name or "(first)"


class ShardCollector:
    """The families of one shard (see the module's docstring), from :meth:`ShardServer.metrics_snapshot`."""

    def __init__(self, probe: StatsProbe, counters: tuple[str, ...]):
        self.probe, self.counters = probe, counters

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self.probe.ask()
        total, spaces, unattributed = snap["total"], snap["spaces"], snap["unattributed"]
        shard = str(total["shard"])
        info = GaugeMetricFamily("commlab_server_info", "The shard, its mode and its incarnation (boot)",
                                 labels=["shard", "shards", "mode", "boot"])
        info.add_metric([shard, str(total["shards"]), str(total["mode"]), str(total["boot"])], 1)
        yield info
        for key in self.counters:
            fam = CounterMetricFamily(f"commlab_server_{key}", f"The shard's {key} counter (stats)",
                                      labels=["shard", "space"])
            for name, st in spaces.items():
                fam.add_metric([shard, space_label(name)], st[key])
            fam.add_metric([shard, "(none)"], unattributed[key])
            yield fam
        gauges = {key: GaugeMetricFamily(f"commlab_server_{key}", doc, labels=["shard", "space"]) for key, doc in (
            ("world", "Ranks in the job the space serves"), ("workers", "Ranks that said hello"),
            ("attempt", "The job's restarts so far (TORCHELASTIC_RESTART_COUNT of the newest hello)"),
            ("version", "Updates applied to the space's parameters"), ("queue", "Pulls waiting"),
            ("live", "1 while ranks use the space, 0 once all closed it"))}
        last = GaugeMetricFamily("commlab_server_last_step", "The last step applied per rank",
                                 labels=["shard", "space", "rank"])
        hists = {key: HistogramMetricFamily(f"commlab_server_{key}", doc, labels=["shard", "space"]) for key, doc in (
            ("staleness", "Per applied push (async, ssp): updates applied since the pusher's pull"),
            ("clock_gap", "Per applied push (async, ssp): the pusher's step minus the slowest active worker's"))}
        for name, st in spaces.items():
            labels = [shard, space_label(name)]
            values = {"world": st["world"] or 0, "workers": len(st["workers"]), "attempt": st["attempt"],
                      "version": st["version"], "queue": st["queue"], "live": 1 if st.get("live", True) else 0}
            for key, value in values.items():
                gauges[key].add_metric(labels, value)
            for rank, step in st["last_step"].items():
                last.add_metric([*labels, rank], step)
            for key, fam in hists.items():
                add_histogram(fam, dict(zip(("shard", "space"), labels)),
                              {int(k): v for k, v in st[key].items()}, STALENESS_BUCKETS)
        yield from gauges.values()
        yield last
        yield from hists.values()
        auth = total["auth"]
        for key in ("handshakes", "failed_handshakes", "refused_messages", "connections_closed", "spaces_freed"):
            fam = CounterMetricFamily(f"commlab_server_auth_{key}", f"The shard's auth {key} counter", labels=["shard"])
            fam.add_metric([shard], auth[key])
            yield fam
        peers = GaugeMetricFamily("commlab_server_auth_peers", "Connections that proved the job's secret",
                                  labels=["shard"])
        peers.add_metric([shard], auth["peers"])
        yield peers
