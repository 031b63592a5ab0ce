"""Prometheus metrics of the host cache, served on `--metrics-port`.

Cache-wide numbers (hits, misses, evictions, bytes, adapters) are read from
the backend at scrape time, so with Redis they describe the shared cache that
every replica sees; latencies are this process's own, and so are adapter loads
from disk (`loraplex_adapter_loads_total{tier="host", outcome}`, their bytes
and seconds: the compute service counts its loads into the GPU pool under
`tier="gpu"`).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.errors import UnavailableError
from loraplex.metrics import AdapterLoadMetrics, serve_metrics
from cache_service.records import CacheStats

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], CacheStats], backend: str) -> None:
        self._stats = stats
        self._backend = backend

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        try:
            s = self._stats()
        except UnavailableError as exc:
            log.warning("metrics: cache stats unavailable: %s", exc)
            return
        labels = ["backend"]
        for name, doc, value in (("loraplex_host_cache_hits", "gets that found the adapter", s.hits),
                                 ("loraplex_host_cache_misses", "gets that did not find the adapter", s.misses),
                                 ("loraplex_host_cache_evictions", "adapters evicted by the LRU", s.evictions)):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self._backend], value)
            yield c
        for name, doc, value in (("loraplex_host_cache_bytes_used", "bytes of cached adapters", s.bytes_used),
                                 ("loraplex_host_cache_bytes_total", "byte budget (lora_cache_host_memory_bytes)",
                                  s.bytes_total),
                                 ("loraplex_host_cache_adapters", "cached adapters", s.num_adapters)):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self._backend], value)
            yield g


class CacheMetrics:
    """Latency histograms plus the stats collector, in a registry of their own."""

    def __init__(self, stats: Callable[[], CacheStats], backend: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats, backend))
        self.put_seconds = Histogram(
            "loraplex_host_cache_put_seconds", "PutAdapter from first to last byte, validation included",
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.get_seconds = Histogram(
            "loraplex_host_cache_get_seconds", "GetAdapter until the last message is sent",
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.conversions = Counter(
            "loraplex_host_cache_conversions", "PEFT adapters converted into the cache, by where the rows were "
            "written: a conversion worker process (--convert-processes) or the service's own process",
            ["where"], registry=self.registry)
        # disk loads (read + validate + store): loraplex_adapter_load_seconds{tier="host"}
        self.adapter_loads = AdapterLoadMetrics(self.registry, "host")

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Starts the /metrics HTTP endpoint in a daemon thread."""
        serve_metrics(self.registry, port, host)
