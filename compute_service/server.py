"""The aio gRPC server of compute_service: health, reflection, graceful shutdown."""
from __future__ import annotations

import grpc

from loraplex.serving import run_server
from loraplex.v1 import compute_pb2_grpc
from compute_service.config import ComputeConfig
from compute_service.servicer import ComputeServicer


async def serve(config: ComputeConfig) -> None:
    """Serves loraplex.v1.Compute on `config.listen` until SIGTERM."""

    def register(server: grpc.aio.Server) -> list[str]:
        compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(), server)
        return ["loraplex.v1.Compute"]

    await run_server("compute_service", config.listen, register, max_message_bytes=config.max_message_bytes)
