"""The tensor-core kernel of the quantized matmul (2+ rows; `kernels.quant_matmul` launches it): a program owns
BLOCK_N features by BLOCK_M tokens and a range of K blocks, and accumulates one fp32 out.T tile (features by
tokens, so a decode batch of 2-16 tokens is the dot's small side). The weight is dequantized in registers (q *
scale + offset in fp32, rounded once to x's dtype, `kernels.quant_tile`) either per 32-wide field, each fed to a
K=32 dot from the registers its words were loaded into (FIELD_DOTS), or per 256-wide block, staged in shared
memory for one dot (better for small, latency-bound weights; `pick_config`). 4 bits in groups of 128 and more
with 16-bit x (the 8B checkpoints' layout; `_pairs_step`): the codes are not dequantized before the dots at all.
One shift and one and-or turn a word into two 16-bit floats BIAS + q (fields i and i + 4: two neighbouring codes
of one half block in the paired layout of `kernels.quant_pack`, side by side as the dot's register operand holds
them, so no byte shuffle); each half block's 16 words give one K=128 dot (Triton lays the join out as the dot's
register operand: no trip through shared memory), and the half's group scale applies to the dot's fp32 sums as
one FMA per element; the offsets' part (with the BIAS it cancels), sum over halves of (o - BIAS s) * sum(x), is
3xTF32 dots after the loop, with the sums of x over each half computed once per call. Per code that is one
integer instruction instead of a float dequantization (H200, 8B layer shapes: 27% less time per layer at 8 rows,
18% at 64); the K=128 dots and the FMA epilogue took another 8-13% off at 16-64 rows (eight K=32 dots per block
each waited for its own result), and the offsets after the loop 11% at 64 rows and 14% at 128 (2f67efe ->
1e45111: the loop waits for 4 loads a block instead of 40, 397 instructions instead of 607, 171 registers instead
of 253).
"""
import triton
import triton.language as tl

from kernels.dots import dot
from kernels.pdl import wait_then_release
from kernels.quant_gemv import half_groups
from kernels.quant_split import write_out
from kernels.quant_tile import biased_pair, dequant_block, dequant_field, pair_bias


