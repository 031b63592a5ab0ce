"""The aio gRPC server of compute_service: builds the runtime, warms up, serves, drains on SIGTERM.

Start-up: the model and the caches load, then the server listens with health
NOT_SERVING while `compute_service.warmup` compiles every kernel a request can
launch and captures the decode graphs; Compute calls in that window get
UNAVAILABLE. Health turns SERVING once the first request would be as fast as
the hundredth. Each stage is logged with its time.

With `--engine-process` (on, or auto with one GPU: the default) the engine
runs in a child process (`compute_service.engine_process`), spawned before
this process imports the engine's modules, and this process keeps only the
gRPC side (`compute_service.engine_link`): the two no longer share one GIL.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from compute_service.config import ComputeConfig
from compute_service.engine_spawn import cuda_visible, spawn_engine

if TYPE_CHECKING:
    from compute_service.engine.loader import LoadedModel

COMPUTE_PREFIX = "/loraplex.v1.Compute/"


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
    """Serves loraplex.v1.Compute on `config.listen` until SIGTERM (`loaded`: a model already in memory,
    served in this process). With `--engine-process` (on, or auto with one GPU) the engine runs in a
    child process (`compute_service.engine_process`) and only the gRPC side runs here."""
    spawned = None
    if loaded is None and config.uses_engine_process("cuda" if cuda_visible(config.device) else "cpu"):
        spawned = spawn_engine(config)      # it loads the model while this process imports the rest
    # Imported here, after the spawn: torch and the engine's modules take seconds to import.
    from compute_service.engine_link import EngineLink
    from compute_service.local_engine import LocalEngine
    from compute_service.servicer import ComputeServicer, ServedRuntime
    from loraplex.serving import run_server
    from loraplex.v1 import compute_pb2_grpc

    side: LocalEngine | EngineLink
    if spawned is not None:
        side = await EngineLink.start(config, spawned)
        rt: ServedRuntime = side.runtime
    else:
        side = await LocalEngine.load(config, loaded)
        rt = side.rt
    gate = WarmupGate()

    async def warm() -> None:
        await side.warm()
        gate.open()

    def register(server: grpc.aio.Server) -> list[str]:
        compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(rt, config.max_model_len), server)
        return ["loraplex.v1.Compute"]

    try:
        await run_server("compute_service", config.listen, register, max_message_bytes=config.max_message_bytes,
                         interceptors=[gate], ready=warm)
    finally:
        await side.close()
