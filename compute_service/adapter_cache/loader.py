"""Asynchronous adapter loading: fetch from the host cache, stage in a worker thread, once per key.

`prepare(key, task_id, version)` returns once the adapter is known to the
paged slots (resident, loading, queued) or staged in host memory, so that a
request naming it can enter the engine. Concurrent requests for an adapter
that is being fetched await the same task: one fetch, one staging copy.
Fetch errors (NotFoundError, UnavailableError, ...) reach every waiter as is;
an adapter too large for the whole pool raises AdapterTooLargeError.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from loraplex.formats.adapter import Adapter

Fetch = Callable[[int, "str | None"], Awaitable[Adapter]]
# Staging is CPU work partly under the GIL (per-row Python); two workers keep a burst of
# loads moving without starving the thread that runs engine steps.
STAGING_WORKERS = 2


def adapter_key(task_id: int, version: str) -> str:
    """The GPU cache key of one adapter version ("" = whatever version the host cache has)."""
    return f"{task_id}@{version}"


def task_of(key: str) -> int:
    return int(key.split("@", 1)[0])


class AdapterLoader:
    """Shares one fetch + staging per adapter key among concurrent requests."""

    def __init__(self, slots: PagedAdapterSlots, fetch: Fetch) -> None:
        self.slots = slots
        self.fetch = fetch
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._staging = ThreadPoolExecutor(STAGING_WORKERS, thread_name_prefix="adapter-staging")
        self.num_fetches = 0

    async def prepare(self, key: str, task_id: int, version: str | None) -> None:
        if self.slots.knows(key) or self.slots.has_staged(key):
            return
        task = self._pending.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch_and_stage(key, task_id, version))
            self._pending[key] = task
            task.add_done_callback(lambda _t, k=key: self._pending.pop(k, None))
        # shield: one cancelled request must not cancel the load others wait for.
        await asyncio.shield(task)

    async def _fetch_and_stage(self, key: str, task_id: int, version: str | None) -> None:
        self.num_fetches += 1
        adapter = await self.fetch(task_id, version or None)
        loop = asyncio.get_running_loop()
        staged = await loop.run_in_executor(self._staging, self.slots.stage_adapter, key, adapter)
        self.slots.add_staged(key, staged)
