"""Cold named adapters through the real host-cache service into the GPU adapter pool.

For each model shape (SmolLM2-135M, Llama-3-8B): a host-cache service runs as
its own process (shm backend, an adapter root holding PEFT folders of every
module at rank 64, bf16); this process plays the compute service's part with
its real pieces: the cache client (the adapter's segment mapped, not copied),
then the paged adapter pool's load (structural checks, gather of the factors
into the pinned ring, host-to-device copies on the side stream, pack into
pages). Per never-seen adapter it times:

- resolve: `ResolveName` on the cache (read the files, convert into shared
  memory, check, hash) - what a gateway does for a named request;
- fetch: `GetAdapter` and the mapping of the segment;
- load: until the adapter is resident in the pool (upload + pack);
and the same adapter again (warm: the name resolves from the cache, the pool
already holds it). Each new adapter comes after `--gap-s` of idle time (0.5
s: one new adapter at a time, the case the goal names; 0 sends them back to
back, when the cache has no idle time to make spare segments in). The floor
is one read of the file plus one pinned copy.

    python bench/cold_adapter.py --out bench/results/cold_adapter.json [--shapes smollm2,llama3-8b]
        [--gap-s 0.5] [--shm-spare-bytes 0] [--cache-flags "--convert-processes 4"]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from adapter_swap import h2d_gbps  # noqa: E402
from cold_adapter_stages import SHAPES, write_model_and_root  # noqa: E402
from compute_service.adapter_cache.loader import adapter_key  # noqa: E402
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots  # noqa: E402
from compute_service.adapter_cache.staging import PinnedRing  # noqa: E402
from compute_service.engine.spec import ModelSpec as EngineSpec  # noqa: E402
from loraplex.cache_client import CacheClient  # noqa: E402
from loraplex.procs import start_service  # noqa: E402


RING_VARIANTS = [(2, 32), (4, 32), (8, 32), (8, 64), (12, 64)]   # (copy threads, buffer MiB)


def engine_spec(cfg: dict) -> EngineSpec:
    return EngineSpec(architecture="llama", num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                      num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
                      head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"],
                      vocab_size=cfg["vocab_size"], rms_norm_eps=1e-5, rope_theta=1e5,
                      max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(), name="bench")


async def one_load(client: CacheClient, slots: PagedAdapterSlots, name: str) -> dict:
    t0 = time.perf_counter()
    task_id, version = await client.resolve_name(name)
    t1 = time.perf_counter()
    adapter = await client.get_adapter(task_id, version)
    t2 = time.perf_counter()
    key = adapter_key(task_id, version)
    await asyncio.to_thread(slots.load, key, adapter)
    t3 = time.perf_counter()
    tm = slots.timings[key]
    warm0 = time.perf_counter()
    again = await client.resolve_name(name)
    warm_ms = (time.perf_counter() - warm0) * 1e3
    assert again == (task_id, version) and slots.is_ready(adapter_key(*again))
    return dict(name=name, converted_bytes=adapter.num_bytes, uploaded_bytes=tm.num_bytes,
                resolve_ms=(t1 - t0) * 1e3, fetch_ms=(t2 - t1) * 1e3, load_ms=(t3 - t2) * 1e3,
                total_ms=(t3 - t0) * 1e3, upload_host_ms=tm.upload_host_ms, upload_device_ms=tm.upload_ms,
                pack_device_ms=tm.copy_ms, warm_resolve_ms=warm_ms,
                upload_gbps=tm.num_bytes / (tm.upload_ms * 1e6) if tm.upload_ms else 0.0)


async def ring_sweep(client: CacheClient, slots: PagedAdapterSlots, name: str) -> list[dict]:
    """Reloads one cached adapter into the pool through rings of other sizes and copy-thread counts."""
    task_id, version = await client.resolve_name(name)
    adapter = await client.get_adapter(task_id, version)
    key = adapter_key(task_id, version)
    default, out = slots.ring, []
    for threads, buffer_mib in RING_VARIANTS:
        slots.ring = PinnedRing(buffer_mib << 20, copy_threads=threads)
        for _ in range(3):
            assert slots.evict(key)
            t0 = time.perf_counter()
            await asyncio.to_thread(slots.load, key, adapter)
            tm = slots.timings[key]
            out.append(dict(copy_threads=threads, buffer_mib=buffer_mib, load_ms=(time.perf_counter() - t0) * 1e3,
                            upload_device_ms=tm.upload_ms, upload_host_ms=tm.upload_host_ms,
                            upload_gbps=tm.num_bytes / (tm.upload_ms * 1e6) if tm.upload_ms else 0.0))
    slots.ring = default
    return out


async def measure(address: str, slots: PagedAdapterSlots, names: list[str], sweep: bool,
                  gap_s: float) -> tuple[list, list]:
    async with CacheClient(address) as client:
        loads = []
        for n in names:
            await asyncio.sleep(gap_s)      # each new adapter comes to a service idle this long
            loads.append(await one_load(client, slots, n))
        return loads, (await ring_sweep(client, slots, names[1]) if sweep else [])


def run_shape(shape: str, rank: int, num_cold: int, device: torch.device, pool_bytes: int, gap_s: float,
              cache_flags: list[str]) -> dict:
    cfg = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        names = ["warm"] + [f"cold{i}" for i in range(num_cold)]
        model_dir, root, file_bytes = write_model_and_root(Path(tmp), shape, names, rank)
        # Started outside any event loop: the start helper waits for health with its own loop.
        cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--lora-root", str(root),
                                        "--model", str(model_dir), "--host-cache-bytes", str(8 << 30),
                                        *cache_flags],
                              timeout_s=120)
        try:
            slots = PagedAdapterSlots(engine_spec(cfg), rank, device, torch.bfloat16)
            slots.allocate(pool_bytes)
            loads, sweep = asyncio.run(measure(cache.address, slots, names, device.type == "cuda", gap_s))
        finally:
            cache.stop()
    cold = loads[1:]
    out = dict(shape=shape, rank=rank, file_bytes=file_bytes[0], first_load_in_process=loads[0], loads=cold,
               ring_sweep=sweep)
    for k in ("resolve_ms", "fetch_ms", "load_ms", "total_ms", "upload_device_ms", "pack_device_ms",
              "warm_resolve_ms", "upload_gbps"):
        out[f"{k}_median"] = statistics.median(ld[k] for ld in cold)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cold_adapter.json")
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--num-cold", type=int, default=4)
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--gap-s", type=float, default=0.5,
                    help="idle time before each adapter's first request (the cache makes spare segments when idle)")
    ap.add_argument("--shm-spare-bytes", default="", help="the cache's --shm-spare-bytes (default: its own)")
    ap.add_argument("--cache-flags", default="", help="more `loraplex cache` flags, e.g. \"--convert-processes 4\"")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    cache_flags = ["--shm-spare-bytes", args.shm_spare_bytes] if args.shm_spare_bytes else []
    cache_flags += args.cache_flags.split()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    result: dict = dict(bench="cold_adapter", device=torch.cuda.get_device_name() if cuda else "cpu",
                        commit=args.commit, torch=torch.__version__,
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        gap_s=args.gap_s, cache_flags=cache_flags)
    if cuda:
        result["h2d_pinned_gbps"] = h2d_gbps(256 << 20, True, device)
    result["shapes"] = [run_shape(s, args.rank, args.num_cold, device, int(args.pool_gib * 2**30), args.gap_s,
                                  cache_flags) for s in args.shapes.split(",")]
    for s in result["shapes"]:
        line = {k: round(v, 2) for k, v in s.items() if k.endswith("_median")}
        print(s["shape"], f"file {s['file_bytes'] / 1e6:.0f} MB", json.dumps(line), flush=True)
        for v in s["ring_sweep"]:
            print("  ring", v["copy_threads"], "threads", v["buffer_mib"], "MiB:",
                  f"upload {v['upload_device_ms']:.1f} ms ({v['upload_gbps']:.1f} GB/s), load {v['load_ms']:.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
