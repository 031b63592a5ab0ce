"""One-row dense matmul (batch-1 decode): `kernels.dense_gemv` against the library GEMM (`F.linear`), per
weight shape of the 8B model and the default SmolLM2 (projections and LM head), bf16.

Each time is a CUDA graph of calls over enough weight copies to exceed the L2 cache (median of replays),
against the floor: weight bytes over the measured copy bandwidth (read + write of a 2 GiB copy, as bench/multi_lora.py). The
picked config (`pick_gemv_config`) and a few alternatives are timed; every output is checked against
the fp32 product.

    python3 bench/dense_gemv.py --commit "$(git rev-parse --short HEAD)" --out bench/results/dense_gemv.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_header import gpu_run_header  # noqa: E402  (bench helpers)
from quant_kernel_sweep import graph_us  # noqa: E402
from compute_service.engine.linear import GEMV_MIN_ELEMENTS, GEMV_MIN_IN_FEATURES  # noqa: E402
from kernels.dense_gemv import DenseGemvConfig, dense_gemv, pick_gemv_config  # noqa: E402

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
          "8b_lm_head": (128256, 4096),
          "smol_qkv": (960, 576), "smol_o": (576, 576), "smol_gate_up": (3072, 576), "smol_down": (576, 1536),
          "smol_lm_head": (49152, 576)}
ALTERNATIVES = [DenseGemvConfig(16, 512, 8), DenseGemvConfig(16, 256, 4), DenseGemvConfig(32, 256, 4),
                DenseGemvConfig(16, 512, 4), DenseGemvConfig(8, 512, 4), DenseGemvConfig(32, 512, 8)]
SPAN = 200 * 2**20          # bytes of weight copies per graph: beyond the L2 cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = {**gpu_run_header(dev, args.commit), "gemv_min_elements": GEMV_MIN_ELEMENTS,
                 "gemv_min_in_features": GEMV_MIN_IN_FEATURES, "shapes": {}}
    bw = res["copy_bandwidth_Bps"]
    for name, (n, k) in SHAPES.items():
        ws = []
        while sum(w.nbytes for w in ws) < SPAN:
            ws.append(torch.randn(n, k, device=dev, generator=gen).mul_(0.02).to(torch.bfloat16))
        x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        want = x.float() @ ws[0].float().t()
        outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        floor_us = n * k * 2 / bw * 1e6
        r: dict = {"n": n, "k": k, "floor_us": floor_us,
                   "library_us": graph_us([lambda w=w: F.linear(x, w) for w in ws])}
        picked = pick_gemv_config(n, k)
        configs: dict = {}
        for cfg in [picked] + [c for c in ALTERNATIVES if c != picked]:
            dense_gemv(x, ws[0], None, outs[0], cfg)
            err = ((outs[0].float() - want).norm() / want.norm()).item()
            if err > 1e-2:
                raise AssertionError(f"{name} {cfg}: rel err {err}")
            us = graph_us([lambda w=w, i=i: dense_gemv(x, w, None, outs[i % 2], cfg) for i, w in enumerate(ws)])
            configs[f"{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}"] = us
        r["gemv_us"] = configs[f"{picked.block_n}x{picked.block_k}w{picked.num_warps}"]
        r["picked"] = f"{picked.block_n}x{picked.block_k}w{picked.num_warps}"
        r["configs_us"] = configs
        r["library_over_floor"] = r["library_us"] / floor_us
        r["gemv_over_floor"] = r["gemv_us"] / floor_us
        r["gemv_speedup"] = r["library_us"] / r["gemv_us"]
        r["gemv_used"] = n * k >= GEMV_MIN_ELEMENTS and k >= GEMV_MIN_IN_FEATURES
        res["shapes"][name] = r
        print(f"{name:14s} floor {floor_us:7.2f} us  library {r['library_us']:7.2f} ({r['library_over_floor']:.2f}x)"
              f"  gemv {r['gemv_us']:7.2f} ({r['gemv_over_floor']:.2f}x) {r['picked']}  best "
              f"{min(configs.items(), key=lambda t: t[1])}", flush=True)
        del ws
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
