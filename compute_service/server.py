"""The aio gRPC server of compute_service: builds the runtime, warms up, serves, drains on SIGTERM.

Start-up: the model and the caches load, then the server listens with health
NOT_SERVING while `compute_service.warmup` compiles every kernel a request can
launch and captures the decode graphs; Compute calls in that window get
UNAVAILABLE. Health turns SERVING once the first request would be as fast as
the hundredth. Each stage is logged with its time.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from compute_service.build import build_runtime
from compute_service.config import ComputeConfig
from compute_service.engine.loader import LoadedModel
from compute_service.metrics import ComputeMetrics
from compute_service.servicer import ComputeServicer
from compute_service.warmup import describe_compiled, warm_up
from loraplex.cache_client import CacheClient
from loraplex.serving import run_server
from loraplex.v1 import compute_pb2_grpc

log = logging.getLogger(__name__)
COMPUTE_PREFIX = "/loraplex.v1.Compute/"
CONNECT_AT_START_S = 30.0    # how long start-up tries to connect to the cache (calls connect anyway)


class WarmupGate(grpc.aio.ServerInterceptor):
    """Refuses Compute calls with UNAVAILABLE until `open()`; health and reflection always pass."""

    def __init__(self) -> None:
        self.is_open = False

    def open(self) -> None:
        self.is_open = True

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if self.is_open or handler is None or not handler_call_details.method.startswith(COMPUTE_PREFIX):
            return handler

        async def refuse(request, context):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the compute service is warming up (compiling "
                                "kernels, capturing graphs); retry once its health check says SERVING")
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[
                    (handler.request_streaming, handler.response_streaming)]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


async def serve(config: ComputeConfig, loaded: LoadedModel | None = None) -> None:
    """Serves loraplex.v1.Compute on `config.listen` until SIGTERM (`loaded`: a model already in memory)."""
    t0 = time.perf_counter()
    cache = CacheClient(config.cache_address, max_message_bytes=config.max_message_bytes)

    async def fetch(task_id: int, version: str | None):  # type: ignore[no-untyped-def]
        return await cache.get_adapter(task_id, version)

    log.info("start-up: loading the model and allocating the KV cache and adapter pool")
    rt = await asyncio.to_thread(build_runtime, config, fetch, loaded, False)
    load_s = time.perf_counter() - t0
    log.info("start-up: model and caches ready in %.1f s; warming up (health NOT_SERVING until done)", load_s)
    metrics = ComputeMetrics(rt)
    metrics.attach()     # warm-up drives the engine directly: none of its work is counted
    if config.metrics_port:
        metrics.serve(config.metrics_port)
        log.info("metrics on :%d/metrics", config.metrics_port)
    gate = WarmupGate()

    connecting: list[asyncio.Task[bool]] = []

    async def warm() -> None:
        # connects to the cache while the kernels compile: the first adapter fetch does not wait for it
        connecting.append(asyncio.create_task(cache.connect(CONNECT_AT_START_S), name="cache-connect"))
        report = await asyncio.to_thread(warm_up, rt, config.warmup, config.warmup_threads)
        metrics.on_startup(load_s, report.total_s)
        rt.runner.start(config.gil_switch_interval_us / 1e6)
        gate.open()
        log.info("start-up: SERVING %.1f s after start (model %.1f s, warm-up %.1f s: %s, %s)",
                 time.perf_counter() - t0, load_s, report.total_s, report.mode,
                 describe_compiled(report.compiled_kernels))

    def register(server: grpc.aio.Server) -> list[str]:
        compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(rt, config.max_model_len), server)
        return ["loraplex.v1.Compute"]

    try:
        await run_server("compute_service", config.listen, register, max_message_bytes=config.max_message_bytes,
                         interceptors=[gate], ready=warm)
    finally:
        for task in connecting:
            task.cancel()
        await rt.runner.stop()
        await cache.close()
