"""A compute service that starts listening after the gateway serves the gateway's next request.

`loraplex serve` starts its services at once, so the gateway's first health check can
find nothing on the compute port; its channel then waits out a reconnect backoff, and
a request arriving in that window (right after serve said ready) failed at once with
UNAVAILABLE. The first call of a request now waits for the connection, briefly.
"""
from __future__ import annotations

import asyncio
import socket

import pytest

from loraplex.errors import UnavailableError
from loraplex.v1 import compute_pb2_grpc
from gateway_fakes import ScriptedCompute, grpc_server
from gateway_harness import gateway_stack

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_compute_service_that_starts_after_the_gateway_serves_the_next_request(tokenizer):
    port = free_port()
    compute = ScriptedCompute(tokenizer)

    async def body():
        async with gateway_stack(tokenizer, compute_address=f"127.0.0.1:{port}", health_checked=True) as st:
            with pytest.raises(UnavailableError, match=f"compute service at 127.0.0.1:{port} is unavailable"):
                await st.client.generate("q", max_tokens=3)     # nothing listens: the channel backs off
            await asyncio.sleep(0.3)                            # a health check fails too
            async with grpc_server(lambda s: compute_pb2_grpc.add_ComputeServicer_to_server(compute, s), port):
                return await st.client.generate("q", max_tokens=3)

    out = asyncio.run(body())
    assert out.completion_tokens == 3 and out.text and not out.error
