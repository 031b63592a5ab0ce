"""Domain errors raised by the engine; the compute service maps them to gRPC codes."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses before it enters the batch (INVALID_ARGUMENT).

    The message names the offending field and what a valid value looks like.
    """


class InvalidAdapterError(EngineError, ValueError):
    """An adapter that does not fit the loaded base model (INVALID_ARGUMENT)."""


class ModelLoadError(EngineError, RuntimeError):
    """A model path that cannot be loaded: missing, unreadable or malformed."""


class UnsupportedModelError(ModelLoadError):
    """A model whose architecture the engine does not implement."""


class CapacityError(EngineError, RuntimeError):
    """A resource the engine cannot provide: KV blocks or adapter slots (RESOURCE_EXHAUSTED)."""