@triton.jit
def _load_x(ptrs, m_mask, k_mask, EVEN_K: tl.constexpr):
    """x.T tile [K-slice, BM]: tokens past T and (unless EVEN_K) features past K read as 0."""
    if EVEN_K:
        xt = tl.load(ptrs, mask=m_mask[None, :], other=0.0)
    else:
        xt = tl.load(ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
    return xt


@triton.jit
def _join4(f0, f1, f2, f3):
    """[BN, 128] from four [BN, 32] fields, column i * 32 + j = field i's column j."""
    BN: tl.constexpr = f0.shape[0]
    j = tl.join(tl.join(f0, f1), tl.join(f2, f3))                   # [BN, 32, 2 (u), 2 (v)]: field 2 v + u
    return tl.reshape(tl.permute(j, (0, 3, 2, 1)), (BN, 128))


@triton.jit
def _pair_cols(words, i: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """[BN, 32] from a half block's words [BN, 16] (paired layout): column 2 j + s is field i + 4 s of word j,
    code i * 32 + 2 j + s of the half. The two fields come from one and-or as a register's two halves, and
    the join puts them side by side as the dot's 16-bit operand holds them: no byte shuffle."""
    lo, hi = biased_pair(words, i, BF16, ASM)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _half_operand(words, BF16: tl.constexpr, ASM: tl.constexpr):
    """[BN, 128] BIAS + q of a half block in k order, from its 16 words a row (paired layout)."""
    return _join4(_pair_cols(words, 0, BF16, ASM), _pair_cols(words, 1, BF16, ASM),
                  _pair_cols(words, 2, BF16, ASM), _pair_cols(words, 3, BF16, ASM))


@triton.jit
def _pairs_step(words, b, acc, x_half, m_mask, offs_h, scales, offs_n, K, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                WORDS: tl.constexpr):
    """Block b of a 4-bit weight in groups of 128 or more (paired layout) into acc (out.T, [BN, BM]): words
    (`_load_words`) is the block's two halves, a (group g_a) and b (g_b), 16 words a row each; scales, their
    group scales as `_block_scales` read them a step earlier. The codes enter the dots as BIAS + q in x's type,
    exact (`biased_pair`: one shift and one instruction per two neighbouring codes, no float math per code, no
    shuffle); each half's 16 words become one [BN, 128] operand in k order (`_half_operand`, so x's half-block
    tile is read as it lies) for one K=128 dot; its sum D = sum((B + q) x) takes the half's group scale after
    the dot, one FMA per element in fp32. The offsets' part, sum over halves of (o - B s) * sum(x), is dots after
    the loop (`_offsets_term`)."""
    BF16: tl.constexpr = x_half.dtype.element_ty == tl.bfloat16
    words_a, words_b = words
    k_a = b * 256
    xa = _load_x(x_half + k_a, m_mask, k_a + offs_h < K, EVEN_K)                      # [128, BM]
    xb = _load_x(x_half + k_a + 128, m_mask, k_a + 128 + offs_h < K, EVEN_K)
    d_a = dot(_half_operand(words_a, BF16, ASM), xa, False)
    d_b = dot(_half_operand(words_b, BF16, ASM), xb, False)
    acc = tl.fma(_scale_value(scales[0], offs_n, WORDS)[:, None], d_a, acc)
    acc = tl.fma(_scale_value(scales[1], offs_n, WORDS)[:, None], d_b, acc)
    return acc


@triton.jit
def _block_scales(s_ptr, b, offs_n, n_mask, N, GROUP: tl.constexpr, WORDS: tl.constexpr):
    """Block b's two halves' group scales (paired layout), requested a loop step before their use. WORDS (N even,
    s_ptr 4-byte aligned): the 4-byte words holding each row's float16 (rows n and n ^ 1 share one), carried to the
    next step as read; as 16-bit values a pack at the loop's back edge would wait for them. Else the float16s."""
    g_a, g_b = half_groups(b, GROUP)
    if WORDS:
        words = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        scales = (tl.load(words + (g_a * N + offs_n) // 2, mask=n_mask, other=0),
                  tl.load(words + (g_b * N + offs_n) // 2, mask=n_mask, other=0))
    else:
        scales = (tl.load(s_ptr + g_a * N + offs_n, mask=n_mask, other=0.0),
                  tl.load(s_ptr + g_b * N + offs_n, mask=n_mask, other=0.0))
    return scales


@triton.jit
def _scale_value(v, offs_n, WORDS: tl.constexpr):
    """float32: row offs_n's scale from `_block_scales` (WORDS: the word's high half for odd rows)."""
    if WORDS:
        v = ((v >> (16 * (offs_n % 2))) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _group_pairs_step(words, b, acc, x_cols, m_mask, offs_k, s_ptr, offs_n, n_mask, N, K, EVEN_K: tl.constexpr,
                      ASM: tl.constexpr):
    """Block b of a 4-bit weight in groups of 32 (plain layout: field i of the block's words is group 8 b + i)
    into acc (out.T, [BN, BM]): fields i and i + 4 come from one and-or as BIAS + q in x's type (`biased_pair`),
    exact, each one K=32 dot against its group's x rows; each dot's sum takes its group scale after it, one
    FMA per element in fp32. The offsets' part is dots after the loop (`_offsets_term`, 32-wide slices)."""
    BF16: tl.constexpr = x_cols.dtype.element_ty == tl.bfloat16
    for i in tl.static_range(4):
        lo, hi = biased_pair(words, i, BF16, ASM)
        k_lo = b * 256 + i * 32
        k_hi = k_lo + 128
        x_lo = _load_x(x_cols + k_lo, m_mask, k_lo + offs_k < K, EVEN_K)                  # [32, BM]
        x_hi = _load_x(x_cols + k_hi, m_mask, k_hi + offs_k < K, EVEN_K)
        s_lo = tl.load(s_ptr + (b * 8 + i) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        s_hi = tl.load(s_ptr + (b * 8 + i + 4) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = tl.fma(s_lo[:, None], dot(lo, x_lo, False), acc)
        acc = tl.fma(s_hi[:, None], dot(hi, x_hi, False), acc)
    return acc


@triton.jit
def _offsets_term(s_ptr, o_ptr, xs_ptr, num_halves, b_lo, b_hi, offs_n, n_mask, offs_m, m_mask, N,
                  GROUP: tl.constexpr, BF16: tl.constexpr, acc, WIDTH: tl.constexpr = 128):
    """acc + [BN, BM]: the sum over the halves h of blocks b_lo..b_hi - 1 of (o - BIAS s)[g(h), n] * xs[t, h]
    (xs: the sums of x over each WIDTH-wide slice: 128-wide halves, or groups of 32 for `_group_pairs_step`),
    the part of the pair-codes steps' sums their FMAs leave out, as dots in three TF32 passes (about fp32's
    precision, as the term cancels most of BIAS * s * sum(x) in the dots' sums), 16 halves a dot: a loop over K's halves, so its registers stay those of a short K (sm_90: 173 a thread
    at 64-row tiles, against 225 for dots of 32 halves and 234 for one dot of 128)."""
    HALVES: tl.constexpr = 16
    PER_BLOCK: tl.constexpr = 256 // WIDTH                  # slices of x a block (WIDTH 32: groups of 32)
    for h0 in range(PER_BLOCK * b_lo, PER_BLOCK * b_hi, HALVES):
        h = h0 + tl.arange(0, HALVES)
        valid = (h < PER_BLOCK * b_hi) & (h < num_halves)
        go = ((h * WIDTH) // GROUP)[None, :] * N + offs_n[:, None]                           # [BN, HALVES]
        mask = n_mask[:, None] & valid[None, :]
        o = (tl.load(o_ptr + go, mask=mask, other=0.0).to(tl.float32)
             - pair_bias(BF16) * tl.load(s_ptr + go, mask=mask, other=0.0).to(tl.float32))
        xs = tl.load(xs_ptr + offs_m[None, :] * num_halves + h[:, None], mask=valid[:, None] & m_mask[None, :],
                     other=0.0)                                                              # [HALVES, BM]
        acc = tl.dot(o, xs, acc, input_precision="tf32x3")
    return acc


@triton.jit
def _load_words(w_ptr, offs_n, n_mask, words_per_row, b, PAIRS: tl.constexpr):
    """Block b's words: [BN, 32] int32, or PAIRS its two halves' [BN, 16] (paired layout: words 0-15 hold
    the first 128 codes)."""
    if PAIRS:
        rows = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + b * 32 + tl.arange(0, 16)[None, :]
        words = (tl.load(rows, mask=n_mask[:, None], other=0), tl.load(rows + 16, mask=n_mask[:, None], other=0))
    else:
        rows = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + b * 32 + tl.arange(0, 32)[None, :]
        words = tl.load(rows, mask=n_mask[:, None], other=0)
    return words


@triton.jit
def _mm_block(words, b, acc, x_cols, m_mask, offs_k, s_ptr, o_ptr, offs_n, n_mask,
              N, K, GROUP: tl.constexpr, BITS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
              FIELD_DOTS: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr, PAIRED: tl.constexpr):
    """Block b's words into acc (out.T, [BN, BM]) by the path the call picked."""
    BLOCK_K: tl.constexpr = 32 * (32 // BITS)
    if PAIRS and not PAIRED:    # groups of 32; x_cols: [32, BM] tiles of x.T
        acc = _group_pairs_step(words, b, acc, x_cols, m_mask, offs_k, s_ptr, offs_n, n_mask, N, K, EVEN_K, ASM)
    elif FIELD_DOTS:      # one K=32 dot per field: the codes reach the dot with no trip through shared memory
        for i in tl.static_range(32 // BITS):
            k0 = b * BLOCK_K + i * 32
            xt = _load_x(x_cols + k0, m_mask, k0 + offs_k < K, EVEN_K)                    # [32, BM]
            w = dequant_field(words, s_ptr, o_ptr, k0 // GROUP, N, offs_n, n_mask, i, BITS).to(xt.dtype)
            acc = dot(w, xt, IEEE, acc)
    else:               # one dot over the whole block, the [BN, BLOCK_K] tile staged in shared memory
        xt = _load_x(x_cols + b * BLOCK_K, m_mask, b * BLOCK_K + offs_k < K, EVEN_K)     # [BK, BM]
        w = dequant_block(words, s_ptr, o_ptr, b, N, offs_n, n_mask, GROUP, BITS, PAIRED).to(xt.dtype)
        acc = dot(w, xt, IEEE, acc)
    return acc


@triton.jit
def quant_mma_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, xs_ptr, num_halves,
                         T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks, split_k,
                         GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                         FENCE: tl.constexpr, NUM_THREADS: tl.constexpr, FIELD_DOTS: tl.constexpr,
                         PAIRS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, PAIRED: tl.constexpr,
                         SCALE_WORDS: tl.constexpr):
    # As a dependent launch (kernels/pdl.py) the first block's words are read before the wait; x, the sums
    # of x, the partials and the locks after it.
    BLOCK_K: tl.constexpr = 32 * (32 // BITS)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    K_STEP: tl.constexpr = 128 if PAIRS and PAIRED else 32 if FIELD_DOTS or PAIRS else BLOCK_K     # x rows a dot
    offs_k = tl.arange(0, K_STEP)
    n_mask, m_mask = offs_n < N, offs_m < T
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x + offs_k[:, None]                 # [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                              # out.T tile
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, num_blocks)
    words = _load_words(w_ptr, offs_n, n_mask, words_per_row, b_lo, PAIRS and PAIRED)
    if PAIRS and PAIRED:    # block b + 1's group scales requested in block b's step (none waited for in its own)
        scales = _block_scales(s_ptr, b_lo, offs_n, n_mask, N, GROUP, SCALE_WORDS)
        wait_then_release(USE_PDL)
        ahead = _block_scales(s_ptr, tl.minimum(b_lo + 1, b_hi - 1), offs_n, n_mask, N, GROUP, SCALE_WORDS)
        acc = _pairs_step(words, b_lo, acc, x_cols, m_mask, offs_k, scales, offs_n, K, EVEN_K, ASM, SCALE_WORDS)
        scales = ahead
        for b in range(b_lo + 1, b_hi):
            words = _load_words(w_ptr, offs_n, n_mask, words_per_row, b, True)
            ahead = _block_scales(s_ptr, tl.minimum(b + 1, b_hi - 1), offs_n, n_mask, N, GROUP, SCALE_WORDS)
            acc = _pairs_step(words, b, acc, x_cols, m_mask, offs_k, scales, offs_n, K, EVEN_K, ASM, SCALE_WORDS)
            scales = ahead
    else:
        wait_then_release(USE_PDL)
        acc = _mm_block(words, b_lo, acc, x_cols, m_mask, offs_k, s_ptr, o_ptr, offs_n, n_mask, N, K, GROUP, BITS,
                        EVEN_K, IEEE, FIELD_DOTS, PAIRS, ASM, PAIRED)
        for b in range(b_lo + 1, b_hi):
            words = _load_words(w_ptr, offs_n, n_mask, words_per_row, b, PAIRS and PAIRED)
            acc = _mm_block(words, b, acc, x_cols, m_mask, offs_k, s_ptr, o_ptr, offs_n, n_mask, N, K, GROUP, BITS,
                            EVEN_K, IEEE, FIELD_DOTS, PAIRS, ASM, PAIRED)
    if PAIRS:           # the offsets' part
        acc = _offsets_term(s_ptr, o_ptr, xs_ptr, num_halves, b_lo, b_hi, offs_n, n_mask, offs_m, m_mask, N, GROUP,
                            x_ptr.dtype.element_ty == tl.bfloat16, acc, 128 if PAIRED else 32)
    store_tile(acc, offs_n, offs_m, n_mask, m_mask, bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, pid_m, pid_k,
               split_k, T, N, stride_out, HAS_BIAS, SPLIT, FENCE, NUM_THREADS)


@triton.jit
def store_tile(acc, offs_n, offs_m, n_mask, m_mask, bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, pid_m, pid_k,
               split_k, T, N, stride_out, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FENCE: tl.constexpr,
               NUM_THREADS: tl.constexpr):
    """out[offs_m, offs_n] = acc.T (+ bias), or under split-K this program's partial, the tile's last program
    summing them (`write_out`, the tile's counter in lock_ptr)."""
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]   # [BN, BM]
    part_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]          # [BN, BM] of split 0
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    write_out(acc, bias, out_ptr, out_ptrs, part_ptrs, T * N, n_mask[:, None] & m_mask[None, :],
              lock_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT, FENCE, NUM_THREADS)
