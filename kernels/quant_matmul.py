"""Weight-only quantized matmul (W4A16 / W8A16): out = x @ dequant(W).T, reading the packed codes in place.

Two kernels of one family, both reading `kernels.quant_pack`'s layout (per K block, 32 int32 words per
row; field i of the words holds 32 consecutive codes of one group, or, in the paired layout of 4 bits in
groups of 128+, 32 codes of one half block, two neighbours a word):

- Tensor-core kernel (2+ rows, `_quant_matmul_kernel` here): a program owns BLOCK_N features by BLOCK_M
  tokens and a range of K blocks, and accumulates one fp32 out.T tile (features by tokens, so a decode
  batch of 2-16 tokens is the dot's small side). The weight is dequantized in registers (q * scale +
  offset in fp32, rounded once to x's dtype, `kernels.quant_tile`) either per 32-wide field, each fed
  to a K=32 dot from the registers its words were loaded into (FIELD_DOTS), or per 256-wide block,
  staged in shared memory for one dot (better for small, latency-bound weights; `pick_config`).
  4 bits in groups of 128 and more with 16-bit x (the 8B checkpoints' layout; `_pairs_step`): the codes are
  not dequantized before the dots at all. One shift and one and-or turn a word into two 16-bit floats BIAS + q
  (fields i and i + 4: two neighbouring codes of one half block in the paired layout of `kernels.quant_pack`,
  side by side as the dot's register operand holds them, so no byte shuffle); each half block's 16 words give
  one K=128 dot (Triton lays the join out as the dot's register operand: no trip through shared memory), and
  the half's group scale applies to the dot's fp32 sums as one FMA per element; the offsets' part (with the
  BIAS it cancels), sum over halves of (o - BIAS s) * sum(x), is 3xTF32 dots after the loop, with the sums
  of x over each half computed once per call. Per code that is one integer instruction instead of a float
  dequantization (H200, 8B layer shapes: 27% less time per layer at 8 rows, 18% at 64); the K=128 dots and
  the FMA epilogue took another 8-13% off at 16-64 rows (eight K=32 dots per block each waited for its own
  result), and the offsets after the loop 11% at 64 rows and 14% at 128 (2f67efe -> 1e45111: the loop
  waits for 4 loads a block instead of 40, 397 instructions instead of 607, 171 registers instead of 253).
- One-row kernel (batch-1 decode, `kernels.quant_gemv`): no tensor cores, codes * x elementwise in fp32.

Split-K (decode: few output tiles for 132 SMs, e.g. the down projection N=4096, K=14336) is
`kernels.quant_split`: the last program of a tile sums the partials, in the same launch.
For many rows, `kernels.quant_dequant.dequantize_packed` writes the dense weight for a library GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv, next_pow2
from kernels.pdl import compiled, launch_args, pdl_enabled, wait_then_release
from kernels.quant_gemv import half_groups, quant_gemv_kernel
from kernels.quant_half_sums import half_sums_into
from kernels.quant_pack import PackedQuantWeight, block_k, paired_layout
from kernels.quant_split import write_out
from kernels.quant_tile import biased_pair, dequant_block, dequant_field, pair_bias


@dataclass(frozen=True)
class QuantMatmulConfig:
    block_n: int        # output features per program (>= 16)
    block_m: int        # tokens per program: 1 (the one-row kernel) or >= 16 (tensor cores)
    split_k: int        # programs sharing one output tile along K
    num_warps: int = 4
    num_stages: int = 3
    field_dots: bool = True     # tensor cores: one K=32 dot per field (else one dot per 256-wide block)
    pair_codes: bool = True     # tensor cores, 4 bits in groups of 128+, 16-bit x: codes into the dot as they
                                # are, group scales after it (`_pairs_step`); else dequantized before the dot
    thread_rows: bool = False   # one row, groups of 32: each thread holds whole rows of a block, one FMA chain
                                # a group and row (`quant_gemv._rows_step`)


def group_pairs_layout(bits: int, group_size: int, K: int) -> bool:
    """Whether a weight suits the pair-codes path for groups of 32 (`_group_pairs_step`): 4 bits in groups of
    32 (the plain layout: a block's field i is one group) and K a multiple of 32."""
    return bits == 4 and group_size == 32 and K % 32 == 0


def pair_codes_layout(bits: int, group_size: int, K: int) -> bool:
    """Whether a weight's layout suits the pair-codes path (`_pairs_step`): the paired layout (4 bits, groups
    of 128 or more: each half block of 128 codes in one group), and K a multiple of 128 (whole halves of x
    to sum)."""
    return paired_layout(bits, group_size) and K % 128 == 0


@triton.jit
def _load_x(ptrs, m_mask, k_mask, EVEN_K: tl.constexpr):
    """x.T tile [K-slice, BM]: tokens past T and (unless EVEN_K) features past K read as 0."""
    if EVEN_K:
        xt = tl.load(ptrs, mask=m_mask[None, :], other=0.0)
    else:
        xt = tl.load(ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
    return xt


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _code_dot(codes, x, ASM: tl.constexpr):
    """fp32 codes @ x for the pair-codes steps (16-bit operands). Triton's interpreter (ASM false: nothing is
    compiled) computes bfloat16 dots wrongly (the raw bit patterns multiplied), so there the operands go to fp32
    first (exact: every 16-bit value is one); compiled, the dot takes them as they are."""
    if not ASM:
        codes = codes.to(tl.float32)
        x = x.to(tl.float32)
    return tl.dot(codes, x)


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
    d_a = _code_dot(_half_operand(words_a, BF16, ASM), xa, ASM)
    d_b = _code_dot(_half_operand(words_b, BF16, ASM), xb, ASM)
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
        acc = tl.fma(s_lo[:, None], _code_dot(lo, x_lo, ASM), acc)
        acc = tl.fma(s_hi[:, None], _code_dot(hi, x_hi, ASM), acc)
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
            acc = _dot(w, xt, acc, IEEE)
    else:               # one dot over the whole block, the [BN, BLOCK_K] tile staged in shared memory
        xt = _load_x(x_cols + b * BLOCK_K, m_mask, b * BLOCK_K + offs_k < K, EVEN_K)     # [BK, BM]
        w = dequant_block(words, s_ptr, o_ptr, b, N, offs_n, n_mask, GROUP, BITS, PAIRED).to(xt.dtype)
        acc = _dot(w, xt, acc, IEEE)
    return acc


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, xs_ptr, num_halves,
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
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]   # [BN, BM]
    part_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]          # [BN, BM] of split 0
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    write_out(acc, bias, out_ptr, out_ptrs, part_ptrs, T * N, n_mask[:, None] & m_mask[None, :],
              lock_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT, FENCE, NUM_THREADS)


