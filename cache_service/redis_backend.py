"""The `redis` backend: adapters and the shared LRU index in a real redis-server.

Every replica pointing at the same server and base model shares one index
(keys under `<prefix>:<fingerprint>`, see redis_scripts). Uploads land under a
temporary key with a TTL and are published by one Lua script that also evicts,
so no reader ever sees a half-written adapter and a crashed upload leaves
nothing behind. A server that is down or restarting gives UnavailableError;
the client reconnects by itself once it is back.
"""
from __future__ import annotations

import functools
import time
import uuid
from typing import Any, Callable, Iterator, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from loraplex.errors import AlreadyExistsError, ResourceExhaustedError, UnavailableError
from cache_service import redis_scripts
from cache_service.backend import CacheBackend, CommitResult, Reader, Writer
from cache_service.records import AdapterRecord, CacheStats, ListedAdapter, SourceEntry

F = TypeVar("F", bound=Callable[..., Any])
_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError)


def _maps_redis_errors(method: F) -> F:
    """Redis down -> UnavailableError; Redis out of memory -> ResourceExhaustedError."""
    @functools.wraps(method)
    def wrapper(self: "RedisBackend", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except _DOWN as exc:
            raise UnavailableError(f"redis at {self.url_for_messages} is unavailable: {exc}") from exc
        except redis.exceptions.ResponseError as exc:
            if str(exc).startswith("OOM"):
                raise ResourceExhaustedError(f"redis at {self.url_for_messages} is out of memory "
                                             f"(raise its maxmemory or lower --host-cache-bytes): {exc}") from exc
            raise
    return wrapper  # type: ignore[return-value]


class RedisWriter(Writer):
    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._data: bytearray | None = bytearray(num_bytes)

    @property
    def buffer(self) -> memoryview:
        if self._data is None:
            raise ValueError("writer already committed or aborted")
        return memoryview(self._data)

    def take(self) -> bytearray:
        data, self._data = self._data, None
        assert data is not None
        return data

    def abort(self) -> None:
        self._data = None


class RedisReader(Reader):
    def __init__(self, record: AdapterRecord, backend: "RedisBackend", blob_key: str) -> None:
        self.record = record
        self._backend = backend
        self._key = blob_key

    def chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        total = self.record.num_bytes
        for start in range(0, total, chunk_bytes):
            want = min(chunk_bytes, total - start)
            part = self._backend._getrange(self._key, start, start + want - 1)
            if len(part) != want:
                # Dropped behind the index's back (Redis maxmemory eviction, or a
                # restart mid-read): forget it so the next get reloads or says NOT_FOUND.
                self._backend._drop_broken(self.record.task_id, self.record.version)
                raise UnavailableError(
                    f"task id {self.record.task_id} version {self.record.version} expired from redis "
                    "while being read (evicted long ago, or redis restarted); retry")
            yield part


class RedisBackend(CacheBackend):
    """Host cache in redis-server, shared by every replica on the same base model."""

    kind = "redis"

    def __init__(self, url: str, budget_bytes: int, fingerprint: str, *, prefix: str = "loraplex",
                 retired_grace_s: float = 60.0, upload_ttl_s: float = 600.0) -> None:
        self.budget_bytes = budget_bytes
        self.url_for_messages = url.split("@")[-1]  # never echo a password
        self.base = f"{prefix}:{fingerprint or 'any'}"
        self._grace_ms = int(retired_grace_s * 1000)
        self._upload_ttl_ms = int(upload_ttl_s * 1000)
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=2.0, socket_timeout=60.0, health_check_interval=5,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])
        self._commit = self._client.register_script(redis_scripts.COMMIT)
        self._get = self._client.register_script(redis_scripts.GET)
        self._evict = self._client.register_script(redis_scripts.EVICT)
        self._stats = self._client.register_script(redis_scripts.STATS)
        self._list = self._client.register_script(redis_scripts.LIST)
        self._drop = self._client.register_script(redis_scripts.DROP_BROKEN)

    @_maps_redis_errors
    def ping(self) -> None:
        self._client.ping()

    def open_writer(self, num_bytes: int) -> RedisWriter:
        if num_bytes > self.budget_bytes:
            raise ResourceExhaustedError(
                f"adapter of {num_bytes} bytes is larger than the whole host cache budget "
                f"({self.budget_bytes} bytes); raise --host-cache-bytes")
        return RedisWriter(num_bytes)

    @_maps_redis_errors
    def commit(self, writer: Writer, record: AdapterRecord, replace: bool) -> CommitResult:
        assert isinstance(writer, RedisWriter)
        data = writer.take()
        tmp = f"{self.base}:tmp:{uuid.uuid4().hex}"
        self._client.set(tmp, memoryview(data), px=self._upload_ttl_ms)
        del data
        out = self._commit(args=[self.base, tmp, record.task_id, record.version, record.num_bytes,
                                 self.budget_bytes, record.to_json(), int(replace), self._grace_ms,
                                 repr(time.time())])
        status = int(out[0])
        if status == 0:
            return CommitResult(stored=True, evicted=[int(t) for t in out[1:]])
        if status == 1:
            return CommitResult(stored=False)
        if status == 2:
            raise AlreadyExistsError(
                f"task id {record.task_id} already holds version {out[1].decode()} "
                f"(this upload is {record.version}); pass replace to overwrite it")
        if status == 3:
            self.open_writer(record.num_bytes)  # raises with the sizes in the message
        raise UnavailableError(f"upload of task id {record.task_id} expired in redis before it was "
                               "published (redis restarted?); retry")

    @_maps_redis_errors
    def get(self, task_id: int, version: str | None = None) -> RedisReader | None:
        out = self._get(args=[self.base, task_id, version or "", repr(time.time())])
        if int(out[0]) == 0:
            return None
        ver = out[1].decode()
        return RedisReader(AdapterRecord.from_json(out[2]), self, f"{self.base}:blob:{task_id}:{ver}")

    @_maps_redis_errors
    def _getrange(self, key: str, start: int, end: int) -> bytes:
        return bytes(self._client.getrange(key, start, end))  # type: ignore[arg-type]

    @_maps_redis_errors
    def _drop_broken(self, task_id: int, version: str) -> None:
        self._drop(args=[self.base, task_id, version])

    @_maps_redis_errors
    def has(self, task_id: int) -> str | None:
        ver = self._client.hget(f"{self.base}:cur", str(task_id))
        return bytes(ver).decode() if ver is not None else None  # type: ignore[arg-type]

    @_maps_redis_errors
    def evict(self, task_id: int) -> bool:
        return bool(self._evict(args=[self.base, task_id, self._grace_ms]))

    @_maps_redis_errors
    def listing(self) -> list[ListedAdapter]:
        flat = self._list(args=[self.base])
        return [ListedAdapter(AdapterRecord.from_json(flat[i + 2]), float(flat[i + 1]))
                for i in range(0, len(flat), 3)]

    @_maps_redis_errors
    def stats(self) -> CacheStats:
        used, n, hits, misses, evictions = (int(v) for v in self._stats(args=[self.base]))
        return CacheStats(used, self.budget_bytes, n, hits, misses, evictions)

    @_maps_redis_errors
    def put_source(self, source: SourceEntry) -> None:
        old = self.source(source.task_id)
        pipe = self._client.pipeline(transaction=True)
        if old is not None and old.name and old.name != source.name:
            pipe.hdel(f"{self.base}:names", old.name)
        pipe.hset(f"{self.base}:src", str(source.task_id), source.to_json())
        if source.name:
            pipe.hset(f"{self.base}:names", source.name, str(source.task_id))
        pipe.execute()

    @_maps_redis_errors
    def source(self, task_id: int) -> SourceEntry | None:
        raw = self._client.hget(f"{self.base}:src", str(task_id))
        return SourceEntry.from_json(raw) if raw is not None else None

    @_maps_redis_errors
    def task_for_name(self, name: str) -> int | None:
        raw = self._client.hget(f"{self.base}:names", name)
        return int(raw) if raw is not None else None

    @_maps_redis_errors
    def forget_source(self, task_id: int) -> None:
        old = self.source(task_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.hdel(f"{self.base}:src", str(task_id))
        if old is not None and old.name:
            pipe.hdel(f"{self.base}:names", old.name)
        pipe.execute()

    @_maps_redis_errors
    def sources(self) -> list[SourceEntry]:
        return [SourceEntry.from_json(v) for v in self._client.hvals(f"{self.base}:src")]

    def close(self) -> None:
        # The cache outlives this replica: other replicas share it.
        self._client.close()
