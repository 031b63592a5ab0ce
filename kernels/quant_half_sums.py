"""Sums of x over each 128-wide half block (or each group of 32), for the pair-codes paths' offsets term
(`kernels.quant_matmul`).

One launch per quantized matmul call on that path whose caller does not hand it the sums: the norms ahead of
q/k/v and gate/up and the SwiGLU ahead of down write them with x (`kernels.rms_norm.add_rms_norm`,
`kernels.silu_mul.silu_mul`, asked by `LlamaModel._x_sums`), so in the engine this launch runs for o only (its
x comes from attention) and under tensor parallelism for q/k/v and gate/up too (the all-reduce + norm writes
none). As a dependent launch (`kernels/pdl.py`) it starts while the kernel that wrote x still runs, and the
quantized matmul after it starts while it runs (a library reduction does neither: both launches' start-up
would sit between the two kernels); still, it sits on the step's path between the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv
from kernels.pdl import launch_args, pdl_enabled, wait_then_release

HALF = 128
HALVES = 16                     # slices (halves or groups) a program sums


@triton.jit
def _half_sums_kernel(x_ptr, out_ptr, stride_x, num_halves, HALVES: tl.constexpr, WIDTH: tl.constexpr,
                      USE_PDL: tl.constexpr):
    wait_then_release(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HALVES + tl.arange(0, HALVES)
    mask = h < num_halves
    v = tl.load(x_ptr + t * stride_x + h[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], mask=mask[:, None],
                other=0.0)
    tl.store(out_ptr + t * num_halves + h, tl.sum(v.to(tl.float32), axis=1), mask=mask)


def half_sums_into(x: torch.Tensor,      # [T, K] 16-bit, unit stride along K, K a multiple of width
                   out: torch.Tensor,    # [T, K / width] float32 contiguous
                   width: int = HALF,    # 128 (the paired layout's halves) or 32 (groups of 32)
                   ) -> None:
    """Semantics: out = x.float().reshape(T, K // width, width).sum(-1) (fp32 sums, in some order)."""
    T, K = x.shape
    if width not in (32, HALF) or K % width or x.stride(1) != 1 or out.shape != (T, K // width) \
            or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"x must be [T, K] with K % {width} == 0 (width 32 or {HALF}) and unit stride, out float32 "
                         f"[T, K / {width}]; got x {tuple(x.shape)} strides {x.stride()}, out {out.dtype} "
                         f"{tuple(out.shape)}")
    if T == 0:
        return
    num_halves = K // width
    _half_sums_kernel[(T, cdiv(num_halves, HALVES))](x, out, x.stride(0), num_halves, HALVES=HALVES, WIDTH=width,
                                                     num_warps=4, **launch_args(pdl_enabled(x.device)))
