"""The one-row 4-bit product with warp roles (`bench/quant_ws_kernels.py`) against the engine's one-row kernel
(pick_config's choice, its split partials left for the next kernel, as the engine launches it) on the 8B's
projections, and loads alone on the engine's grid (`loads_kernel`): how fast each structure streams the words and
what the arithmetic adds to it.

    python3 bench/quant_ws_probe.py --commit "$(git rev-parse --short HEAD)" --out bench/results/quant_ws_probe.json \
        [--shapes gate_up,down] [--quick]

Each figure is the median of CUDA-graph replays over packed random weights (groups of 128) whose copies span
160 MB, so each launch reads its words from memory, not the L2; `engine_us` is taken before and after the sweeps.
Each warp-role config also runs with COMPUTE off (`loads_us`: the same copies, no arithmetic) and its result is
checked against the fp32 product of the dequantized weight (`err`, relative; the float16-pairs rounding gives
~2.5e-3). Needs an sm_90+ GPU: the warp-role kernels are compiled only (tests/bench/test_quant_ws_probe.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.quant_kernel_sweep import SHAPES_8B, graph_us, packed_copies  # noqa: E402
from kernels.quant_dequant import dequantize_packed  # noqa: E402
from kernels.quant_matmul import pick_config, quant_matmul  # noqa: E402
from run_header import gpu_run_header  # noqa: E402

SMEM = 224 * 1024       # shared memory a config may take per SM (the H100/H200's 227 KB, less a margin)
SLOT = 17 * 1024        # one 32-word block of 128 rows, with its scales and offsets


def tma_launch(x, w, part, split, stages, programs, warps=4, maxnreg=128, compute=True, rot=0, sub=1) -> None:
    """`ws_tma_kernel` on x (bf16 [K]) and w (4 bits, groups of 128) into part (fp32 [split, N])."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from quant_ws_kernels import ws_tma_kernel
    n, nb, bn = w.words.shape[0], w.words.shape[1] // 32, 128
    w_sh = gl.NVMMASharedLayout(swizzle_byte_width=128 if sub == 1 else 0, element_bitwidth=32, rank=2)
    s_sh = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    w_desc = TensorDescriptor.from_tensor(w.words, [bn, 32 * sub], w_sh)
    s_desc = TensorDescriptor.from_tensor(w.scales, [2 * sub, bn], s_sh)
    o_desc = TensorDescriptor.from_tensor(w.offsets, [2 * sub, bn], s_sh)
    units = n // bn * split
    ws_tma_kernel[(min(programs, units),)](x, w_desc, s_desc, o_desc, part, n, units, split, nb // split, bn, stages,
                                          compute, rot, num_warps=warps, maxnreg=maxnreg)


def regs_launch(x, w, part, split, stages, programs, ahead=1, compute=True) -> None:
    """`ws_regs_kernel` (four copy warps of 96 registers beside four compute warps)."""
    from quant_ws_kernels import ws_regs_kernel
    n, nb, bn = w.words.shape[0], w.words.shape[1] // 32, 128
    units = n // bn * split
    ws_regs_kernel[(min(programs, units),)](x, w.words, w.scales, w.offsets, part, n, units, split, nb // split,
                                           w.words.shape[1], bn, stages, compute, ahead, 96, num_warps=4,
                                           maxnreg=128)


