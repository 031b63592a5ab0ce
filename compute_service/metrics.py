"""Prometheus metrics of the compute service, served on `--metrics-port`.

Gauges are read from the engine and the adapter pool at scrape time (no
book-keeping of their own): sequences running and waiting, in total and per
adapter (`loraplex_lora_requests_running{adapter}`, `..._waiting{adapter}`,
and `loraplex_lora_requests_info` whose labels list the adapters running and
waiting and the most adapters resident at once), KV-cache and adapter-pool
use. Step times are histograms; per sequence, time to first token,
inter-token latency and end-to-end latency are measured on the event loop
when a step's tokens are handed to their stream (`SequenceLatency`, lock-free
histograms fed by the runner's drain); adapter loads into the GPU pool
(fetch from the host cache and upload to the device) are counted with their
bytes, seconds and outcome, under `tier="gpu"` (the host cache counts its
own loads from disk under `tier="host"`).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from compute_service.adapter_cache.loader import task_of
from compute_service.build import Runtime
from compute_service.engine.outputs import RequestOutput
from loraplex.metrics import (E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, AdapterLoadMetrics, HistogramFamily,
                              serve_metrics)

FINISH_REASONS = ("stop", "length", "abort")


def _adapter_counts(per_key: dict[str, int]) -> dict[str, int]:
    """Sequences per adapter task id (as a label string); the base model's ("" key) left out."""
    out: dict[str, int] = {}
    for key, n in per_key.items():
        if key:
            label = str(task_of(key))
            out[label] = out.get(label, 0) + n
    return out


class _Collector:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def _stats(self) -> tuple[Any, Any]:
        # Read from the scrape thread while the engine thread steps: a dict it resizes meanwhile
        # raises, and the next try reads a consistent enough picture.
        for attempt in range(3):
            try:
                return self.rt.engine.stats(), self.rt.slots.stats()
            except RuntimeError:
                if attempt == 2:
                    raise
                time.sleep(0.001)
        raise AssertionError("unreachable")

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        eng, pool = self._stats()
        for name, doc, value in (
            ("loraplex_compute_running", "sequences in the running batch", eng.num_running),
            ("loraplex_compute_waiting", "sequences queued", eng.num_waiting),
            ("loraplex_compute_kv_blocks_used", "KV blocks in use", eng.num_kv_blocks_used),
            ("loraplex_compute_kv_blocks_total", "KV blocks in the pool", eng.num_kv_blocks_total),
            ("loraplex_compute_kv_cache_usage_ratio", "fraction of KV blocks in use",
             eng.num_kv_blocks_used / max(eng.num_kv_blocks_total, 1)),
            ("loraplex_compute_preemptions", "sequences preempted so far", eng.num_preemptions),
            ("loraplex_adapter_pool_pages_used", "adapter pool pages in use", pool.pages_used),
            ("loraplex_adapter_pool_pages_total", "adapter pool pages", pool.pages_total),
            ("loraplex_adapter_pool_bytes_used", "adapter pool bytes in use", pool.bytes_used),
            ("loraplex_adapter_pool_bytes_total", "adapter pool bytes", pool.bytes_total),
            ("loraplex_adapter_pool_usage_ratio", "fraction of adapter pool pages in use",
             pool.pages_used / max(pool.pages_total, 1)),
            ("loraplex_adapters_resident", "adapters resident in the pool", pool.num_resident),
            ("loraplex_adapters_loading", "adapter copies in flight", pool.num_loading),
            ("loraplex_adapters_queued", "adapter loads waiting for pages", pool.num_queued),
            ("loraplex_adapter_evictions", "adapters evicted so far", pool.num_evictions),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self._per_adapter(eng)

    def _per_adapter(self, eng: Any) -> Iterator[GaugeMetricFamily]:
        running, waiting = _adapter_counts(eng.running_per_adapter), _adapter_counts(eng.waiting_per_adapter)
        info = GaugeMetricFamily(
            "loraplex_lora_requests_info", "adapters (task ids) with sequences running and waiting, and the most "
            "adapters resident at once; the value is the scrape's time",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(sorted(running, key=int)), ",".join(sorted(waiting, key=int)),
                         str(self.rt.slots.max_slots)], time.time())
        yield info
        for name, doc, counts in (("loraplex_lora_requests_running", "sequences running per adapter", running),
                                  ("loraplex_lora_requests_waiting", "sequences waiting per adapter", waiting)):
            g = GaugeMetricFamily(name, doc, labels=["adapter"])
            for adapter, n in sorted(counts.items()):
                g.add_metric([adapter], n)
            yield g


class SequenceLatency:
    """Per-sequence time to first token, inter-token latency and end-to-end latency (the runner's observer)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = HistogramFamily("loraplex_compute_time_to_first_token_seconds",
                                    "time from a sequence's start on compute to its first token", TTFT_BUCKETS,
                                    registry=registry).child()
        self.itl = HistogramFamily("loraplex_compute_inter_token_latency_seconds",
                                   "time between two tokens of a sequence", ITL_BUCKETS, registry=registry).child()
        self.e2e = HistogramFamily("loraplex_compute_e2e_request_latency_seconds",
                                   "time from a sequence's start on compute to its end", E2E_BUCKETS,
                                   registry=registry).child()
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        registry.register(self)  # type: ignore[arg-type]

    def steady(self, seconds: float, n: int) -> None:
        """`n` sequences each got one token `seconds` after their previous one (those of a step that
        also had a token in the step before: one observation for all of them)."""
        self.itl.observe(seconds, n)

    def delivered(self, req: Any, out: RequestOutput, now: float) -> None:
        n = len(out.new_token_ids)
        if n:
            if req.last_token_at:
                self.itl.observe((now - req.last_token_at) / n, n)
            else:
                self.ttft.observe(now - req.started)
            req.last_token_at = now
        if out.finished:
            self.e2e.observe(now - req.started)
            reason = out.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily("loraplex_compute_requests_finished", "sequences finished, by reason",
                                labels=["reason"])
        for reason, n in list(self.finished.items()):
            c.add_metric([reason], n)
        yield c

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("loraplex_compute_requests_finished", "sequences finished, by reason",
                                  labels=["reason"])


class ComputeMetrics:
    """Registry with the live gauges, the step and sequence histograms and adapter loads; `serve(port)`
    exposes it. `attach()` hooks them into the runner (after warm-up, whose requests are not counted)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
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
        self.latency = SequenceLatency(self.registry)
        self.adapter_loads = AdapterLoadMetrics(self.registry, "gpu")

    def attach(self) -> None:
        runner = self.rt.runner
        runner.on_step = self.on_step
        runner.latency = self.latency
        runner.on_adapter_load = self.adapter_loads.observe

    def on_startup(self, model_s: float, warmup_s: float) -> None:
        self.startup_seconds.labels("model").set(model_s)
        self.startup_seconds.labels("warmup").set(warmup_s)

    def on_step(self, num_tokens: int, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.tokens.observe(num_tokens)

    def serve(self, port: int) -> None:
        serve_metrics(self.registry, port)
