"""The storage interface both host-cache backends (shm, redis) implement.

A put is two steps so that nothing half-written is ever visible: the caller
fills a `Writer`'s buffer (a fresh shm segment, or process memory for Redis),
validates the adapter in place, then `commit`s it, which publishes record and
bytes atomically and evicts least recently used adapters until it fits.
Backends are synchronous and thread-safe; the servicer calls them from
worker threads.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterator

from cache_service.records import AdapterRecord, CacheStats, ListedAdapter, SourceEntry


class Writer(abc.ABC):
    """A writable buffer of exactly `num_bytes` for one adapter's weights, zero-filled when opened
    (a converter writes only each row's factors and leaves the padding as it is)."""

    num_bytes: int

    @property
    @abc.abstractmethod
    def buffer(self) -> memoryview:
        """Writable bytes; valid until commit or abort."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drops the upload; safe to call twice or after commit."""

    @property
    def shm_location(self) -> tuple[str, int] | None:
        """(segment name, byte offset of the buffer) when another process can write the buffer by name."""
        return None


class Reader(abc.ABC):
    """One adapter version, held readable until `close` (even if evicted meanwhile)."""

    record: AdapterRecord

    @property
    def shm_location(self) -> tuple[str, int] | None:
        """(segment name, byte offset of weights) when the bytes sit in POSIX shm."""
        return None

    @abc.abstractmethod
    def chunks(self, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        """The weight bytes in order, at most `chunk_bytes` each."""

    def close(self) -> None:
        """Releases the hold on the bytes."""

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class CommitResult:
    """What a commit did."""

    stored: bool                                   # False: this version was already cached
    evicted: list[int] = field(default_factory=list)  # task ids pushed out to make room


class CacheBackend(abc.ABC):
    """Adapter bytes + records + the LRU index + the source registry."""

    kind: str
    budget_bytes: int

    @abc.abstractmethod
    def open_writer(self, num_bytes: int) -> Writer: ...

    def expect_put_bytes(self, num_bytes: int) -> None:
        """A hint of the size puts will have (a backend may prepare memory for them); none by default."""

    @abc.abstractmethod
    def commit(self, writer: Writer, record: AdapterRecord, replace: bool) -> CommitResult:
        """Publishes the writer's bytes under `record`.

        Same task id and same version: keeps the cached copy (stored=False).
        Same task id, other version: AlreadyExistsError unless `replace`.
        Larger than the budget: ResourceExhaustedError.
        """

    @abc.abstractmethod
    def get(self, task_id: int, version: str | None = None) -> Reader | None:
        """Counts a use (hit) and holds the bytes, or counts a miss and returns None."""

    @abc.abstractmethod
    def has(self, task_id: int) -> str | None:
        """The cached version, without counting a use."""

    @abc.abstractmethod
    def evict(self, task_id: int) -> bool: ...

    @abc.abstractmethod
    def listing(self) -> list[ListedAdapter]:
        """Cached adapters, most recently used first."""

    @abc.abstractmethod
    def stats(self) -> CacheStats: ...

    @abc.abstractmethod
    def put_source(self, source: SourceEntry) -> None:
        """Remembers where a task id reloads from (and its name)."""

    @abc.abstractmethod
    def source(self, task_id: int) -> SourceEntry | None: ...

    @abc.abstractmethod
    def task_for_name(self, name: str) -> int | None: ...

    @abc.abstractmethod
    def forget_source(self, task_id: int) -> None: ...

    @abc.abstractmethod
    def sources(self) -> list[SourceEntry]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Releases everything this process holds (shm: unlinks every segment)."""
