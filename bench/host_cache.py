"""Host cache throughput: put/get MB/s and latency for 1, 10 and 300 MB adapters, shm and redis.

    python bench/host_cache.py --out bench/results/host_cache.json

Each backend runs as a real `loraplex cache` process (Llama-3-8B shapes as the
base model) and is driven through `loraplex.cache_client.CacheClient` over
gRPC on 127.0.0.1, so the numbers include what a caller pays: chunking,
validation against the base model, content hashing, the backend's copy and
the LRU bookkeeping (the client sends no hash; the cache computes the
version). `get chunks` streams the bytes through gRPC (what a remote compute
service does); `get shm` maps the segment (co-located, shm backend only),
timed once for the mapping alone and once including a first read of every
byte (page faults included), which is what a caller really waits for. Redis is a foreground redis-server started here unless
--redis-url is given. Timing on shared CPUs is noisy: each case repeats and
reports the best and the median.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loraplex.cache_client import CacheClient  # noqa: E402
from loraplex.formats import Adapter, AdapterMetadata, ModelSpec  # noqa: E402
from loraplex.procs import start_service  # noqa: E402

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256}
# label -> (module ids, rank): q+v over 32 layers is 1 MiB per unit of rank in fp16;
# all seven modules at rank 36 is ~297 MB (a rank-64 all-module 8B adapter is ~335 MB unpadded).
CASES = {"1MB": ((1, 3), 1, 20), "10MB": ((1, 3), 10, 10), "300MB": ((1, 2, 3, 4, 5, 6, 7), 36, 3)}


def make_adapter(spec: ModelSpec, module_ids: tuple[int, ...], rank: int, seed: int) -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    rows = [(m, layer) for layer in range(spec.num_layers) for m in module_ids]
    used = [rank * (spec.module_shape(m).in_features + spec.module_shape(m).out_features) for m, _ in rows]
    weights = torch.empty(len(rows), max(used), dtype=torch.float16).uniform_(0.01, 0.2, generator=gen)
    for i, u in enumerate(used):
        weights[i, u:] = 0
    config = np.array([[m, layer, rank] for m, layer in rows], dtype=np.int32)
    return Adapter(config=config, weights=weights, metadata=AdapterMetadata(source="inline"))


def read_all(adapter: Adapter) -> int:
    """Reads every weight byte once (first touch of a fresh mapping pays its page faults)."""
    raw = adapter.weights.reshape(-1).view(torch.uint8).numpy()
    whole = len(raw) // 8 * 8
    return int(np.bitwise_xor.reduce(raw[:whole].view(np.uint64))) ^ int(np.bitwise_xor.reduce(raw[whole:], initial=0))


def start_redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install -y redis-server) or pass --redis-url")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def summarize(times: list[float], num_bytes: int) -> dict:
    best = min(times)
    return {"reps": len(times), "best_s": round(best, 5), "median_s": round(statistics.median(times), 5),
            "best_mb_per_s": round(num_bytes / best / 1e6, 1),
            "median_mb_per_s": round(num_bytes / statistics.median(times) / 1e6, 1)}


async def bench_backend(address: str, backend: str, spec: ModelSpec) -> list[dict]:
    results = []
    async with CacheClient(address) as client:
        for label, (module_ids, rank, reps) in CASES.items():
            adapters = [make_adapter(spec, module_ids, rank, seed) for seed in range(2)]
            num_bytes = adapters[0].num_bytes
            puts, gets, maps, reads = [], [], [], []
            for i in range(reps):
                # Alternate two adapters under one task id: every put stores a new version.
                t0 = time.perf_counter()
                await client.put_adapter(adapters[i % 2], 1, replace=True)
                puts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = await client.get_adapter(1, allow_shm=False)
                gets.append(time.perf_counter() - t0)
                if backend == "shm":
                    t0 = time.perf_counter()
                    mapped = await client.get_adapter(1)
                    t1 = time.perf_counter()
                    read_all(mapped)
                    maps.append(t1 - t0)
                    reads.append(time.perf_counter() - t0)
                assert torch.equal(got.weights, adapters[i % 2].weights)
            for op, times in (("put", puts), ("get chunks", gets), ("get shm (map only)", maps),
                              ("get shm + read every byte", reads)):
                if times:
                    row = {"backend": backend, "size": label, "num_bytes": num_bytes, "op": op, **summarize(times, num_bytes)}
                    print(json.dumps(row), flush=True)
                    results.append(row)
            await client.evict(1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/host_cache.json")
    parser.add_argument("--redis-url", default="", help="use this redis-server instead of starting one")
    parser.add_argument("--backends", default="shm,redis")
    args = parser.parse_args()
    spec = ModelSpec.from_hf_config(LLAMA_8B)
    results: list[dict] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_8B))
        for backend in args.backends.split(","):
            redis_proc = None
            extra: list[str] = []
            if backend == "redis":
                url = args.redis_url
                if not url:
                    redis_proc, url = start_redis()
                extra = ["--redis-url", url, "--redis-prefix", f"bench{os.getpid()}"]
            svc = start_service(f"cache-{backend}", ["cache", "--listen", "127.0.0.1:0", "--backend", backend,
                                                     "--model", tmp, "--host-cache-bytes", str(1 << 30), *extra])
            try:
                results += asyncio.run(bench_backend(svc.address, backend, spec))
            finally:
                svc.stop()
                if redis_proc is not None:
                    redis_proc.kill()
                    redis_proc.wait()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"benchmark": "host_cache", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                         "python": platform.python_version(), "torch": torch.__version__,
                                         "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
           "base_model_shapes": "Llama-3-8B (hidden 4096, 32 layers, GQA 8, intermediate 14336), fp16 adapters",
           "chunk_bytes": 4 << 20, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