def tma_configs(nb: int, tiles: int, quick: bool) -> list[dict]:
    out = []
    for split, stages, programs, sub, rot in itertools.product((1, 2, 4, 7, 8, 14), (2, 3, 4), (132, 264, 396),
                                                              (1, 2, 4), (0, 1)):
        if nb % split or (nb // split) % sub or tiles * split < 128 or programs // 132 * stages * sub * SLOT > SMEM:
            continue
        if quick and (sub > 1 or rot or stages > 3):
            continue
        out.append(dict(split=split, stages=stages, programs=programs, sub=sub, rot=rot))
    return out


def regs_configs(nb: int, tiles: int) -> list[dict]:
    return [dict(split=split, stages=stages, programs=programs, ahead=ahead)
            for split, stages, programs, ahead in itertools.product((2, 4, 7, 8, 14), (2, 3, 4), (264, 396), (0, 1))
            if nb % split == 0 and tiles * split >= 128 and programs // 132 * stages * SLOT <= SMEM]


def sweep(kind: str, launch, configs: list[dict], x, ws, want) -> list[dict]:
    n = ws[0].words.shape[0]
    found = []
    for cfg in configs:
        part = torch.zeros(cfg["split"], n, device=x.device)
        try:
            launch(x, ws[0], part, **cfg)
            torch.cuda.synchronize()
            err = ((part.sum(0) - want).norm() / want.norm()).item()
            us = graph_us([lambda w=w: launch(x, w, part, **cfg) for w in ws])
            loads = graph_us([lambda w=w: launch(x, w, part, compute=False, **cfg) for w in ws])
        except Exception as e:  # noqa: BLE001  a config the compiler refuses: reported, skipped
            print(f"  {kind} {cfg} failed: {e!r}"[:300], flush=True)
            continue
        found.append(dict(cfg, us=us, loads_us=loads, err=err))
    found.sort(key=lambda c: c["us"])
    for c in found[:3]:
        print(f"  {kind} {c}", flush=True)
    return found


def loads_alone(ws, quick: bool) -> list[dict]:
    from quant_ws_kernels import loads_kernel
    n, nb = ws[0].words.shape[0], ws[0].words.shape[1] // 32
    out = torch.empty(n, dtype=torch.int32, device=ws[0].words.device)
    rows = []
    for bn, split, stages, warps in itertools.product((64, 128), (1, 2, 4, 7, 8, 14), (1, 2, 3), (4, 8)):
        if nb % split or (quick and warps == 4):
            continue
        us = graph_us([lambda w=w: loads_kernel[(n // bn, split)](w.words, out, w.words.shape[1], nb // split, bn,
                                                                  stages, num_warps=warps) for w in ws])
        rows.append(dict(block_n=bn, split=split, stages=stages, warps=warps, us=us))
    rows.sort(key=lambda r: r["us"])
    print(f"  loads alone {rows[0]}", flush=True)
    return rows


def compile_sm90(kind: str, sub: int = 1) -> str:
    """The PTX of `ws_tma_kernel` (kind "tma", SUB-block boxes) or `ws_regs_kernel` ("regs") for sm_90, compiled
    with no GPU (the interpreter does not run them; TRITON_INTERPRET must be unset)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    import quant_ws_kernels as qk
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", "part_ptr": "*fp32"}
    if kind == "tma":
        fn, consts = qk.ws_tma_kernel, dict(BN=128, STAGES=3, COMPUTE=True, ROT=1, num_warps=4)
        w_sh = gl.NVMMASharedLayout(swizzle_byte_width=128 if sub == 1 else 0, element_bitwidth=32, rank=2)
        s_sh = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        s_ty = f"tensordesc<fp16[{2 * sub},128],{s_sh!r}>"
        ptrs.update(w_desc=f"tensordesc<i32[128,{32 * sub}],{w_sh!r}>", s_desc=s_ty, o_desc=s_ty)
    else:
        fn, consts = qk.ws_regs_kernel, dict(BN=128, STAGES=3, COMPUTE=True, AHEAD=1, COPY_REGS=96, num_warps=4)
    params = list(fn.arg_names)
    sig = {p: "constexpr" if p in consts else ptrs.get(p, "i32") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p.endswith("_ptr") or p == "N"}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(params.index(p),): v for p, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 128}).asm["ptx"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", choices=("tma", "regs"), help="write that kernel's sm_90 PTX to --out and stop "
                    "(no GPU needed)")
    ap.add_argument("--sub", type=int, default=1, help="with --compile-only tma: blocks a box")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--quick", action="store_true", help="fewer configs (one-block boxes, 2-3 stages)")
    ap.add_argument("--commit", default="", help="the commit measured, for the JSON (given, not looked up: a copy "
                    "of the tree run elsewhere may carry another commit's git state)")
    args = ap.parse_args()
    if args.compile_only:
        args.out.write_text(compile_sm90(args.compile_only, args.sub))
        return
    dev = torch.device("cuda")
    res = {**gpu_run_header(dev, args.commit), "cases": {}}
    gen = torch.Generator(device=dev).manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES_8B[name]
        ws = packed_copies(n, k, 128, gen)
        x = torch.randn(k, device=dev, generator=gen).to(torch.bfloat16)
        w0 = torch.empty(n, k, device=dev)
        dequantize_packed(ws[0], w0)
        want = x.float() @ w0.t()
        pc = pick_config(1, n, k, 4, torch.cuda.get_device_properties(dev).multi_processor_count, 128)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        part = torch.empty(pc.split_k * n, device=dev)
        locks = torch.zeros(65536, dtype=torch.int32, device=dev)
        engine = [lambda w=w: quant_matmul(x[None], w, None, out, pc, part, locks, defer_split=True) for w in ws]
        r = {"pick_config": str(pc), "copies": len(ws), "engine_us": [graph_us(engine) for _ in range(2)]}
        print(f"{name}: engine {r['engine_us']}", flush=True)
        nb, tiles = k // 256, n // 128
        r["loads_alone"] = loads_alone(ws, args.quick)
        r["tma"] = sweep("tma", tma_launch, tma_configs(nb, tiles, args.quick), x, ws, want)
        r["regs"] = [] if args.quick else sweep("regs", regs_launch, regs_configs(nb, tiles), x, ws, want)
        r["engine_us"] += [graph_us(engine) for _ in range(2)]
        r["summary"] = {"engine_us": min(r["engine_us"]), "loads_alone_us": r["loads_alone"][0]["us"],
                        "tma_us": r["tma"][0]["us"] if r["tma"] else None,
                        "tma_loads_us": min(c["loads_us"] for c in r["tma"]) if r["tma"] else None,
                        "regs_us": r["regs"][0]["us"] if r["regs"] else None,
                        "regs_loads_us": min(c["loads_us"] for c in r["regs"]) if r["regs"] else None,
                        "max_err": max(c["err"] for c in r["tma"] + r["regs"])}
        print(f"{name}: {r['summary']}", flush=True)
        res["cases"][name] = r
        args.out.write_text(json.dumps(res, indent=1))
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
