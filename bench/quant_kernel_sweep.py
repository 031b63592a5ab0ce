"""Tile / split / path sweep of the quantized matmul kernels against bf16 `F.linear`, per layer shape and row
count, for choosing `pick_config` (the 8B layer shapes at group 128, the default SmolLM2's at group 32).

Each time is a CUDA graph of calls over enough weight copies to exceed the L2 cache (median of replays).
Every config's output is checked against dequantize-then-matmul in fp32 (rel err < 1e-2).

    python3 bench/quant_kernel_sweep.py --out sweep.json [--only smol]
    python3 bench/quant_kernel_sweep.py --out ab.json --only 8b --rows 1 --compare candidate/quant_gemv.py
    python3 bench/quant_kernel_sweep.py --out ab.json --only 8b --rows 8,16,32,64 --compare old/quant_matmul.py \
        --picked-only       # pick_config's choice alone, before and after
    (the candidate is timed before and after the tree's configs, old_us the better of the two, old_err its error)
    python3 bench/quant_kernel_sweep.py --out big.json --only 8b --rows 96,128,192,256   # where dense takes over
    python3 bench/quant_kernel_sweep.py --out g32.json --only 8b --group-size 32     # an 8B's Q4_0 / Q4_K GGUF
    python3 bench/quant_kernel_sweep.py --out tma.json --only 8b --rows 1 --tma   # the TMA-read one-row kernel
    python3 bench/quant_kernel_sweep.py --out tt.json --only 8b --rows 32,64,128 --tma   # the TMA-read tiles
    python3 bench/quant_kernel_sweep.py --out w.json --only 8b --rows 64,128,256,512 --wide   # 128/256-row rings
    python3 bench/quant_kernel_sweep.py --out a.json --only 8b --rows 64,128,256 --wide --after-norm   # below
    python3 bench/quant_kernel_sweep.py --out d.json --only 8b --rows 1 --defer   # one row as the engine runs it
    TRITON_INTERPRET=1 python3 bench/quant_kernel_sweep.py --out s.json --smoke [--after-norm] [--defer]   # CPU

With --after-norm each launch follows an RMSNorm launch that writes its x (and, where the config reads them, x's
slice sums, as the engine's norms and SwiGLU do), and a config's time is that pair's less the norm's alone: a
kernel that copies weights before its wait then overlaps a short kernel, as in a decode step, not a launch of
itself (docs/quantization-performance.md, "Tried at 32-256 rows"); without it the pair-codes tiles' times include
their own launch for the sums. (The bf16, dense-path and --compare figures stay plain launches either way.)

With --defer (one row; implies --after-norm) every launch that splits K leaves its partials (`defer_split`, as the
engine's projections do) and a reader sums them after it, as in a decode step: SwiGLU (`kernels.silu_mul`) after
q/k/v and gate/up, the norm after o and down; a config's time is then norm + projection + reader less the norm
alone and the reader alone on a plain output (`reader_us`), i.e. the projection and what its partials add to the
reader. Its configs (`defer_configs`) are the register-set kernel and the TMA-read kernel over features, splits and
stages, since their split rule was swept with the sum inside the launch.

Each config is recorded as [block_n, block_m, split_k, num_warps, field_dots, num_stages], then 1 for whole rows a
thread, or 0, tma_stages, scales_ahead for the TMA-read kernels, or "ring", ring, ring_step for the
asynchronous-dot kernel. Cases on the
pair-codes path (4 bits, groups of 128+, 2+ rows) also record `x_sums_us`: the launch that sums x per
128-wide half on every call, alone (part of every pair-codes time here).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compute_service.engine.cuda_graphs import median_replay_ms  # noqa: E402
from kernels.quant_dequant import dequantize_packed  # noqa: E402
from kernels.quant_matmul import (QuantMatmulConfig, dense_min_rows, half_sums, launch_split,  # noqa: E402
                                  pair_codes_layout, pick_config, quant_matmul, sums_width)
from kernels.quant_pack import pack_quantized  # noqa: E402
from kernels.rms_norm import add_rms_norm  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402
from kernels.split_sum import SplitSum  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # [N, K]
SHAPES = {"8b": (SHAPES_8B, 128, (1, 8, 32, 64, 512)),
          "smol": ({"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}, 32,
                   (1, 8, 64)),
          "smoke": ({"o": (64, 256)}, 128, (16,)),      # --smoke: the CPU interpreter, to check the script
          "smoke_defer": ({"o": (64, 1024), "gate_up": (128, 512)}, 128, (1,))}   # --smoke --defer
SPAN = 160 * 2**20          # bytes of weight copies per graph: beyond the 50 MB L2
EPS = 1e-5                  # --after-norm's RMSNorm


def packed_copies(n: int, k: int, group: int, gen: torch.Generator, span: int = SPAN) -> list:
    """Random 4-bit [n, k] weights in groups of `group` (codes 0-15, small fp16 scales, offsets -8 s), packed, as
    many copies as take `span` bytes: a graph over them reads each from memory, not from the L2."""
    ws: list = []
    while sum(w.nbytes for w in ws) < span:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=gen.device, generator=gen)
        s = (torch.rand(n, k // group, device=gen.device, generator=gen) * 0.002 + 1e-4).half()
        ws.append(pack_quantized(q, s, (-8 * s.float()).half(), 4, group))
    return ws


def wall_us(fns: list) -> float:
    """--smoke: one plain pass (the interpreter on the CPU; no graphs, no figures)."""
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) * 1e6 / len(fns)


def graph_us(fns: list, iters: int = 10) -> float:
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return median_replay_ms(g, iters) * 1e3 / len(fns)


def configs(model: str, t: int) -> list[QuantMatmulConfig]:
    C = QuantMatmulConfig
    if model == "smoke":    # pair-codes tiles (split or not), one dot per block, one row a program: sums or none
        return [C(32, 16, 1), C(32, 16, 2), C(16, 16, 1), C(32, 16, 1, field_dots=False), C(64, 1, 1)]
    small = model == "smol"
    if t == 1:
        splits = (1, 2) if small else (1, 4, 8, 16)
        return ([C(bn, 1, s) for bn in ((16, 32, 64) if small else (32, 64, 128)) for s in splits]
                + [C(bn, 16, 1) for bn in ((16, 32) if small else (64,))]
                + ([] if small else [C(bn, 16, s) for bn in (64, 128) for s in (2, 4, 8)]))   # tensor cores, split
    if t <= 16:
        splits = (1, 2, 4) if small else (1, 2, 4, 8)
        return [C(bn, 16, s) for bn in ((16, 32, 64) if small else (32, 64, 128)) for s in splits]
    if t <= 32:
        return [C(bn, 32, s) for bn in (32, 64) for s in (1, 2, 4)]
    if t <= 64:
        return ([C(bn, bm, s) for bn in ((16, 32, 64) if small else (32, 64, 128)) for bm in (32, 64) for s in (1, 2)]
                + [C(64, 64, 1, field_dots=False), C(128, 64, 1, num_warps=8, field_dots=False)])
    if small:       # more than 64 rows: the block dequantization's tiles
        return [C(bn, bm, sp, num_warps=w, field_dots=fd) for bn, bm, sp, w, fd in
                ((32, 64, 1, 4, False), (32, 64, 4, 4, False), (32, 128, 1, 4, False), (64, 64, 1, 4, False),
                 (64, 64, 1, 4, True), (64, 128, 1, 8, True))]
    return ([C(64, 64, 1, num_stages=st) for st in (2, 3, 4)]      # more than 64 rows: the pair-codes tiles
            + [C(bn, bm, sp, num_warps=w) for bn, bm, sp, w in
               ((64, 64, 2, 4), (32, 64, 1, 4), (128, 64, 1, 8), (64, 128, 1, 4), (64, 128, 1, 8), (128, 128, 1, 8))])


def tma_configs(n: int, k: int, group: int) -> list[QuantMatmulConfig]:
    """One row: pick_config's choice, the register-set kernel at its own rule's split, then the TMA-read kernel
    (`kernels.quant_gemv_tma`) over 64-256-feature programs on 4 or 8 warps, splits 1-16, 2-4 stages, scales in the
    step or a block ahead."""
    C = QuantMatmulConfig
    blocks = k // 256
    return [pick_config(1, n, k, 4, 132, group), QuantMatmulConfig(128, 1, 1 if n >= 128 * 132 else 8)] + [
        C(bn, 1, s, num_warps=w, tma_stages=st, scales_ahead=a)
        for bn, w in ((64, 4), (128, 4), (128, 8), (256, 8)) for s in (1, 2, 4, 8, 16) if s <= blocks // 2
        for st in (2, 3, 4) for a in (False, True)]


def defer_configs(n: int, k: int, group: int, smoke: bool = False) -> list[QuantMatmulConfig]:
    """--defer, one row: pick_config's choice, the register-set kernel over 64/128 features and splits 1-16, and the
    TMA-read kernel over 128/256 features, splits 1-16 and 2-3 stages (scales in the step)."""
    C = QuantMatmulConfig
    blocks = k // 256
    if smoke:
        return [C(64, 1, 1), C(64, 1, 2), C(64, 1, 4)]
    return [pick_config(1, n, k, 4, 132, group)] + [
        C(bn, 1, s) for bn in (64, 128) for s in (1, 2, 4, 8, 16) if s <= blocks] + [
        C(bn, 1, s, num_warps=w, tma_stages=st) for bn, w in ((128, 4), (128, 8), (256, 8))
        for s in (1, 2, 3, 4, 8, 16) if s <= blocks // 2 for st in (2, 3)]


def tile_tma_configs(t: int, n: int, k: int, group: int) -> list[QuantMatmulConfig]:
    """2+ rows: pick_config's choice (the register-set tiles), then the tiles whose words are read by TMA a half block
    a step (`kernels.quant_mma_tma`) at the same token tile, 64 features, splits 1-4, 2-5 stages (sm_90, 64 rows:
    130 registers; 3 stages take 57.9 KB of shared memory, three programs an SM; 4 and 5 stages two;
    scripts/kernel_sass.py)."""
    picked = pick_config(t, n, k, 4, 132, group)
    return [picked] + [QuantMatmulConfig(64, picked.block_m, s, tma_stages=st) for s in (1, 2, 4)
                       for st in (2, 3, 4, 5)]


def wide_configs(t: int, n: int, k: int, group: int) -> list[QuantMatmulConfig]:
    """64+ rows: pick_config's choice (with the asynchronous-dot kernel, as on an H200), then that kernel on 128- and
    256-row tiles (weights dequantized into its operand, `kernels.quant_wgmma`'s DEQ), 64 or 128 features, rings of
    3-4 (3 at 256 rows: shared memory), splits 1-4 that divide K's half blocks."""
    halves = k // 128
    return [pick_config(t, n, k, 4, 132, group, async_dots=True)] + [
        QuantMatmulConfig(bn, bm, s, ring=nx, ring_step=1) for bm in (128, 256) if bm < 2 * t
        for bn in (64, 128) for nx in ((3, 4) if bm == 128 else (3,)) for s in (1, 2, 4) if halves % s == 0]


def warps_configs(model: str, t: int) -> list[QuantMatmulConfig]:
    """Warps per program and narrower tiles (latency-bound small weights)."""
    C = QuantMatmulConfig
    if t == 1:
        return [C(bn, 1, s, num_warps=w) for bn in (16, 32, 64) for w in (2, 4, 8) for s in (1, 8)]
    bm = 16 if t <= 16 else 32
    return [C(bn, bm, s, num_warps=w, field_dots=False) for bn in (16, 32) for w in (2, 4, 8) for s in (1, 4)]


def compare_configs(model: str, t: int, n: int, k: int, group: int) -> list[QuantMatmulConfig]:
    """`pick_config`'s choice first, then near alternatives."""
    C = QuantMatmulConfig
    picked = pick_config(t, n, k, 4, 132, group)
    if t == 1:      # and the wider programs per thread (more rows a thread: x's work shared by more codes)
        alts = ([C(32, 1, s) for s in (1, 2, 4, 8)] + [C(64, 1, s, num_warps=2) for s in sorted({1, picked.split_k})]
                + [C(128, 1, s) for s in sorted({1, picked.split_k})])
        if group == 32:     # whole rows a thread: 2 (256 features, 4 warps), 1 (128), 2 on 2 warps
            alts += ([C(256, 1, s, thread_rows=True) for s in (4, 8, 16)] + [C(128, 1, 16, thread_rows=True)]
                     + [C(128, 1, s, num_warps=2, thread_rows=True) for s in (4, 8, 16)])
    else:
        bm = picked.block_m
        alts = [C(32, bm, 1, field_dots=False), C(64, bm, 1, field_dots=False), C(32, bm, 1), C(64, bm, 1),
                C(64, bm, 4), C(64, bm, 8)]
        if bm == 64:        # 4 warps spill at 64-row tiles (scripts/kernel_sass.py): the same on 8
            alts += [C(64, bm, s, num_warps=8) for s in sorted({1, 2, picked.split_k})]
        if t > 64:          # 128-token tiles
            alts += [C(64, 128, s) for s in (1, 2)]
    return [picked] + [c for c in alts if c != picked]


def old_kernel(path: Path):
    """The kernel module of an earlier commit or a candidate, for before/after: a copy of
    kernels/quant_matmul.py, or of kernels/quant_gemv.py (the one-row kernel alone: run through this
    tree's wrapper and config choice, with that kernel in place of the tree's)."""
    import importlib.util

    import kernels.quant_matmul as tree
    spec = importlib.util.spec_from_file_location("old_" + path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    if hasattr(mod, "quant_matmul"):
        return mod

    class OneRow:
        pick_config = staticmethod(tree.pick_config)

        @staticmethod
        def quant_matmul(*args, **kwargs):
            own, tree.quant_gemv_kernel = tree.quant_gemv_kernel, mod.quant_gemv_kernel
            try:
                tree.quant_matmul(*args, **kwargs)
            finally:
                tree.quant_gemv_kernel = own
    return OneRow


def make_reader(x: torch.Tensor, n: int, name: str):
    """--defer: the kernel that reads a one-row projection's output in a decode step (SwiGLU after q/k/v and gate/up,
    the norm after o and down), as a function of that output (a tensor or a SplitSum); `.plain` is an output tensor
    for timing it alone."""
    t, dev = x.shape[0], x.device
    if name in ("o", "down"):
        w, out = torch.ones(n, device=dev, dtype=x.dtype), torch.empty(t, n, device=dev, dtype=x.dtype)

        def read(y) -> None:
            add_rms_norm(y, None, w, EPS, out)
    else:
        half = torch.empty(t, n // 2, device=dev, dtype=x.dtype)

        def read(y) -> None:
            silu_mul(y, half)
    read.plain = torch.randn(t, n, device=dev, dtype=torch.float32).to(x.dtype)
    return read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="smol,8b")
    ap.add_argument("--compare", type=Path, help="an earlier kernels/quant_matmul.py, or a quant_gemv.py (with --rows "
                    "1): time it (its own config choice) and only pick_config's choice and its neighbours here")
    ap.add_argument("--rows", default="")
    ap.add_argument("--shapes", default="", help="only these layer shapes (e.g. gate_up,down)")
    ap.add_argument("--picked-only", action="store_true", help="with --compare: time only pick_config's choice "
                    "(a quick before/after over many shapes and rows)")
    ap.add_argument("--warps", action="store_true", help="sweep warps per program and narrow tiles instead")
    ap.add_argument("--tma", action="store_true", help="pick_config's choice against the TMA-read kernels' configs: "
                    "one row `tma_configs`, 2+ rows `tile_tma_configs`")
    ap.add_argument("--wide", action="store_true", help="64+ rows: pick_config's choice against the asynchronous-dot "
                    "kernel's 128- and 256-row tiles (`wide_configs`)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape in the CPU interpreter, timed plainly: checks "
                    "the script (and its configs' outputs), no figures")
    ap.add_argument("--after-norm", action="store_true", help="each launch after an RMSNorm launch that writes its "
                    "x (and x's sums where the config reads them), timed as the pair less the norm (module docstring)")
    ap.add_argument("--defer", action="store_true", help="one row, after a norm: split launches leave their partials "
                    "and a reader (SwiGLU or the norm) sums them, timed with them (module docstring)")
    ap.add_argument("--group-size", type=int, help="quantization group instead of the model's (8b: 128, smol: 32); "
                    "--only 8b --group-size 32 is what a Q4_0 / Q4_K GGUF of an 8B runs")
    args = ap.parse_args()
    if args.smoke:      # tiny shape, CPU interpreter, plain timing
        args.only = "smoke"
    if args.defer:
        args.after_norm = True
        if args.smoke:
            args.only = "smoke_defer"
    time_us = wall_us if args.smoke else graph_us
    dev = torch.device("cpu" if args.smoke else "cuda")
    span = 1 if args.smoke else SPAN
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(dev), "cases": {}}
    old = old_kernel(args.compare) if args.compare else None
    for model in args.only.split(","):
        shapes, group, rows = SHAPES[model]
        group = args.group_size or group
        res.setdefault("group_size", {})[model] = group
        for name, (n, k) in shapes.items():
            if args.shapes and name not in args.shapes.split(","):
                continue
            ws = packed_copies(n, k, group, gen, span)
            w0 = torch.empty(n, k, device=dev)
            dequantize_packed(ws[0], w0)
            dense: list = []
            while sum(d.nbytes for d in dense) < span:
                dense.append(torch.randn(n, k, device=dev, generator=gen).mul_(0.02).to(torch.bfloat16))
            for t in ([int(r) for r in args.rows.split(",")] if args.rows else rows):
                x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
                src, norm_w = x.clone(), torch.ones(k, device=dev, dtype=torch.bfloat16)
                if args.after_norm:     # x as the norm writes it (the same values on every replay)
                    add_rms_norm(src, None, norm_w, EPS, x)
                want = x.float() @ w0.t()
                r: dict = {"bf16_us": time_us([lambda d=d: F.linear(x, d) for d in dense])}
                pc = pick_config(t, n, k, 4, 132, group)     # QuantLinear's choice for this shape
                r["pick_config"] = [pc.block_n, pc.block_m, pc.split_k, pc.num_warps, int(pc.field_dots), pc.num_stages]
                r["dense_min_rows"] = dense_min_rows(n, k, 4, group)        # QuantLinear dequantizes from here
                wd = [torch.empty(n, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]
                r["dense_path_us"] = time_us([lambda w=w, d=wd[i % 2]: (dequantize_packed(w, d), F.linear(x, d))
                                              for i, w in enumerate(ws)])
                if pair_codes_layout(4, group, k):      # the pair-codes path's launch for the sums of x (16+ rows)
                    r["x_sums_us"] = time_us([lambda: half_sums(x)] * 16)
                old_calls: list = []
                if old is not None:
                    ocfg = old.pick_config(t, n, k, 4, 132, group)
                    opart = torch.empty(ocfg.split_k * t * n, device=dev)
                    olocks = torch.zeros(4096, dtype=torch.int32, device=dev)
                    oouts = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
                    old_calls = [lambda w=w, o=oouts[i % 2]: old.quant_matmul(x, w, None, o, ocfg, opart, olocks)
                                 for i, w in enumerate(ws)]
                    old_calls[0]()
                    r["old_err"] = ((oouts[0].float() - want).norm() / want.norm()).item()
                    r["old_us_first"] = time_us(old_calls)
                found = []
                reader = make_reader(x, n, name) if args.defer and t == 1 else None
                if reader is not None:
                    r["reader_us"] = time_us([lambda: reader(reader.plain)] * len(ws))
                cfgs = (defer_configs(n, k, group, args.smoke) if reader is not None
                        else wide_configs(t, n, k, group) if args.wide
                        else tma_configs(n, k, group) if args.tma and t == 1 else tile_tma_configs(t, n, k, group)
                        if args.tma else warps_configs(model, t) if args.warps
                        else compare_configs(model, t, n, k, group) if old is not None else configs(model, t))
                if args.picked_only:
                    cfgs = cfgs[:1] if old is not None else [pick_config(t, n, k, 4, 132, group)]
                norm_us: dict = {}      # --after-norm: the norm alone, by the sums' width it writes
                for cfg in cfgs:
                    outs = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
                    part = torch.empty(cfg.split_k * t * n, device=dev)
                    locks = torch.zeros(4096, dtype=torch.int32, device=dev)
                    width = sums_width(cfg, ws[0], x.dtype) if args.after_norm else 0
                    sums = torch.empty(t, k // width, device=dev) if width else None

                    def norm(sums=sums) -> None:
                        add_rms_norm(src, None, norm_w, EPS, x, sums=sums)

                    split = launch_split(cfg, ws[0]) if reader is not None else 1
                    parts = SplitSum(part[:split * t * n].view(split, t, n), x.dtype) if split > 1 else None

                    def call(w, o, cfg=cfg, part=part, locks=locks, sums=sums, parts=parts) -> None:
                        if args.after_norm:
                            norm(sums)
                        quant_matmul(x, w, None, o, cfg, part, locks, x_sums=sums, defer_split=parts is not None)
                        if reader is not None:
                            reader(parts if parts is not None else o)
                    try:
                        call(ws[0], outs[0])
                        got = parts.materialize() if parts is not None else outs[0]
                        err = ((got.float() - want).norm() / want.norm()).item()
                        us = time_us([lambda w=w, i=i: call(w, outs[i % 2]) for i, w in enumerate(ws)])
                        if args.after_norm:
                            if width not in norm_us:
                                norm_us[width] = time_us([norm] * len(ws))
                            us -= norm_us[width]
                        if reader is not None:
                            us -= r["reader_us"]
                    except Exception as e:  # noqa: BLE001  a config the compiler refuses: recorded, skipped
                        print(f"  {name} T={t} {cfg} failed: {e!r}"[:300], flush=True)
                        continue
                    found.append(dict(cfg=[cfg.block_n, cfg.block_m, cfg.split_k, cfg.num_warps, int(cfg.field_dots),
                                           cfg.num_stages] + ([1] if cfg.thread_rows else [])
                                      + ([0, cfg.tma_stages, int(cfg.scales_ahead)] if cfg.tma_stages else [])
                                      + (["ring", cfg.ring, cfg.ring_step] if cfg.ring else []),
                                      us=us, err=err))
                r["picked"] = found[0] if old is not None and found else None
                if args.after_norm:
                    r["norm_us"] = {str(wd): v for wd, v in norm_us.items()}
                if old_calls:       # again after the tree's configs (a case's first timing sometimes runs slow)
                    r["old_us_last"] = time_us(old_calls)
                    r["old_us"] = min(r["old_us_first"], r["old_us_last"])
                found.sort(key=lambda c: c["us"])
                r["configs"] = found
                res["cases"][f"{model}/{name}/{t}"] = r
                best = found[0] if found else {}
                bad = [c["cfg"] for c in found if not c["err"] < 1e-2]
                print(f"{model:4s} {name:7s} T={t:4d} bf16 {r['bf16_us']:7.1f} dense {r['dense_path_us']:7.1f} "
                      + (f"old {r['old_us']:7.1f} picked {r['picked']['us']:7.1f} " if r.get("picked") else "")
                      + f"best {best.get('us', 0):7.1f} {best.get('cfg')} next "
                      + " ".join(f"{c['us']:.1f}{c['cfg']}" for c in found[1:4]) + (f" BAD {bad}" if bad else ""),
                      flush=True)
                args.out.write_text(json.dumps(res, indent=1))
            del ws, dense
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
