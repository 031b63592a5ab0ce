"""Prometheus pieces every service shares: hot-path histograms, the latency buckets, `/metrics` serving.

`FastHistogram` is for code that observes per token or per step: `observe`
adds to plain lists with no lock and no label lookup (a family's children are
made once, up front), so it must have one writer, the service's event loop. A
scrape runs on the HTTP server's thread and copies the lists: it may see an
observation half applied (a count without its sum), never a torn value.
`HistogramFamily` exposes children as one Prometheus histogram.

Every service's names are listed in docs/deploy.md ("Metrics"), and the
Grafana dashboard under deploy/grafana/ queries only those (a test checks it).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# Seconds. First tokens include queueing and prefill; gaps between tokens are one engine step or a few.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.75, 1.0,
               2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
LOAD_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


class FastHistogram:
    """Bucket counts and a sum in plain Python lists; one writer, no lock."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Counts `n` observations of `value` (n tokens that arrived `value` seconds apart each)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.total += value * n

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative (le, count) pairs and the sum, as a Prometheus histogram exposes them."""
        counts, total = list(self.counts), self.total
        buckets, running = [], 0
        for bound, c in zip((*self.bounds, float("inf")), counts):
            running += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return buckets, total


class HistogramFamily(Collector):
    """One Prometheus histogram made of `FastHistogram` children (one per label values, made by `child`)."""

    def __init__(self, name: str, doc: str, bounds: Sequence[float], labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name, self.doc, self.bounds, self.labelnames = name, doc, tuple(bounds), tuple(labelnames)
        self._children: dict[tuple[str, ...], FastHistogram] = {}
        if not labelnames:
            self._children[()] = FastHistogram(self.bounds)
        if registry is not None:
            registry.register(self)

    def child(self, *labelvalues: str) -> FastHistogram:
        """The child for these label values (create children up front, not per observation)."""
        key = tuple(str(v) for v in labelvalues)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = FastHistogram(self.bounds)
        return found

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, hist in list(self._children.items()):
            buckets, total = hist.snapshot()
            family.add_metric(list(key), buckets, total)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)


class AdapterLoadMetrics:
    """`loraplex_adapter_loads_total{tier, outcome}`, `..._load_bytes_total{tier}`, `..._load_seconds{tier}`."""

    def __init__(self, registry: CollectorRegistry, tier: str) -> None:
        loads = Counter("loraplex_adapter_loads", "adapter loads by tier (host: disk into the host cache; gpu: "
                        "host cache into the GPU pool) and outcome", ["tier", "outcome"], registry=registry)
        self._ok, self._error = loads.labels(tier, "ok"), loads.labels(tier, "error")
        self._bytes = Counter("loraplex_adapter_load_bytes", "bytes of adapters loaded", ["tier"],
                              registry=registry).labels(tier)
        self._seconds = Histogram("loraplex_adapter_load_seconds", "time to load one adapter", ["tier"],
                                  registry=registry, buckets=LOAD_BUCKETS).labels(tier)

    def observe(self, num_bytes: int, seconds: float, ok: bool) -> None:
        (self._ok if ok else self._error).inc()
        if ok:
            self._bytes.inc(num_bytes)
            self._seconds.observe(seconds)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
    """Serves `registry` as Prometheus text on http://host:port/metrics from a daemon thread."""
    start_http_server(port, addr=host, registry=registry)
