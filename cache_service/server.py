"""The aio gRPC server of cache_service: health, reflection, graceful shutdown."""
from __future__ import annotations

import grpc

from loraplex.serving import run_server
from loraplex.v1 import cache_pb2_grpc
from cache_service.config import CacheConfig
from cache_service.servicer import AdapterCacheServicer


async def serve(config: CacheConfig) -> None:
    """Serves loraplex.v1.AdapterCache on `config.listen` until SIGTERM."""

    def register(server: grpc.aio.Server) -> list[str]:
        cache_pb2_grpc.add_AdapterCacheServicer_to_server(AdapterCacheServicer(), server)
        return ["loraplex.v1.AdapterCache"]

    await run_server("cache_service", config.listen, register, max_message_bytes=config.max_message_bytes)
