"""Which adapters own GPU pages and slots: loading, residency, pinning, LRU eviction.

Plain Python, no torch, so the scheduler + cache interplay is unit- and
property-tested on its own (tests/compute_service/test_no_deadlock.py).

Life of an entry: QUEUED (wanted, waiting for pages) -> LOADING (pages and a
slot granted, bytes in flight) -> RESIDENT (kernels may read it) -> evicted.

Why it cannot deadlock ("cache full, no done tasks to evict"):
- an entry's pages and slot are granted all at once, never in part, so two
  loads can never each hold half of what both need;
- only idle residents are evicted: no pin (no running request) and no want
  (no request in the engine names it); an entry is never evicted while a
  request that needs it is waiting or running, so a loaded adapter is not
  thrown out before its requests run;
- every pin and want belongs to a request that finishes in finite time (it is
  running, or it is waiting on an adapter that is resident or loading), so
  pages held by busy entries always come back; an adapter larger than the
  whole pool is refused up front (AdapterTooLargeError) rather than queued;
- the load queue is FIFO and its head is never overtaken, so a large adapter
  is not starved by a stream of small ones.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from compute_service.adapter_cache.errors import AdapterTooLargeError
from compute_service.adapter_cache.pages import PageAllocator


class State(Enum):
    QUEUED = "queued"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass(eq=False)
class Entry:
    """One adapter version in the GPU cache (or queued for it)."""

    key: str
    num_pages: int
    state: State = State.QUEUED
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    pins: int = 0            # running requests using it: never evicted while > 0
    wants: int = 0           # requests in the engine (waiting or running) naming it
    prefetched: bool = False  # asked for by PrefetchAdapter; loads even with no want
    drop_when_idle: bool = False
    last_used: int = 0

    @property
    def idle(self) -> bool:
        return self.state is State.RESIDENT and self.pins == 0 and self.wants == 0


class AdapterResidency:
    """Page and slot ownership of adapters; `on_evict(entry)` runs before an entry's pages are reused."""

    def __init__(self, num_pages: int, max_slots: int, page_bytes: int = 0,
                 on_evict: Callable[[Entry], None] | None = None) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.pages = PageAllocator(num_pages)
        self.max_slots = max_slots
        self.page_bytes = page_bytes
        self.on_evict = on_evict
        self._free_slots: deque[int] = deque(range(max_slots))
        self._entries: dict[str, Entry] = {}
        self._queue: deque[Entry] = deque()   # QUEUED entries, FIFO
        self._clock = itertools.count(1)
        self.num_evictions = 0

    # -- queries -----------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def is_ready(self, key: str) -> bool:
        e = self._entries.get(key)
        return e is not None and e.state is State.RESIDENT

    def slot_of(self, key: str) -> int:
        e = self._entries.get(key)
        if e is None or e.state is not State.RESIDENT:
            raise KeyError(f"adapter {key} is not resident")
        return e.slot

    def touch(self, key: str) -> int:
        """Marks a resident `key` as just used (LRU) and returns its slot."""
        slot = self.slot_of(key)
        self._entries[key].last_used = next(self._clock)
        return slot

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def resident_keys(self) -> list[str]:
        return [k for k, e in self._entries.items() if e.state is State.RESIDENT]

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def has_queued(self) -> bool:
        return bool(self._queue)

    # -- requests ------------------------------------------------------------------
    def check_fits(self, key: str, num_pages: int) -> None:
        """Raises AdapterTooLargeError when the adapter could never fit, even in an empty pool."""
        if num_pages > self.pages.num_pages:
            raise AdapterTooLargeError(key, num_pages, self.pages.num_pages, self.page_bytes)

    def want(self, key: str, num_pages: int) -> Entry:
        """A request naming `key` entered the engine: keep it (or queue its load)."""
        e = self._ensure(key, num_pages)
        e.wants += 1
        return e

    def unwant(self, key: str) -> None:
        """A request naming `key` left the engine (finished, aborted or failed)."""
        e = self._entries[key]
        if e.wants < 1:
            raise RuntimeError(f"adapter {key}: unwant without want")
        e.wants -= 1
        self._settle(e)

    def prefetch(self, key: str, num_pages: int) -> Entry:
        """Queues a load with no request behind it; once resident it is the first to go."""
        e = self._ensure(key, num_pages)
        e.prefetched = True
        return e

    def pin(self, key: str) -> None:
        e = self._entries[key]
        if e.state is not State.RESIDENT:
            raise RuntimeError(f"adapter {key} pinned while {e.state.value}")
        e.pins += 1
        e.last_used = next(self._clock)

    def unpin(self, key: str) -> None:
        e = self._entries[key]
        if e.pins < 1:
            raise RuntimeError(f"adapter {key}: unpin without pin")
        e.pins -= 1
        e.last_used = next(self._clock)
        self._settle(e)

    def drop(self, key: str) -> bool:
        """Evicts `key` now if idle, else once it becomes idle; True when it was in the cache."""
        e = self._entries.get(key)
        if e is None:
            return False
        e.prefetched = False
        if e.state is State.QUEUED and e.wants == 0:
            self._queue.remove(e)
            del self._entries[key]
        elif e.idle:
            self._evict(e)
        else:
            e.drop_when_idle = True
        return True

    # -- loads -----------------------------------------------------------------------
    def start_loads(self) -> list[Entry]:
        """Grants pages and a slot to queued entries, FIFO, evicting idle residents LRU-first.

        Stops at the first entry that does not fit yet (it keeps its place).
        Returns the entries now LOADING; the caller copies their bytes and then
        calls `finish_load` (or `fail_load`).
        """
        started: list[Entry] = []
        while self._queue:
            e = self._queue[0]
            if not self._make_room(e.num_pages):
                break
            self._queue.popleft()
            e.pages = self.pages.alloc(e.num_pages)
            e.slot = self._free_slots.popleft()
            e.state = State.LOADING
            started.append(e)
        return started

    def finish_load(self, key: str) -> None:
        e = self._entries[key]
        if e.state is not State.LOADING:
            raise RuntimeError(f"adapter {key}: finish_load while {e.state.value}")
        e.state = State.RESIDENT
        e.last_used = next(self._clock)
        self._settle(e)

    def fail_load(self, key: str) -> Entry:
        """Forgets a load that failed; its pages and slot go back. The caller fails its requests."""
        e = self._entries.pop(key)
        if e.state is State.QUEUED:
            self._queue.remove(e)
        else:
            self._release(e)
        return e

    # -- internals ---------------------------------------------------------------------
    def _ensure(self, key: str, num_pages: int) -> Entry:
        e = self._entries.get(key)
        if e is None:
            self.check_fits(key, num_pages)
            e = Entry(key, num_pages)
            self._entries[key] = e
            self._queue.append(e)
        e.drop_when_idle = False
        return e

    def _settle(self, e: Entry) -> None:
        """Drops an entry nobody needs any more: a queued one with no want, or an idle one asked to go."""
        if e.state is State.QUEUED and e.wants == 0 and not e.prefetched:
            self._queue.remove(e)
            del self._entries[e.key]
        elif e.idle and e.drop_when_idle:
            self._evict(e)

    def _make_room(self, num_pages: int) -> bool:
        """Evicts idle residents (LRU first, prefetched-never-used ones alike) until `num_pages` and a slot are free."""
        idle = sorted((x for x in self._entries.values() if x.idle), key=lambda x: x.last_used)
        have_pages = self.pages.num_free + sum(x.num_pages for x in idle)
        have_slots = len(self._free_slots) + len(idle)
        if have_pages < num_pages or have_slots < 1:
            return False        # evicting would not help yet: keep what is cached
        for x in idle:
            if self.pages.num_free >= num_pages and self._free_slots:
                break
            self._evict(x)
        return True

    def _evict(self, e: Entry) -> None:
        if not e.idle:
            raise RuntimeError(f"adapter {e.key} evicted while busy (pins={e.pins}, wants={e.wants})")
        if self.on_evict is not None:
            self.on_evict(e)
        del self._entries[e.key]
        self._release(e)
        self.num_evictions += 1

    def _release(self, e: Entry) -> None:
        self.pages.free(e.pages)
        if e.slot >= 0:
            self._free_slots.append(e.slot)
        e.pages, e.slot = [], -1

    def check(self) -> None:
        """Asserts the book-keeping invariants (used by tests)."""
        owned = [p for e in self._entries.values() for p in e.pages]
        assert len(owned) == len(set(owned)) == self.pages.num_used, "pages owned twice or leaked"
        slots = [e.slot for e in self._entries.values() if e.slot >= 0]
        assert len(slots) == len(set(slots)) == self.max_slots - len(self._free_slots), "slots owned twice or leaked"
        for e in self._entries.values():
            assert e.pins == 0 or e.state is State.RESIDENT, f"{e.key} pinned while {e.state.value}"
            assert (e.state is State.QUEUED) == (e in self._queue), f"{e.key} queue membership"
