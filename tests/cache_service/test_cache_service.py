"""The AdapterCache service, end to end through CacheClient, on both backends."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_helpers import run, valid_adapter
from loraplex import errors
from loraplex.cache_client import CacheClient
from loraplex.formats import ModelSpec


async def _clear(client: CacheClient) -> None:
    for a in (await client.list()).adapters:
        if a.in_host_cache:
            await client.evict(a.task_id)


def _same(a, b) -> None:
    assert np.array_equal(a.config, b.config)
    assert a.weights.dtype == b.weights.dtype and torch.equal(a.weights, b.weights)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_chunks_and_shm(service, dtype):
    adapter = valid_adapter(service.spec, rank=3, dtype=dtype)

    async def body():
        async with CacheClient(service.address, chunk_bytes=5000) as c:
            put = await c.put_adapter(adapter, 1001, name="rt", replace=True)
            assert put.adapter.version == adapter.content_hash
            assert put.adapter.num_bytes == adapter.num_bytes and put.adapter.max_rank == 3
            assert {m.module_name for m in put.adapter.modules} >= {"attn_q", "mlp_4h_to_h"}
            chunked = await c.get_adapter(1001, allow_shm=False)
            mapped = await c.get_adapter(1001, version=adapter.content_hash)
            return chunked, mapped

    chunked, mapped = run(body())
    for got in (chunked, mapped):
        _same(got, adapter)
        assert got.content_hash == adapter.content_hash
        assert got.metadata.fingerprint == service.spec.fingerprint
        assert got.in_out[0] == (64, 64) and len(got.in_out) == adapter.num_rows
    # Writing into a mapped adapter never reaches the shared copy (copy-on-write mapping).
    mapped.weights[0, 0] = 123.0
    again = run(_get(service, 1001))
    _same(again, adapter)


async def _get(service, task_id, **kw):
    async with CacheClient(service.address) as c:
        return await c.get_adapter(task_id, **kw)


def test_has_evict_list_info(service):
    adapter = valid_adapter(service.spec, rank=2)

    async def body():
        async with CacheClient(service.address) as c:
            await _clear(c)
            assert await c.has(2001) is None
            await c.put_adapter(adapter, 2001)
            assert await c.has(2001) == adapter.content_hash
            listing = await c.list()
            info = await c.info()
            assert await c.evict(2001) and not await c.evict(2001)
            with pytest.raises(errors.NotFoundError, match="resend its weights"):
                await c.get_adapter(2001)
            return listing, info

    listing, info = run(body())
    cached = [a for a in listing.adapters if a.in_host_cache]
    assert [a.task_id for a in cached] == [2001] and listing.bytes_used == adapter.num_bytes
    assert listing.bytes_total == service.budget
    assert (info.backend, info.bytes_total, info.max_lora_rank) == (service.backend, service.budget, 16)
    assert info.fingerprint == service.spec.fingerprint


def test_lru_evicts_by_bytes_and_counts(service):
    adapters = [valid_adapter(service.spec, rank=4) for _ in range(7)]  # 17920 bytes each, budget 100000

    async def body():
        async with CacheClient(service.address) as c:
            await _clear(c)
            before = await c.list()
            for i in range(5):
                assert (await c.put_adapter(adapters[i], 3000 + i)).evicted == []
            await c.get_adapter(3000)  # 3001 becomes the least recently used
            put5 = await c.put_adapter(adapters[5], 3005)
            put6 = await c.put_adapter(adapters[6], 3006)
            after = await c.list()
            with pytest.raises(errors.NotFoundError):
                await c.get_adapter(3001)
            return before, put5, put6, after

    before, put5, put6, after = run(body())
    assert put5.evicted == [3001] and put6.evicted == [3002]
    cached = [a.task_id for a in after.adapters if a.in_host_cache]
    assert cached == [3006, 3005, 3000, 3004, 3003]
    assert after.bytes_used == 5 * adapters[0].num_bytes <= service.budget
    assert after.evictions - before.evictions == 2
    assert after.hits - before.hits == 1


def test_too_large_is_resource_exhausted(service):
    spec = service.spec
    big = valid_adapter(spec, rank=16, dtype=torch.float32)  # 143360 bytes, budget 100000
    assert big.num_bytes > service.budget

    async def body():
        async with CacheClient(service.address) as c:
            await c.put_adapter(big, 4001)

    with pytest.raises(errors.ResourceExhaustedError, match=f"{big.num_bytes} bytes.*{service.budget}"):
        run(body())


def _bad_rank(spec):
    a = valid_adapter(spec, rank=2)
    a.config[3, 2] = 17  # over --max-lora-rank 16
    return a, "row 3.*rank 17"


def _bad_layer(spec):
    a = valid_adapter(spec, rank=2)
    a.config[5, 1] = 9
    return a, "row 5.*layer 9"


def _nan(spec):
    a = valid_adapter(spec, rank=2)
    a.weights[4, 7] = float("nan")
    return a, "row 4"


@pytest.mark.parametrize("make_bad", [_bad_rank, _bad_layer, _nan])
def test_invalid_adapter_is_refused_naming_the_row(service, make_bad):
    adapter, pattern = make_bad(service.spec)

    async def body():
        async with CacheClient(service.address) as c:
            with pytest.raises(errors.InvalidArgumentError, match=pattern):
                await c.put_adapter(adapter, 5001)
            assert await c.has(5001) is None

    run(body())


def test_other_base_model_is_failed_precondition(service):
    other = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=16, intermediate_size=96)
    adapter = valid_adapter(service.spec, rank=2).with_metadata(fingerprint=other.fingerprint)

    async def body():
        async with CacheClient(service.address) as c:
            await c.put_adapter(adapter, 5002)

    with pytest.raises(errors.FailedPreconditionError, match=other.fingerprint):
        run(body())


def test_versions_and_replace(service):
    old, new = valid_adapter(service.spec, rank=2), valid_adapter(service.spec, rank=2)

    async def body():
        async with CacheClient(service.address) as c:
            await c.evict(6001)
            first = await c.put_adapter(old, 6001)
            same = await c.put_adapter(old, 6001)  # resending the same weights is fine
            with pytest.raises(errors.AlreadyExistsError, match="replace"):
                await c.put_adapter(new, 6001)
            replaced = await c.put_adapter(new, 6001, replace=True)
            with pytest.raises(errors.NotFoundError, match=f"at version {new.content_hash}"):
                await c.get_adapter(6001, version=old.content_hash)
            got = await c.get_adapter(6001, version=new.content_hash)
            return first, same, replaced, got

    first, same, replaced, got = run(body())
    assert first.adapter.version == same.adapter.version == old.content_hash
    assert replaced.adapter.version == new.content_hash != old.content_hash
    _same(got, new)


def test_prefetch_folder_loaded_at_start(service):
    listing = run(_list(service))
    entry = next(a for a in listing.adapters if a.task_id == 42)
    assert entry.source.startswith("prefetch:") or not entry.in_host_cache
    # Evicted or not, a prefetched adapter comes back from its folder.
    got = run(_get(service, 42, allow_shm=False))
    assert got.max_rank == 2 and got.metadata.original_format == "npy"


async def _list(service):
    async with CacheClient(service.address) as c:
        return await c.list()


def test_metrics_endpoint(tmp_path, tiny_model, free_port):
    import urllib.request

    from cache_helpers import start_cache

    svc = start_cache(tmp_path, tiny_model, "shm", extra=("--metrics-port", str(free_port)))
    try:
        listing = run(_list(svc))
        assert [(a.task_id, a.in_host_cache) for a in listing.adapters] == [(42, True)]  # prefetched at start
        run(_get(svc, 42))
        text = urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=10).read().decode()
    finally:
        svc.proc.stop()
    assert 'loraplex_host_cache_hits_total{backend="shm"} 1.0' in text
    assert "loraplex_host_cache_bytes_used" in text and 'loraplex_adapter_load_seconds_count{tier="host"}' in text


def test_verify_and_corrupted_or_short_uploads(service):
    import grpc

    from loraplex.cache_client import adapter_header
    from loraplex.v1 import cache_pb2, cache_pb2_grpc

    adapter = valid_adapter(service.spec, rank=2)
    data = adapter.weights.reshape(-1).view(torch.uint8).numpy().tobytes()

    async def send(header, payload):
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = cache_pb2_grpc.AdapterCacheStub(channel)

            async def requests():
                yield cache_pb2.PutAdapterRequest(header=header)
                yield cache_pb2.PutAdapterRequest(chunk=payload)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PutAdapter(requests())
            return info.value

    async def body():
        async with CacheClient(service.address) as c:
            ok = await c.put_adapter(adapter, 8001, verify=True, replace=True)
            assert ok.adapter.version == adapter.content_hash
        flipped = bytearray(data)
        flipped[100] ^= 0x01
        corrupted = await send(adapter_header(adapter, 8002), bytes(flipped))
        short = await send(adapter_header(adapter, 8003), data[:-2])
        async with CacheClient(service.address) as c:
            assert await c.has(8002) is None and await c.has(8003) is None
        return corrupted, short

    corrupted, short = run(body())
    assert corrupted.code() == grpc.StatusCode.INVALID_ARGUMENT and "corrupted transfer" in corrupted.details()
    assert short.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream ended after" in short.details()
