"""The one request-id rule of both APIs (gRPC metadata / GenerateRequest.request_id, HTTP header)."""
from __future__ import annotations

import contextvars

from gateway.requests import MAX_REQUEST_ID, take_request_id
from loraplex.logging_setup import REQUEST_ID


def _in_fresh_context(*given: str) -> tuple[str, str]:
    def run() -> tuple[str, str]:
        return take_request_id(*given), REQUEST_ID.get()
    return contextvars.copy_context().run(run)


def test_the_first_given_id_wins_is_cut_and_becomes_the_log_context():
    assert _in_fresh_context("", "meta-1") == ("meta-1", "meta-1")
    assert _in_fresh_context("body-1", "meta-1") == ("body-1", "body-1")
    long_id, logged = _in_fresh_context("x" * 1000)
    assert long_id == logged == "x" * MAX_REQUEST_ID


def test_an_id_is_made_up_when_none_is_given_and_differs_per_call():
    a, logged = _in_fresh_context("", "")
    b, _ = _in_fresh_context()
    assert a and logged == a and a != b
