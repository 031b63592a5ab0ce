"""The gateway's end of the token stream: one StreamTokens call per compute replica, many requests on it.

`ReplicaSession` owns the call. `start()` queues a request's start (a writer
task sends every start and cancel queued in the same loop turn as one
message) and returns its `RequestStream`. The call's responses are read on a
thread of their own, not by an event-loop task: the thread parks every step
message compute sends and posts one drain per batch of them to the event
loop, which splits them into the requests' buffers. A reader task would take
one message per turn of the event loop, behind every client write of the
previous step, so a gateway with more streams than it can write per engine
step would fall behind one token per message; with the thread, messages
pile up while the loop writes and the next drain hands each request all of
them. A `RequestStream` hands out everything buffered at once (`next()`), so
a client that reads slower than the engine steps gets fewer, fuller messages
and never holds up the others.

Bounds: a request's buffer holds at most `max_buffered_tokens` tokens its
client has not taken; past that the request is cancelled on compute and ends
with RESOURCE_EXHAUSTED (a client that stops reading cannot grow the
gateway's memory). Failures: a request's own error (its gRPC code and
message) reaches that request only; when the call breaks, every request on it
fails with UNAVAILABLE naming the replica, and the next start opens a new call.
The call's end is also watched through its done callback: now and then (3 of
about 170 runs of a replica stopped under CPU load) a call gets its status
while a read it started never completes, and its reader blocks for good; the
requests on it (and every later start on that call) would wait forever. A call
that ended and whose reader has not seen it after `END_GRACE_S` counts as
broken all the same.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from loraplex.errors import ResourceExhaustedError
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED_TOKENS = 4096
END_GRACE_S = 1.0    # after a call's end, how long its reader has to hand over the messages it still holds
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


class _CallReader:
    """Reads one call's responses on a thread; the event loop drains what it parked, one drain per batch."""

    def __init__(self, session: "ReplicaSession", call: grpc.Future, loop: asyncio.AbstractEventLoop) -> None:
        self.session = session
        self.call = call
        self.loop = loop
        self.inbox: deque[compute_pb2.StreamTokensResponse] = deque()
        self.posted = False       # a drain is scheduled on the event loop
        self.thread = threading.Thread(target=self._run, name=f"tokens-read-{session.address}", daemon=True)
        self.reported = False     # the thread posted the call's end
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.Future) -> None:
        """On gRPC's thread when the call gets its status: the reader has END_GRACE_S to report the end."""
        reason = f"{call.code().name}: {call.details()}"     # type: ignore[attr-defined]
        self._post(lambda: self.loop.call_later(END_GRACE_S, self._stuck, reason))

    def _stuck(self, reason: str) -> None:
        if self.reported or self.session._reader is not self:
            return
        log.warning("the token stream to %s ended (%s) but its reader did not return within %.1f s; "
                    "failing its requests", self.session.address, reason, END_GRACE_S)
        self.session._broken(self, reason)

    def _run(self) -> None:
        reason = "the compute service ended the token stream"
        try:
            for msg in self.call:          # blocks without the GIL between messages
                self.inbox.append(msg)
                if not self.posted:
                    self.posted = True
                    self._post(self.drain)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            reason = f"{code.name}: {details}"
        except Exception as exc:  # noqa: BLE001 - reported as the call's break
            reason = f"{type(exc).__name__}: {exc}"
        self.reported = True
        self._post(lambda: self.session._broken(self, reason))

    def _post(self, callback: object) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)   # type: ignore[arg-type]
        except RuntimeError:
            pass                                       # the event loop is closed: nobody waits any more

    def drain(self) -> None:
        self.posted = False       # first: a message parked from now on posts a new drain
        inbox, demux = self.inbox, self.session._demux
        while inbox:
            demux(inbox.popleft())


def _until_none(outbox: queue.SimpleQueue[compute_pb2.StreamTokensRequest | None],
                ) -> Iterator[compute_pb2.StreamTokensRequest]:
    """A call's requests: what the writer puts in `outbox`, until None."""
    while (msg := outbox.get()) is not None:
        yield msg


class ReplicaSession:
    """The long-lived StreamTokens call to one replica (opened when a health check first finds the replica
    serving, or on first use; reopened after a break)."""

    def __init__(self, address: str, max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
                 channel_options: Sequence[tuple[str, int]] = ()) -> None:
        self.address = address
        self._max_buffered = max_buffered_tokens
        self._channel_options = list(channel_options)
        self._channel: grpc.Channel | None = None
        self._handles = itertools.count(1)
        self._streams: dict[int, RequestStream] = {}
        self._starts: list[compute_pb2.StartTokens] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._reader: _CallReader | None = None
        self._outbox: queue.SimpleQueue[compute_pb2.StreamTokensRequest | None] | None = None
        self._writer: asyncio.Task[None] | None = None

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def open(self) -> None:
        """Opens the call now (idempotent), so the first request does not wait for its connection."""
        self._ensure_open()

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
        reader, self._reader = self._reader, None
        self._stop_writer()
        if reader is not None:
            reader.call.cancel()
            await asyncio.to_thread(reader.thread.join, 5.0)
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- the call ---------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._reader is not None:
            return
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address, options=self._channel_options)
        stub = compute_pb2_grpc.ComputeStub(self._channel)
        outbox: queue.SimpleQueue[compute_pb2.StreamTokensRequest | None] = queue.SimpleQueue()
        self._attach(stub.StreamTokens(_until_none(outbox)), outbox)

    def _attach(self, call: grpc.Future,
                outbox: queue.SimpleQueue[compute_pb2.StreamTokensRequest | None]) -> None:
        """Makes `call` (whose requests come from `outbox`) the session's call: its reader and writer start."""
        reader = _CallReader(self, call, asyncio.get_running_loop())
        self._reader, self._outbox = reader, outbox
        self._writer = asyncio.create_task(self._write(outbox), name=f"tokens-write-{self.address}")
        reader.thread.start()

    def _stop_writer(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            self._writer = None
        if self._outbox is not None:
            self._outbox.put(None)         # ends the request iterator
            self._outbox = None

    async def _write(self, outbox: queue.SimpleQueue[compute_pb2.StreamTokensRequest | None]) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._starts or self._cancels:
                outbox.put(compute_pb2.StreamTokensRequest(start=self._starts, cancel=self._cancels))
                self._starts, self._cancels = [], []

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

    def _broken(self, reader: _CallReader, reason: str) -> None:
        reader.drain()                     # what compute sent before the break still counts
        reader.call.cancel()
        if self._reader is not reader:
            return      # an older call: its requests failed when it broke; the open ones are the new call's
        self._reader = None
        self._stop_writer()
        if self._channel is not None:
            # a fresh channel for the next call: this one may sit in reconnect backoff long after the
            # replica is back (the health checker talks to it over its own channel)
            self._channel.close()
            self._channel = None
        streams, self._streams = self._streams, {}
        self._starts, self._cancels = [], []
        for stream in streams.values():
            stream.fail(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                  f"the token stream to the compute replica at {self.address} broke ({reason})"))
