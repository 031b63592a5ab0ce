"""Weight-only quantized matmul (W4A16 / W8A16): out = x @ dequant(W).T, reading the packed codes in place.

Two kernels of one family, both reading `kernels.quant_pack`'s layout (per K block, 32 int32 words per
row; field i of the words holds 32 consecutive codes of one group). A code becomes a float without a
conversion instruction: code | 0x4B000000 read as a float is 2**23 + code, and one subtract leaves the
code (small integers are exact in every float dtype). Scales and offsets are applied per group to sums,
never per weight: s * sum(q * x) + o * sum(x) is w @ x with no multiply or rounding of w.

- Tensor-core kernel (2+ rows): a program owns BLOCK_N features by BLOCK_M tokens and a range of K blocks;
  per group it accumulates `codes @ x.T` and sum(x) (a dot with ones) with dots in fp32. The tile is
  out.T (features by tokens), so a decode batch of 2-16 tokens is the dot's small side.
- One-row kernel (batch-1 decode): no tensor cores; a [BLOCK_N, 32] fp32 accumulator takes codes * x
  elementwise (about 4 instructions per weight), reduced once at the end.

Split-K (decode: few output tiles for 132 SMs, e.g. the down projection N=4096, K=14336): split_k
programs share an output tile, each writes its fp32 partial, bumps the tile's counter, and the program
that finds itself last sums the partials in a fixed order (deterministic), adds the bias, writes the
output and resets the counter to zero. No extra launch and no host sync, so it runs inside CUDA graphs;
the counters (int32, zero) and the partials buffer are owned by the caller.

For large T, `dequantize_packed` writes the dense weight once so a library GEMM can run at full rate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant_pack import SUB_K, PackedQuantWeight, block_k
from kernels.tiles import dot

_F32_MAGIC = 0x4B000000     # bit pattern of 2**23; OR-ing a code < 2**23 into the mantissa gives 2**23 + code


@dataclass(frozen=True)
class QuantMatmulConfig:
    block_n: int        # output features per program (>= 16)
    block_m: int        # tokens per program (>= 16)
    split_k: int        # programs sharing one output tile along K
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _dequant_field(words, s_ptr, o_ptr, g, N, offs_n, n_mask, i: tl.constexpr, BITS: tl.constexpr):
    """fp32 [BLOCK_N, 32]: field i of a block's words, times its group's scale, plus its offset."""
    codes = (words >> (BITS * i)) & ((1 << BITS) - 1)
    f = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return f * s[:, None] + o[:, None]


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                         T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks, split_k,
                         GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                         FENCE: tl.constexpr):
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = 32 * FIELDS
    FPG: tl.constexpr = FIELDS if GROUP >= BLOCK_K else GROUP // 32             # fields per group
    # sum_k x per group by a dot with ones: summing x in registers instead measured slower on an H100 even
    # at 64-token tiles (the layout change of the sums costs more than the extra tensor-core work).
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, 32)
    n_mask, m_mask = offs_n < N, offs_m < T
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + offs_j[None, :]     # [BN, 32]
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x + offs_j[:, None]         # [32, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                              # out.T tile
    ones = tl.full((BLOCK_N, 32), 1.0, x_ptr.dtype.element_ty)
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, num_blocks)
    for b in range(b_lo, b_hi):
        words = tl.load(w_rows + b * 32, mask=n_mask[:, None], other=0)                # [BN, 32] int32
        for gi in tl.static_range(FIELDS // FPG):                                     # groups in the block
            acc_q = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                    # sum_k q * x
            acc_x = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                    # sum_k x (every row)
            for f in tl.static_range(FPG):
                i = gi * FPG + f
                k0 = b * BLOCK_K + i * 32
                if EVEN_K:
                    xt = tl.load(x_cols + k0, mask=m_mask[None, :], other=0.0)         # [32, BM]
                else:
                    xt = tl.load(x_cols + k0, mask=m_mask[None, :] & (k0 + offs_j < K)[:, None], other=0.0)
                codes = (((words >> (BITS * i)) & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True)
                codes = (codes - 8388608.0).to(xt.dtype)                               # exact small integers
                acc_q += dot(codes, xt, IEEE)
                acc_x += dot(ones, xt, IEEE)
            g = (b * BLOCK_K + gi * FPG * 32) // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += s[:, None] * acc_q + o[:, None] * acc_x
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]   # [BN, BM]
    part_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]          # [BN, BM] of split 0
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    _write_out(acc, bias, out_ptr, out_ptrs, part_ptrs, T * N, n_mask[:, None] & m_mask[None, :],
               lock_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT, FENCE)


@triton.jit
def _fence(t):
    """Every thread holding part of `t` runs a GPU-scope fence (a no-op in Triton's interpreter, which runs
    programs one after another): its partial stores are visible GPU-wide before the tile's count moves,
    and the last program's loads of the partials happen after it saw the count."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.b32 $0, $1;", "=r,r", [t.to(tl.int32, bitcast=True)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _write_out(acc, bias, out_ptr, out_ptrs, part_ptrs, part_stride, mask, lock, pid_k, split_k,
               SPLIT: tl.constexpr, FENCE: tl.constexpr):
    """out = acc + bias; under split-K via the partials (part_stride apart) and the tile's counter `lock`."""
    if not SPLIT:
        tl.store(out_ptrs, (acc + bias).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptrs + pid_k * part_stride, acc, mask=mask)   # split-K runs only for small T: int32 offsets
        if FENCE:
            _fence(acc)
        tl.debug_barrier()                         # every thread's partial is stored before the count
        done = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:                    # the last program of this tile reduces it, in split order
            if FENCE:
                _fence(acc)
            total = tl.zeros_like(acc)
            for s in range(split_k):
                total += tl.load(part_ptrs + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, (total + bias).to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _quant_gemv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                       T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks, split_k,
                       GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FENCE: tl.constexpr):
    """One token row per program (grid axis 1), no tensor cores: a [BLOCK_N, 32] fp32 accumulator takes
    codes * x elementwise (4 instructions per weight), reduced once at the end."""
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = 32 * FIELDS
    FPG: tl.constexpr = FIELDS if GROUP >= BLOCK_K else GROUP // 32             # fields per group
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + offs_j[None, :]     # [BN, 32]
    x_row = x_ptr + m.to(tl.int64) * stride_x + offs_j                                 # [32]
    acc = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, num_blocks)
    for b in range(b_lo, b_hi):
        words = tl.load(w_rows + b * 32, mask=n_mask[:, None], other=0)                # [BN, 32] int32
        for gi in tl.static_range(FIELDS // FPG):
            acc_q = tl.zeros((BLOCK_N, 32), dtype=tl.float32)                         # q * x per column
            x_g = tl.zeros((32,), dtype=tl.float32)                                   # x per column
            for f in tl.static_range(FPG):
                i = gi * FPG + f
                k0 = b * BLOCK_K + i * 32
                if EVEN_K:
                    xv = tl.load(x_row + k0).to(tl.float32)
                else:
                    xv = tl.load(x_row + k0, mask=k0 + offs_j < K, other=0.0).to(tl.float32)
                codes = (((words >> (BITS * i)) & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True)
                acc_q += (codes - 8388608.0) * xv[None, :]
                x_g += xv
            g = (b * BLOCK_K + gi * FPG * 32) // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += s[:, None] * acc_q + o[:, None] * x_g[None, :]
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _write_out(tl.sum(acc, axis=1), bias, out_ptr, out_ptr + m.to(tl.int64) * stride_out + offs_n,
               part_ptr + m.to(tl.int64) * N + offs_n, T * N, n_mask, lock_ptr + m * tl.num_programs(0) + pid_n,
               pid_k, split_k, SPLIT, FENCE)


def quant_matmul(
    x: torch.Tensor,                 # [T, K] float16 / bfloat16 / float32, unit stride along K
    w: PackedQuantWeight,            # [N, K] packed (kernels.quant_pack)
    bias: torch.Tensor | None,       # [N] or None
    out: torch.Tensor,               # [T, N] contiguous, x's dtype
    config: QuantMatmulConfig,
    partials: torch.Tensor | None = None,   # float32, >= split_k * T * N elements (split_k > 1 only)
    locks: torch.Tensor | None = None,      # int32 zeros, >= cdiv(N, block_n) * cdiv(T, block_m) (split_k > 1)
) -> None:
    """Semantics (fp32 accumulation; IEEE fp32 products for float32 x):
        W = q * scales[:, k // G] + offsets[:, k // G]          # [N, K] in fp32, q unpacked from w.words
        out[:] = (x.float() @ W.T + (bias.float() if bias is not None else 0)).to(x.dtype)
    W is never rounded to x's dtype: per group, scales[n, g] * sum(q * x) + offsets[n, g] * sum(x).
    `locks` must hold zeros before the call and holds zeros after it.
    """
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [T, K] float16/bfloat16/float32 with unit stride along K, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    T, K = x.shape
    N = w.out_features
    if K != w.in_features:
        raise ValueError(f"x has {K} features, the weight takes {w.in_features}")
    if out.shape != (T, N) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{T}, {N}] of dtype {x.dtype}, got {out.dtype} {tuple(out.shape)}")
    if w.words.dtype != torch.int32 or not w.words.is_contiguous() or w.scales.dtype != torch.float16 \
            or not w.scales.is_contiguous() or not w.offsets.is_contiguous() or w.scales.shape != w.offsets.shape:
        raise ValueError("packed weight must be contiguous int32 words and float16 [groups, N] scales/offsets")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{N}], got {tuple(bias.shape)}")
    cfg = config
    if cfg.block_n < 16 or not (cfg.block_m == 1 or cfg.block_m >= 16) or cfg.split_k < 1:
        raise ValueError(f"bad config {cfg}: block_n >= 16, block_m 1 (one row per program) or >= 16, split_k >= 1")
    num_blocks = w.padded_in_features // block_k(w.bits)
    split = min(cfg.split_k, num_blocks)
    per_split = -(-num_blocks // split)
    split = -(-num_blocks // per_split)                     # no program left without a block
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(T, cfg.block_m), split)
    if split > 1:
        if partials is None or partials.dtype != torch.float32 or partials.numel() < split * T * N:
            raise ValueError(f"split-K {split} needs float32 partials of >= {split * T * N} elements")
        if locks is None or locks.dtype != torch.int32 or locks.numel() < grid[0] * grid[1]:
            raise ValueError(f"split-K needs int32 zero locks of >= {grid[0] * grid[1]} elements")
    if T == 0 or N == 0:
        return
    args = (x, w.words, w.scales, w.offsets, bias if bias is not None else out, out,
            partials if split > 1 else out, locks if split > 1 else out,
            T, N, K, x.stride(0), out.stride(0), w.words.shape[1], per_split, num_blocks, split)
    even_k = K % block_k(w.bits) == 0
    fence = os.environ.get("TRITON_INTERPRET", "0") != "1"
    if cfg.block_m == 1:
        _quant_gemv_kernel[grid](*args, GROUP=w.group_size, BITS=w.bits, BLOCK_N=cfg.block_n, SPLIT=split > 1,
                                 HAS_BIAS=bias is not None, EVEN_K=even_k, FENCE=fence,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _quant_matmul_kernel[grid](*args, GROUP=w.group_size, BITS=w.bits, BLOCK_N=cfg.block_n,
                                   BLOCK_M=cfg.block_m, SPLIT=split > 1, HAS_BIAS=bias is not None,
                                   EVEN_K=even_k, IEEE=x.dtype == torch.float32, FENCE=fence,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def pick_config(T: int, N: int, K: int, bits: int, num_sms: int) -> QuantMatmulConfig:
    """Tiles and split-K for a shape (from a sweep of the 8B layer shapes on an H100, bench/quant_decode.py).

    One row: the elementwise kernel, 32 features per program, split until ~8 programs per SM. 2-64 rows:
    the tensor-core kernel with 64-feature tiles, split until ~4 programs per SM (at most 4 splits above
    16 rows). Prefill rows (> 64): 128 x 64 tiles (QuantLinear dequantizes and uses a GEMM there)."""
    num_blocks = -(-K // block_k(bits))

    def split_for(tiles: int, per_sm: int, cap: int) -> int:
        want = -(-per_sm * num_sms // tiles)
        return max(1, min(1 << (want.bit_length() - 1), cap, max(1, num_blocks // 2)))

    if T == 1:
        return QuantMatmulConfig(32, 1, split_for(triton.cdiv(N, 32), 8, 16), num_warps=4, num_stages=3)
    if T <= 64:
        block_m = max(16, triton.next_power_of_2(T))
        tiles = triton.cdiv(N, 64) * triton.cdiv(T, block_m)
        return QuantMatmulConfig(64, block_m, split_for(tiles, 4, 8 if T <= 16 else 4), num_warps=4, num_stages=3)
    return QuantMatmulConfig(128, 64, 1, num_warps=4, num_stages=3)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, o_ptr, out_ptr, N, K, words_per_row,
                    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = 32 * FIELDS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    offs_j = tl.arange(0, 32)
    n_mask = offs_n < N
    words = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + b * 32 + offs_j[None, :],
                    mask=n_mask[:, None], other=0)
    for i in tl.static_range(FIELDS):
        k0 = b * BLOCK_K + i * 32
        w = _dequant_field(words, s_ptr, o_ptr, k0 // GROUP, N, offs_n, n_mask, i, BITS)
        cols = k0 + offs_j
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
                          GROUP=w.group_size, BITS=w.bits, BLOCK_N=block_n, num_warps=4)


__all__ = ["SUB_K", "QuantMatmulConfig", "dequantize_packed", "pick_config", "quant_matmul"]
