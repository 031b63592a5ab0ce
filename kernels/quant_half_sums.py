"""Sums of x over each 128-wide half block (or each group of 32), for the pair-codes paths' offsets term
(`kernels.quant_matmul`): their launch, the check of a sums buffer (`check_sums`) and the device helper with
which the kernels that write x write them too (`store_slice_sums`).

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


@triton.jit
def store_slice_sums(v, sums_ptr, first, count, WIDTH: tl.constexpr):
    """sums[first + j] = fp32 sum of v[j * WIDTH : (j + 1) * WIDTH] (v: [BLOCK] of values as stored, BLOCK a
    multiple of WIDTH, 0 past the row's end) for j < count: the sums written by the kernel that writes x
    (`kernels.rms_norm`, `kernels.silu_mul`), so that no launch of their own sits between it and the matmul."""
    S: tl.constexpr = v.shape[0] // WIDTH
    j = tl.arange(0, S)
    tl.store(sums_ptr + first + j, tl.sum(tl.reshape(v.to(tl.float32), (S, WIDTH)), axis=1), mask=j < count)


def check_sums(sums: torch.Tensor, T: int, K: int, width: int, name: str) -> None:
    """Raises unless `sums` is contiguous float32 [T, K / width], width 32 or 128 dividing K."""
    if width not in (32, HALF) or K % width or sums.shape != (T, K // width) or sums.dtype != torch.float32 \
            or not sums.is_contiguous():
        raise ValueError(f"{name} must be contiguous float32 [{T}, {K} / width] with K % {width} == 0 (width 32 or "
                         f"{HALF}); got {sums.dtype} {tuple(sums.shape)}")


def slice_width(sums: torch.Tensor | None, T: int, K: int) -> int:
    """The width of the slices `sums` ([T, K / width]) holds a sum for, checked (`check_sums`); 0 without."""
    if sums is None:
        return 0
    width = K // sums.shape[1] if sums.dim() == 2 and sums.shape[1] else 0
    check_sums(sums, T, K, width, "sums")
    return width


def half_sums_into(x: torch.Tensor,      # [T, K] 16-bit, unit stride along K, K a multiple of width
                   out: torch.Tensor,    # [T, K / width] float32 contiguous
                   width: int = HALF,    # 128 (the paired layout's halves) or 32 (groups of 32)
                   ) -> None:
    """Semantics: out = x.float().reshape(T, K // width, width).sum(-1) (fp32 sums, in some order)."""
    T, K = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit stride along K, got strides {x.stride()}")
    check_sums(out, T, K, width, "out")
    if T == 0:
        return
    num_halves = K // width
    _half_sums_kernel[(T, cdiv(num_halves, HALVES))](x, out, x.stride(0), num_halves, HALVES=HALVES, WIDTH=width,
                                                     num_warps=4, **launch_args(pdl_enabled(x.device)))
