"""The GPU cache's adapter keys, and the fetch the compute service reads adapters with.

The fetching itself (one fetch and staging per key, shared by the requests that
wait for it) is the runner's (`compute_service.runner.EngineRunner._fetch`).
"""
from __future__ import annotations

from typing import Awaitable, Callable

from loraplex.formats.adapter import Adapter

Fetch = Callable[[int, "str | None"], Awaitable[Adapter]]   # (task id, version or None) -> the adapter


def adapter_key(task_id: int, version: str) -> str:
    """The GPU cache key of one adapter version ("" = whatever version the host cache has)."""
    return f"{task_id}@{version}"


def task_of(key: str) -> int:
    return int(key.split("@", 1)[0])
