"""Engine and adapter-cache errors as loraplex errors, and as the (code, message) of one stream entry.

`domain_error` is what `@maps_errors` needs to answer a call with the right
status; `status_of` is the same mapping for one request inside a multiplexed
StreamTokens call, where a request's failure is a message, not the call's status.
"""
from __future__ import annotations

import grpc

from compute_service.adapter_cache.errors import AdapterLoadError, AdapterTooLargeError
from compute_service.engine import errors as engine_errors
from loraplex import errors

MAX_ERROR_CHARS = 512   # a per-request error message is cut here (it may echo user values)


class DeadlineExceededError(errors.LoraplexError):
    """The caller's deadline passed before the request finished."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


def domain_error(exc: BaseException) -> BaseException:
    """Engine and adapter-cache errors as loraplex errors (which carry their gRPC code)."""
    if isinstance(exc, errors.LoraplexError):
        return exc
    if isinstance(exc, (engine_errors.InvalidRequestError, engine_errors.InvalidAdapterError)):
        return errors.InvalidArgumentError(str(exc))
    if isinstance(exc, (engine_errors.CapacityError, AdapterTooLargeError)):
        return errors.ResourceExhaustedError(str(exc))
    if isinstance(exc, AdapterLoadError):
        return domain_error(exc.cause)
    return exc


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status one failed request reports: its domain code, or INTERNAL naming the exception."""
    mapped = domain_error(exc)
    code = getattr(mapped, "grpc_code", None)
    if isinstance(code, grpc.StatusCode):
        text = str(mapped)
    else:
        code, text = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS - 3] + "..."
    return code, text
