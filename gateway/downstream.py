"""Errors of downstream calls (cache, compute) turned into domain exceptions.

A downstream status is kept when it describes the user's request (NOT_FOUND,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED ...); a service that cannot be reached
becomes UNAVAILABLE with a message naming the service and its address.
"""
from __future__ import annotations

import grpc

from loraplex.errors import LoraplexError


class DownstreamError(LoraplexError):
    """A downstream call failed; carries the status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.grpc_code = code


# Codes whose meaning is the service's own failure, not the caller's request.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}


def from_rpc_error(exc: grpc.aio.AioRpcError | grpc.RpcError, service: str, address: str) -> DownstreamError:
    """Maps a failed call to `service` at `address` to the status the gateway answers with."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else "") or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return DownstreamError(code, f"the {service} service at {address} is unavailable ({details}); "
                                     f"start it or point the gateway at a running one")
    if code in _UNREACHABLE:
        return DownstreamError(grpc.StatusCode.UNAVAILABLE,
                               f"the {service} service at {address} failed: {code.name}: {details}")
    if code == grpc.StatusCode.INTERNAL:
        return DownstreamError(code, f"the {service} service failed: {details}")
    return DownstreamError(code, details)
