"""Prometheus metrics of the gateway, in `REGISTRY`.

`REGISTRY` is the gateway's `prometheus_client.CollectorRegistry`: the gateway
serves it on `--metrics-port` (LORAPLEX_METRICS_PORT), and the HTTP API
(`gateway.http`) mounts it at `/metrics` on its own port, so one scrape of
either port reads the same numbers. It is a module-level registry: a process
runs one gateway.

- `loraplex_gateway_requests_total{method, code}`: calls by gRPC method
  (`Generate`, `ListLoras`, ...) and status code name (`OK`, `NOT_FOUND`, ...),
  counted by `RequestMetrics`, a server interceptor; the HTTP API counts its
  requests in `REQUESTS` too, by route (`POST /v1/completions`) and HTTP status.
- `loraplex_gateway_time_to_first_token_seconds`,
  `loraplex_gateway_inter_token_latency_seconds`,
  `loraplex_gateway_e2e_request_latency_seconds`: per stream (one per adapter
  of a fan-out), from the moment the gateway starts it on compute (routing and
  queueing included) to the tokens it hands to the client; inter-token gaps
  are per token (a message carrying n tokens counts n gaps of 1/n of its
  wait), end to end only for streams that produced tokens.
- `loraplex_gateway_streams_running`: streams between their first token and
  their end.
- `loraplex_gateway_generated_tokens_total`: tokens handed to clients.

Per-token work is `EntryClock.tokens`: a clock read and plain list updates,
no lock and no label lookup.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, HistogramFamily

REGISTRY = CollectorRegistry()

REQUESTS = Counter("loraplex_gateway_requests", "gateway calls by method and status code", ["method", "code"],
                   registry=REGISTRY)
_TTFT = HistogramFamily("loraplex_gateway_time_to_first_token_seconds",
                        "time from starting a stream on compute to its first token", TTFT_BUCKETS,
                        registry=REGISTRY).child()
_ITL = HistogramFamily("loraplex_gateway_inter_token_latency_seconds", "time between two tokens of a stream",
                       ITL_BUCKETS, registry=REGISTRY).child()
_E2E = HistogramFamily("loraplex_gateway_e2e_request_latency_seconds",
                       "time from starting a stream on compute to its end", E2E_BUCKETS, registry=REGISTRY).child()


class _Streams(Collector):
    """Streams running and tokens handed out: plain integers, read at scrape time."""

    def __init__(self) -> None:
        self.running = 0
        self.tokens = 0

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("loraplex_gateway_streams_running", "streams that have had their first token "
                                "and not ended", value=self.running)
        yield CounterMetricFamily("loraplex_gateway_generated_tokens", "tokens handed to clients",
                                  value=self.tokens)


_STREAMS = _Streams()
REGISTRY.register(_STREAMS)


class EntryClock:
    """Times one stream; `tokens(n)` at each message, `end()` once (the event loop is the only writer)."""

    __slots__ = ("started", "last")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last = 0.0

    def tokens(self, n: int) -> None:
        if not n:
            return
        now = time.perf_counter()
        if self.last:
            _ITL.observe((now - self.last) / n, n)
        else:
            _TTFT.observe(now - self.started)
            _STREAMS.running += 1
        self.last = now
        _STREAMS.tokens += n

    def end(self) -> None:
        if self.last:
            _E2E.observe(time.perf_counter() - self.started)
            _STREAMS.running -= 1
            self.last = 0.0


def _code_name(exc: BaseException, context: Any) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code() if callable(getattr(context, "code", None)) else None
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


class RequestMetrics(grpc.aio.ServerInterceptor):
    """Counts every call of `prefix`'s methods by method and final status code."""

    def __init__(self, prefix: str = "/loraplex.v1.Gateway/") -> None:
        self.prefix = prefix
        self._children: dict[tuple[str, str], Any] = {}

    def count(self, method: str, code: str) -> None:
        child = self._children.get((method, code))
        if child is None:
            child = self._children[(method, code)] = REQUESTS.labels(method, code)
        child.inc()

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        name = handler_call_details.method
        if handler is None or not name.startswith(self.prefix) or handler.request_streaming:
            return handler
        method = name[len(self.prefix):]

        def finished(context: Any) -> None:
            code = context.code() if callable(getattr(context, "code", None)) else None
            self.count(method, code.name if isinstance(code, grpc.StatusCode) else "OK")

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except BaseException as exc:
                    self.count(method, _code_name(exc, context))
                    raise
                finished(context)
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            try:
                result = await inner_unary(request, context)
            except BaseException as exc:
                self.count(method, _code_name(exc, context))
                raise
            finished(context)
            return result
        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
