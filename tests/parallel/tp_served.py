"""A served TP=2 compute service (real `loraplex compute` processes with a host cache) against the
single-process engine on the same device: a base and an adapter request, greedy."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from compute_service.build import zero_kv_cache
from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.cache_client import CacheClient
from loraplex.procs import start_service
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc
from tp_helpers import random_adapter, save_tiny_llama

PROMPT = [5, 6, 7, 8]
# Until SERVING: on 2 H200s with a cold kernel cache 22.6 s (the compile pass on rank 0 alone), 113.4 s before it
# (bench/results/tp_cold_start.json); generous, for slower hosts.
START_S = 300.0


def serve_tp2_and_generate(tmp_path: Path, device: str, max_tokens: int = 8, extra: tuple[str, ...] = ()):
    """(served tokens by request id, reference tokens [base, adapter], exit codes, compute's output, the
    service's GetStats after the requests)."""
    folder = save_tiny_llama(tmp_path / "m", 4, 1, seed=7)          # one KV head: replicated on both ranks
    ref = LLMEngine(EngineConfig(model=str(folder), max_model_len=96, kv_cache_bytes=1 << 20, device=device,
                                 dtype="float32", lora_backend="auto" if device == "cuda" else "torch"))
    zero_kv_cache(ref)
    adapter = random_adapter(ref.spec, (1, 2, 3, 4, 5, 6, 7), 8, seed=3)
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--model", str(folder)])
    compute = None
    try:
        compute = start_service("compute", [
            "compute", "--listen", "127.0.0.1:0", "--cache-address", cache.address, "--model", str(folder),
            "--device", device, "--dtype", "float32", "--tensor-parallel-size", "2", "--max-model-len", "96",
            "--kv-cache-bytes", str(1 << 20), "--max-lora-rank", "64", *extra], timeout_s=START_S)

        async def main():
            async with CacheClient(cache.address) as client:
                await client.put_adapter(adapter, 5)
            async with grpc.aio.insecure_channel(compute.address) as ch:
                stub = compute_pb2_grpc.ComputeStub(ch)
                out = {}
                for rid, ref_ in (("base", None), ("lora", compute_pb2.AdapterRef(task_id=5))):
                    req = compute_pb2.GenerateTokensRequest(
                        request_id=rid, input_ids=PROMPT, adapter=ref_,
                        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                    out[rid] = [t async for m in stub.GenerateTokens(req) for t in m.token_ids]
                return out, await stub.GetStats(compute_pb2.GetStatsRequest())

        got, stats = asyncio.run(main())
    finally:
        codes = [svc.stop() for svc in (compute, cache) if svc is not None]
    ref.add_adapter("a", adapter)
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = ref.generate([PROMPT, PROMPT], p, [None, "a"])
    return got, want, codes, compute.output() if compute is not None else "", stats
