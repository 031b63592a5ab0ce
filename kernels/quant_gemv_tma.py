"""The one-row 4-bit kernel's float16-pairs path (`kernels.quant_gemv`, H2: bfloat16 x, 4 bits in groups of 128
and more, the paired layout) with its words read by the tensor memory accelerator (TMA) through the compiler's
multi-stage pipeline: each block's [BLOCK_N, 32] words are copied by the hardware into shared memory, STAGES - 1
blocks ahead of the arithmetic, with no registers held while they are in flight. The register-set kernel holds
one block of words in flight a thread (its loop's loads wait behind a block of arithmetic); here the copies run
on regardless of how far the arithmetic is. The arithmetic is the register-set kernel's (`quant_gemv.h2_block`).

SCALES_AHEAD: each block's scales and offsets are read one block ahead (in the words' layout, `tile_value`;
more registers; `scale_tiles`), else in the block's own step. As a dependent launch (kernels/pdl.py) the first STAGES - 1
blocks of each row are requested into L2 before the wait (`_prefetch_rows`): the pipeline's own first copies
are issued after it.

Taken where `QuantMatmulConfig.tma_stages` > 0 (`pick_config`: one row of a weight whose 128-feature tiles alone
fill the SMs, gate/up, split 4 (2 beside a LoRA launch), two stages) unless LORAPLEX_H2_TMA=0;
LORAPLEX_H2_TMA=stages[,1] forces it on every float16-pairs launch (`kernels.quant_matmul.tma_override`). H200, the
8B's gate/up: 24.6-25.5 us against 28.9-30.4 for the register-set kernel; on q/k/v, o and down (split 8: two to
seven blocks a program) it is no faster, the pipeline's start costing what it hides (bench/results/quant_tma_ab.json).
"""
import triton
import triton.language as tl

from kernels.pdl import read_early, wait_then_release
from kernels.quant_gemv import h2_block, half_groups, one_row_out, scale_tiles, x_words


@triton.jit
def _prefetch_rows(w_ptr, offs_n, words_per_row, b, ON: tl.constexpr):
    """Requests block b of each row (128 bytes a row: one line) into L2 (ON: compiled; the interpreter has no
    caches)."""
    if ON:
        p = w_ptr + offs_n.to(tl.int64) * words_per_row + b * 32
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.b32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def quant_gemv_tma_kernel(x_ptr, w_desc, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, add_ptr,
                          T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks, split_k,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          EVEN_K: tl.constexpr, FENCE: tl.constexpr, NUM_THREADS: tl.constexpr, ASM: tl.constexpr,
                          USE_PDL: tl.constexpr, ADD: tl.constexpr, STAGES: tl.constexpr,
                          SCALES_AHEAD: tl.constexpr):
    """`quant_gemv_kernel`'s H2 path (one token row per program, grid axis 1; BLOCK_N features, axis 0; a range
    of K blocks, axis 2), its words read through w_desc (a [BLOCK_N, 32] box of the [N, words_per_row] int32
    words, which w_ptr also points to, for the L2 requests before the wait)."""
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)
    x_base = x_ptr + m.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, num_blocks)
    read_early(ADD and FENCE, NUM_THREADS)                   # ADD: x is read before the wait
    rows = tl.minimum(offs_n, N - 1)
    for i in tl.static_range(STAGES - 1):
        _prefetch_rows(w_ptr, rows, words_per_row, tl.minimum(b_lo + i, b_hi - 1), USE_PDL and ASM)
    if not ADD:
        wait_then_release(USE_PDL)
    if SCALES_AHEAD:
        g_a, g_b = half_groups(b_lo, GROUP)
        s, o = scale_tiles(s_ptr, o_ptr, g_a, g_b, offs_n, N, ASM)
    for b in tl.range(b_lo, b_hi, num_stages=STAGES):
        words = w_desc.load([pid_n * BLOCK_N, b * 32])
        xv = x_words(x_base, b, offs_j, K, EVEN_K)
        if SCALES_AHEAD:
            g_a1, g_b1 = half_groups(tl.minimum(b + 1, b_hi - 1), GROUP)
            s1, o1 = scale_tiles(s_ptr, o_ptr, g_a1, g_b1, offs_n, N, ASM)
            acc = h2_block(words, xv, s, o, acc, ASM)
            s = s1
            o = o1
        else:
            g_a, g_b = half_groups(b, GROUP)
            s, o = scale_tiles(s_ptr, o_ptr, g_a, g_b, offs_n, N, ASM)
            acc = h2_block(words, xv, s, o, acc, ASM)
    if ADD:
        wait_then_release(USE_PDL)
    one_row_out(tl.sum(acc, axis=1), offs_n, offs_n < N, m, pid_n, pid_k, split_k, T, N, stride_out, bias_ptr,
                out_ptr, part_ptr, lock_ptr, add_ptr, HAS_BIAS, SPLIT, FENCE, NUM_THREADS, ADD)
