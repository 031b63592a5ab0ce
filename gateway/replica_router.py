"""Routing over several compute replicas: channels, health checks, failover.

`ReplicaRouter` is the gateway's `ComputeRouter` for any number of compute
addresses. The rule (which replica) lives in `gateway/replicas.py`; this file
feeds it: a background task asks every replica's `grpc.health.v1` each
`health_interval_s` and re-resolves `dns:///name:port` addresses, and calls
that fail with UNAVAILABLE take their replica out at once.

`stream()` starts a request on a replica's token stream with failover: until
the first tokens arrive nothing has reached the client, so a replica that is
unreachable, draining or dies in prefill is taken out and the request is
retried on the next one. Once tokens have arrived, a replica failure ends the
request with UNAVAILABLE (a retry would repeat tokens already sent).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import AsyncIterator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.v1 import compute_pb2, compute_pb2_grpc
from gateway.downstream import DownstreamError, from_rpc_error
from gateway.replicas import NoReplicaError, ReplicaSet, format_address, is_dns_target, split_target
from gateway.router import ComputeReplica
from loraplex.channels import channel_options
from gateway.token_stream import DEFAULT_MAX_BUFFERED_TOKENS, RequestStream, TokenBatch, rpc_error

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], list[str]]

# Codes after which a request that has not started is retried elsewhere: the
# replica could not take it (down, draining on SIGTERM, connection lost).
_RETRY_BEFORE_START = {grpc.StatusCode.UNAVAILABLE}
# Codes that mean the replica, not the request, failed mid-stream.
_REPLICA_FAILED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}


def resolve_all(host: str, port: int) -> list[str]:
    """Every TCP address `host` resolves to, as `ip:port` (IPv6 bracketed), in DNS order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(format_address(str(info[4][0]), port) for info in infos))


class ReplicaStream:
    """A started request: iterate it for token batches; `address` says where it runs."""

    def __init__(self, address: str, stream: RequestStream, first: TokenBatch,
                 on_failure: Callable[[str, str], None] | None = None) -> None:
        self.address = address
        self._stream = stream
        self._first: TokenBatch | None = first
        self._on_failure = on_failure  # (address, reason) when the replica fails mid-stream

    def cancel(self) -> None:
        self._stream.cancel()

    def done(self) -> bool:
        return self._stream.done()

    async def __aiter__(self) -> AsyncIterator[TokenBatch]:
        batch, self._first = self._first, None
        while batch is not None:
            yield batch
            try:
                batch = await self._stream.next()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _REPLICA_FAILED:
                    raise
                if self._on_failure is not None:
                    self._on_failure(self.address, f"{exc.code().name}: {exc.details()}")
                raise DownstreamError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the compute replica at {self.address} failed during generation "
                    f"({exc.code().name}: {exc.details()}); tokens were already sent, so the request "
                    "was not retried: send it again") from exc


async def start_stream(replica: ComputeReplica, request: compute_pb2.GenerateTokensRequest,
                       timeout_s: float | None,
                       on_failure: Callable[[str, str], None] | None = None) -> ReplicaStream:
    """Starts `request` on `replica`'s token stream and waits for its first tokens.

    Raises the request's AioRpcError if it fails before that (nothing was sent
    to the client yet, so the caller may retry elsewhere). The caller cancels
    the stream when done with it (`if not s.done(): s.cancel()`)."""
    stream = replica.tokens().start(request, timeout_s)
    try:
        first = await stream.next()
    except BaseException:
        stream.cancel()
        raise
    if first is None:
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the request ended before its first tokens")
    return ReplicaStream(replica.address, stream, first, on_failure)


