"""The aio gRPC server of gateway: health, reflection, graceful shutdown."""
from __future__ import annotations

import grpc

from loraplex.serving import run_server
from loraplex.v1 import gateway_pb2_grpc
from gateway.config import GatewayConfig
from gateway.servicer import GatewayServicer


async def serve(config: GatewayConfig) -> None:
    """Serves loraplex.v1.Gateway on `config.listen` until SIGTERM."""

    def register(server: grpc.aio.Server) -> list[str]:
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(), server)
        return ["loraplex.v1.Gateway"]

    await run_server("gateway", config.listen, register, max_message_bytes=config.max_message_bytes)
