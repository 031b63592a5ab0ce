"""Byte-budget LRU index: which task ids are cached, their sizes, and who goes next.

Plain Python with no I/O, so the eviction policy is unit-testable on its own
(the shm backend uses it as is; the Redis backend runs the same policy as a
Lua script over a sorted set). Not thread-safe: the owner holds a lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loraplex.errors import ResourceExhaustedError


@dataclass(frozen=True)
class LruEntry:
    """One cached adapter as the index sees it."""

    task_id: int
    version: str
    num_bytes: int


class LruIndex:
    """task id -> entry, least recently used first, with a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self._entries: OrderedDict[int, LruEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._entries

    def peek(self, task_id: int) -> LruEntry | None:
        """The entry without counting a use."""
        return self._entries.get(task_id)

    def touch(self, task_id: int) -> LruEntry | None:
        """Counts a use: the entry becomes the most recently used."""
        entry = self._entries.get(task_id)
        if entry is not None:
            self._entries.move_to_end(task_id)
        return entry

    def check_fits(self, num_bytes: int) -> None:
        """Refuses an adapter that could never fit, whatever is evicted."""
        if num_bytes > self.budget_bytes:
            raise ResourceExhaustedError(
                f"adapter of {num_bytes} bytes is larger than the whole host cache budget "
                f"({self.budget_bytes} bytes); raise --host-cache-bytes")

    def admit(self, entry: LruEntry) -> list[LruEntry]:
        """Adds (or replaces) an entry as most recently used; returns the entries evicted for it.

        An existing entry for the same task id is removed first and is not
        reported as evicted (it was replaced, not pushed out).
        """
        self.check_fits(entry.num_bytes)
        self.remove(entry.task_id)
        evicted: list[LruEntry] = []
        while self.bytes_used + entry.num_bytes > self.budget_bytes:
            _, victim = self._entries.popitem(last=False)
            self.bytes_used -= victim.num_bytes
            evicted.append(victim)
        self._entries[entry.task_id] = entry
        self.bytes_used += entry.num_bytes
        return evicted

    def remove(self, task_id: int) -> LruEntry | None:
        entry = self._entries.pop(task_id, None)
        if entry is not None:
            self.bytes_used -= entry.num_bytes
        return entry

    def order(self) -> list[LruEntry]:
        """Entries, least recently used first."""
        return list(self._entries.values())
