"""Turns domain exceptions into gRPC statuses, in one place for every servicer.

Decorate servicer methods with `@maps_errors`; it handles unary methods and
async-generator (streaming) methods alike. Exceptions carrying `grpc_code`
(see `loraplex.errors`) become that status with their message; anything else
is logged with its traceback and becomes INTERNAL. Every message is cut to
`MAX_STATUS_MESSAGE` characters: a message echoes what the caller sent (an
adapter name, a path), and status details travel in gRPC's response metadata,
whose 8 KiB limit would otherwise turn the refusal into a transport error.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import grpc

log = logging.getLogger(__name__)
MAX_STATUS_MESSAGE = 1024


def bounded(message: str, limit: int = MAX_STATUS_MESSAGE) -> str:
    """`message` cut to at most `limit` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    note = f"... ({len(message) - limit} more characters cut)"
    return message[:max(limit - len(note), 0)] + note


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code = getattr(exc, "grpc_code", None)
    if isinstance(code, grpc.StatusCode):
        await context.abort(code, bounded(str(exc)))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(exc).__name__}: {exc}"))


def maps_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for aio servicer methods (coroutines or async generators)."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                await _abort(context, exc)
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort(context, exc)
    return unary_wrapper
