"""How fast the one-row quantized kernel's words can be read at all: a loads-only probe of its access pattern.

The one-row kernel (kernels/quant_gemv.py) reads, per program, [block_n, 32] int32 words of block_n rows, one
256-code block (128 bytes a row) a loop step. This probe does exactly that and no arithmetic (the words summed
as floats, one value a row written), over the 8B layer shapes packed 4-bit, for a grid of
  block_n 32/64/128, split-K 1/2/4 (each program a range of blocks), 4 or 8 warps,
  unroll 1/2 (blocks a loop step, all requested before any is used),
  stagger (each program starts at a different block of its range),
  flat (each program's rows as one contiguous span: what a tile-major layout would read).
Against the byte floor: weight bytes over the measured copy bandwidth. What the kernel itself takes is in
bench/quant_kernel_sweep.py; bench/results/quant_gemv_bounds.json sets the two side by side.

    python3 bench/quant_gemv_probe.py --commit "$(git rev-parse --short HEAD)" --out bench/results/probe.json
    python3 bench/quant_gemv_probe.py --staged --only gate_up,qkv --out staged.json   # TMA / pipelined, 2-6 stages
    TRITON_INTERPRET=1 python3 bench/quant_gemv_probe.py --smoke --out /tmp/p.json     # the script on CPU
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_lora import copy_bandwidth  # noqa: E402  (bench helpers)
from quant_kernel_sweep import SHAPES_8B, graph_us  # noqa: E402

SHAPES = SHAPES_8B
SPAN = 200 * 2**20          # bytes of weight copies per timed graph: beyond the 50 MB L2


@triton.jit
def _read_words(w_ptr, out_ptr, N, words_per_row, blocks_per_split, BN: tl.constexpr, UNROLL: tl.constexpr,
                STAGGER: tl.constexpr, FLAT: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, 32)
    if FLAT:
        base = w_ptr + (pid_n * BN).to(tl.int64) * words_per_row + pid_k * blocks_per_split * BN * 32
        ptrs = base + tl.arange(0, BN)[:, None] * 32 + offs_j[None, :]
        step = BN * 32
    else:
        ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + pid_k * blocks_per_split * 32 + offs_j[None, :]
        step = 32
    acc = tl.zeros((BN, 32), tl.float32)
    for i in range(0, blocks_per_split, UNROLL):
        for u in tl.static_range(UNROLL):
            r = i + u
            if STAGGER:
                r = (r + pid_n) % blocks_per_split
            acc += tl.load(ptrs + r * step).to(tl.float32, bitcast=True)
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, 1))


@triton.jit
def _read_words_staged(w_src, out_ptr, N, words_per_row, blocks_per_split, BN: tl.constexpr,
                       STAGES: tl.constexpr, TMA: tl.constexpr):
    """The same reads through the compiler's multi-stage pipeline: TMA (w_src a tensor descriptor of [BN, 32]
    boxes; the hardware copies each block into shared memory, STAGES - 1 blocks requested ahead) or plain
    pointers (w_src the words; asynchronous copies where the compiler pipelines them)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    b0 = pid_k * blocks_per_split
    acc = tl.zeros((BN, 32), tl.float32)
    for b in tl.range(0, blocks_per_split, num_stages=STAGES):
        if TMA:
            w = w_src.load([pid_n * BN, (b0 + b) * 32])
        else:
            w = tl.load(w_src + offs_n.to(tl.int64)[:, None] * words_per_row + (b0 + b) * 32
                        + tl.arange(0, 32)[None, :])
        acc += w.to(tl.float32, bitcast=True)
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, 1))


def staged_cases(n: int, blocks: int, smoke: bool) -> list[tuple[int, int, int, int, int]]:
    """(block_n, split, warps, stages, tma) for `_read_words_staged`."""
    if smoke:
        return [(32, 2, 4, 3, 0), (32, 2, 4, 3, 1)]
    grid = itertools.product((64, 128), (1, 2, 4), (4, 8), (2, 4, 6), (1, 0))
    return [c for c in grid if blocks % c[1] == 0 and n % c[0] == 0]


