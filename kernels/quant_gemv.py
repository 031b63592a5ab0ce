"""One-row weight-only quantized matmul (batch-1 decode): no tensor cores, a [BLOCK_N, 32] fp32
accumulator takes codes * x elementwise, reduced once at the end. Launched by `kernels.quant_matmul`.

Per code: one shift and one and-or (`biased_field`: BIAS + q as a float; one instruction on a GPU) and
one FMA. With groups of
64 codes and more, the products BIAS+q times x accumulate per group and the group's scale and offset
apply to the sums: s * sum((B + q) x) + (o - B s) * sum(x). With groups of 32 (one field), the weight
q * s + o is formed per code instead (one FMA, cheaper than a per-field epilogue).
"""
import triton
import triton.language as tl

from kernels.quant_split import write_out
from kernels.quant_tile import biased_field, field_bias


@triton.jit
def quant_gemv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                      T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks, split_k,
                      GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FENCE: tl.constexpr,
                      NUM_THREADS: tl.constexpr, ASM: tl.constexpr):
    """One token row per program (grid axis 1), BLOCK_N features (axis 0), a range of K blocks (axis 2)."""
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = 32 * FIELDS
    FPG: tl.constexpr = FIELDS if GROUP >= BLOCK_K else GROUP // 32             # fields per group
    BIAS = field_bias(BITS)
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
            g = (b * BLOCK_K + gi * FPG * 32) // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32) - BIAS * s
            acc_q = tl.zeros((BLOCK_N, 32), dtype=tl.float32)                         # (B + q) * x per column
            x_g = tl.zeros((32,), dtype=tl.float32)                                   # x per column
            for f in tl.static_range(FPG):
                i = gi * FPG + f
                k0 = b * BLOCK_K + i * 32
                if EVEN_K:
                    xv = tl.load(x_row + k0).to(tl.float32)
                else:
                    xv = tl.load(x_row + k0, mask=k0 + offs_j < K, other=0.0).to(tl.float32)
                if FPG == 1:
                    acc += (biased_field(words, i, BITS, ASM) * s[:, None] + o[:, None]) * xv[None, :]
                else:
                    acc_q += biased_field(words, i, BITS, ASM) * xv[None, :]
                    x_g += xv
            if FPG > 1:
                acc += s[:, None] * acc_q + o[:, None] * x_g[None, :]
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    write_out(tl.sum(acc, axis=1), bias, out_ptr, out_ptr + m.to(tl.int64) * stride_out + offs_n,
              part_ptr + m.to(tl.int64) * N + offs_n, T * N, n_mask, lock_ptr + m * tl.num_programs(0) + pid_n,
              pid_k, split_k, SPLIT, FENCE, NUM_THREADS)
