"""What the split-K reduction costs the one-row 4-bit launches (batch 1). pick_config's one-row launch on each 8B
shape, after an RMSNorm launch that writes its x (as in a decode step; the norm's own time taken off), against the
same launch with no reduction at all: the same grid, every program storing its partial sum straight into the output
(a wrong result, timed only). The split programs' counter, GPU-scope fences and the last program's reads of the
partials are what the difference holds: what summing the partials in the next kernel instead (the norm, RoPE or the
SwiGLU reading the few partial rows in a fixed order) could save a projection at most.

    python3 bench/quant_split_cost.py --commit "$(git rev-parse --short HEAD)" --out bench/results/quant_split_cost.json
    TRITON_INTERPRET=1 python3 bench/quant_split_cost.py --smoke --out s.json      # CPU: checks the script
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels.quant_matmul as qm  # noqa: E402
from kernels.quant_matmul import QuantMatmulConfig, pick_config, quant_matmul  # noqa: E402
from kernels.rms_norm import add_rms_norm  # noqa: E402
from quant_kernel_sweep import EPS, SHAPES_8B, SPAN, graph_us, packed_copies, wall_us  # noqa: E402
from run_header import gpu_run_header  # noqa: E402  (bench helpers)

LAYERS = 32         # the 8B's layers: a token's saving is this many times a layer's


class _Unreduced:
    """A one-row kernel whose launches run with SPLIT off on the same grid (each program stores its own sum)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kw: launch(*args, **{**kw, "SPLIT": False})


@contextlib.contextmanager
def unreduced():
    """quant_matmul's one-row launches without their split-K reduction while inside."""
    saved = qm.quant_gemv_kernel, qm.quant_gemv_tma_kernel
    qm.quant_gemv_kernel, qm.quant_gemv_tma_kernel = _Unreduced(saved[0]), _Unreduced(saved[1])
    try:
        yield
    finally:
        qm.quant_gemv_kernel, qm.quant_gemv_tma_kernel = saved


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
        part = torch.empty(cfg.split_k * n, device=dev)
        locks = torch.zeros(4096, dtype=torch.int32, device=dev)

        def norm() -> None:
            add_rms_norm(src, None, norm_w, EPS, x)

        def pairs(ws=ws) -> list:
            return [lambda w=w, o=outs[i % 2]: (norm(), quant_matmul(x, w, None, o, cfg, part, locks))
                    for i, w in enumerate(ws)]
        norm_us = time_us([norm] * len(ws))
        reduced = time_us(pairs()) - norm_us
        want = outs[(len(ws) - 1) % 2].clone()          # the last call's output, reduced
        with unreduced():
            unreduced_us = time_us(pairs()) - norm_us
        if cfg.split_k > 1 and torch.equal(outs[(len(ws) - 1) % 2], want):
            raise RuntimeError(f"{name}: the unreduced launch wrote the reduced output (was the reduction skipped?)")
        res["cases"][name] = dict(config=[cfg.block_n, cfg.split_k, cfg.tma_stages], norm_us=norm_us,
                                  reduced_us=reduced, unreduced_us=unreduced_us, saving_us=reduced - unreduced_us)
        layer["reduced_us"] += reduced
        layer["unreduced_us"] += unreduced_us
        print(f"{name:8s} split {cfg.split_k:2d} reduced {reduced:6.2f} unreduced {unreduced_us:6.2f} us", flush=True)
        del ws
    layer["saving_ms_a_token"] = (layer["reduced_us"] - layer["unreduced_us"]) * LAYERS / 1e3
    res["layer"] = layer
    print(f"a layer: {layer['reduced_us']:.1f} -> {layer['unreduced_us']:.1f} us; at most "
          f"{layer['saving_ms_a_token']:.3f} ms a token", flush=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
