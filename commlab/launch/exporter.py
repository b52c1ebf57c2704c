"""Live metrics in Prometheus's text format: ``commlab server --metrics-port P`` and ``commlab run --metrics-port P``.

Off by default and free when off: nothing here is imported, no thread runs, until a metrics port is
given. The ``prometheus-client`` package serves the endpoint (``pip install 'commlab[metrics]'``);
without it a metrics port is refused in one line before anything starts.

Who serves what::

    commlab run --metrics-port P  (the launcher, one endpoint)
      ├── the job:    commlab_job_*  (ranks, ranks up, restarts)
      ├── each rank:  commlab_rank_* (step, step time, exposed communication, bytes), read from the
      │               lines each rank already writes to $COMMLAB_METRICS (commlab.report())
      └── each shard: commlab_server_*, fetched from the shard's own endpoint, which the launcher
                      asks it to open on loopback port 0 (``--metrics-port 0``), at every scrape

    commlab server --metrics-port P  (one shard: servers/metrics.py builds its families)

Every endpoint binds loopback (127.0.0.1) unless told otherwise; an address off loopback serves
unauthenticated plain HTTP to whoever reaches it, so it needs ``--metrics-insecure`` as well, the
same explicit choice a server's zmq bind needs (``--insecure``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from commlab.base.errors import ConfigError
from commlab.core.metrics import metrics_path

EXTRA = "pip install 'commlab[metrics]'"
DEFAULT_ADDR = "127.0.0.1"
# step times (seconds): from a tiny model's milliseconds to a large model's seconds
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SCRAPE_TIMEOUT_S = 5.0


def require(option: str = "--metrics-port") -> None:
    """Raise ConfigError naming ``option`` when prometheus-client is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"{option} needs the prometheus-client package: {EXTRA}") from None


def check_bind(addr: str, insecure: bool, option: str = "--metrics-addr") -> None:
    """ConfigError unless ``addr`` is loopback (or ``localhost``), or ``insecure`` says off-loopback is meant."""
    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        raise ConfigError(f"{option} {addr!r} is not an IP address (or localhost)") from None
    if not loopback and not insecure:
        raise ConfigError(f"{option} {addr}: metrics are plain, unauthenticated HTTP; binding an address off "
                          f"loopback needs --metrics-insecure as well")


@dataclass
class Endpoint:
    """A running metrics endpoint (:func:`serve`); :meth:`close` stops it."""

    url: str
    httpd: Any  # wsgiref's WSGIServer, made by prometheus_client

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(collector, addr: str, port: int, option: str = "--metrics-port") -> Endpoint:
    """Serve ``collector`` (an object with ``collect()`` yielding metric families) at ``http://addr:port/metrics``
    on a daemon thread; port 0 takes a free one (the URL says which). The collector is called only when
    scraped, on the server's thread. Raises ConfigError naming ``option`` if the port cannot be bound."""
    require(option)
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)  # (auto-describe would scrape once now)
    registry.register(collector)
    try:
        httpd, _ = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError(f"{option} {port} on {addr}: {exc.strerror or exc}") from None
    host, bound = str(httpd.server_address[0]), int(httpd.server_address[1])
    host = f"[{host}]" if ":" in host else host
    return Endpoint(f"http://{host}:{bound}/metrics", httpd)


def add_histogram(family, labels: Mapping[str, str], counts: Mapping[float, int], bounds: Iterable[float]) -> None:
    """One series of ``family`` (a HistogramMetricFamily) from exact counts per observed value."""
    buckets = [(_le(b), sum(n for v, n in counts.items() if v <= b)) for b in bounds]
    buckets.append(("+Inf", sum(counts.values())))
    family.add_metric(list(labels.values()), buckets, sum(v * n for v, n in counts.items()))


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


# ----- the launcher's endpoint ------------------------------------------------------------------------------

