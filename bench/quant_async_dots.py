"""The asynchronous-dot 4-bit tiles (`kernels.quant_wgmma`, an experiment) against pick_config's tiles
(`kernels.quant_matmul`) on the 8B layer shapes, groups of 128, bf16 x, both given the sums of x: per shape and row
count, pick_config's time and error without and with `async_dots` (the kernel's rule), then each tile / split /
ring / step of the kernel as measured so far (64 features, SYNC 0), and its best three again with the other
half-block synchronisations (`--syncs`) and on two warpgroups (128 features); each with its
error against the fp32 reference (split-K summed in order). Weights rotate
through more than the L2 holds; CUDA graphs, median of replays.

    python3 bench/quant_async_dots.py --rows 16,32,64 --out bench/results/quant_async_dots.json
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
from kernels.quant_wgmma import quant_wgmma  # noqa: E402
from quant_kernel_sweep import SHAPES_8B as SHAPES, graph_us, packed_copies  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--commit", default="")
    ap.add_argument("--syncs", default="0,1,2", help="the half-block synchronisations the best configs are tried with "
                    "(the kernel's SYNC: 0 as measured so far, 1 barrier before fence, 2 and the early refill)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(dev), "commit": args.commit, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "date": datetime.now(timezone.utc).isoformat(), "cases": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = packed_copies(n, k, 128, gen)
        w0 = torch.empty(n, k, device=dev)
        dequantize_packed(ws[0], w0)
        for t in (int(r) for r in args.rows.split(",")):
            x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
            xs = half_sums(x)
            want = x.float() @ w0.t()
            outs = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            part = torch.empty(16 * t * n, device=dev)
            locks = torch.zeros(4096, dtype=torch.int32, device=dev)
            r = {}
            for key, on in (("pick", False), ("pick_async", True)):
                cfg = pick_config(t, n, k, 4, 132, 128, async_dots=on)
                quant_matmul(x, ws[0], None, outs[0], cfg, part, locks, x_sums=xs)
                r[key] = [cfg.block_n, cfg.block_m, cfg.split_k, cfg.ring, cfg.ring_step]
                r[f"{key}_err"] = ((outs[0].float() - want).norm() / want.norm()).item()
                r[f"{key}_us"] = graph_us([lambda w=w, o=outs[i % 2], c=cfg: quant_matmul(x, w, None, o, c, part, locks,
                                                                                         x_sums=xs)
                                           for i, w in enumerate(ws)])
            r["tried"] = []

            def run(case: dict) -> None:
                """Times one configuration of the kernel into r["tried"] (or records why it failed)."""
                bn, bm, split, nx, u, sync = (case[key] for key in ("bn", "bm", "split", "nx", "u", "sync"))
                t0 = time.time()
                try:
                    quant_wgmma(x, ws[0], None, outs[0], xs, bm, split, nx, u, part, locks, bn, sync)
                    torch.cuda.synchronize()
                    err = ((outs[0].float() - want).norm() / want.norm()).item()
                    us = graph_us([lambda w=w, o=outs[i % 2]: quant_wgmma(x, w, None, o, xs, bm, split, nx, u, part,
                                                                         locks, bn, sync)
                                   for i, w in enumerate(ws)])
                except Exception as e:  # noqa: BLE001  a configuration that does not compile: recorded
                    r["tried"].append(dict(case, failed=repr(e)[:300]))
                    return
                r["tried"].append(dict(case, us=us, err=err, first_call_s=time.time() - t0))

            # every tile / split / ring of one warpgroup as measured so far (SYNC 0), then the best three of
            # those with the other synchronisations and on two warpgroups (each program a distinct compile: the
            # full product would take ~10x as long)
            tiles = sorted({min(32, max(16, t)), 16} | ({64} if t >= 64 else set()) | ({8} if t <= 8 else set()))
            for bm, split, (nx, u) in [(bm, sp, ring) for bm in tiles for sp in (1, 2, 4) + ((8,) if k >= 8192 else ())
                                       for ring in ((4, 4), (6, 2), (8, 2))]:
                if (k // 128) % (u * split) == 0:
                    run(dict(bn=64, bm=bm, split=split, nx=nx, u=u, sync=0))
            base = sorted((c for c in r["tried"] if "us" in c and c["err"] < 1e-2), key=lambda c: c["us"])[:3]
            syncs = [int(v) for v in args.syncs.split(",")]
            for c in base:
                for bn in (64, 128):
                    for sync in syncs:
                        if bn != 64 or sync != 0:
                            run(dict(bn=bn, bm=c["bm"], split=c["split"], nx=c["nx"], u=c["u"], sync=sync))
            ok = [c for c in r["tried"] if "us" in c and c["err"] < 1e-2]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            bad = [c for c in r["tried"] if "failed" in c or c.get("err", 0) >= 1e-2]
            print(f"{name:8s} T={t:3d} pick {r['pick']} {r['pick_us']:6.1f} us | with async dots {r['pick_async']} "
                  f"{r['pick_async_us']:6.1f} us (err {r['pick_async_err']:.1e}) | best "
                  + (f"{best['us']:6.1f} us (tile {best['bn']}x{best['bm']} split {best['split']} ring "
                     f"{best['nx']} step {best['u']} sync {best['sync']})" if best else "none correct")
                  + "".join(f" | best of {bn} features {min(c['us'] for c in ok if c['bn'] == bn):6.1f} us"
                            for bn in (64, 128) if any(c["bn"] == bn for c in ok))
                  + "".join(f" | best sync {v} {min(c['us'] for c in ok if c['sync'] == v):6.1f} us"
                            for v in (0, 1, 2) if any(c["sync"] == v for c in ok))
                  + (f" | {len(bad)} failed or wrong, e.g. {bad[0]}" if bad else ""), flush=True)
            res["cases"][f"{name}/{t}"] = r
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
