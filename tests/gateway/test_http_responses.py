"""Pieces of the HTTP API's responses: the request counter's labels, and Retry-After on a rate refusal."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.http.app import CountRequests


async def _ok(request):
    return JSONResponse({})


def _get(app, path: str) -> int:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [], "scheme": "http", "server": ("t", 80), "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_requests_count_by_route_template_and_unknown_paths_as_other():
    registry = CollectorRegistry()
    counter = Counter("t_requests", "t", ["method", "code"], registry=registry)
    app = Starlette(routes=[Route("/v1/models", _ok), Route("/v1/models/{model_id:path}", _ok)])
    app.add_middleware(CountRequests, counter=counter)
    assert _get(app, "/v1/models/alpha") == 200 and _get(app, "/v1/models/beta") == 200
    assert _get(app, "/v1/models") == 200 and _get(app, "/nothing") == 404

    def count(method: str, code: str) -> float:
        return registry.get_sample_value("t_requests_total", {"method": method, "code": code}) or 0.0
    assert count("GET /v1/models/{model_id:path}", "200") == 2
    assert count("GET /v1/models", "200") == 1
    assert count("GET other", "404") == 1


def test_a_key_over_its_rate_gets_429_with_retry_after():
    from gateway.auth import RateLimitedError
    from gateway.http.errors import error_response
    limited = error_response(RateLimitedError("key 'k' is over its rate", 2.3))
    assert limited.status_code == 429 and limited.headers["retry-after"] == "3"
    assert "retry-after" not in error_response(ValueError("x")).headers