class ReplicaRouter:
    """Routes compute calls over replicas by adapter affinity and load, around failures."""

    def __init__(self, targets: Sequence[str], max_message_bytes: int, *, spill_threshold: int = 32,
                 health_interval_s: float = 1.0, health_timeout_s: float = 2.0,
                 resolver: Resolver = resolve_all, max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS) -> None:
        for t in targets:
            split_target(t)  # a bad address fails at start, naming itself
        self._targets = list(targets)
        self._max_message_bytes = max_message_bytes
        self._max_buffered_tokens = max_buffered_tokens
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._resolver = resolver
        self._set = ReplicaSet([], spill_threshold)
        self._replicas: dict[str, ComputeReplica] = {}
        self._retired: list[ComputeReplica] = []  # left the set, channel not closed yet
        # what each dns:/// target resolved to last; kept through a failed lookup
        self._resolved: dict[str, list[str]] = {t: [] for t in targets if is_dns_target(t)}
        self._apply(self._resolve_names())  # at start, so replicas() is complete at once
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        with contextlib.suppress(RuntimeError):  # no loop yet: started on first use
            asyncio.get_running_loop()
            self._ensure_started()

    # --- the ComputeRouter interface --------------------------------------
    def replicas(self) -> list[ComputeReplica]:
        """Every replica, healthy ones first (so `replicas()[0]` is a good one to ask)."""
        self._ensure_started()
        healthy = set(self._set.healthy())
        return sorted(self._replicas.values(), key=lambda r: r.address not in healthy)

    @contextlib.asynccontextmanager
    async def lease(self, task_id: int | None) -> AsyncIterator[ComputeReplica]:
        """A replica chosen for adapter `task_id`, counted as busy until the block ends (no retry)."""
        self._ensure_started()
        replica = self._pick(task_id, {})
        self._acquire(replica)
        try:
            yield replica
        finally:
            self._release(replica)

    @contextlib.asynccontextmanager
    async def stream(self, task_id: int | None, request: compute_pb2.GenerateTokensRequest,
                     timeout_s: float | None) -> AsyncIterator[ReplicaStream]:
        """A GenerateTokens stream that has its first message, retried on other replicas until then."""
        self._ensure_started()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        failed: dict[str, str] = {}  # replica -> why this request could not start there
        while True:
            replica = self._pick(task_id, failed)
            remaining = None if deadline is None else max(deadline - loop.time(), 0.001)
            self._acquire(replica)
            try:
                stream = await start_stream(replica, request, remaining, self.take_out)
            except grpc.aio.AioRpcError as exc:
                self._release(replica)
                if exc.code() not in _RETRY_BEFORE_START:
                    raise from_rpc_error(exc, "compute", replica.address) from exc
                failed[replica.address] = f"{exc.code().name}: {exc.details()}"
                if replica.channel.get_state() != grpc.ChannelConnectivity.READY:
                    # the connection is gone: out for everyone until a health check says otherwise;
                    # a replica that answered (draining, its own downstream down) is skipped only here
                    self.take_out(replica.address, failed[replica.address])
                continue
            except BaseException:
                self._release(replica)
                raise
            break
        if failed:
            log.info("request %s: runs on %s after %s", request.request_id, replica.address,
                     "; ".join(f"{a} failed ({why})" for a, why in failed.items()))
        try:
            yield stream
        finally:
            if not stream.done():
                stream.cancel()
            self._release(replica)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for replica in [*self._replicas.values(), *self._retired]:
            await replica.close()

    # --- health and membership ---------------------------------------------
    def take_out(self, address: str, reason: str) -> None:
        """Marks a replica out until a health check finds it serving."""
        if self._set.mark_down(address, reason):
            log.warning("compute replica %s is out: %s", address, reason)

    async def refresh(self) -> None:
        """One round: re-resolve dns:/// addresses, then health-check every replica."""
        await self._resolve()
        await self._close_retired()
        await asyncio.gather(*(self._check(r) for r in list(self._replicas.values())))

    def _ensure_started(self) -> None:
        if self._task is None and not self._closed:
            with contextlib.suppress(RuntimeError):  # no running loop: the next call starts it
                self._task = asyncio.get_running_loop().create_task(
                    self._watch(), name="compute-replica-health")

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad round
                log.exception("compute replica health round failed")
            await asyncio.sleep(self._health_interval_s)

    async def _check(self, replica: ComputeReplica) -> None:
        stub = health_pb2_grpc.HealthStub(replica.channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._health_timeout_s)
            serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            reason = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as exc:
            serving, reason = False, f"health check: {exc.code().name}: {exc.details()}"
        if serving:
            if self._set.mark_up(replica.address):
                log.info("compute replica %s is back", replica.address)
            replica.tokens().open()      # the token stream is up before the first request needs it
        else:
            self.take_out(replica.address, reason)

    async def _resolve(self) -> None:
        if self._resolved:
            self._apply(await asyncio.to_thread(self._resolve_names))

    def _resolve_names(self) -> dict[str, list[str]]:
        results = {}
        for target in self._resolved:
            host, port = split_target(target)
            try:
                results[target] = self._resolver(host, port)
            except OSError as exc:
                # keep what the name gave last time: a DNS hiccup is not a replica failure
                log.warning("compute address %s: cannot resolve %s (%s)", target, host, exc)
        return results

    def _apply(self, resolved: dict[str, list[str]]) -> None:
        self._resolved.update(resolved)
        addresses: list[str] = []
        for target in self._targets:
            addresses += self._resolved.get(target, []) if is_dns_target(target) else [target]
        added, removed = self._set.set_addresses(addresses)
        for a in added:
            self._replicas[a] = self._open(a)
            if self._resolved:
                log.info("compute replica %s joined", a)
        for a in removed:
            log.info("compute replica %s left", a)
            # running streams still use its channel: it closes once they end
            self._retired.append(self._replicas.pop(a))

    async def _close_retired(self) -> None:
        idle = [r for r in self._retired if r.num_in_flight <= 0]
        self._retired = [r for r in self._retired if r.num_in_flight > 0]
        for replica in idle:
            await replica.close()

    # --- helpers -----------------------------------------------------------
    def _open(self, address: str) -> ComputeReplica:
        options = channel_options(self._max_message_bytes)
        channel = grpc.aio.insecure_channel(address, options=options)
        return ComputeReplica(address, channel, compute_pb2_grpc.ComputeStub(channel), 0,
                              self._max_buffered_tokens, channel_options=options)

    def _pick(self, task_id: int | None, failed: dict[str, str]) -> ComputeReplica:
        try:
            address = self._set.choose(None if task_id is None else str(task_id), exclude=failed)
        except NoReplicaError as exc:
            detail = "".join(f"; {a}: {why}" for a, why in failed.items())
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"{exc}{detail}; compute addresses: {', '.join(self._targets)}") from exc
        return self._replicas[address]

    def _acquire(self, replica: ComputeReplica) -> None:
        self._set.acquire(replica.address)
        replica.num_in_flight += 1

    def _release(self, replica: ComputeReplica) -> None:
        self._set.release(replica.address)
        replica.num_in_flight -= 1
