"""The services' gRPC server options (loraplex.serving.server_options) under a backlog of calls.

gRPC's own server cancels a call that waited more than 30 s for the application to take it, with a
bare CANCELLED its client cannot tell from its own cancel. A loraplex service whose event loop is
saturated must leave that decision to the caller's deadline.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from loraplex.serving import server_options

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BLOCK_S = 32.0   # past gRPC's default of 30 s
NUM_WAITING = 200  # more than the server has asked for ahead: these wait in gRPC's own queue


def test_a_call_that_waits_longer_than_30s_to_be_taken_is_served_not_cancelled():
    async def handler(request: bytes, context) -> bytes:
        if request == b"block":
            time.sleep(BLOCK_S)      # the event loop is stuck: calls wait to be taken
        return b"done"

    def client(port: int) -> list[str]:
        """From another thread: the blocking call, calls that wait behind it, and (past 30 s) one more,
        whose arrival is when gRPC looks at how long the waiting one has waited."""
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary("/t.T/U")
            futures = [call.future(b"block", timeout=90)]
            time.sleep(0.5)
            futures += [call.future(b"wait", timeout=90) for _ in range(NUM_WAITING)]
            time.sleep(BLOCK_S - 1.0)
            futures.append(call.future(b"late", timeout=90))
            out = []
            for f in futures:
                try:
                    out.append(f.result().decode())
                except grpc.RpcError as exc:
                    out.append(exc.code().name)
            return out

    async def main() -> list[str]:
        server = grpc.aio.server(options=server_options(4 << 20))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.T", {"U": grpc.unary_unary_rpc_method_handler(handler)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await asyncio.to_thread(client, port)
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == ["done"] * (NUM_WAITING + 2)
