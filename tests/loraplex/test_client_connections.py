"""`Client(connections=N)` / `AsyncClient(connections=N)`: N TCP connections, calls taking them in turn."""
from __future__ import annotations

import asyncio
import collections
from concurrent import futures

import grpc
import pytest

from loraplex.client import AsyncClient, Client
from loraplex.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


class PeerRecorder(gateway_pb2_grpc.GatewayServicer):
    """Answers GetModelInfo and counts the calls per client connection (its peer address and port)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def GetModelInfo(self, request, context):
        self.calls[context.peer()] += 1
        return gateway_pb2.GetModelInfoResponse(model=common_pb2.ModelInfo(model_name="recorder"))


@pytest.fixture
def recorder():
    servicer = PeerRecorder()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.mark.parametrize("connections", [1, 3])
def test_blocking_client_spreads_calls_over_its_connections_in_turn(recorder, connections):
    servicer, address = recorder
    with Client(address, timeout=10, connections=connections) as client:
        names = [client.model_info().model_name for _ in range(2 * connections)]
    assert names == ["recorder"] * (2 * connections)
    assert sorted(servicer.calls.values()) == [2] * connections      # each connection took two calls


def test_async_client_spreads_calls_over_its_connections_in_turn(recorder):
    servicer, address = recorder

    async def go():
        async with AsyncClient(address, timeout=10, connections=4) as client:
            for _ in range(8):
                await client.model_info()
    asyncio.run(go())
    assert sorted(servicer.calls.values()) == [2, 2, 2, 2]


def test_connections_must_be_at_least_one():
    with pytest.raises(ValueError, match="connections must be >= 1"):
        Client("127.0.0.1:1", connections=0)
