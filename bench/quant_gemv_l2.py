"""How much faster the 4-bit projections run with their weight already in the L2 cache: pick_config's launch on the
8B shapes (and half of gate/up, which alone fits the 50 MB L2) at 1 and 8 rows, over weight copies past the L2
("cold", as a decode step reads them) against one copy called again and again ("hot"). What prefetching the next
projection's weight into L2 while the small kernels run could buy at most.

    python3 bench/quant_gemv_l2.py --commit "$(git rev-parse --short HEAD)" --out bench/results/quant_gemv_l2.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels.quant_matmul import pick_config, quant_matmul  # noqa: E402
from quant_kernel_sweep import SHAPES_8B, graph_us, packed_copies  # noqa: E402
from run_header import gpu_run_header  # noqa: E402  (bench helpers)

SHAPES = {**SHAPES_8B, "gate_up_half": (14336, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--rows", default="1,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = {**gpu_run_header(dev, args.commit), "group_size": 128, "cases": {}}
    for name, (n, k) in SHAPES.items():
        ws = packed_copies(n, k, 128, gen)
        for t in (int(r) for r in args.rows.split(",")):
            x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
            cfg = pick_config(t, n, k, 4, torch.cuda.get_device_properties(dev).multi_processor_count, 128)
            outs = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            part = torch.empty(cfg.split_k * t * n, device=dev)
            locks = torch.zeros(4096, dtype=torch.int32, device=dev)
            cold = graph_us([lambda w=w, i=i: quant_matmul(x, w, None, outs[i % 2], cfg, part, locks)
                             for i, w in enumerate(ws)])
            hot = graph_us([lambda w=ws[0], i=i: quant_matmul(x, w, None, outs[i % 2], cfg, part, locks)
                            for i in range(len(ws))])
            res["cases"][f"{name}/{t}"] = dict(cold_us=cold, hot_us=hot, weight_mb=ws[0].nbytes / 1e6)
            print(f"{name:12s} T={t} {ws[0].nbytes / 1e6:6.1f} MB cold {cold:6.2f} hot {hot:6.2f} us", flush=True)
            args.out.write_text(json.dumps(res, indent=1))
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
