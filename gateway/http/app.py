"""The ASGI app of the OpenAI-compatible API and the server that runs it on the gateway's event loop.

`build_app` mounts the routes (`gateway.http.routes`) and `/metrics`; unknown
paths and methods get OpenAI error bodies too. `HttpServer` binds its socket
before the gRPC server starts (a taken port fails the start), serves with
the ASGI server on the running event loop, and stops with the gateway: the
gRPC server's SIGTERM handling stops it, not a signal handler of its own.

Access control plugs in at one point: the `guard` passed to `build_app`
(see `routes.Guard`); `gateway.server` passes `gateway.auth.http_guard` over
the gateway's own AccessControl, so a key's limits count both APIs.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import metrics
from gateway.auth import http_guard
from gateway.config import GatewayConfig
from gateway.http.errors import error_body
from gateway.http.routes import Guard, OpenAIRoutes, allow_all
from gateway.servicer import GatewayServicer
from gateway.tls import http_tls_options

log = logging.getLogger(__name__)


def metrics_route(registry: Any = None) -> Route:
    """`/metrics`: the Prometheus text of `registry` (the default registry when None)."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry or REGISTRY), media_type=CONTENT_TYPE_LATEST)
    return Route("/metrics", metrics, methods=["GET"])


class CountRequests:
    """ASGI middleware: counts each HTTP request by "METHOD /route" (the route's template, e.g.
    `GET /v1/models/{model_id:path}`; requests no route matched as "other") and status code in `counter`
    (the gateway's requests counter), when it ends."""

    def __init__(self, app: Any, counter: Any) -> None:
        self._app, self._counter = app, counter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        status = 499     # unless a response starts: the client left first

        async def counting(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self._app(scope, receive, counting)
        finally:
            route = scope.get("route")       # set by the router on the scope it was handed
            path = route.path if isinstance(route, Route) else "other"
            self._counter.labels(f"{scope['method']} {path}", str(status)).inc()


def build_app(servicer: GatewayServicer, base_model: str, *, guard: Guard = allow_all,
              metrics_registry: Any = None, request_counter: Any = None) -> Starlette:
    routes = OpenAIRoutes(servicer, base_model, guard)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = (f"no route {request.method} {request.url.path} (see docs/openai.md)" if status in (404, 405)
                   else str(getattr(exc, "detail", exc)))
        return JSONResponse(error_body(status, message), status_code=status)

    app = Starlette(
        routes=[
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"]),
            Route("/health", routes.health, methods=["GET"]),
            metrics_route(metrics_registry),
        ],
        exception_handlers={HTTPException: http_error, Exception: http_error},
    )
    if request_counter is not None:
        app.add_middleware(CountRequests, counter=request_counter)
    return app


class _Embedded(uvicorn.Server):
    """The ASGI server without signal handlers of its own: it stops when the gateway does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class HttpServer:
    """Serves an ASGI app on `address` (port 0 picks one) inside the running event loop."""

    def __init__(self, app: Starlette, address: str, grace_s: float = 5.0,
                 tls: dict[str, Any] | None = None, reuse_port: bool = False) -> None:
        # `tls`: uvicorn's ssl_* options (gateway.tls.http_tls_options), None for plaintext
        self._config = uvicorn.Config(app, log_config=None, lifespan="off", access_log=False,
                                      timeout_graceful_shutdown=grace_s, server_header=False, **(tls or {}))
        self._server = _Embedded(self._config)
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._reuse_port = reuse_port      # other gateway processes listen on the same port
        self.address = address

    def bind(self) -> str:
        """Binds and listens (connections wait in the backlog until `start`); returns HOST:PORT."""
        host, port = split_host_port(self.address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self._reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"gateway: cannot serve HTTP on {self.address}: {exc.strerror or exc}") from exc
        sock.listen(2048)
        sock.setblocking(False)
        self._socket = sock
        bound = sock.getsockname()[1]
        self.address = f"{host if family == socket.AF_INET else '[' + host + ']'}:{bound}"
        return self.address

    async def start(self) -> None:
        if self._socket is None:
            self.bind()
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="http-server")

    def begin_stop(self) -> None:
        self._server.should_exit = True

    async def stop(self) -> None:
        if self._task is None:
            if self._socket is not None:
                self._socket.close()
            return
        self.begin_stop()
        try:
            await self._task
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - stopping anyway
            log.warning("http server stopped with %s", exc)
        self._task = None


def served_model_name(config: GatewayConfig, model_path: Path) -> str:
    """The base model's id in the API: --served-model-name, else the model folder's name, or the GGUF
    file's without its quantization tag ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    if config.served_model_name:
        return config.served_model_name
    if model_path.is_file():
        return re.sub(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", "", model_path.stem, flags=re.IGNORECASE)
    return model_path.name


def http_server_for(config: GatewayConfig, servicer: GatewayServicer, model_path: Path,
                    grace_s: float = 5.0, guard: Guard | None = None) -> HttpServer:
    """The gateway's HTTP server on `config.http_listen`: access control is `guard` (the gateway's,
    sharing its keys' limits with the gRPC API), else `gateway.auth.http_guard(config)`; /metrics
    serves the gateway's `metrics.REGISTRY` and its `REQUESTS` counter counts the HTTP requests too.
    TLS settings are the gRPC API's."""
    app = build_app(servicer, served_model_name(config, model_path),
                    guard=http_guard(config) if guard is None else guard,
                    metrics_registry=metrics.REGISTRY, request_counter=metrics.REQUESTS)
    return HttpServer(app, config.http_listen, grace_s, http_tls_options(config), reuse_port=config.reuse_port)
