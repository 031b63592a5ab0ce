"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Domain errors carry a gRPC code (`loraplex.errors`); the status follows from
it (INVALID_ARGUMENT 400, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE
503 ...). Errors the HTTP layer finds itself (bad JSON, a body over the size
limit) are `HttpError`s with their status. Every message is cut to
MAX_STATUS_MESSAGE characters, like the gRPC API's: a refusal may echo what the
caller sent.
"""
from __future__ import annotations

import logging
import math

import grpc
from starlette.responses import JSONResponse

from loraplex.grpc_errors import bounded

log = logging.getLogger(__name__)

# gRPC code -> (HTTP status, OpenAI error type)
_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_TYPE_BY_STATUS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 415: "invalid_request_error"}


class HttpError(Exception):
    """A refusal found by the HTTP layer: its status, and the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": bounded(message), "type": type_ or _TYPE_BY_STATUS.get(status, "api_error"),
                      "param": param, "code": code}}


def error_of(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) of any exception; unexpected ones are logged and give 500."""
    if isinstance(exc, HttpError):
        return exc.status, error_body(exc.status, str(exc), param=exc.param, code=exc.code)
    code = getattr(exc, "grpc_code", None)
    if isinstance(code, grpc.StatusCode):
        return status_of_code(code, str(exc))
    log.error("internal error in the HTTP API", exc_info=exc)
    return 500, error_body(500, f"internal error: {type(exc).__name__}: {exc}", type_="internal_error",
                           code="internal")


def status_of_code(code: grpc.StatusCode, message: str) -> tuple[int, dict]:
    status, type_ = _BY_CODE.get(code, (500, "internal_error"))
    return status, error_body(status, message, type_=type_, code=code.name.lower())


def status_of_entry_error(error: str) -> tuple[int, dict]:
    """A fan-out entry's `error` ("NOT_FOUND: loras[2]: ...") as a status and body."""
    name, sep, rest = error.partition(": ")
    code = grpc.StatusCode.__members__.get(name) if sep else None
    if code is None:
        return 500, error_body(500, error, type_="internal_error", code="internal")
    return status_of_code(code, rest)


def error_response(exc: BaseException) -> JSONResponse:
    """The error's JSON response; a refusal that knows when to come back (a key over its rate) says so in
    `Retry-After` (whole seconds)."""
    status, body = error_of(exc)
    retry_after = getattr(exc, "retry_after_s", None)
    headers = None
    if status == 429 and isinstance(retry_after, (int, float)):
        headers = {"retry-after": str(max(1, math.ceil(retry_after)))}
    return JSONResponse(body, status_code=status, headers=headers)
