"""Many never-seen named adapters at once through the real host-cache service, against one after another.

Writes 2N + 1 PEFT folders of one model shape (every module of every layer, bf16) under a temporary
`--lora-root`, starts `loraplex cache` on it, resolves the first name (the service's first load), then N
names one after another and N other names all at once (`ResolveName`, each converting its adapter into
shared memory). A burst of new names right after start is what a user's first requests do; its time
against the one-after-another time shows how well conversions share the process (the GIL).

    python bench/cold_adapter_burst.py [--num 16] [--shape smollm2] [--rank 64] [--repeats 3] \
        [--cache-flags "--gil-switch-interval-us 0"] [--out result.json]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cold_adapter_stages import SHAPES, write_model_and_root  # noqa: E402
from loraplex.cache_client import CacheClient  # noqa: E402
from loraplex.procs import start_service  # noqa: E402


async def one_round(address: str, first: str, serial: list[str], burst: list[str]) -> dict:
    async with CacheClient(address) as client:
        await client.resolve_name(first)
        await asyncio.sleep(0.5)
        t = time.perf_counter()
        for name in serial:
            await client.resolve_name(name)
        one_after_another = time.perf_counter() - t
        await asyncio.sleep(0.5)
        t = time.perf_counter()
        await asyncio.gather(*[client.resolve_name(name) for name in burst])
        at_once = time.perf_counter() - t
    return {"one_after_another_s": one_after_another, "at_once_s": at_once}


def run(shape: str, rank: int, num: int, cache_flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(2 * num + 1)]
        model_dir, root, _ = write_model_and_root(Path(tmp), shape, names, rank)
        cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--lora-root", str(root),
                                        "--model", str(model_dir), "--host-cache-bytes", str(8 << 30),
                                        *cache_flags], timeout_s=120)
        try:
            return asyncio.run(one_round(cache.address, names[0], names[1:num + 1], names[num + 1:]))
        finally:
            cache.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--num", type=int, default=16, help="adapters in each of the two phases")
    ap.add_argument("--repeats", type=int, default=3, help="fresh services, each with new adapters")
    ap.add_argument("--cache-flags", default="", help="more `loraplex cache` flags")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rounds = []
    for _ in range(args.repeats):
        r = run(args.shape, args.rank, args.num, args.cache_flags.split())
        rounds.append(r)
        print(f"{args.num} adapters: one after another {r['one_after_another_s'] * 1e3:.0f} ms, "
              f"all at once {r['at_once_s'] * 1e3:.0f} ms", flush=True)
    out = {"bench": "cold_adapter_burst", "shape": args.shape, "rank": args.rank, "num": args.num,
           "cache_flags": args.cache_flags, "cpus": os.cpu_count(), "rounds": rounds,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
