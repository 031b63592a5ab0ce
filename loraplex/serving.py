"""Running an asyncio gRPC server the loraplex way: health, reflection, SIGTERM.

Every service starts through `run_server`: it binds the address (port 0 picks a
free port), registers `grpc.health.v1` and server reflection, prints one line
`<service> listening on HOST:PORT` (tests and `loraplex serve` read it), and on
SIGTERM/SIGINT marks itself NOT_SERVING, stops accepting calls and lets running
calls finish within a grace period.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplex.logging_setup import say

log = logging.getLogger(__name__)

# Adapters can be hundreds of MB; services raise these from their settings.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


# Calls the server may hold before the application takes them. gRPC's default (1,000, hard limit 3,000)
# cancels the calls of a larger burst with a bare CANCELLED, as if their clients had cancelled them; a
# burst of new streams is the services' own business to queue (tests/reliability/test_soak.py).
MAX_PENDING_CALLS = 1 << 16
# gRPC also cancels (bare CANCELLED again) a call that waited 30 s to be taken; a saturated service
# leaves that to the caller's deadline (tests/reliability/test_transport.py).
MAX_PENDING_CALL_S = 24 * 3600


def server_options(max_message_bytes: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    """`reuse_port`: several processes may listen on the same port (the kernel spreads connections over
    them); off, a port already in use fails the start."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ("grpc.server_max_unrequested_time_in_server", MAX_PENDING_CALL_S),
    ]


GC_THRESHOLDS = (50_000, 50, 100)   # young collections rarer than Python's 700: fewer pauses while serving


def tune_gc() -> None:
    """Once a service is ready: what start-up built (model, tables, tokenizer) leaves the collector's
    view and young collections become rarer, so no long collection pauses a stream mid-way."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def run_server(
    name: str,
    address: str,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    grace_s: float = 5.0,
    on_started: Callable[[int], Awaitable[None]] | None = None,
    on_stopping: Callable[[], Awaitable[None]] | None = None,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    ready: Callable[[], Awaitable[None]] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
) -> None:
    """Serves until SIGTERM/SIGINT. `register` adds servicers and returns their full names.
    With `credentials`, the port speaks TLS only.

    With `reuse_port`, other processes may serve the same address (`server_options`).

    With `ready`, health says NOT_SERVING from the listening line until `ready()` returns (a service
    that warms up while reachable); an exception from it stops the server and propagates.
    """
    server = grpc.aio.server(options=server_options(max_message_bytes, reuse_port),
                             interceptors=list(interceptors))
    service_names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"{name}: cannot listen on {address} (address in use or not local?)")
    first = health_pb2.HealthCheckResponse.SERVING if ready is None else health_pb2.HealthCheckResponse.NOT_SERVING
    for svc in service_names + [""]:      # before start: no check may see a default SERVING
        await health_servicer.set(svc, first)
    await server.start()
    host = address.rsplit(":", 1)[0]
    say(f"{name} listening on {host}:{port}")
    if ready is not None:
        try:
            await ready()
        except BaseException:
            await server.stop(0)
            raise
        for svc in service_names + [""]:
            await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    tune_gc()
    if on_started is not None:
        await on_started(port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s: stopping (grace %.1fs)", name, grace_s)
    for svc in service_names + [""]:
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
    if on_stopping is not None:
        await on_stopping()
    await server.stop(grace_s)
    say(f"{name} stopped")


def configure_logging(level: str = "INFO", log_format: str = "text", service: str = "") -> None:
    """Text or JSON log lines on stderr (`loraplex.logging_setup`)."""
    from loraplex.logging_setup import configure_logging as configure

    configure(level, log_format, service)


def abort_code_for(exc: BaseException) -> grpc.StatusCode:
    """Maps a domain exception to a status code by its `grpc_code` attribute."""
    code = getattr(exc, "grpc_code", None)
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.INTERNAL


async def wait_healthy(target: str, timeout_s: float = 60.0, service: str = "") -> None:
    """Polls grpc.health.v1 on `target` until SERVING or timeout (raises TimeoutError)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{target} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
