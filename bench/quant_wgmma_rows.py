"""The many-row asynchronous-dot 4-bit kernel (`kernels.quant_wgmma_rows`, an experiment: not picked) against
pick_config's choice (the tiles below 256 rows) and the bfloat16 GEMM on the 8B layer shapes, groups of 128, bf16
x: per shape and row count each tile / ring of the kernel with its error against the fp32 reference, and per row
count a layer (q/k/v + o + gate/up + down) with the best of each. Counted first, per case: the 4-bit weight's
bytes (words, scales, offsets) over the measured copy bandwidth and the multiply-adds over the measured bf16 GEMM
rate (an 8192^3 matmul); the larger is the case's floor. Weights rotate through more than the L2 holds; CUDA
graphs, median of replays.

    python3 bench/quant_wgmma_rows.py --rows 64,128,192,255 --out bench/results/quant_wgmma_rows.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels.quant_dequant import dequantize_packed  # noqa: E402
from kernels.quant_matmul import half_sums, pick_config, quant_matmul  # noqa: E402
from kernels.quant_wgmma_rows import quant_wgmma_rows  # noqa: E402
from multi_lora import copy_bandwidth  # noqa: E402  (bench helpers)
from quant_async_dots import SHAPES, rotating_weights  # noqa: E402
from quant_kernel_sweep import graph_us  # noqa: E402

# rows, features, ring, half blocks a loop step (U: each step ends with its dots complete, so 4 lets 3 of its 4
# halves' unpacking overlap the dot before them where 2 lets 1 of 2), split-K; no 256 rows with a ring of 4 (more
# shared memory than an SM has), U = 4 or a split (they were the slowest tiles already); a split of 4 only on
# 64-row tiles (the 128-row ones spill summing 4 partials)
CONFIGS = [(bm, bn, nx, u, split) for bm in (64, 128, 256) for bn in (64, 128) for nx in (3, 4) for u in (2, 4)
           for split in (1, 2, 4)
           if not (bm == 256 and (nx == 4 or u == 4 or split > 1)) and not (split == 4 and bm > 64)]


def gemm_rate(dev: torch.device, n: int = 8192) -> float:
    """Multiply-adds x 2 a second of a bf16 [n, n] x [n, n] matmul (CUDA graph, median of replays)."""
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    return 2 * n**3 / (graph_us([lambda: torch.matmul(a, a)]) * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,128,192,255")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(dev), "commit": args.commit, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "date": datetime.now(timezone.utc).isoformat(), "cases": {},
           "layer_us": {}}
    rows = [int(r) for r in args.rows.split(",")]
    bw = res["copy_bandwidth_Bps"] = copy_bandwidth(dev, 2**31)
    flops = res["bf16_gemm_flops"] = gemm_rate(dev)
    print(f"copy {bw / 1e12:.2f} TB/s (read + written), bf16 GEMM {flops / 1e12:.0f} TFLOP/s", flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = rotating_weights(n, k, gen)
        dense = [torch.empty(n, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]     # 2 x >= 32 MB
        for d in dense:
            dequantize_packed(ws[0], d)
        want_w = dense[0].float()
        for t in rows:
            x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
            xs = half_sums(x)
            want = x.float() @ want_w.t()
            outs = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            part = torch.empty(16 * t * n, device=dev)
            locks = torch.zeros(8192, dtype=torch.int32, device=dev)
            cfg = pick_config(t, n, k, 4, sms, 128, async_dots=True)
            quant_matmul(x, ws[0], None, outs[0], cfg, part, locks, x_sums=xs)
            nbytes = ws[0].nbytes
            floor = max(nbytes / bw * 1e6, 2 * t * n * k / flops * 1e6)
            r = {"bytes": nbytes, "flop": 2 * t * n * k, "floor_us": floor,
                 "pick": [cfg.block_n, cfg.block_m, cfg.split_k, cfg.ring, cfg.ring_step],
                 "pick_err": ((outs[0].float() - want).norm() / want.norm()).item(),
                 "pick_us": graph_us([lambda w=w, o=outs[i % 2]: quant_matmul(x, w, None, o, cfg, part, locks,
                                                                               x_sums=xs) for i, w in enumerate(ws)]),
                 "bf16_us": graph_us([lambda d=d, o=outs[i % 2]: torch.matmul(x, d.t(), out=o)
                                      for i, d in enumerate(dense)]),
                 "tried": []}
            for bm, bn, nx, u, split in CONFIGS:
                tiles = -(-t // bm) * -(-n // bn)
                if bm > 2 * t or k % (128 * u * split) or split > 1 and tiles >= 2 * sms:   # a split where the
                    continue                                                                 # tiles leave SMs idle
                case = dict(bm=bm, bn=bn, nx=nx, u=u, split=split)
                t0 = time.time()
                try:
                    quant_wgmma_rows(x, ws[0], None, outs[0], bm, bn, nx, u, split, part, locks)
                    torch.cuda.synchronize()
                    err = ((outs[0].float() - want).norm() / want.norm()).item()
                    us = graph_us([lambda w=w, o=outs[i % 2]: quant_wgmma_rows(x, w, None, o, bm, bn, nx, u, split,
                                                                               part, locks)
                                   for i, w in enumerate(ws)])
                except Exception as e:  # noqa: BLE001  a configuration that does not compile: recorded
                    r["tried"].append(dict(case, failed=repr(e)[:300]))
                    continue
                r["tried"].append(dict(case, us=us, err=err, first_call_s=time.time() - t0))
            ok = [c for c in r["tried"] if "us" in c and c["err"] < 1e-2]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            r["best"] = best
            bad = [c for c in r["tried"] if "failed" in c or c.get("err", 0) >= 1e-2]
            print(f"{name:8s} T={t:3d} floor {floor:6.1f} us | pick {r['pick']} {r['pick_us']:6.1f} us "
                  f"(err {r['pick_err']:.1e}) | bf16 "
                  f"{r['bf16_us']:6.1f} us | rows kernel "
                  + (f"{best['us']:6.1f} us (tile {best['bn']}x{best['bm']} ring {best['nx']} step {best['u']} "
                     f"split {best['split']}, err {best['err']:.1e})"
                     if best else "none correct")
                  + (f" | {len(bad)} failed or wrong, e.g. {bad[0]}" if bad else ""), flush=True)
            res["cases"][f"{name}/{t}"] = r
        del ws, dense
    for t in rows:
        cases = [res["cases"].get(f"{name}/{t}") for name in SHAPES]
        if all(cases):
            layer = {key: sum(c[key] for c in cases) for key in ("floor_us", "pick_us", "bf16_us")}
            if all(c["best"] for c in cases):
                layer["rows_us"] = sum(c["best"]["us"] for c in cases)
            res["layer_us"][str(t)] = layer
            print(f"layer T={t:3d} " + " | ".join(f"{k} {v:6.1f}" for k, v in layer.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