def _quad_words(w: PackedQuantWeight) -> bool:
    """The words' layout gives a thread 4 consecutive words of a row (16-byte reads: rows of a multiple of 16 words,
    16-byte aligned), which `kernels.quant_h2.h2_acc4`'s packs of 4 assume (otherwise its packs would group other
    elements, silently). Packed rows always hold a multiple of 16 words (`kernels.quant_pack`, 4 bits); words
    that do not start 16-byte aligned (a view at an odd offset) take the fp32 path."""
    return w.words.shape[1] % 16 == 0 and w.words.data_ptr() % 16 == 0


def quant_matmul(
    x: torch.Tensor,                 # [T, K] float16 / bfloat16 / float32, unit stride along K
    w: PackedQuantWeight,            # [N, K] packed (kernels.quant_pack)
    bias: torch.Tensor | None,       # [N] or None
    out: torch.Tensor,               # [T, N] contiguous, x's dtype
    config: QuantMatmulConfig,
    partials: torch.Tensor | None = None,   # float32, >= split_k * T * N elements (split_k > 1 only)
    locks: torch.Tensor | None = None,      # int32 zeros, >= cdiv(N, block_n) * cdiv(T, block_m) (split_k > 1)
    addend: torch.Tensor | None = None,     # [T, N] float32 contiguous, one-row kernel only (block_m == 1)
) -> None:
    """Semantics (fp32 accumulation; IEEE fp32 products for float32 x):
        W = q * scales[:, k // G] + offsets[:, k // G]          # [N, K] in fp32, q unpacked from w.words
        out[:] = (x.float() @ W.to(x.dtype).float().T + (bias.float() if bias is not None else 0)).to(x.dtype)
    The tensor-core kernel (block_m >= 16) rounds W to x's dtype once before its dot (bf16: relative
    2**-9 per weight), except on the pair-codes path (4 bits, groups of 128+, K % 128 == 0, 16-bit x),
    which like the one-row kernel (block_m == 1) keeps W in fp32: the scales apply to the fp32 sums (its
    offsets' part as a 3xTF32 dot, about fp32's precision). One exception to fp32 products: the one-row kernel
    on the paired layout (4 bits, groups of 128+) with bfloat16 x sums each word's 8 codes times x in float16
    pairs (`kernels.quant_h2`: relative ~2e-3 before the output's rounding; exact range |x| < 2**15).
    `locks` must hold zeros before the call and holds zeros after it.
    With an `addend` (one-row kernel) out also adds it before rounding, and it is left all zeros. The
    kernel is then meant to follow the launch that wrote the addend (the LoRA delta, into zeros): it reads
    x and the whole weight before waiting for that launch (kernels/pdl.py) and waits only to add it, so
    the caller guarantees that no kernel since x was written wrote anything this one reads but the addend.
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
    if cfg.thread_rows and (cfg.block_m != 1 or w.group_size != 32):
        raise ValueError(f"bad config {cfg}: thread_rows is the one-row kernel's path for groups of 32")
    if addend is not None and (cfg.block_m != 1 or addend.dtype != torch.float32 or addend.numel() != T * N
                               or not addend.is_contiguous()):
        raise ValueError(f"an addend takes the one-row kernel (block_m 1) and contiguous float32 [{T}, {N}], got "
                         f"block_m {cfg.block_m}, {addend.dtype} {tuple(addend.shape)}")
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
    pairs = (cfg.block_m > 1 and cfg.pair_codes and cfg.field_dots and x.dtype != torch.float32
             and (pair_codes_layout(w.bits, w.group_size, K) or group_pairs_layout(w.bits, w.group_size, K)))
    if pairs and split > 1 and cfg.num_warps > 4:
        raise ValueError(f"bad config {cfg}: the pair-codes tiles on more than 4 warps run without split-K only "
                         "(split-K there made an illegal memory access on an H200; not diagnosed)")
    paired = paired_layout(w.bits, w.group_size)    # without the pair-codes path: one dot per block
    x_sums = out
    width = 128 if paired else 32
    if pairs:       # sum of x over each 128-wide half block (32-wide group), once per call (`_offsets_term`)
        x_sums = half_sums(x, width)
    buffers = (x, w.words, w.scales, w.offsets, bias if bias is not None else out, out,
               partials if split > 1 else out, locks if split > 1 else out)
    sizes = (T, N, K, x.stride(0), out.stride(0), w.words.shape[1], per_split, num_blocks, split)
    even_k = K % block_k(w.bits) == 0
    asm = compiled()                                   # fences and inline assembly: not interpreted
    pdl = launch_args(pdl_enabled(x.device))
    if cfg.block_m == 1:
        x32 = (paired or cfg.thread_rows) and x.element_size() == 2 and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
        h2 = paired and x32 and x.dtype == torch.bfloat16 and _quad_words(w)
        quant_gemv_kernel[grid](*buffers, addend if addend is not None else out, *sizes, GROUP=w.group_size,
                                BITS=w.bits, BLOCK_N=cfg.block_n, SPLIT=split > 1, HAS_BIAS=bias is not None,
                                EVEN_K=even_k, FENCE=asm, NUM_THREADS=32 * cfg.num_warps, ASM=asm,
                                ADD=addend is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                PAIRED=paired, X32=x32, ROWS=cfg.thread_rows, H2=h2,
                                EVEN_N=h2 and N % cfg.block_n == 0, **pdl)
    else:
        _quant_matmul_kernel[grid](*buffers, x_sums, K // width, *sizes, GROUP=w.group_size, BITS=w.bits,
                                   BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SPLIT=split > 1, HAS_BIAS=bias is not None,
                                   EVEN_K=even_k, IEEE=x.dtype == torch.float32, FENCE=asm,
                                   NUM_THREADS=32 * cfg.num_warps,
                                   FIELD_DOTS=cfg.field_dots and not paired, PAIRS=pairs, ASM=asm,
                                   PAIRED=paired, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                   SCALE_WORDS=pairs and paired and N % 2 == 0 and w.scales.data_ptr() % 4 == 0,
                                   **pdl)


def half_sums(x: torch.Tensor, width: int = 128) -> torch.Tensor:
    """[T, K / width] float32: the sums of x [T, K] over each 128-wide half block (width 32: each group of 32),
    the pair-codes paths' offsets term (`_offsets_term`), by a dependent launch (`kernels.quant_half_sums`)."""
    out = torch.empty(x.shape[0], x.shape[1] // width, dtype=torch.float32, device=x.device)
    half_sums_into(x, out, width)
    return out


# Weights of fewer codes (N * K) are latency-bound: their own tiles in pick_config, dense from 65 rows.
SMALL_WEIGHT = 4 * 2**20


def dense_min_rows(N: int, K: int, bits: int, group_size: int) -> int:
    """Rows from which dequantizing the weight once and running a library GEMM beats this kernel (QuantLinear's
    switch). H100 sweeps: 65 for most layouts (the fused kernel was 30-40% slower on o and down at 128 rows);
    H200 sweep of the 8B shapes on the pair-codes path: 256 (a layer at 128 rows 229 us against 354, at 192
    rows 341 against 379, at 256 rows even, 393 against 392; bench/results/quant_kernel_big_rows.json); 4 bits
    in groups of 32 (pair codes): 129 (a layer at 96 rows 284 us against 359, at 128 rows 295 against 364, at
    192 rows 506 against 388; bench/results/quant_kernel_big_rows_g32.json)."""
    if N * K < SMALL_WEIGHT:
        return 65
    return 256 if pair_codes_layout(bits, group_size, K) else 129 if group_pairs_layout(bits, group_size, K) else 65


def pick_config(T: int, N: int, K: int, bits: int, num_sms: int, group_size: int = 128,
                x_dtype: torch.dtype = torch.bfloat16, beside_lora: bool = False) -> QuantMatmulConfig:
    """Kernel, tiles and split-K for a shape (bench/quant_kernel_sweep.py on an H100: the 8B layer shapes at
    group 128 and the default SmolLM2's at group 32; each rule below was the fastest or within ~10% there).

    One row of a large 4-bit weight in groups of 32 with K < 8192 (what a Q4_0 GGUF of an 8B runs): each
    thread holds two whole rows of a block (`thread_rows`, 128-feature programs of 2 warps; sm_90 machine code
    4.52 instructions a code against 7.95 for the elementwise kernel's 32-feature programs), split to about 8
    programs an SM, rounded up to a power of two, at most 16 (H200 sweep, 8B shapes, against the elementwise
    kernel's rule: q/k/v 17.1 -> 13.9 us, o 11.8 -> 11.4, gate/up 47.1 -> 46.0; down, K = 14336, stays
    elementwise: 30.6 there against 32.7; `bench/results/quant_rows32_ab.json`).
    One row of a large 4-bit weight in groups of 128 and more with bfloat16 x (the served 8B; `quant_gemv`'s
    two-register-set float16-pairs path): 128-feature programs, split to about three programs an SM or fewer
    (one wave at its 168 registers), at most 16 (H200 sweep of the 8B shapes over 32/64/128 features and splits
    1-16, bench/results/quant_sweep_8b_rows1.json: q/k/v 7.6 us at split 8 against 9.5 at the two-an-SM rule's
    4; o and down 6.9 / 16.1 at 8, each the fastest; gate/up 28.9 at 1, the fastest 27.9). `beside_lora` (the
    call adds a LoRA delta whose fused launch runs beside it, `quant_matmul`'s addend): about two an SM, leaving
    room for that launch's programs (only q/k/v differs, 8 -> 4: H200 engine at batch 1, one run each, rank 16
    on every module 2.91 against 2.84 ms a token, rank 64 on q/k/v 2.65 against 2.55; with no adapter 2.39
    against 2.43, bench/results/quant_chain4_ab.json).
    Other one-row cases: the elementwise kernel, split until ~8 programs of 32 features per SM (the same feature
    count as ~4 programs of 64) where K has 6 blocks or more; 64 features per program for 4 bits in groups
    of 128 and more (its two-halves path: H200 sweep, each 8B shape's fastest or within 5%), else 32.
    The same kernel (a program per row) for 2-8 rows of a small weight with T * N <= 8192 (the default
    SmolLM2's q/k/v, o and down up to 8 rows, gate/up up to 2; H200: 3.4-6.0 us against 5.3-6.4 for the
    tensor-core tiles; each row reads the weight, from L2 at these sizes).
    2-64 rows on a small weight (N * K < 4M, latency-bound): one dot per 256-wide block, 32-feature tiles;
    below 6 blocks of K no split, from 6 blocks split 4. (16-feature programs of 2 warps were 10% faster
    per launch in the sweep at 1-16 rows; one run of the default model's engine decode with them was
    13-24% slower at batch 1/8, inside that benchmark's run-to-run spread: not picked until measured.)
    On a large weight: one dot per field, 64-feature tiles, split 4 (8 for a long K), none above 32 rows
    when the feature tiles alone fill the SMs. 4 bits in groups of 128+ (the pair-codes path; H200 sweeps of
    the 8B shapes at 8-64 rows, each within 10% of its best): 64-feature tiles, split 1 where the tiles
    fill the SMs twice, else 4 (8 for a long K up to 16 rows); above 16 rows split to about two programs per
    SM (q/k/v at 48-64 rows: 26.5 -> 23.0 us with split 2 instead of 4; at 32 rows 21.7 -> 18.6-19.4 us).
    Token tiles of 16 / 32 / 64 rows (32 where a long K or few feature tiles leave SMs idle).
    More than 64 rows of a large weight on the pair-codes path: the same 64 x 64 tiles and split rule (H200,
    8B shapes at 96-256 rows: the fastest of 64/128-row token tiles, 64/128-feature tiles, 4/8 warps and 2-4
    stages; QuantLinear runs it below `dense_min_rows`).
    65-128 rows of a large 4-bit weight in groups of 32 (pair codes, `_group_pairs_step`; QuantLinear runs it
    below `dense_min_rows`): 128 x 128 tiles on 8 warps where 128-feature tiles alone fill the SMs (gate/up),
    else 64 x 64, split 2 where those tiles do not fill the SMs once (H200 sweep of the 8B shapes at 96 and 128
    rows, `bench/results/quant_kernel_big_rows_g32.json`: each the fastest tried; a layer at 128 rows 295 us
    against 364 for dequantize + GEMM; at 192 rows and more the GEMM is faster).
    Other layouts above 64 rows: 128 x 64 tiles (QuantLinear dequantizes and uses a GEMM there).
    Other layouts on a large weight (groups of 32 or 64, 8 bits; H200 sweep of the 8B shapes at group 32,
    `bench/results/quant_kernel_sweep_8b_g32.json`): 33-64 rows with K < 8192 take one dot per 256-wide block
    with no split, 64-feature tiles, or 128 on 8 warps where those alone fill the SMs (64 rows: q/k/v 60.9 ->
    33.1 us, o 42.2 -> 33.6, gate/up 188.5 -> 108.4); 8-32 rows split 2 where the tiles fill the SMs twice
    (gate/up at 32 rows 112.0 -> 99.3). 4 bits in groups of 32 take pair codes (`_group_pairs_step`) wherever
    those rules pick one dot per field; at 33-64 rows with K < 8192 64 x 64 tiles, split 4 unless the tiles
    fill the SMs twice (H200, `bench/results/quant_group_pairs_ab.json`, 64 rows: o 33.2 -> 20.8 us, gate/up
    106.5 -> 90.6; q/k/v 33.3 -> 35.6, within 10%)."""
    num_blocks = -(-K // block_k(bits))

    def pow2_floor(v: int) -> int:
        return 1 << (max(1, v).bit_length() - 1)

    if T == 1 and bits == 4 and group_size == 32 and K < 8192 and N * K >= SMALL_WEIGHT:     # whole rows a thread
        split = min(next_pow2(cdiv(8 * num_sms, cdiv(N, 128))), 16)
        return QuantMatmulConfig(128, 1, max(1, min(split, num_blocks)), num_warps=2, thread_rows=True)
    if T == 1 and paired_layout(bits, group_size) and x_dtype == torch.bfloat16 and N * K >= SMALL_WEIGHT:
        split = pow2_floor((2 if beside_lora else 3) * num_sms // cdiv(N, 128))
        return QuantMatmulConfig(128, 1, max(1, min(split, 16, num_blocks)))
    if T == 1 or (N * K < SMALL_WEIGHT and T * N <= 8192):     # one row, or a few rows of a small weight
        bn = 64 if paired_layout(bits, group_size) else 32          # the two-halves path reads 64 well
        if num_blocks < 6:      # short K: no split
            return QuantMatmulConfig(bn, 1, 1)
        per_sm = 256 * num_sms // bn            # 8 programs of 32 features (4 of 64) per SM, over the T rows
        return QuantMatmulConfig(bn, 1, min(pow2_floor(min(per_sm // (triton.cdiv(N, bn) * T), 16)), num_blocks))
    pairs = pair_codes_layout(bits, group_size, K)
    if T > 64 and N * K >= SMALL_WEIGHT and group_pairs_layout(bits, group_size, K):
        if cdiv(N, 128) >= num_sms:
            return QuantMatmulConfig(128, 128, 1, num_warps=8)
        return QuantMatmulConfig(64, 64, 1 if cdiv(N, 64) * cdiv(T, 64) >= num_sms else 2)
    if T > 64 and not pairs:
        return QuantMatmulConfig(128, 64, 1, num_warps=8)
    block_m = 16 if T <= 16 else 32 if T <= 32 else 64
    if N * K < SMALL_WEIGHT:
        if num_blocks >= 6:     # longer K: split 4
            return QuantMatmulConfig(32, min(block_m, 32), 4, field_dots=False)
        block_m = min(block_m, 32) if triton.cdiv(N, 32) < 64 else block_m
        return QuantMatmulConfig(32, block_m, 1, field_dots=False)
    tiles = triton.cdiv(N, 64) * triton.cdiv(T, block_m)
    if pairs:
        split = 1 if tiles >= 2 * num_sms else 8 if K >= 8192 and T <= 16 else 4
        if T > 16 and split > 1:        # 32- and 64-row tiles: about 2 programs per SM (q/k/v: split 2)
            split = pow2_floor(2 * num_sms // tiles)
        return QuantMatmulConfig(64, block_m, max(1, min(split, num_blocks // 3)))
    if T > 32 and K < 8192 and group_pairs_layout(bits, group_size, K):    # 33-64 rows, pair codes: 64 x 64
        return QuantMatmulConfig(64, 64, 1 if tiles >= 2 * num_sms else 4)
    if T > 32 and K < 8192:     # 33-64 rows: one dot per 256-wide block, no split
        wide = triton.cdiv(N, 128) >= num_sms
        return QuantMatmulConfig(128 if wide else 64, 64, 1, num_warps=8 if wide else 4, field_dots=False)
    block_m = min(block_m, 32) if K >= 8192 else block_m
    tiles = triton.cdiv(N, 64) * triton.cdiv(T, block_m)
    split = 1 if T > 32 and tiles >= num_sms else 2 if tiles >= 2 * num_sms else 8 if K >= 8192 else 4
    return QuantMatmulConfig(64, block_m, max(1, min(split, num_blocks // 3)))


__all__ = ["QuantMatmulConfig", "dense_min_rows", "half_sums", "pick_config", "quant_matmul"]
