"""ReplicaRouter over real gRPC servers: affinity, health checks, failover, DNS targets.

Each replica is an in-process aio server with grpc.health.v1 and a small
Compute servicer that answers with its own port as the token, so a test sees
which replica served a request; its request id scripts a failure.
"""
from __future__ import annotations

import asyncio
import collections
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loraplex.v1 import compute_pb2, compute_pb2_grpc
from gateway.downstream import DownstreamError
from gateway_fakes import PerRequestStreams
from gateway.replica_router import ReplicaRouter, resolve_all
from gateway.replicas import rendezvous_order

pytestmark = pytest.mark.timeout(120)


class PortCompute(PerRequestStreams, compute_pb2_grpc.ComputeServicer):
    def __init__(self, port: int) -> None:
        self.port = port
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    async def GenerateTokens(self, request, context):
        self.calls.append(request.request_id)
        rid = request.request_id
        if rid.startswith("refuse"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if rid.startswith("invalid"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        try:
            for i in range(3):
                yield compute_pb2.GenerateTokensResponse(token_ids=[self.port, i])
                if rid.startswith("die"):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "replica lost")
                await asyncio.sleep(0.5 if rid.startswith("slow") else 0)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


class Replica:
    """One fake compute replica that can be stopped and started on the same port."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.server: grpc.aio.Server | None = None
        self.compute: PortCompute | None = None
        self.health: health.aio.HealthServicer | None = None

    async def start(self) -> "Replica":
        self.server = grpc.aio.server()
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.compute = PortCompute(self.port)
        compute_pb2_grpc.add_ComputeServicer_to_server(self.compute, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self) -> None:
        await self.server.stop(None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def replicas(n: int) -> list[Replica]:
    return [await Replica().start() for _ in range(n)]


def request(rid: str, task_id: int | None = None) -> compute_pb2.GenerateTokensRequest:
    req = compute_pb2.GenerateTokensRequest(request_id=rid, input_ids=[1, 2, 3])
    if task_id is not None:
        req.adapter.task_id = task_id
    return req


async def served_by(router: ReplicaRouter, rid: str, task_id: int | None = None) -> int:
    """Runs one stream to its end; returns the port of the replica that served it."""
    ports = set()
    async with router.stream(task_id, request(rid, task_id), timeout_s=30) as stream:
        async for msg in stream:
            ports.add(msg.token_ids[0])
    assert len(ports) == 1
    return ports.pop()


async def until_all_healthy(router: ReplicaRouter, n: int, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(router._set.healthy()) < n:
        assert loop.time() < deadline, "replicas did not come back"
        await router.refresh()
        await asyncio.sleep(0.1)


def run(coro):
    return asyncio.run(coro)


def test_adapter_affinity_and_base_spread():
    async def main():
        reps = await replicas(3)
        router = ReplicaRouter([r.address for r in reps], 1 << 20, health_interval_s=0.2)
        try:
            for task_id in (11, 12, 13, 14):
                homes = {await served_by(router, f"a{task_id}-{i}", task_id) for i in range(5)}
                assert len(homes) == 1, f"adapter {task_id} moved between replicas: {homes}"
            base = collections.Counter([await served_by(router, f"b{i}") for i in range(9)])
            assert sorted(base.values()) == [3, 3, 3]
            assert all(r.num_in_flight == 0 for r in router.replicas())
        finally:
            await router.close()
            for r in reps:
                await r.stop()
    run(main())


def test_request_not_started_is_retried_on_another_replica():
    async def main():
        a, b = await replicas(2)
        a2 = None
        router = ReplicaRouter([a.address, b.address], 1 << 20, health_interval_s=60)
        try:
            await router.refresh()
            await a.stop()  # the health checker has not noticed yet
            # adapters homed on each replica, the dead one's first (else all six could hash to b, 1 in 64,
            # and a would never be tried)
            homes = {t: rendezvous_order(str(t), [a.address, b.address])[0] for t in range(64)}
            task_ids = ([t for t in homes if homes[t] == a.address][:3]
                        + [t for t in homes if homes[t] == b.address][:3])
            ports = collections.Counter([await served_by(router, f"r{t}", task_id=t) for t in task_ids])
            assert ports == {b.port: 6}
            assert router.replicas()[0].address == b.address, "the dead one went to the back"
            # replicas that answer UNAVAILABLE (draining, their own downstream down) are
            # skipped for this request but stay in: they are connected and say so themselves
            b.compute.calls.clear()
            a2 = await Replica(a.port).start()
            await until_all_healthy(router, 2)
            with pytest.raises(DownstreamError) as info:
                async with router.stream(None, request("refuse"), 30):
                    pass
            assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE
            assert "every compute replica failed" in str(info.value) and "draining" in str(info.value)
            assert len(a2.compute.calls) == 1 and len(b.compute.calls) == 1, "each tried once"
            assert len(router._set.healthy()) == 2
            assert all(r.num_in_flight == 0 for r in router.replicas())
        finally:
            await router.close()
            for r in (a, b):
                await r.stop()
            if a2 is not None:
                await a2.stop()
    run(main())


def test_started_stream_ends_with_unavailable_and_is_not_retried():
    async def main():
        a, b = await replicas(2)
        router = ReplicaRouter([a.address, b.address], 1 << 20, health_interval_s=60)
        try:
            got = []
            with pytest.raises(DownstreamError) as info:
                async with router.stream(7, request("die", 7), 30) as stream:
                    async for msg in stream:
                        got.append(msg.token_ids[0])
            assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE
            assert "already sent" in str(info.value) and stream.address in str(info.value)
            assert len(got) == 1
            assert len(a.compute.calls) + len(b.compute.calls) == 1, "no retry once tokens were sent"
            assert router.replicas()[-1].address == stream.address, "the failed replica is out"
        finally:
            await router.close()
            await a.stop()
            await b.stop()
    run(main())


def test_request_errors_pass_through_without_retry():
    async def main():
        a, b = await replicas(2)
        router = ReplicaRouter([a.address, b.address], 1 << 20, health_interval_s=60)
        try:
            with pytest.raises(DownstreamError) as info:
                async with router.stream(5, request("invalid", 5), 30):
                    pass
            assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt too long" in str(info.value)
            assert len(a.compute.calls) + len(b.compute.calls) == 1
            await router.refresh()
            assert {r.address for r in router.replicas()} == {a.address, b.address}
            assert all(r.num_in_flight == 0 for r in router.replicas())
        finally:
            await router.close()
            await a.stop()
            await b.stop()
    run(main())


def test_health_checks_take_a_replica_out_and_back():
    async def main():
        a, b = await replicas(2)
        router = ReplicaRouter([a.address, b.address], 1 << 20, health_interval_s=0.1)
        try:
            # adapters homed on each replica (else all could hash to the live one and the one out never be
            # asked for): those of the one out go to the other
            addresses = [a.address, b.address]
            homes = {t: rendezvous_order(str(t), addresses)[0] for t in range(64)}
            task_ids = [t for t in homes if homes[t] == a.address][:4] + [t for t in homes if homes[t] == b.address][:4]
            await a.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
            await asyncio.sleep(0.5)
            assert {await served_by(router, f"x{t}", task_id=t) for t in task_ids} == {b.port}
            await a.health.set("", health_pb2.HealthCheckResponse.SERVING)
            await b.stop()  # killed: its health check fails
            await asyncio.sleep(0.5)
            assert {await served_by(router, f"y{t}", task_id=t) for t in task_ids} == {a.port}
            b2 = await Replica(b.port).start()  # restarted on its address
            deadline = asyncio.get_running_loop().time() + 10
            while asyncio.get_running_loop().time() < deadline:
                ports = {await served_by(router, f"z{i}") for i in range(4)}
                if ports == {a.port, b.port}:
                    break
                await asyncio.sleep(0.2)
            assert ports == {a.port, b.port}, "the restarted replica is back within seconds"
            await b2.stop()
        finally:
            await router.close()
            await a.stop()
    run(main())


def test_cancelled_consumer_cancels_the_call_and_frees_the_slot():
    async def main():
        (a,) = await replicas(1)
        router = ReplicaRouter([a.address], 1 << 20, health_interval_s=60)

        async def consume():
            async with router.stream(None, request("slow"), 30) as stream:
                async for _ in stream:
                    pass
        try:
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.3)
            assert router.replicas()[0].num_in_flight == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)
            assert a.compute.cancelled == ["slow"], "compute learns of the cancel"
            assert router.replicas()[0].num_in_flight == 0
        finally:
            await router.close()
            await a.stop()
    run(main())


def test_dns_target_expands_to_every_address_and_follows_changes():
    async def main():
        a, b = await replicas(2)
        answers = {"compute": [a.address, b.address]}

        def resolver(host, port):
            if host not in answers:
                raise socket.gaierror("Name or service not known")
            return list(answers[host])

        router = ReplicaRouter(["dns:///compute:50053"], 1 << 20, health_interval_s=0.1, resolver=resolver)
        try:
            assert {r.address for r in router.replicas()} == {a.address, b.address}
            assert {await served_by(router, f"d{i}") for i in range(4)} == {a.port, b.port}
            answers["compute"] = [a.address]  # scaled down
            await router.refresh()
            assert [r.address for r in router.replicas()] == [a.address]
            del answers["compute"]  # the name stops resolving: keep the last answer
            await router.refresh()
            assert [r.address for r in router.replicas()] == [a.address]
        finally:
            await router.close()
            await a.stop()
            await b.stop()
    run(main())


def test_resolve_all_and_bad_addresses():
    assert resolve_all("127.0.0.1", 7) == ["127.0.0.1:7"]
    assert "127.0.0.1:7" in resolve_all("localhost", 7)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ReplicaRouter(["compute"], 1 << 20)


def test_token_stream_opens_when_the_replica_is_first_found_serving():
    """The first request does not pay for the StreamTokens call's connection: the health check that finds a
    replica serving opens it, and requests then run on that same call; a replica not serving gets none."""
    async def main():
        a, b = await replicas(2)
        await b.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        router = ReplicaRouter([a.address, b.address], 1 << 20, health_interval_s=3600)
        try:
            await router.refresh()
            by_address = {r.address: r for r in router.replicas()}
            opened = by_address[a.address].session
            assert opened is not None and opened._reader is not None, "not opened by the health check"
            reader = opened._reader
            assert by_address[b.address].session is None
            assert await served_by(router, "first") == a.port
            assert by_address[a.address].session._reader is reader       # the same call served it
        finally:
            await router.close()
            await a.stop()
            await b.stop()
    run(main())
