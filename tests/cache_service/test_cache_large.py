"""A ~300 MB adapter (rank 36, all seven modules, Llama-3-8B shapes) round-trips through each backend."""
from __future__ import annotations

import json
import time

import pytest
import torch

from cache_helpers import run, valid_adapter
from loraplex.cache_client import CacheClient
from loraplex.formats import ModelSpec
from loraplex.procs import start_service

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256}


@pytest.mark.slow
@pytest.mark.parametrize("backend_kind", ["shm", "redis"])
def test_300mb_round_trip(tmp_path, backend_kind, request):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    spec = ModelSpec.from_hf_config(LLAMA_8B)
    adapter = valid_adapter(spec, rank=36, seed=1)
    assert adapter.num_bytes >= 295_000_000
    args = ["cache", "--listen", "127.0.0.1:0", "--backend", backend_kind, "--model", str(tmp_path),
            "--host-cache-bytes", str(1 << 30)]
    if backend_kind == "redis":
        args += ["--redis-url", request.getfixturevalue("redis_server").url, "--redis-prefix", f"big{time.time_ns()}"]
    svc = start_service(f"cache-{backend_kind}", args)

    async def body():
        async with CacheClient(svc.address) as c:
            t0 = time.perf_counter()
            put = await c.put_adapter(adapter, 1)
            t1 = time.perf_counter()
            chunked = await c.get_adapter(1, allow_shm=False)
            t2 = time.perf_counter()
            mapped = await c.get_adapter(1)
            return put, chunked, mapped, (t1 - t0, t2 - t1)

    try:
        put, chunked, mapped, seconds = run(body())
    finally:
        assert svc.stop() == 0, svc.output()
    print(f"{backend_kind}: put {seconds[0]:.2f}s, chunked get {seconds[1]:.2f}s for {adapter.num_bytes / 1e6:.0f} MB")
    assert put.adapter.version == adapter.content_hash and put.adapter.num_bytes == adapter.num_bytes
    assert torch.equal(chunked.weights, adapter.weights)
    assert torch.equal(mapped.weights, adapter.weights)
