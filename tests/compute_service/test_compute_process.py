"""Real processes: a host cache (shm) and a compute service; an adapter put in the cache serves a request."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from compute_helpers import random_adapter

from compute_service.engine.loader import load_model
from compute_service.engine.sampling_params import SamplingParams
from loraplex.cache_client import CacheClient
from loraplex.procs import start_service
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_compute_process_serves_adapter_from_host_cache(tiny_model_dir, engine_process):
    loaded = load_model(tiny_model_dir)
    adapter = random_adapter(loaded.spec, 8, seed=42)
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--model", str(tiny_model_dir)])
    compute = None
    try:
        compute = start_service("compute", [
            "compute", "--listen", "127.0.0.1:0", "--cache-address", cache.address, "--model", str(tiny_model_dir),
            "--max-model-len", "96", "--kv-cache-bytes", str(1 << 20), "--lora-gpu-cache-bytes", str(4 << 20),
            "--max-lora-rank", "64", "--engine-process", engine_process])

        async def main():
            async with CacheClient(cache.address) as client:
                await client.put_adapter(adapter, 77)
            async with grpc.aio.insecure_channel(compute.address) as ch:
                stub = compute_pb2_grpc.ComputeStub(ch)
                req = compute_pb2.GenerateTokensRequest(
                    request_id="p1", input_ids=[5, 6, 7], adapter=compute_pb2.AdapterRef(task_id=77),
                    sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True))
                toks = [t async for m in stub.GenerateTokens(req) for t in m.token_ids]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    bad = compute_pb2.GenerateTokensRequest(request_id="p2", input_ids=[1],
                                                            adapter=compute_pb2.AdapterRef(task_id=78))
                    async for _ in stub.GenerateTokens(bad):
                        pass
                stats = await stub.GetStats(compute_pb2.GetStatsRequest())
                return toks, err.value, stats

        toks, err, stats = asyncio.run(main())
    finally:
        codes = [svc.stop() for svc in (compute, cache) if svc is not None]
    from compute_service.engine.config import EngineConfig
    from compute_service.build import zero_kv_cache
    from compute_service.engine.llm_engine import LLMEngine
    ref = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_lora_rank=64, max_model_len=96,
                                 kv_cache_bytes=1 << 20, lora_backend="torch"), loaded)
    zero_kv_cache(ref)
    ref.add_adapter("a", adapter)
    assert toks == ref.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), ["a"])[0]
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert list(stats.resident_task_ids) == [77] and stats.kv_blocks_used == 0
    assert codes == [0, 0], compute.output() if compute else ""
    assert "compute_service stopped" in compute.output()
