"""Errors of the GPU adapter cache (no grpc import: the GPU benchmark uses this package bare).

The servicer maps them to gRPC codes: AdapterTooLargeError -> RESOURCE_EXHAUSTED,
AdapterLoadError -> the code of its cause (NOT_FOUND, UNAVAILABLE, ...).
"""
from __future__ import annotations


class AdapterCacheError(Exception):
    """Base class of the adapter cache's errors."""


class AdapterTooLargeError(AdapterCacheError):
    """The adapter can never fit: it needs more pages (or rank) than the whole pool offers."""

    def __init__(self, key: str, num_pages: int, capacity_pages: int, page_bytes: int) -> None:
        self.key, self.num_pages, self.capacity_pages, self.page_bytes = key, num_pages, capacity_pages, page_bytes
        super().__init__(
            f"adapter {key} needs {num_pages} pages ({num_pages * page_bytes} bytes) but the GPU adapter pool "
            f"holds {capacity_pages} pages ({capacity_pages * page_bytes} bytes); raise --lora-gpu-cache-bytes "
            f"or --lora-gpu-memory-fraction")


class AdapterLoadError(AdapterCacheError):
    """Fetching or copying an adapter failed; `cause` is the original exception."""

    def __init__(self, key: str, cause: BaseException) -> None:
        self.key, self.cause = key, cause
        super().__init__(f"adapter {key} could not be loaded: {cause}")
