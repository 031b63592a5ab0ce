"""The tensor-core kernel's pair-codes path (`kernels.quant_mma`, 2+ rows; 4 bits in groups of 128 and more, the
paired layout, 16-bit x) with its words read by TMA, a half block a loop step: each step's [BLOCK_N, 16] words
(one half block, one group) are copied by the hardware into shared memory and its [128, BLOCK_M] x tile by
asynchronous copies, STAGES - 1 half blocks ahead of the arithmetic, through the compiler's pipeline. The
arithmetic per half block is `quant_mma`'s (`_half_operand`: BIAS + q as the dot's register operand, one K=128
dot, the group scale as one FMA per element; the offsets' part after the loop, `_offsets_term`).

Why (not measured yet): the register-set kernel keeps one block of words (8 KB a 64-feature program) in flight,
in registers, and its x stages are whole blocks (32 KB at 64 rows), so a 3-stage program takes 112 KB of shared
memory and 176 registers: two programs an SM, ~16 KB of words in flight an SM, about half of what the memory's
latency at full bandwidth asks for. Half-block stages (20 KB at 64 rows with the words) let 4-5 stages fit two
programs an SM, or 3 stages three (the words no longer held in registers), with 2-4 half blocks of words in
flight a program. `QuantMatmulConfig.tma_stages` > 0 with block_m > 1 takes it on sm_90+ (`pick_config` never
does); `bench/quant_kernel_sweep.py` times it beside the register-set tiles.
"""
import triton
import triton.language as tl

from kernels.dots import dot
from kernels.pdl import wait_then_release
from kernels.quant_gemv_tma import _prefetch_rows
from kernels.quant_mma import _half_operand, _load_x, _offsets_term, _scale_value, store_tile


@triton.jit
def _half_scale(s_ptr, h, offs_n, n_mask, N, GROUP: tl.constexpr, WORDS: tl.constexpr):
    """float32 [BN]: half block h's group scale of each row (WORDS: read as the 4-byte words holding two rows'
    float16s, as `quant_mma._block_scales` does)."""
    g = (h * 128) // GROUP
    if WORDS:
        words = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        v = tl.load(words + (g * N + offs_n) // 2, mask=n_mask, other=0)
    else:
        v = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0)
    return _scale_value(v, offs_n, WORDS)


@triton.jit
def quant_mma_tma_kernel(x_ptr, w_desc, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, xs_ptr,
                         num_halves, T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks,
                         split_k, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FENCE: tl.constexpr,
                         NUM_THREADS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr,
                         SCALE_WORDS: tl.constexpr, STAGES: tl.constexpr):
    """out.T tile [BLOCK_N, BLOCK_M] over K blocks b_lo..b_hi - 1 (grid axis 2: split-K), its words through w_desc
    (a [BLOCK_N, 16] box of the [N, words_per_row] int32 words, which w_ptr also points to, for the L2 requests
    before the wait; TMA fills rows past N with zeros). As a dependent launch (kernels/pdl.py) the first
    STAGES - 1 half blocks' words are requested into L2 before the wait; x, its sums, the partials and the
    locks are read after it."""
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, 128)
    n_mask, m_mask = offs_n < N, offs_m < T
    x_half = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x + offs_h[:, None]                # [128, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                              # out.T tile
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, num_blocks)
    rows = tl.minimum(offs_n, N - 1)
    for i in tl.static_range((STAGES + 1) // 2):            # a block (two half blocks) a 128-byte line a row
        _prefetch_rows(w_ptr, rows, words_per_row, tl.minimum(b_lo + i, b_hi - 1), USE_PDL and ASM)
    wait_then_release(USE_PDL)
    for h in tl.range(2 * b_lo, 2 * b_hi, num_stages=STAGES):
        words = w_desc.load([pid_n * BLOCK_N, h * 16])                                      # [BN, 16]
        xh = _load_x(x_half + h * 128, m_mask, h * 128 + offs_h < K, EVEN_K)                  # [128, BM]
        d = dot(_half_operand(words, BF16, ASM), xh, False)
        acc = tl.fma(_half_scale(s_ptr, h, offs_n, n_mask, N, GROUP, SCALE_WORDS)[:, None], d, acc)
    acc = _offsets_term(s_ptr, o_ptr, xs_ptr, num_halves, b_lo, b_hi, offs_n, n_mask, offs_m, m_mask, N, GROUP,
                        BF16, acc)
    store_tile(acc, offs_n, offs_m, n_mask, m_mask, bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, pid_m, pid_k,
               split_k, T, N, stride_out, HAS_BIAS, SPLIT, FENCE, NUM_THREADS)
