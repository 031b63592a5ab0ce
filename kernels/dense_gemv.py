"""One-row dense matmul (batch-1 decode): out[N] = w[N, K] @ x[K] (+ bias), reading w once at full width.

A program owns BLOCK_N output features and walks K in BLOCK_K-wide steps: each step loads a [BLOCK_N,
BLOCK_K] tile of w (BLOCK_K * 2 contiguous bytes per row for 16-bit weights) and the matching slice of x,
and multiplies them elementwise into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced once at the end. No
tensor cores (one row would use 1/16 of an MMA) and no split-K: with 16-feature programs even the
narrowest 8B projection (4096 features) has 256 programs for 132 SMs.

Why it exists: decode at batch 1 reads every weight once per token, so weight reads are most of a batch-1
step, and at one row the library GEMM reads the 8B model's weights at 1.09-1.63x their copy-bandwidth time
against 0.95-1.50x for this kernel (H200, `bench/results/dense_gemv.json`; the LM head gains most, 283 ->
238 us).
`compute_service.engine.linear.dense_linear` runs it for single rows on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.addend import take_addend
from kernels.pdl import compiled, launch_args, pdl_enabled, read_early, read_input, wait_then_release


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int = 16       # output features per program
    block_k: int = 512      # in features per step
    num_warps: int = 8


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, add_ptr, out_ptr, N, K, stride_w,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EVEN_K: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr, FENCE: tl.constexpr,
                       NUM_THREADS: tl.constexpr):
    """ADD: out += add (fp32, left zero), and x is read before the wait, after `read_early`'s fence (see
    `dense_gemv`; FENCE: compiled, not interpreted)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]          # [BN, BK]
    read_early(ADD and FENCE, NUM_THREADS)
    # The first weight tile does not depend on the previous kernel: it is read before the wait.
    if EVEN_K:
        w = tl.load(rows, mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(rows, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if not ADD:
        wait_then_release(USE_PDL)
    xv = read_input(x_ptr + offs_k, offs_k < K, EVEN_K)
    acc = w.to(tl.float32) * xv.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(rows + k0, mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(rows + k0, mask=n_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        xv = read_input(x_ptr + (k0 + offs_k), k0 + offs_k < K, EVEN_K)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    total = tl.sum(acc, axis=1)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if ADD:
        wait_then_release(USE_PDL)
        total = take_addend(total, add_ptr + offs_n, n_mask)
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def pick_gemv_config(n: int, k: int) -> DenseGemvConfig:
    """H200 sweep (`bench/dense_gemv.py`): 16-feature programs; 512-wide steps of 8 warps, except very
    wide weights (the 8B gate_up, 28672 features), where 256-wide steps of 4 warps were 7% faster."""
    if n >= 16384 and k % 256 == 0:
        return DenseGemvConfig(16, 256, 4)
    return DenseGemvConfig(16, 512, 8)


def dense_gemv(x: torch.Tensor,                 # [K] or [1, K], unit stride
               w: torch.Tensor,                 # [N, K], unit stride along K
               bias: torch.Tensor | None,       # [N] or None
               out: torch.Tensor,               # [N] or [1, N], contiguous, x's dtype
               config: DenseGemvConfig | None = None,
               addend: torch.Tensor | None = None) -> None:   # [N] or [1, N] float32, contiguous
    """Semantics (fp32 accumulation): out[:] = (w.float() @ x.float().reshape(-1) + bias + addend).to(out.dtype);
    the addend is left all zeros.

    With an addend the kernel is meant to follow the launch that wrote it (the LoRA delta, written into
    zeros): it reads x and the whole weight before waiting for that launch and waits only to add it.
    So x must not be written by the launch just before this one (kernels/pdl.py): the caller guarantees
    that every kernel since x was written wrote nothing this one reads but the addend."""
    k = x.shape[-1]
    n = w.shape[0]
    if x.numel() != k or x.stride(-1) != 1:
        raise ValueError(f"x must be one row of unit stride, got {tuple(x.shape)} strides {x.stride()}")
    if w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"w must be [N, {k}] with unit stride along K, got {tuple(w.shape)} strides {w.stride()}")
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be {n} contiguous elements, got {tuple(out.shape)}")
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"bias must be {n} contiguous elements, got {tuple(bias.shape)}")
    if addend is not None and (addend.numel() != n or not addend.is_contiguous() or addend.dtype != torch.float32):
        raise ValueError(f"addend must be {n} contiguous float32 elements, got {addend.dtype} {tuple(addend.shape)}")
    if n == 0:
        return
    cfg = config or pick_gemv_config(n, k)
    grid = (triton.cdiv(n, cfg.block_n),)
    pdl = pdl_enabled(x.device)
    _dense_gemv_kernel[grid](x, w, bias if bias is not None else out, addend if addend is not None else out, out,
                             n, k, w.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
                             EVEN_K=k % cfg.block_k == 0, ADD=addend is not None,
                             FENCE=compiled(), NUM_THREADS=32 * cfg.num_warps,
                             num_warps=cfg.num_warps, **launch_args(pdl))


__all__ = ["DenseGemvConfig", "dense_gemv", "pick_gemv_config"]
