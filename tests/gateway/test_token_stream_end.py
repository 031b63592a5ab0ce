"""A token-stream call that ends while its reader stays blocked still fails its requests.

Under load, a StreamTokens call to a replica that stopped can get its status while a read it started never
completes; the reader thread then blocks for good (3 of about 170 runs of test_replicas_router's
stopped-replica test on two busy cores). `EndedCall` plays that call: its done
callback fires, its iteration never returns. The session must fail the requests on it with UNAVAILABLE
after END_GRACE_S, and open a new call for the next start; a call whose reader does return in the grace
hands over its last messages first.
"""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading

import grpc
import pytest

from gateway import token_stream
from gateway.token_stream import ReplicaSession
from loraplex.v1 import common_pb2, compute_pb2

pytestmark = pytest.mark.timeout(60)


class EndedCall:
    """A call that ends (done callbacks, UNAVAILABLE) when `end()` is called; its iteration yields what
    `messages` gets and returns only once `release` is set (never, for the stuck reader)."""

    def __init__(self) -> None:
        self.callbacks: list = []
        self.messages: queue.SimpleQueue = queue.SimpleQueue()
        self.release = threading.Event()
        self.ended = False
        self.cancelled = False

    def add_done_callback(self, fn) -> None:
        if self.ended:
            fn(self)
        else:
            self.callbacks.append(fn)

    def end(self) -> None:
        self.ended = True
        for fn in self.callbacks:
            fn(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "GOAWAY received"

    def cancel(self) -> bool:
        self.cancelled = True
        return False

    def __iter__(self):
        while True:
            try:
                yield self.messages.get(timeout=0.05)
            except queue.Empty:
                if self.release.is_set():
                    return


def request() -> compute_pb2.GenerateTokensRequest:
    return compute_pb2.GenerateTokensRequest(request_id="r", input_ids=[1, 2, 3])


@contextlib.asynccontextmanager
async def one_request_on(call: EndedCall):
    """A session on `call` with one request started on it: (session, its stream)."""
    session = ReplicaSession("127.0.0.1:9")
    session._attach(call, queue.SimpleQueue())
    stream = session.start(request(), 30)
    try:
        await asyncio.sleep(0.05)
        yield session, stream
    finally:
        call.release.set()
        await session.close()


def test_requests_fail_when_the_reader_never_sees_the_end(monkeypatch):
    monkeypatch.setattr(token_stream, "END_GRACE_S", 0.2)

    async def main():
        call = EndedCall()
        async with one_request_on(call) as (session, stream):
            threading.Thread(target=call.end).start()          # gRPC's thread reports the status
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async with asyncio.timeout(5):
                    await stream.next()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "127.0.0.1:9 broke" in info.value.details() and "GOAWAY received" in info.value.details()
            assert call.cancelled and session._reader is None and session.num_open == 0
    asyncio.run(main())


def test_messages_read_within_the_grace_still_count(monkeypatch):
    """The status can come before the last messages are read: a reader that returns within the grace hands
    them over, so a request that finished in them ends normally."""
    monkeypatch.setattr(token_stream, "END_GRACE_S", 2.0)

    async def main():
        call = EndedCall()
        async with one_request_on(call) as (session, stream):
            call.end()
            done = compute_pb2.StreamTokensResponse(handles=[stream.handle], num_tokens=[2], token_ids=[7, 8])
            done.finished.add(handle=stream.handle, finish_reason=common_pb2.STOP)
            call.messages.put(done)
            call.release.set()
            async with asyncio.timeout(5):
                batch = await stream.next()
            assert batch.token_ids == [7, 8] and batch.finish_reason == common_pb2.STOP
            await asyncio.sleep(2.5)                                   # past the grace: nothing more happens
            assert session._reader is None and session.num_open == 0     # the reader reported the end
    asyncio.run(main())