@dataclass
class _RankTail:
    """What one rank reported so far, read incrementally from its metrics file."""

    path: str
    offset: int = 0
    partial: bytes = b""
    reports: int = 0
    step: float | None = None
    step_s: float | None = None
    loss: float | None = None
    step_times: dict[float, int] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=lambda: {"bytes_sent": 0, "bytes_received": 0, "comm_s": 0.0})

    def read(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if isinstance(record, dict):
                self._add(record)

    def _add(self, r: dict) -> None:
        nums = {k: float(v) for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.reports += 1
        self.step, self.loss = nums.get("step", self.step), nums.get("loss", self.loss)
        if "step_s" in nums:
            self.step_s = t = nums["step_s"]
            self.step_times[t] = self.step_times.get(t, 0) + 1
        for key in self.sums:
            self.sums[key] += nums.get(key, 0)


class JobCollector:
    """The families ``commlab run --metrics-port`` serves: the job's, each rank's (from the metrics lines the
    ranks write, :mod:`commlab.core.metrics`) and each shard's (fetched from the shard's own endpoint, whose
    URLs :attr:`server_urls` lists once the servers reported them). Thread-safe: scrapes may overlap."""

    def __init__(self, metrics_base: str, workers: int, up: Callable[[], Mapping[int, bool]] | None = None):
        self.workers = workers
        self.ranks = [_RankTail(os.fspath(metrics_path(metrics_base, r))) for r in range(workers)]
        self.server_urls: list[str] = []
        self.restarts = 0
        self.up = up
        self._lock = threading.Lock()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            for tail in self.ranks:
                tail.read()
            yield GaugeMetricFamily("commlab_job_workers", "Ranks in the job", value=self.workers)
            yield CounterMetricFamily("commlab_job_restarts", "Times every rank was started again (--max-restarts)",
                                      value=self.restarts)
            if self.up is not None:
                up = GaugeMetricFamily("commlab_rank_up", "1 while the rank's process runs", labels=["rank"])
                for r, alive in sorted(self.up().items()):
                    up.add_metric([str(r)], 1 if alive else 0)
                yield up
            fams = {
                "reports": CounterMetricFamily("commlab_rank_reports", "Metrics lines the rank wrote", labels=["rank"]),
                "step": GaugeMetricFamily("commlab_rank_step", "The last step the rank reported (0-based)",
                                          labels=["rank"]),
                "step_s": GaugeMetricFamily("commlab_rank_last_step_seconds", "The last reported step's time",
                                            labels=["rank"]),
                "loss": GaugeMetricFamily("commlab_rank_loss", "The last reported training loss", labels=["rank"]),
                "bytes_sent": CounterMetricFamily("commlab_rank_sent_bytes", "Bytes the rank's exchanges sent",
                                                  labels=["rank"]),
                "bytes_received": CounterMetricFamily("commlab_rank_received_bytes",
                                                      "Bytes the rank's exchanges received", labels=["rank"]),
                "comm_s": CounterMetricFamily("commlab_rank_exposed_comm_seconds",
                                              "Seconds the rank's steps waited on the exchange", labels=["rank"]),
            }
            times = HistogramMetricFamily("commlab_rank_step_seconds", "Step time per rank (its reports' step_s)",
                                          labels=["rank"])
            for r, tail in enumerate(self.ranks):
                label = [str(r)]
                fams["reports"].add_metric(label, tail.reports)
                for key in ("step", "step_s", "loss"):
                    if getattr(tail, key) is not None:
                        fams[key].add_metric(label, getattr(tail, key))
                for key, total in tail.sums.items():
                    fams[key].add_metric(label, total)
                add_histogram(times, {"rank": str(r)}, tail.step_times, STEP_BUCKETS)
            yield from fams.values()
            yield times
            urls = list(self.server_urls)
        yield from self._servers(urls)

    def _servers(self, urls: list[str]):
        """The shards' families, merged by name (each shard's series carry its ``shard`` label)."""
        from prometheus_client.core import GaugeMetricFamily
        from prometheus_client.parser import text_string_to_metric_families

        up = GaugeMetricFamily("commlab_job_server_up", "1 when the shard's metrics endpoint answered this scrape",
                               labels=["server"])
        merged: dict = {}
        for i, url in enumerate(urls):
            try:
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
                    text = resp.read().decode()
            except OSError:
                up.add_metric([str(i)], 0)
                continue
            up.add_metric([str(i)], 1)
            for family in text_string_to_metric_families(text):
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield up
        yield from merged.values()
