"""The aio gRPC server of the gateway: builds its parts, serves health and reflection.

The tokenizer loads before the server listens, so a gateway that says
`listening` can tokenize at once (a GGUF model's is converted on the first
start, about 7 s for the default SmolLM2, and read from the tokenizer cache on
later ones, 0.3 s: `loraplex.tokenizer_cache`).
The gateway starts (and answers UNAVAILABLE for requests that need them)
while the cache and compute services are down; once it listens it connects
to them in the background, so the first requests do not wait for that.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

import grpc

from loraplex.formats import ModelSpec
from loraplex.model_files import load_tokenizer, resolve_model_path
from loraplex.metrics import serve_metrics
from loraplex.logging_setup import say
from loraplex.serving import run_server
from loraplex.v1 import gateway_pb2_grpc
from gateway import metrics
from gateway.adapters import AdapterResolver, AdapterStore
from gateway.auth import AuthInterceptor, access_from_config, http_guard, reload_keys, warn_if_exposed
from gateway.config import GatewayConfig
from gateway.http.app import HttpServer, http_server_for
from gateway.requests import PromptCodec
from gateway.router import ComputeRouter, build_router
from gateway.servicer import GatewayServicer
from gateway.tls import credentials_from_config

log = logging.getLogger(__name__)
CONNECT_AT_START_S = 10.0     # how long the start-up connection to the cache is tried (calls connect anyway)


def transport_limit(max_message_bytes: int) -> int:
    """gRPC's own receive limit: above the gateway's, so a request a little over the limit reaches
    the servicer, which refuses it with a message naming the setting (gRPC's own says only numbers)."""
    return min(2 * max_message_bytes, 2**31 - 1)


def build_servicer(config: GatewayConfig, tokenizer: Any, model_spec: ModelSpec, store: AdapterStore,
                   router: ComputeRouter) -> GatewayServicer:
    """Wires the gateway's parts (tests pass their own store and router)."""
    codec = PromptCodec(tokenizer)
    return GatewayServicer(config, codec, store, AdapterResolver(store, model_spec, ttl_s=config.adapter_resolve_ttl_s),
                           router)


async def serve(config: GatewayConfig) -> None:
    """Serves loraplex.v1.Gateway on `config.listen` until SIGTERM."""
    from gateway.cache_store import CacheStore

    if config.gil_switch_interval_us > 0:
        sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
    model_path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(model_path)
    model_spec = ModelSpec.from_path(model_path)
    store = CacheStore(config.cache_address, config.max_message_bytes, config.downstream_timeout_s)
    router = build_router(config.compute_addresses, config.max_message_bytes,
                          spill_threshold=config.replica_spill_threshold,
                          health_interval_s=config.replica_health_interval_s,
                          max_buffered_tokens=config.max_buffered_tokens)
    servicer = build_servicer(config, tokenizer, model_spec, store, router)
    access = access_from_config(config)
    http = (http_server_for(config, servicer, model_path, guard=http_guard(access)) if config.http_listen
            else None)
    if http is not None:
        # bound before the gRPC server starts (a taken port fails the start); connections wait in the
        # backlog until it serves, once the gRPC server does
        say(f"gateway http listening on {http.bind()}")

    connecting: list[asyncio.Task[bool]] = []

    async def started(port: int) -> None:
        # `kill -HUP`: the key file is read again (revoked keys stop working, new ones start; no restart)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, reload_keys, access, config)
        # The cache channel connects now, in the background (the compute replicas' health checks open
        # theirs): the first request naming an adapter does not pay for the connection.
        connecting.append(loop.create_task(store.connect(CONNECT_AT_START_S), name="cache-connect"))
        if http is not None:
            await http.start()

    def register(server: grpc.aio.Server) -> list[str]:
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return ["loraplex.v1.Gateway"]

    log.info("gateway: model %s, cache %s, compute %s", model_path, config.cache_address,
             ",".join(config.compute_addresses))
    credentials = credentials_from_config(config)
    warn_if_exposed(config.listen, access, credentials is not None)
    if config.http_listen:
        warn_if_exposed(config.http_listen, access, credentials is not None, "the HTTP API")
    log.info("gateway: %s, %s", f"{len(access.key_names())} API key(s)" if access.enabled else "no API keys (open)",
             "TLS" + (" with client certificates" if config.tls_client_ca else "") if credentials else "plaintext")
    if config.reuse_port:
        log.info("gateway: sharing %s%s with other gateway processes (SO_REUSEPORT): API key limits and /metrics "
                 "count this process only", config.listen, f" and {config.http_listen}" if config.http_listen else "")
    if config.metrics_port:
        serve_metrics(metrics.REGISTRY, config.metrics_port)
        log.info("metrics on :%d/metrics", config.metrics_port)
    # Channels close with the process: closing them before the server's grace period ends
    # would cut the streams it is letting finish.
    try:
        await run_server("gateway", config.listen, register,
                         max_message_bytes=transport_limit(config.max_message_bytes), on_started=started,
                         interceptors=[metrics.RequestMetrics(), AuthInterceptor(access)], credentials=credentials,
                         on_stopping=(lambda: _begin_stop(http)), reuse_port=config.reuse_port)
    finally:
        for task in connecting:
            task.cancel()
        if http is not None:
            await http.stop()


async def _begin_stop(http: HttpServer | None) -> None:
    if http is not None:
        http.begin_stop()   # stops accepting; running answers finish while gRPC's grace period runs
