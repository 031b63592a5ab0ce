"""`loraplex compute --tensor-parallel-size 2` on CPU, as real processes with a host cache: a base and
an adapter request stream the same tokens as the single-process engine; stopping ends every rank."""
from __future__ import annotations

import asyncio

import grpc
import pytest


from compute_service.build import zero_kv_cache
from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.cache_client import CacheClient
from loraplex.procs import start_service
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc
from tp_helpers import random_adapter, save_tiny_llama

pytestmark = pytest.mark.slow


def test_served_tp2_streams_the_single_process_tokens(tmp_path):
    folder = save_tiny_llama(tmp_path / "m", 4, 1, seed=7)          # one KV head: replicated on both ranks
    ref = LLMEngine(EngineConfig(model=str(folder), max_model_len=96, kv_cache_bytes=1 << 20, lora_backend="torch"))
    zero_kv_cache(ref)
    adapter = random_adapter(ref.spec, (1, 2, 3, 4, 5, 6, 7), 8, seed=3)
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--model", str(folder)])
    compute = None
    try:
        compute = start_service("compute", [
            "compute", "--listen", "127.0.0.1:0", "--cache-address", cache.address, "--model", str(folder),
            "--device", "cpu", "--tensor-parallel-size", "2", "--max-model-len", "96",
            "--kv-cache-bytes", str(1 << 20), "--max-lora-rank", "64"])

        async def main():
            async with CacheClient(cache.address) as client:
                await client.put_adapter(adapter, 5)
            async with grpc.aio.insecure_channel(compute.address) as ch:
                stub = compute_pb2_grpc.ComputeStub(ch)
                out = {}
                for rid, ref_ in (("base", None), ("lora", compute_pb2.AdapterRef(task_id=5))):
                    req = compute_pb2.GenerateTokensRequest(
                        request_id=rid, input_ids=[5, 6, 7, 8], adapter=ref_,
                        sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
                    out[rid] = [t async for m in stub.GenerateTokens(req) for t in m.token_ids]
                return out

        got = asyncio.run(main())
    finally:
        codes = [svc.stop() for svc in (compute, cache) if svc is not None]
    ref.add_adapter("a", adapter)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = ref.generate([[5, 6, 7, 8], [5, 6, 7, 8]], p, [None, "a"])
    assert got == {"base": want[0], "lora": want[1]}, compute.output() if compute else ""
    assert want[0] != want[1]
    assert codes == [0, 0], compute.output() if compute else ""
    assert "tensor parallel group of 2 ranks" in compute.output()



def test_serve_passes_tensor_parallel_size_to_compute():
    from loraplex.cli.main import build_parser
    from loraplex.cli.serve import service_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--tensor-parallel-size", "2"])
    _cache, compute = service_args(args, "")
    assert compute[compute.index("--tensor-parallel-size") + 1] == "2"
    _cache, compute = service_args(build_parser().parse_args(["serve"]), "")
    assert "--tensor-parallel-size" not in compute
