"""The same storage suite on both backends: atomic puts, versions, LRU by bytes, sources."""
from __future__ import annotations

import os

import pytest

from loraplex.errors import AlreadyExistsError, ResourceExhaustedError
from cache_service.records import AdapterRecord, SourceEntry


def _record(task_id: int, num_bytes: int, version: str) -> AdapterRecord:
    return AdapterRecord(task_id=task_id, version=version, config=((1, 0, 2),), dtype="float16",
                         shape=(1, num_bytes // 2), num_bytes=num_bytes, fingerprint="fp")


def _put(backend, task_id: int, num_bytes: int, *, replace: bool = False, payload: bytes | None = None):
    data = payload if payload is not None else os.urandom(num_bytes)
    writer = backend.open_writer(len(data))
    writer.buffer[:] = data
    version = data[:8].hex()
    return backend.commit(writer, _record(task_id, len(data), version), replace), data


def _read(backend, task_id: int, chunk: int = 100) -> bytes:
    reader = backend.get(task_id)
    assert reader is not None
    with reader:
        return b"".join(bytes(c) for c in reader.chunks(chunk))


def test_put_get_round_trip_in_chunks(backend):
    _, data = _put(backend, 7, 1000)
    assert _read(backend, 7, chunk=333) == data
    assert backend.has(7) == data[:8].hex()
    assert backend.stats().bytes_used == 1000


def test_lru_evicts_least_recently_used_by_bytes(backend):
    _put(backend, 1, 1500)
    _put(backend, 2, 1500)
    _read(backend, 1)  # 2 is now the least recently used
    result, _ = _put(backend, 3, 1500)
    assert result.evicted == [2]
    assert backend.has(2) is None and backend.has(1) and backend.has(3)
    assert [a.record.task_id for a in backend.listing()] == [3, 1]
    stats = backend.stats()
    assert (stats.bytes_used, stats.num_adapters, stats.evictions) == (3000, 2, 1)


def test_has_does_not_count_as_use(backend):
    _put(backend, 1, 1500)
    _put(backend, 2, 1500)
    assert backend.has(1)
    result, _ = _put(backend, 3, 1500)
    assert result.evicted == [1]


def test_too_large_refused_with_sizes(backend):
    with pytest.raises(ResourceExhaustedError, match="5000 bytes.*4096"):
        backend.open_writer(5000)


def test_same_version_is_kept_other_version_needs_replace(backend):
    payload = os.urandom(800)
    first, _ = _put(backend, 5, 800, payload=payload)
    again, _ = _put(backend, 5, 800, payload=payload)
    assert first.stored and not again.stored
    with pytest.raises(AlreadyExistsError, match="replace"):
        _put(backend, 5, 800)
    assert _read(backend, 5) == payload
    result, new = _put(backend, 5, 600, replace=True)
    assert result.stored and result.evicted == []
    assert _read(backend, 5) == new
    assert backend.stats().bytes_used == 600


def test_reader_finishes_on_old_version_after_replace(backend):
    _, old = _put(backend, 9, 1000)
    reader = backend.get(9)
    _put(backend, 9, 1000, replace=True)
    with reader:
        assert b"".join(bytes(c) for c in reader.chunks(64)) == old


def test_get_with_wrong_version_is_a_miss(backend):
    _, data = _put(backend, 4, 100)
    assert backend.get(4, version="0" * 16) is None
    reader = backend.get(4, version=data[:8].hex())
    assert reader is not None
    reader.close()
    stats = backend.stats()
    assert (stats.hits, stats.misses) == (1, 1)


def test_evict(backend):
    _put(backend, 3, 100)
    assert backend.evict(3)
    assert not backend.evict(3)
    assert backend.get(3) is None
    assert backend.stats().bytes_used == 0


def test_aborted_upload_leaves_nothing(backend):
    writer = backend.open_writer(100)
    writer.buffer[:] = os.urandom(100)
    writer.abort()
    assert backend.stats().num_adapters == 0 and backend.listing() == []


def test_sources_and_names(backend):
    backend.put_source(SourceEntry(11, "/root/a", "a", "root"))
    backend.put_source(SourceEntry(12, "/pre/12", "", "prefetch"))
    assert backend.task_for_name("a") == 11
    assert backend.source(12).path == "/pre/12"
    backend.forget_source(11)
    assert backend.task_for_name("a") is None and backend.source(11) is None
    assert [s.task_id for s in backend.sources()] == [12]


def test_redis_bytes_dropped_behind_the_index(redis_server):
    """A blob deleted outside the cache (maxmemory eviction) fails one read, then reads as a miss."""
    import uuid

    import redis as redis_lib

    from loraplex.errors import UnavailableError
    from cache_service.redis_backend import RedisBackend

    backend = RedisBackend(redis_server.url, 4096, fingerprint=uuid.uuid4().hex[:8])
    _, data = _put(backend, 5, 1000)
    client = redis_lib.Redis.from_url(redis_server.url)
    assert client.delete(f"{backend.base}:blob:5:{data[:8].hex()}") == 1
    reader = backend.get(5)
    with pytest.raises(UnavailableError, match="retry"):
        b"".join(reader.chunks(100))
    assert backend.get(5) is None and backend.stats().bytes_used == 0
    backend.close()
