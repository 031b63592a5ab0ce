"""Which compute replica serves a request.

The gateway reaches compute services only through a `ComputeRouter`:
`lease(task_id)` picks a replica and counts the request on it until the lease
ends; `stream(task_id, request, timeout_s)` starts the request on the replica's
token stream (gateway/token_stream.py: one StreamTokens call per replica,
shared by every request routed there) and returns once its first tokens are in. The server uses `ReplicaRouter`
(gateway/replica_router.py: adapter affinity, load, health, failover before the
first token) for one address or many; `SingleReplicaRouter` is the plain
one-address form.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol

import grpc

from loraplex.channels import MAX_RECONNECT_BACKOFF_MS, channel_options
from gateway.downstream import from_rpc_error
from gateway.token_stream import DEFAULT_MAX_BUFFERED_TOKENS, ReplicaSession
from loraplex.v1 import compute_pb2, compute_pb2_grpc

if TYPE_CHECKING:
    from gateway.replica_router import ReplicaStream


@dataclass
class ComputeReplica:
    """One compute service: its address, channel, stub, token stream and requests in flight."""

    address: str
    channel: grpc.aio.Channel
    stub: compute_pb2_grpc.ComputeStub
    num_in_flight: int = 0
    max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS
    session: ReplicaSession | None = None
    channel_options: tuple[tuple[str, int], ...] = ()   # for the token stream's own channel

    def tokens(self) -> ReplicaSession:
        """The replica's token stream (its call opens on the first request)."""
        if self.session is None:
            self.session = ReplicaSession(self.address, self.max_buffered_tokens, self.channel_options)
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await self.channel.close()


def until_connected_timeout(replica: ComputeReplica, timeout_s: float) -> tuple[float, bool]:
    """(timeout, wait_for_ready) for a unary call to `replica`: on a channel that is not connected (the
    replica started after the gateway, or restarted, and the channel waits out a reconnect backoff) the
    call waits for the connection, for at most one backoff and a second more, instead of failing at once."""
    if replica.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
        return timeout_s, False
    return min(timeout_s, MAX_RECONNECT_BACKOFF_MS / 1000 + 1.0), True


def open_replica(address: str, max_message_bytes: int,
                 max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS) -> ComputeReplica:
    """A replica with a lazily connecting channel (the service may start later)."""
    options = channel_options(max_message_bytes)
    channel = grpc.aio.insecure_channel(address, options=options)
    return ComputeReplica(address, channel, compute_pb2_grpc.ComputeStub(channel), 0, max_buffered_tokens,
                          channel_options=options)


class ComputeRouter(Protocol):
    """Chooses a compute replica per request."""

    def replicas(self) -> list[ComputeReplica]:
        """Every replica (for stats, model info and adapter drops)."""

    def lease(self, task_id: int | None) -> contextlib.AbstractAsyncContextManager[ComputeReplica]:
        """The replica for a request using adapter `task_id` (None: the base model)."""

    def stream(self, task_id: int | None, request: compute_pb2.GenerateTokensRequest,
               timeout_s: float | None) -> contextlib.AbstractAsyncContextManager[ReplicaStream]:
        """`request` started for adapter `task_id`, once its first tokens are in."""

    async def close(self) -> None:
        """Closes every channel."""


class SingleReplicaRouter:
    """Every request goes to the one compute service."""

    def __init__(self, address: str, max_message_bytes: int,
                 max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS) -> None:
        self._replica = open_replica(address, max_message_bytes, max_buffered_tokens)

    def replicas(self) -> list[ComputeReplica]:
        return [self._replica]

    @contextlib.asynccontextmanager
    async def lease(self, task_id: int | None) -> AsyncIterator[ComputeReplica]:
        replica = self._replica
        replica.num_in_flight += 1
        try:
            yield replica
        finally:
            replica.num_in_flight -= 1

    @contextlib.asynccontextmanager
    async def stream(self, task_id: int | None, request: compute_pb2.GenerateTokensRequest,
                     timeout_s: float | None) -> AsyncIterator[ReplicaStream]:
        from gateway.replica_router import start_stream  # it builds on ComputeReplica, defined here

        async with self.lease(task_id) as replica:
            try:
                stream = await start_stream(replica, request, timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, "compute", replica.address) from exc
            try:
                yield stream
            finally:
                if not stream.done():
                    stream.cancel()

    async def close(self) -> None:
        await self._replica.close()


def build_router(addresses: tuple[str, ...], max_message_bytes: int, *, spill_threshold: int = 32,
                 health_interval_s: float = 1.0,
                 max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS) -> ComputeRouter:
    """The router for the configured compute addresses (one or more; `dns:///name:port` expands)."""
    from gateway.replica_router import ReplicaRouter  # it builds on ComputeReplica, defined here

    return ReplicaRouter(addresses, max_message_bytes, spill_threshold=spill_threshold,
                         health_interval_s=health_interval_s, max_buffered_tokens=max_buffered_tokens)