def cases(n: int, blocks: int, smoke: bool) -> list[tuple[int, int, int, int, int, int]]:
    """(block_n, split, warps, unroll, stagger, flat) that tile the shape evenly."""
    if smoke:
        return [(32, 1, 4, 1, 0, 0), (32, 2, 4, 2, 1, 1)]
    grid = itertools.product((32, 64, 128), (1, 2, 4), (4, 8), (1, 2), (0, 1), (0, 1))
    return [c for c in grid if not (c[0] == 32 and c[2] == 8) and blocks % c[1] == 0
            and (blocks // c[1]) % c[3] == 0 and n % c[0] == 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--staged", action="store_true", help="only the multi-stage variants (`_read_words_staged`: "
                    "TMA boxes or pipelined pointer loads, 2-6 stages)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    shapes = {"tiny": (64, 1024)} if args.smoke else {s: SHAPES[s] for s in args.only.split(",")}
    res: dict = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(dev), "commit": args.commit,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "copy_bandwidth_Bps": None if args.smoke else copy_bandwidth(dev, 2**31), "cases": []}
    for name, (n, k) in shapes.items():
        words_per_row = k // 8
        blocks = words_per_row // 32
        nbytes = n * words_per_row * 4
        ws = [torch.randn(n, words_per_row, device=dev).view(torch.int32)         # words whose sums are finite
              for _ in range(1 if args.smoke else max(2, -(-SPAN // nbytes)))]
        plain = [] if args.staged else [dict(kind="plain", block_n=c[0], split=c[1], warps=c[2], unroll=c[3],
                                                  stagger=c[4], flat=c[5]) for c in cases(n, blocks, args.smoke)]
        staged = [dict(kind="tma" if c[4] else "pipelined", block_n=c[0], split=c[1], warps=c[2], stages=c[3])
                  for c in staged_cases(n, blocks, args.smoke)]
        for case in plain + staged:
            bn, split, warps = case["block_n"], case["split"], case["warps"]
            out = torch.empty(split, n, device=dev)
            grid = (n // bn, split)
            descs = {}

            def launch(w: torch.Tensor, case=case, bn=bn, split=split, warps=warps, out=out, grid=grid,
                       descs=descs) -> None:
                if case["kind"] == "plain":
                    _read_words[grid](w, out, n, words_per_row, blocks // split, BN=bn, UNROLL=case["unroll"],
                                      STAGGER=case["stagger"], FLAT=case["flat"], num_warps=warps)
                    return
                tma = case["kind"] == "tma"
                if tma and w.data_ptr() not in descs:
                    descs[w.data_ptr()] = TensorDescriptor.from_tensor(w, [bn, 32])
                _read_words_staged[grid](descs[w.data_ptr()] if tma else w, out, n, words_per_row, blocks // split,
                                         BN=bn, STAGES=case["stages"], TMA=tma, num_warps=warps)
            try:
                if args.smoke:
                    launch(ws[0])
                    want = ws[0].view(torch.float32).view(n // bn, -1).sum(1)       # each program's words, all read
                    assert torch.allclose(out.sum(0).view(n // bn, bn).sum(1), want, rtol=1e-4, atol=1e-2), \
                        f"probe read the wrong words ({case})"
                    us = 0.0
                else:
                    us = graph_us([lambda w=w: launch(w) for w in ws])
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001  a variant the compiler or the GPU refuses: recorded, skipped
                print(name, case, f"failed: {e!r}"[:300], flush=True)
                res["cases"].append(dict(shape=name, **case, failed=repr(e)[:300]))
                continue
            row = dict(shape=name, **case, us=us, TBps=nbytes / us / 1e6 if us else None,
                       floor_us=nbytes / res["copy_bandwidth_Bps"] * 1e6 if res["copy_bandwidth_Bps"] else None)
            res["cases"].append(row)
            print(name, " ".join(f"{k}={v}" for k, v in case.items()), f"{us:.1f} us", flush=True)
        args.out.write_text(json.dumps(res, indent=1))
    for name in shapes:
        mine = [c for c in res["cases"] if c["shape"] == name and "us" in c]
        print("best", name, min(mine, key=lambda c: c["us"]))


if __name__ == "__main__":
    main()
