"""The gateway's end of the token stream: one StreamTokens call per compute replica, many requests on it.

`ReplicaSession` owns the call. `start()` queues a request's start (a writer
task sends every start and cancel queued in the same loop turn as one
message) and returns its `RequestStream`; a reader task splits each step
message from compute into the requests' buffers. A `RequestStream` hands out
everything buffered at once (`next()`), so a client that reads slower than
the engine steps gets fewer, fuller messages and never holds up the others.

Bounds: a request's buffer holds at most `max_buffered_tokens` tokens its
client has not taken; past that the request is cancelled on compute and ends
with RESOURCE_EXHAUSTED (a client that stops reading cannot grow the
gateway's memory). Failures: a request's own error (its gRPC code and
message) reaches that request only; when the call breaks, every request on it
fails with UNAVAILABLE naming the replica, and the next start opens a new call.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass
import grpc

from loraplex.errors import ResourceExhaustedError
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED_TOKENS = 4096
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A request's status as the error a per-request call would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass
class TokenBatch:
    """Everything a request got since the last `next()`: tokens, and how it ended if it did."""

    token_ids: list[int]
    finish_reason: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None


class RequestStream:
    """One request's deltas on a session, buffered until its reader takes them."""

    def __init__(self, session: "ReplicaSession", handle: int, max_buffered_tokens: int) -> None:
        self._session = session
        self.handle = handle
        self._max = max_buffered_tokens
        self._tokens: list[int] = []
        self._finish: tuple[common_pb2.FinishReason, common_pb2.Usage] | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.ended = False        # finished, failed or cancelled: nothing more comes from compute
        self._taken_end = False   # the reader saw the end

    def done(self) -> bool:
        return self.ended

    async def next(self) -> TokenBatch | None:
        """Every token buffered (waits for at least one, or the end); None after the last batch."""
        while not (self._tokens or self._finish or self._error or self._taken_end):
            self._event.clear()
            await self._event.wait()
        if self._tokens or self._finish:
            batch = TokenBatch(self._tokens)
            self._tokens = []
            if self._finish is not None:
                batch.finish_reason, batch.usage = self._finish
                self._finish, self._taken_end = None, True
                if not batch.token_ids and batch.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    return None     # ended without a reason: the caller decides what that means
            return batch
        if self._error is not None:
            exc, self._error, self._taken_end = self._error, None, True
            raise exc
        return None

    def cancel(self) -> None:
        """Aborts the request on compute (its KV blocks and adapter pin are freed there)."""
        if not self.ended:
            self.ended = True
            self._session.cancel(self.handle)

    # -- from the session's reader --------------------------------------------------------------
    def push(self, token_ids: list[int]) -> None:
        self._tokens += token_ids
        self._event.set()
        if len(self._tokens) > self._max:
            self.cancel()
            self.fail(ResourceExhaustedError(
                f"the client has not read {len(self._tokens)} tokens of this stream (the gateway buffers at "
                f"most {self._max} per request); the request was cancelled: read the stream as it comes"))

    def finish(self, reason: common_pb2.FinishReason, usage: common_pb2.Usage) -> None:
        self.ended = True
        self._finish = (reason, usage)
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self.ended = True
        if self._error is None and self._finish is None:
            self._error = exc
        self._event.set()


class ReplicaSession:
    """The long-lived StreamTokens call to one replica (opened on first use, reopened after a break)."""

    def __init__(self, address: str, stub: compute_pb2_grpc.ComputeStub,
                 max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS) -> None:
        self.address = address
        self._stub = stub
        self._max_buffered = max_buffered_tokens
        self._handles = itertools.count(1)
        self._streams: dict[int, RequestStream] = {}
        self._starts: list[compute_pb2.StartTokens] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def start(self, request: compute_pb2.GenerateTokensRequest, timeout_s: float | None) -> RequestStream:
        """Starts `request` on the replica; compute aborts it once `timeout_s` passed."""
        self._ensure_open()
        handle = next(self._handles) & 0xFFFFFFFF
        stream = RequestStream(self, handle, self._max_buffered)
        self._streams[handle] = stream
        self._starts.append(compute_pb2.StartTokens(handle=handle, request=request, timeout_s=timeout_s or 0.0))
        self._wake.set()
        return stream

    def cancel(self, handle: int) -> None:
        if self._streams.pop(handle, None) is not None:
            self._cancels.append(handle)
            self._wake.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._call is not None:
            self._call.cancel()
            self._call = None

    # -- the call ---------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._call is not None:
            return
        call = self._stub.StreamTokens()
        self._call = call
        self._tasks = [asyncio.create_task(self._write(call), name=f"tokens-write-{self.address}"),
                       asyncio.create_task(self._read(call), name=f"tokens-read-{self.address}")]

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._starts or self._cancels:
                    msg = compute_pb2.StreamTokensRequest(start=self._starts, cancel=self._cancels)
                    self._starts, self._cancels = [], []
                    await call.write(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader reports the broken call
            log.debug("compute %s: token stream write failed: %s", self.address, exc)
            call.cancel()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        reason = "the compute service ended the token stream"
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                self._demux(msg)
        except asyncio.CancelledError:
            if self._call is not call:
                raise
            reason = "the token stream was cancelled"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        self._broken(call, reason)

    def _demux(self, msg: compute_pb2.StreamTokensResponse) -> None:
        streams = self._streams
        tokens = list(msg.token_ids)
        pos = 0
        for handle, n in zip(msg.handles, msg.num_tokens):
            stream = streams.get(handle)
            if stream is not None:
                stream.push(tokens[pos:pos + n])
            pos += n
        for f in msg.finished:
            stream = streams.pop(f.handle, None)
            if stream is not None:
                stream.finish(f.finish_reason, f.usage)
        for e in msg.errors:
            stream = streams.pop(e.handle, None)
            if stream is not None:
                stream.fail(rpc_error(_CODES.get(e.code, grpc.StatusCode.UNKNOWN), e.message))

    def _broken(self, call: grpc.aio.StreamStreamCall, reason: str) -> None:
        call.cancel()
        if self._call is not call:
            return      # an older call: its requests failed when it broke; the open ones are the new call's
        self._call = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks = []
        streams, self._streams = self._streams, {}
        self._starts, self._cancels = [], []
        for stream in streams.values():
            stream.fail(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                  f"the token stream to the compute replica at {self.address} broke ({reason})"))
