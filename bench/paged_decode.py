"""Paged-attention decode (`kernels.paged_attention`): the context split over several programs a (sequence,
KV head) as `decode_splits` picks it, against the unsplit kernel (one program a pair) and other split counts
(`--splits`), by batch and context length, on the 8B model's heads (32 query heads, 8 KV heads, 128 dims,
bf16, pages of 16 tokens).

Each time is a CUDA graph of launches over enough KV-cache copies to exceed the L2 cache (median of replays),
against the floor: the keys' and values' bytes over the measured copy bandwidth (read + write of a 2 GiB
copy, as bench/multi_lora.py). Every output is checked against the fp32 definition first.

    python3 bench/paged_decode.py --commit "$(git rev-parse --short HEAD)" --out bench/results/paged_decode.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_header import gpu_run_header  # noqa: E402  (bench helpers)
from quant_kernel_sweep import graph_us  # noqa: E402
from kernels.paged_attention import paged_attention_decode  # noqa: E402
from kernels.paged_attention_ref import paged_attention_decode_ref  # noqa: E402
from kernels.paged_split import decode_splits  # noqa: E402
from kernels.shrink import _num_sms  # noqa: E402

H, KVH, D, BLOCK = 32, 8, 128, 16
SPAN = 200 * 2**20          # bytes of KV-cache copies per graph: beyond the L2 cache
MAX_CONTEXT = 32768         # the tables' width: what a server with this longest context captures its graphs with


def case(batch: int, ctx: int, dev: torch.device, gen: torch.Generator):
    """KV caches (as many copies as SPAN asks), their shuffled page tables, q and the context lengths."""
    pages = -(-ctx // BLOCK)
    per_copy = batch * pages * BLOCK * KVH * D * 2 * 2
    copies = max(1, min(32, -(-SPAN // per_copy)))
    caches = []
    for _ in range(copies):
        k = torch.randn(batch * pages, BLOCK, KVH, D, device=dev, generator=gen).to(torch.bfloat16)
        v = torch.randn(batch * pages, BLOCK, KVH, D, device=dev, generator=gen).to(torch.bfloat16)
        caches.append((k, v))
    tables = torch.zeros(batch, MAX_CONTEXT // BLOCK, dtype=torch.int32, device=dev)
    tables[:, :pages] = torch.randperm(batch * pages, device=dev, generator=gen).view(batch, pages).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, D, device=dev, generator=gen).to(torch.bfloat16)
    return caches, tables, lens, q, per_copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--contexts", default="128,512,2048,8192,32768")
    ap.add_argument("--splits", default="", help="more split counts to time at every case (e.g. 2,4,8,16)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = {**gpu_run_header(dev, args.commit), "heads": H, "kv_heads": KVH, "head_dim": D,
                 "block_size": BLOCK, "max_context": MAX_CONTEXT, "num_sms": _num_sms(dev), "cases": []}
    bw = res["copy_bandwidth_Bps"]
    extra = [int(x) for x in args.splits.split(",") if x]
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            caches, tables, lens, q, per_copy = case(batch, ctx, dev, gen)
            splits = decode_splits(batch, KVH, H // KVH, MAX_CONTEXT, 64, _num_sms(dev))
            want = paged_attention_decode_ref(q, *caches[0], tables, lens, D ** -0.5)
            outs = [torch.empty_like(q) for _ in range(2)]
            r: dict = {"batch": batch, "context": ctx, "splits": splits, "kv_bytes": per_copy,
                       "floor_us": per_copy / bw * 1e6}
            for s in sorted({1, splits, *extra}):
                paged_attention_decode(q, *caches[0], tables, lens, outs[0], D ** -0.5, num_splits=s)
                err = ((outs[0].float() - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:
                    raise AssertionError(f"batch {batch} context {ctx} splits {s}: rel err {err}")
                fns = [lambda kv=kv, i=i: paged_attention_decode(q, *kv, tables, lens, outs[i % 2], D ** -0.5,
                                                                  num_splits=s)
                       for i, kv in enumerate(caches * max(1, -(-8 // len(caches))))]
                r.setdefault("by_splits_us", {})[str(s)] = graph_us(fns)
            r["unsplit_us"], r["split_us"] = r["by_splits_us"]["1"], r["by_splits_us"][str(splits)]
            r["speedup"] = r["unsplit_us"] / r["split_us"]
            r["split_over_floor"] = r["split_us"] / r["floor_us"]
            res["cases"].append(r)
            best = min(r["by_splits_us"].items(), key=lambda t: t[1])
            print(f"B={batch:3d} ctx {ctx:6d} splits {splits:2d}  floor {r['floor_us']:8.2f} us  unsplit "
                  f"{r['unsplit_us']:8.2f}  split {r['split_us']:8.2f}  x{r['speedup']:.2f}  best {best[0]}: "
                  f"{best[1]:.2f}", flush=True)
            args.out.write_text(json.dumps(res, indent=1))
            del caches
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
