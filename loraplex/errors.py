"""Domain exceptions shared by the services, each carrying its gRPC status code.

Raise these where the problem is found; `loraplex.grpc_errors` turns them into
gRPC statuses in one place. A user's mistake is never reported as INTERNAL.
"""
from __future__ import annotations

import grpc


class LoraplexError(Exception):
    """Base class: `grpc_code` says how the error reaches a client."""

    grpc_code = grpc.StatusCode.INTERNAL


class InvalidArgumentError(LoraplexError, ValueError):
    """The request is malformed (bad tensors, bad sampling values, prompt too long)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(LoraplexError, KeyError):
    """An unknown task id or name."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class FailedPreconditionError(LoraplexError):
    """The request cannot run in the current state (adapter built for another model)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(LoraplexError):
    """Over a size limit, or a queue is full."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(LoraplexError):
    """A downstream service or store is down."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class AlreadyExistsError(LoraplexError):
    """A task id or name is taken and replace was not asked for."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


# Status code -> its domain exception, for a status that comes back over a call or a pipe (each class
# keeps `grpc_code`); a code without a class here (DEADLINE_EXCEEDED, CANCELLED, INTERNAL ...) has none.
BY_GRPC_CODE: dict[grpc.StatusCode, type[LoraplexError]] = {
    cls.grpc_code: cls for cls in (InvalidArgumentError, NotFoundError, FailedPreconditionError,
                                   ResourceExhaustedError, UnavailableError, AlreadyExistsError)}
