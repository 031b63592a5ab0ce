"""Prometheus metrics of the compute service, served on `--metrics-port`.

Gauges are read from the engine and the adapter pool at scrape time (no
book-keeping of their own); step times and adapter load latencies are histograms.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from compute_service.build import Runtime


class _Collector:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self):  # type: ignore[no-untyped-def]
        eng, pool = self.rt.engine.stats(), self.rt.slots.stats()
        for name, doc, value in (
            ("loraplex_compute_running", "sequences in the running batch", eng.num_running),
            ("loraplex_compute_waiting", "sequences queued", eng.num_waiting),
            ("loraplex_compute_kv_blocks_used", "KV blocks in use", eng.num_kv_blocks_used),
            ("loraplex_compute_kv_blocks_total", "KV blocks in the pool", eng.num_kv_blocks_total),
            ("loraplex_compute_preemptions", "sequences preempted so far", eng.num_preemptions),
            ("loraplex_adapter_pool_pages_used", "adapter pool pages in use", pool.pages_used),
            ("loraplex_adapter_pool_pages_total", "adapter pool pages", pool.pages_total),
            ("loraplex_adapter_pool_bytes_used", "adapter pool bytes in use", pool.bytes_used),
            ("loraplex_adapter_pool_bytes_total", "adapter pool bytes", pool.bytes_total),
            ("loraplex_adapters_resident", "adapters resident in the pool", pool.num_resident),
            ("loraplex_adapters_loading", "adapter copies in flight", pool.num_loading),
            ("loraplex_adapters_queued", "adapter loads waiting for pages", pool.num_queued),
            ("loraplex_adapter_evictions", "adapters evicted so far", pool.num_evictions),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class ComputeMetrics:
    """Registry with the live gauges and the step-time histogram; `serve(port)` exposes it."""

    def __init__(self, rt: Runtime) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(rt))  # type: ignore[arg-type]
        self.step_seconds = Histogram("loraplex_compute_step_seconds", "engine step wall time",
                                      registry=self.registry,
                                      buckets=(.002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
        self.tokens = Histogram("loraplex_compute_tokens_per_step", "tokens emitted per step",
                                registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))

        self.startup_seconds = Gauge("loraplex_compute_startup_seconds", "start-up time by stage (model: load and "
                                     "allocate; warmup: compile kernels, capture graphs, real requests)",
                                     ["stage"], registry=self.registry)

    def on_startup(self, model_s: float, warmup_s: float) -> None:
        self.startup_seconds.labels("model").set(model_s)
        self.startup_seconds.labels("warmup").set(warmup_s)

    def on_step(self, num_tokens: int, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.tokens.observe(num_tokens)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
