"""What the split-K reduction costs the one-row 4-bit launches (batch 1). pick_config's one-row launch on each 8B
shape, after an RMSNorm launch that writes its x (as in a decode step; the norm's own time taken off), summing its
partials in the launch against the same launch leaving them to the next kernel (`defer_split=True`, what the
engine runs since 6714be1: every program stores its partial, no counter, fences or read-back; kernels/split_sum.py).
The difference is what the deferral saves the projection; what the reading kernel pays for the partials is not in it
(the engine A/B is: bench/results/split_defer_ab.json). The deferred partials are checked against the summed output.

    python3 bench/quant_split_cost.py --commit "$(git rev-parse --short HEAD)" --out bench/results/quant_split_cost.json
    TRITON_INTERPRET=1 python3 bench/quant_split_cost.py --smoke --out s.json      # CPU: checks the script
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels.quant_matmul import QuantMatmulConfig, launch_split, pick_config, quant_matmul  # noqa: E402
from kernels.rms_norm import add_rms_norm  # noqa: E402
from kernels.split_sum import SplitSum  # noqa: E402
from quant_kernel_sweep import EPS, SHAPES_8B, SPAN, graph_us, packed_copies, wall_us  # noqa: E402
from run_header import gpu_run_header  # noqa: E402  (bench helpers)

LAYERS = 32         # the 8B's layers: a token's saving is this many times a layer's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape split 2 in the CPU interpreter, timed plainly")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {"smoke": (256, 1024)} if args.smoke else SHAPES_8B
    time_us = wall_us if args.smoke else graph_us
    res: dict = ({"device": "cpu (smoke)", "commit": args.commit} if args.smoke else gpu_run_header(dev, args.commit))
    res.update(rows=1, layers=LAYERS, cases={})
    sms = 132 if args.smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    layer = {"reduced_us": 0.0, "unreduced_us": 0.0}
    for name, (n, k) in shapes.items():
        ws = packed_copies(n, k, 128, gen, 1 if args.smoke else SPAN)
        cfg = QuantMatmulConfig(64, 1, 2) if args.smoke else pick_config(1, n, k, 4, sms, 128)
        src = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        norm_w = torch.ones(k, device=dev, dtype=torch.bfloat16)
        x = torch.empty_like(src)
        outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        split = launch_split(cfg, ws[0])
        parts = [torch.empty(split, 1, n, device=dev) for _ in range(2)]
        locks = torch.zeros(4096, dtype=torch.int32, device=dev)

        def norm() -> None:
            add_rms_norm(src, None, norm_w, EPS, x)

        def pairs(defer: bool, ws=ws) -> list:
            return [lambda w=w, i=i: (norm(), quant_matmul(x, w, None, outs[i % 2], cfg, parts[i % 2], locks,
                                                           defer_split=defer))
                    for i, w in enumerate(ws)]
        norm_us = time_us([norm] * len(ws))
        reduced = time_us(pairs(False)) - norm_us
        want = outs[(len(ws) - 1) % 2].clone()          # the last call's output, summed in the launch
        unreduced_us = time_us(pairs(True)) - norm_us
        got = SplitSum(parts[(len(ws) - 1) % 2], want.dtype).materialize()
        # bit for bit on the GPU; the interpreter rounds float32 to bfloat16 its own way (the smoke run: close)
        same = torch.equal(got, want) if not args.smoke else torch.allclose(got.float(), want.float(), rtol=1e-2)
        if split > 1 and not same:
            raise RuntimeError(f"{name}: the deferred partials do not sum to the output")
        # unreduced_us: the launch with its partials left to the next kernel (the key as in earlier results)
        res["cases"][name] = dict(config=[cfg.block_n, cfg.split_k, cfg.tma_stages], norm_us=norm_us,
                                  reduced_us=reduced, unreduced_us=unreduced_us, saving_us=reduced - unreduced_us)
        layer["reduced_us"] += reduced
        layer["unreduced_us"] += unreduced_us
        print(f"{name:8s} split {split:2d} summed {reduced:6.2f} deferred {unreduced_us:6.2f} us", flush=True)
        del ws
    layer["saving_ms_a_token"] = (layer["reduced_us"] - layer["unreduced_us"]) * LAYERS / 1e3
    res["layer"] = layer
    print(f"a layer: {layer['reduced_us']:.1f} -> {layer['unreduced_us']:.1f} us; at most "
          f"{layer['saving_ms_a_token']:.3f} ms a token", flush=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
