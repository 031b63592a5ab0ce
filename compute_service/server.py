"""The aio gRPC server of compute_service: builds the runtime, serves, drains on SIGTERM."""
from __future__ import annotations

import asyncio
import logging

import grpc

from compute_service.build import build_runtime
from compute_service.config import ComputeConfig
from compute_service.engine.loader import LoadedModel
from compute_service.metrics import ComputeMetrics
from compute_service.servicer import ComputeServicer
from loraplex.cache_client import CacheClient
from loraplex.serving import run_server
from loraplex.v1 import compute_pb2_grpc

log = logging.getLogger(__name__)


async def serve(config: ComputeConfig, loaded: LoadedModel | None = None) -> None:
    """Serves loraplex.v1.Compute on `config.listen` until SIGTERM (`loaded`: a model already in memory)."""
    cache = CacheClient(config.cache_address, max_message_bytes=config.max_message_bytes)

    async def fetch(task_id: int, version: str | None):  # type: ignore[no-untyped-def]
        return await cache.get_adapter(task_id, version)

    rt = await asyncio.to_thread(build_runtime, config, fetch, loaded)
    metrics = ComputeMetrics(rt)
    rt.runner.on_step = metrics.on_step
    if config.metrics_port:
        metrics.serve(config.metrics_port)
        log.info("metrics on :%d/metrics", config.metrics_port)
    rt.runner.start(config.gil_switch_interval_us / 1e6)

    def register(server: grpc.aio.Server) -> list[str]:
        compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(rt, config.max_model_len), server)
        return ["loraplex.v1.Compute"]

    try:
        await run_server("compute_service", config.listen, register, max_message_bytes=config.max_message_bytes)
    finally:
        await rt.runner.stop()
        await cache.close()
