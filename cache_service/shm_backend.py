"""The embedded `shm` backend: adapters in POSIX shared memory, index in this process.

One segment per adapter version (see shm_segments), taken from the spares
made ahead of time when one fits (see shm_spares). The LRU index, records
and source registry live in this process under one lock; a co-located compute
service maps segments by name instead of copying bytes over gRPC.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from loraplex.errors import AlreadyExistsError
from cache_service.backend import CacheBackend, CommitResult, Reader, Writer
from cache_service.lru import LruEntry, LruIndex
from cache_service.records import AdapterRecord, CacheStats, ListedAdapter, SourceEntry
from cache_service.shm_segments import HEADER_BYTES, OwnedSegment, new_instance_tag
from cache_service.shm_spares import SpareSegments


class ShmWriter(Writer):
    def __init__(self, segment: OwnedSegment, on_finish: Callable[[], None]) -> None:
        self.segment = segment
        self.num_bytes = segment.num_bytes
        self.committed = False
        self._on_finish: Callable[[], None] | None = on_finish

    def finished(self) -> None:
        """Committed or aborted (the first call counts)."""
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish()

    @property
    def buffer(self) -> memoryview:
        return self.segment.data

    @property
    def shm_location(self) -> tuple[str, int]:
        return self.segment.name, HEADER_BYTES

    def abort(self) -> None:
        if not self.committed:
            self.segment.retire()
        self.finished()


class ShmReader(Reader):
    def __init__(self, record: AdapterRecord, segment: OwnedSegment) -> None:
        self.record = record
        self._segment = segment
        segment.pin()
        self._open = True

    @property
    def shm_location(self) -> tuple[str, int]:
        return self._segment.name, HEADER_BYTES

    def chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        data = self._segment.data
        try:
            for start in range(0, self.record.num_bytes, chunk_bytes):
                # A copy: gRPC keeps the message after we move on, and the
                # segment may be unmapped once this reader closes.
                yield bytes(data[start:start + chunk_bytes])
        finally:
            data.release()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._segment.unpin()


class ShmBackend(CacheBackend):
    """Host cache in POSIX shared memory, indexed in this process."""

    kind = "shm"

    def __init__(self, budget_bytes: int, instance: str | None = None, spare_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.instance = instance or new_instance_tag()
        self.spares = SpareSegments(self.instance, spare_bytes)
        self._lock = threading.Lock()
        self._lru = LruIndex(budget_bytes)
        self._records: dict[int, AdapterRecord] = {}
        self._segments: dict[int, OwnedSegment] = {}
        self._last_used: dict[int, float] = {}
        self._sources: dict[int, SourceEntry] = {}
        self._names: dict[str, int] = {}
        self._hits = self._misses = self._evictions = 0

    def open_writer(self, num_bytes: int) -> ShmWriter:
        self._lru.check_fits(num_bytes)
        spare = self.spares.take(num_bytes)
        try:
            segment = spare or OwnedSegment(self.instance, num_bytes)
        except BaseException:
            self.spares.put_finished()
            raise
        return ShmWriter(segment, self.spares.put_finished)

    def expect_put_bytes(self, num_bytes: int) -> None:
        self.spares.expect(num_bytes)

    def commit(self, writer: Writer, record: AdapterRecord, replace: bool) -> CommitResult:
        assert isinstance(writer, ShmWriter)
        try:
            return self._commit(writer, record, replace)
        finally:
            writer.finished()

    def _commit(self, writer: ShmWriter, record: AdapterRecord, replace: bool) -> CommitResult:
        with self._lock:
            current = self._records.get(record.task_id)
            if current is not None and current.version == record.version:
                writer.abort()
                self._touch(record.task_id)
                return CommitResult(stored=False)
            if current is not None and not replace:
                writer.abort()
                raise AlreadyExistsError(
                    f"task id {record.task_id} already holds version {current.version} "
                    f"(this upload is {record.version}); pass replace to overwrite it")
            writer.segment.seal(record.version, record.task_id)
            evicted = self._lru.admit(LruEntry(record.task_id, record.version, record.num_bytes))
            if current is not None:
                self._segments.pop(record.task_id).retire()
            for victim in evicted:
                self._drop(victim.task_id)
            self._evictions += len(evicted)
            writer.committed = True
            self._records[record.task_id] = record
            self._segments[record.task_id] = writer.segment
            self._last_used[record.task_id] = time.time()
        return CommitResult(stored=True, evicted=[v.task_id for v in evicted])

    def _drop(self, task_id: int) -> None:
        self._records.pop(task_id, None)
        self._last_used.pop(task_id, None)
        segment = self._segments.pop(task_id, None)
        if segment is not None:
            segment.retire()

    def _touch(self, task_id: int) -> None:
        self._lru.touch(task_id)
        self._last_used[task_id] = time.time()

    def get(self, task_id: int, version: str | None = None) -> ShmReader | None:
        with self._lock:
            record = self._records.get(task_id)
            if record is None or (version and record.version != version):
                self._misses += 1
                return None
            self._hits += 1
            self._touch(task_id)
            return ShmReader(record, self._segments[task_id])

    def has(self, task_id: int) -> str | None:
        with self._lock:
            record = self._records.get(task_id)
            return record.version if record is not None else None

    def evict(self, task_id: int) -> bool:
        with self._lock:
            if self._lru.remove(task_id) is None:
                return False
            self._drop(task_id)
            return True

    def listing(self) -> list[ListedAdapter]:
        with self._lock:
            order = reversed(self._lru.order())
            return [ListedAdapter(self._records[e.task_id], self._last_used[e.task_id]) for e in order]

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._lru.bytes_used, self.budget_bytes, len(self._lru),
                              self._hits, self._misses, self._evictions)

    def put_source(self, source: SourceEntry) -> None:
        with self._lock:
            old = self._sources.get(source.task_id)
            if old is not None and old.name and self._names.get(old.name) == source.task_id:
                del self._names[old.name]
            self._sources[source.task_id] = source
            if source.name:
                self._names[source.name] = source.task_id

    def source(self, task_id: int) -> SourceEntry | None:
        with self._lock:
            return self._sources.get(task_id)

    def task_for_name(self, name: str) -> int | None:
        with self._lock:
            return self._names.get(name)

    def forget_source(self, task_id: int) -> None:
        with self._lock:
            old = self._sources.pop(task_id, None)
            if old is not None and old.name and self._names.get(old.name) == task_id:
                del self._names[old.name]

    def sources(self) -> list[SourceEntry]:
        with self._lock:
            return list(self._sources.values())

    def close(self) -> None:
        self.spares.close()
        with self._lock:
            for task_id in list(self._segments):
                self._lru.remove(task_id)
                self._drop(task_id)

    def segment_names(self) -> list[str]:
        """Names of the live segments (for tests and diagnostics)."""
        with self._lock:
            return [s.name for s in self._segments.values()]
