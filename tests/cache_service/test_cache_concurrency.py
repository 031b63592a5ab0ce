"""Many concurrent clients never read a torn or wrong adapter, and the byte accounting holds."""
from __future__ import annotations

import asyncio
import hashlib
import random
import threading

import torch

from cache_helpers import valid_adapter
from loraplex import errors
from loraplex.cache_client import CacheClient
from cache_service.records import AdapterRecord

NUM_THREADS = 16


def _payload(task_id: int, seed: int) -> bytes:
    size = 64 + (seed * 37 + task_id * 11) % 900
    return random.Random(seed * 1_000_003 + task_id).randbytes(size)


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _run_threads(worker) -> None:
    failures: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            worker(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(NUM_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_backend_16_threads_1000_ops_each(backend):
    """Puts (replace), gets, has and evicts on 12 task ids under a 4 KiB budget."""
    def worker(i: int) -> None:
        rng = random.Random(i)
        for n in range(1000):
            task_id = rng.randrange(12)
            op = rng.random()
            if op < 0.3:
                data = _payload(task_id, i * 10_000 + n)
                writer = backend.open_writer(len(data))
                writer.buffer[:] = data
                record = AdapterRecord(task_id=task_id, version=_version(data), config=((1, 0, 1),),
                                       dtype="float16", shape=(1, len(data) // 2), num_bytes=len(data))
                backend.commit(writer, record, replace=True)
            elif op < 0.75:
                reader = backend.get(task_id)
                if reader is not None:
                    with reader:
                        data = b"".join(bytes(c) for c in reader.chunks(rng.choice([100, 4096])))
                    assert reader.record.task_id == task_id
                    assert len(data) == reader.record.num_bytes
                    assert _version(data) == reader.record.version, "torn or wrong adapter read"
            elif op < 0.9:
                backend.has(task_id)
            else:
                backend.evict(task_id)

    _run_threads(worker)
    listed = backend.listing()
    stats = backend.stats()
    assert stats.bytes_used == sum(a.record.num_bytes for a in listed) <= stats.bytes_total
    assert stats.num_adapters == len(listed) == len({a.record.task_id for a in listed})
    if backend.kind == "shm":
        assert len(backend.segment_names()) == len(listed)


def test_service_16_threads_1000_ops(service):
    """16 client threads, 63 operations each, through gRPC (puts validated, gets chunked or mapped)."""
    adapters = {(t, s): valid_adapter(service.spec, rank=1, module_ids=(1,), layers=[0], seed=t * 100 + s)
                for t in range(6) for s in range(4)}
    by_version = {a.content_hash: (t, a) for (t, _), a in adapters.items()}

    def worker(i: int) -> None:
        async def body() -> None:
            rng = random.Random(i)
            async with CacheClient(service.address) as c:
                for _ in range(63):
                    task_id = 9000 + rng.randrange(6)
                    if rng.random() < 0.35:
                        await c.put_adapter(adapters[(task_id - 9000, rng.randrange(4))], task_id, replace=True)
                        continue
                    try:
                        got = await c.get_adapter(task_id, allow_shm=rng.random() < 0.5)
                    except errors.NotFoundError:
                        continue
                    owner, expected = by_version[got.content_hash]
                    assert owner == task_id - 9000, "adapter of another task id"
                    assert torch.equal(got.weights, expected.weights), "torn adapter"
        asyncio.run(body())

    _run_threads(worker)
