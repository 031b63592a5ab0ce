"""The engine side of a compute service in one process: runtime, metrics and host-cache client.

`LocalEngine.load` builds the runtime (model, KV cache, adapter pool, runner)
and its metrics; `warm` compiles and captures (`compute_service.warmup`) and
starts the engine thread; `close` stops it. The compute service runs this in
its own process (`--engine-process off`) or in the engine process
(`compute_service.engine_process`), the same way.
"""
from __future__ import annotations

import asyncio
import logging
import time

from compute_service.build import Runtime, build_runtime
from compute_service.config import ComputeConfig
from compute_service.engine.loader import LoadedModel
from compute_service.metrics import ComputeMetrics
from compute_service.warmup import describe_compiled, warm_up
from loraplex.cache_client import CacheClient

log = logging.getLogger(__name__)
CONNECT_AT_START_S = 30.0    # how long start-up tries to connect to the cache (calls connect anyway)


class LocalEngine:
    """The runtime of this process with its metrics and its host-cache client."""

    def __init__(self, config: ComputeConfig, rt: Runtime, cache: CacheClient, metrics: ComputeMetrics,
                 started: float, load_s: float) -> None:
        self.config = config
        self.rt = rt
        self.cache = cache
        self.metrics = metrics
        self.started = started
        self.load_s = load_s
        self._connecting: list[asyncio.Task[bool]] = []

    @classmethod
    async def load(cls, config: ComputeConfig, loaded: LoadedModel | None = None) -> "LocalEngine":
        """Loads the model and allocates the KV cache and adapter pool (`loaded`: a model in memory)."""
        t0 = time.perf_counter()
        cache = CacheClient(config.cache_address, max_message_bytes=config.max_message_bytes)

        async def fetch(task_id: int, version: str | None):  # type: ignore[no-untyped-def]
            return await cache.get_adapter(task_id, version)

        log.info("start-up: loading the model and allocating the KV cache and adapter pool")
        try:
            rt = await asyncio.to_thread(build_runtime, config, fetch, loaded, False)
        except BaseException:
            await cache.close()
            raise
        load_s = time.perf_counter() - t0
        log.info("start-up: model and caches ready in %.1f s; warming up (health NOT_SERVING until done)", load_s)
        metrics = ComputeMetrics(rt)
        metrics.attach()     # warm-up drives the engine directly: none of its work is counted
        if config.metrics_port:
            metrics.serve(config.metrics_port)
            log.info("metrics on :%d/metrics", config.metrics_port)
        return cls(config, rt, cache, metrics, t0, load_s)

    async def warm(self) -> None:
        """Compiles every kernel a request can launch and captures the graphs, then starts the engine
        thread; connects to the cache meanwhile, so the first adapter fetch does not wait for it."""
        self._connecting.append(asyncio.create_task(self.cache.connect(CONNECT_AT_START_S), name="cache-connect"))
        report = await asyncio.to_thread(warm_up, self.rt, self.config.warmup, self.config.warmup_threads,
                                       self.config.compile_processes)
        self.metrics.on_startup(self.load_s, report.total_s)
        self.rt.runner.start(self.config.gil_switch_interval_us / 1e6)
        log.info("start-up: SERVING %.1f s after start (model %.1f s, warm-up %.1f s: %s, %s)",
                 time.perf_counter() - self.started, self.load_s, report.total_s, report.mode,
                 describe_compiled(report.compiled_kernels))

    async def close(self) -> None:
        for task in self._connecting:
            task.cancel()
        await self.rt.runner.stop()
        await self.cache.close()
