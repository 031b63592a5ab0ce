"""Which compute replica serves a request.

The gateway reaches compute services only through a `ComputeRouter`. Today
there is one implementation, `SingleReplicaRouter`; routing over many replicas
by adapter affinity (rendezvous hashing weighted by load) slots in behind the
same interface: `lease(task_id)` picks a replica and counts the request on it
until the lease ends, so a load-aware router has the numbers it needs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import grpc

from loraplex.serving import server_options
from loraplex.settings import SettingsError
from loraplex.v1 import compute_pb2_grpc


@dataclass
class ComputeReplica:
    """One compute service: its address, channel, stub and requests in flight."""

    address: str
    channel: grpc.aio.Channel
    stub: compute_pb2_grpc.ComputeStub
    num_in_flight: int = 0


def open_replica(address: str, max_message_bytes: int) -> ComputeReplica:
    """A replica with a lazily connecting channel (the service may start later)."""
    channel = grpc.aio.insecure_channel(address, options=server_options(max_message_bytes)[:2])
    return ComputeReplica(address, channel, compute_pb2_grpc.ComputeStub(channel))


class ComputeRouter(Protocol):
    """Chooses a compute replica per request."""

    def replicas(self) -> list[ComputeReplica]:
        """Every replica (for stats, model info and adapter drops)."""

    def lease(self, task_id: int | None) -> contextlib.AbstractAsyncContextManager[ComputeReplica]:
        """The replica for a request using adapter `task_id` (None: the base model)."""

    async def close(self) -> None:
        """Closes every channel."""


class SingleReplicaRouter:
    """Every request goes to the one compute service."""

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self._replica = open_replica(address, max_message_bytes)

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

    async def close(self) -> None:
        await self._replica.channel.close()


def build_router(addresses: tuple[str, ...], max_message_bytes: int) -> ComputeRouter:
    """The router for the configured compute addresses."""
    if len(addresses) != 1:
        raise SettingsError(
            f"{len(addresses)} compute addresses given; this gateway routes to one compute service "
            "(give one address in --compute-addresses)")
    return SingleReplicaRouter(addresses[0], max_message_bytes)
