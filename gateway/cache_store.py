"""The gateway's `AdapterStore` over the host cache service (`loraplex.cache_client`).

Adds what a gateway caller needs on top of the client: a deadline on every
call, UNAVAILABLE messages that name the cache and its address, and the
cache's limits fetched once and kept.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

from loraplex import errors
from loraplex.cache_client import CacheClient
from loraplex.formats import Adapter
from loraplex.v1 import common_pb2
from gateway.adapters import StoreLimits

T = TypeVar("T")

_MODE_NAMES: dict[int, str] = {common_pb2.LOAD_MODE_AUTO: "auto", common_pb2.LOAD_MODE_ALWAYS: "always",
               common_pb2.LOAD_MODE_NEVER: "never"}


class CacheStore:
    """AdapterStore backed by a running cache service."""

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._client = CacheClient(address, max_message_bytes=min(max_message_bytes, 64 << 20))
        self._limits: StoreLimits | None = None

    async def close(self) -> None:
        await self._client.close()

    async def connect(self, timeout_s: float) -> bool:
        """Connects to the cache now, so the first request naming an adapter does not wait for it."""
        return await self._client.connect(timeout_s)

    async def _call(self, what: str, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        try:
            return await asyncio.wait_for(coro, timeout_s or self._timeout_s)
        except errors.UnavailableError as exc:
            raise errors.UnavailableError(
                f"the host cache service at {self.address} is unavailable ({exc}); start it or point "
                "the gateway at a running one (--cache-address)") from exc
        except asyncio.TimeoutError:
            raise errors.UnavailableError(f"the host cache service at {self.address} did not answer {what} "
                                          f"within {timeout_s or self._timeout_s:.0f}s") from None

    async def cached_version(self, task_id: int) -> str | None:
        return await self._call("HasAdapter", self._client.has(task_id))

    async def put(self, task_id: int, adapter: Adapter, *, name: str = "",
                  replace: bool = False) -> common_pb2.AdapterInfo:
        # Large adapters take a while to stream: allow about 50 MB/s on top of the usual deadline.
        timeout = self._timeout_s + adapter.num_bytes / 50e6
        result = await self._call("PutAdapter", self._client.put_adapter(adapter, task_id, name=name,
                                                                          replace=replace), timeout)
        return result.adapter.to_proto()

    async def resolve_name(self, name: str, load_mode: int) -> tuple[int, str]:
        resolved = await self._call("ResolveName", self._client.resolve_name(name, _MODE_NAMES[load_mode]))
        return resolved.task_id, resolved.version

    async def limits(self) -> StoreLimits:
        if self._limits is None:
            info = await self._call("GetCacheInfo", self._client.info())
            self._limits = StoreLimits(info.fingerprint, info.max_lora_rank, info.bytes_total)
        return self._limits

    async def load_path(self, path: str, task_id: int | None, name: str, replace: bool) -> common_pb2.AdapterInfo:
        adapter: Any = await self._call("LoadPath", self._client.load_path(path, task_id=task_id, name=name,
                                                                            replace=replace))
        return adapter.to_proto()

    async def evict(self, task_id: int | None, name: str) -> bool:
        return await self._call("EvictAdapter", self._client.evict(task_id, name=name, forget_name=True))

    async def list(self) -> tuple[list[common_pb2.AdapterInfo], int, int]:
        listing = await self._call("ListAdapters", self._client.list())
        return [a.to_proto() for a in listing.adapters], listing.bytes_used, listing.bytes_total
