"""Dequantize a packed weight-only quantized matrix into a dense one (prefill: a library GEMM then runs on it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_pack import PackedQuantWeight, block_k, paired_layout
from kernels.quant_tile import dequant_block


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, o_ptr, out_ptr, N, K, words_per_row,
                    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    BLOCK_K: tl.constexpr = 32 * (32 // BITS)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    n_mask = offs_n < N
    words = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + b * 32 + tl.arange(0, 32)[None, :],
                    mask=n_mask[:, None], other=0)
    w = dequant_block(words, s_ptr, o_ptr, b, N, offs_n, n_mask, GROUP, BITS, PAIRED)  # [BN, BLOCK_K] fp32
    cols = b * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (cols < K)[None, :])


def dequantize_packed(w: PackedQuantWeight,       # [N, K] packed
                      out: torch.Tensor,          # [N, K] contiguous, float16 / bfloat16 / float32
                      ) -> None:
    """Semantics: out[:] = (q * scales[:, k // G] + offsets[:, k // G]).to(out.dtype)   (computed in fp32)."""
    N, K = w.out_features, w.in_features
    if out.shape != (N, K) or not out.is_contiguous() or out.dtype not in (torch.float16, torch.bfloat16,
                                                                           torch.float32):
        raise ValueError(f"out must be contiguous float [{N}, {K}], got {out.dtype} {tuple(out.shape)}")
    if N == 0:
        return
    block_n = 32
    grid = (triton.cdiv(N, block_n), w.padded_in_features // block_k(w.bits))
    _dequant_kernel[grid](w.words, w.scales, w.offsets, out, N, K, w.words.shape[1],
                          GROUP=w.group_size, BITS=w.bits, BLOCK_N=block_n,
                          PAIRED=paired_layout(w.bits, w.group_size), num_warps=4)
