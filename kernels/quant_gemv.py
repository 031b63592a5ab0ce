"""One-row weight-only quantized matmul (batch-1 decode): no tensor cores, [BLOCK_N, 32] fp32
accumulators take codes * x elementwise, reduced once at the end. Launched by `kernels.quant_matmul`.

Per code: one shift and one and-or (`biased_field`: BIAS + q as a float; one instruction on a GPU) and
one FMA. The products (BIAS + q) x accumulate per group and the group's scale and offset apply to the
sums: s * sum((B + q) x) + (o - B s) * sum(x).

4 bits, groups of 128 and more (`_halves_step`, the 8B checkpoints' layout, packed in the paired layout of
kernels.quant_pack): a block's words 0-15 hold one half of 128 codes, words 16-31 the other, each half inside
one group, so a column's group scale applies to its sum over all 8 fields. Both halves' scales and offsets are
requested with the block's words, before any arithmetic; fields 0-3 and 4-7 go to two per-block sums,
alternating (two independent FMA chains); the offsets' term is one value per row and block, (o - B s) * sum(x
over the half), outside the per-code work. Against the per-group loop below: 7-15% less time per launch on the
8B shapes (H200 A/B, 78.9 -> 71.0 us per layer with 64-feature programs).
With bfloat16 x (the served 8B's case) that layout takes `_halves_step_h2` instead: two codes an instruction
in float16 pairs (`kernels.quant_h2`; its rounding is stated there) and a loop of two blocks a step in two register
sets, each block's words (and then its scales and offsets) requested one block ahead (H200, the 8B shapes, each at its
pick_config, us: q/k/v 10.9 -> 10.0, o 7.6 -> 7.1, gate/up 35.1 -> 31.6, down 18.2 -> 16.6;
bench/results/quant_h2_ab.json). Either alone did little:
the arithmetic alone (no new words) and the loads alone (no arithmetic) each took ~29 us on gate/up, so a kernel
that halves one of them still waits on the other; the float16 pairs cut the registers (128 -> 96), which is what
leaves room for the second register set. Each block's x is requested a block ahead as well (`x_words`): read
in the step, its latency (an L2 round trip a block) was paid once a block by every program, and a program's 16
blocks took ~27 us on gate/up whether its SM held one program or two (bench/results/quant_gemv_xprefetch.json).
H200, each at its pick_config, us: q/k/v 10.0 -> 9.2, o 7.1 -> 6.7, gate/up 32.2 -> 30.4, down 15.9 -> 14.9
(bench/results/quant_h2_xprefetch_ab.json).
The scales and offsets are read in the step, in the words' own layout (`tile_value`): read as [BN] values they
were exchanged through shared memory into that layout twice a block, behind 8 barriers a loop step; offsets
apply per word. H200, us: gate/up 29.2 -> 27.8, the others within 0.1; the engine at batch 1 2.48 -> 2.46 ms a
token, 3.23 -> 3.15 with rank-16 adapters on every module (bench/results/quant_scale_layout_ab.json).
Other groups (32, 64) and 8 bits: `_groups_step`, the scales and offsets loaded per group as it comes.
"""
import triton
import triton.language as tl

from kernels.pdl import read_early, read_input, wait_then_release
from kernels.quant_h2 import h2_acc4, h2_nsum, h2_quad_sum, h2_x
from kernels.quant_split import write_out
from kernels.quant_tile import biased_field, field_bias


@triton.jit
def _x_field(x_row, k0, offs_j, K, EVEN_K: tl.constexpr):
    """fp32 [32]: x[k0 : k0 + 32] (0 past K)."""
    return read_input(x_row + k0, k0 + offs_j < K, EVEN_K).to(tl.float32)


@triton.jit
def _halves_step(words, b, acc, acc_o, x_ptr, s_ptr, o_ptr, offs_n, n_mask, offs_j, N, K,
                 GROUP: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, X32: tl.constexpr):
    """Block b of a 4-bit weight in groups of 128 or more (the paired layout, kernels.quant_pack): words 0-15
    hold half a (group g_a), words 16-31 half b (g_b); fields i and i + 4 of word j are codes 2
    `_paired_word(j, i)` and the one after it (x_ptr: the token row's x). Two per-column sums (fields 0-3,
    4-7: independent FMA chains), each column's group scale after."""
    g_a, g_b = half_groups(b, GROUP)
    s_a, s_b, o_a, o_b = _half_scales(g_a, g_b, s_ptr, o_ptr, offs_n, n_mask, N)
    s_a = s_a.to(tl.float32)
    s_b = s_b.to(tl.float32)
    o_a = o_a.to(tl.float32)
    o_b = o_b.to(tl.float32)
    q_0 = tl.zeros(acc.shape, dtype=tl.float32)              # (B + q) * x per column, fields 0-3
    q_1 = tl.zeros(acc.shape, dtype=tl.float32)              # fields 4-7
    x_t = tl.zeros((32,), dtype=tl.float32)                  # x per column, all fields
    for i in tl.static_range(4):
        x0, x1 = _x_pair(x_ptr, b * 128 + _paired_word(offs_j, i), K, EVEN_K, X32)   # fields i, i + 4
        q_0 += biased_field(words, i, 4, ASM) * x0[None, :]
        q_1 += biased_field(words, i + 4, 4, ASM) * x1[None, :]
        x_t += x0 + x1
    half_a = offs_j < 16
    acc += tl.where(half_a[None, :], s_a[:, None], s_b[:, None]) * (q_0 + q_1)
    BIAS = field_bias(4)
    x_a = tl.sum(tl.where(half_a, x_t, 0.0), axis=0)
    x_b = tl.sum(tl.where(half_a, 0.0, x_t), axis=0)
    acc_o += (o_a - BIAS * s_a) * x_a + (o_b - BIAS * s_b) * x_b
    return acc, acc_o


@triton.jit
def half_groups(b, GROUP: tl.constexpr):
    """The groups of block b's two halves in the paired layout (half a: codes 256 b.., half b: 256 b + 128..)."""
    return (b * 256) // GROUP, (b * 256 + 128) // GROUP


@triton.jit
def _half_scales(g_a, g_b, s_ptr, o_ptr, offs_n, n_mask, N):
    """Groups g_a and g_b's scales and offsets as stored (float16, [BN] each): s_a, s_b, o_a, o_b."""
    return (tl.load(s_ptr + g_a * N + offs_n, mask=n_mask, other=0.0), tl.load(s_ptr + g_b * N + offs_n, mask=n_mask, other=0.0),
            tl.load(o_ptr + g_a * N + offs_n, mask=n_mask, other=0.0), tl.load(o_ptr + g_b * N + offs_n, mask=n_mask, other=0.0))


@triton.jit
def _paired_block(w_rows, b, n_mask, GROUP: tl.constexpr, EVEN_N: tl.constexpr):
    """Block b of the paired layout as read from memory: its [BN, 32] words, and its halves' groups (whose scales
    and offsets `tile_value` reads). EVEN_N (every program's rows exist): the words are read unmasked."""
    g_a, g_b = half_groups(b, GROUP)
    if EVEN_N:
        words = tl.load(w_rows + b * 32)
    else:
        words = tl.load(w_rows + b * 32, mask=n_mask[:, None], other=0)
    return words, g_a, g_b


@triton.jit
def tile_value(ptr, g_a, g_b, offs_n, N, ASM: tl.constexpr):
    """fp32 [BN, 32]: element (row, j) is float16 [groups, N] `ptr`'s value of row offs_n in group g_a for words
    j < 16, g_b for the others (rows past N: undefined, never written out). Read in the words' own layout (inline
    assembly: a load would be given a layout of its own and exchanged through shared memory, behind barriers),
    once a row by each thread: its 4 neighbouring words share one half, so their addresses are one value."""
    g = g_a + (tl.arange(0, 32) // 16) * (g_b - g_a)
    p = ptr + g[None, :] * N + offs_n[:, None]
    inside = (offs_n < N)[:, None]
    if not ASM:
        return tl.load(p, mask=inside, other=0.0).to(tl.float32)
    return tl.inline_asm_elementwise("{ .reg .pred q; .reg .b16 t; setp.ne.b32 q, $2, 0;\n"
                                     "@q ld.global.nc.b16 t, [$1]; cvt.f32.f16 $0, t; }", "=f,l,r",
                                     [p, inside.to(tl.int32)], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def x_words(x_ptr, b, offs_j, K, EVEN_K: tl.constexpr):
    """Block b's x for `_halves_step_h2`: four [32] int32 (two bfloat16 each), the x pairs of fields (0, 4) ..
    (3, 7) of the block's words (x_ptr: the token row's x, 4-byte aligned)."""
    return (_x_word(x_ptr, b * 128 + _paired_word(offs_j, 0), K, EVEN_K),
            _x_word(x_ptr, b * 128 + _paired_word(offs_j, 1), K, EVEN_K),
            _x_word(x_ptr, b * 128 + _paired_word(offs_j, 2), K, EVEN_K),
            _x_word(x_ptr, b * 128 + _paired_word(offs_j, 3), K, EVEN_K))


@triton.jit
def _x_word(x_ptr, p, K, EVEN_K: tl.constexpr):
    """int32: x[2 p] and x[2 p + 1] of 16-bit x in 4-byte aligned rows as one read (0 past K)."""
    return read_input(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + p, 2 * p < K, EVEN_K)


@triton.jit
def _halves_step_h2(words, g_a, g_b, xv, acc, offs_n, s_ptr, o_ptr, N, ASM: tl.constexpr):
    """`_halves_step` for bfloat16 x in 4-byte aligned rows, two codes an instruction (`kernels.quant_h2`): each
    thread's 4 neighbouring words of a row (32 codes, one group half) summed in one chain of float16 pairs, then
    their group scale (times 256: the sums are of q / 256) and offset (times their fp32 sum of x) applied in two
    FMAs. The scales and offsets are read here, in the words' layout (`tile_value`); a block's words and groups
    come from `_paired_block`, its x from `x_words` (xv), both requested a block ahead by the caller."""
    s, o = scale_tiles(s_ptr, o_ptr, g_a, g_b, offs_n, N, ASM)
    return h2_block(words, xv, s, o, acc, ASM)


@triton.jit
def scale_tiles(s_ptr, o_ptr, g_a, g_b, offs_n, N, ASM: tl.constexpr):
    """A block's scales and offsets (groups g_a and g_b of its halves) in the words' layout (`tile_value`)."""
    return tile_value(s_ptr, g_a, g_b, offs_n, N, ASM), tile_value(o_ptr, g_a, g_b, offs_n, N, ASM)


@triton.jit
def h2_block(words, xv, s, o, acc, ASM: tl.constexpr):
    """`_halves_step_h2`'s arithmetic on one block: words [BN, 32], its x (`x_words`), and its scales and offsets
    in the words' layout (`tile_value`)."""
    v0, v1, v2, v3 = xv
    h0, t0 = h2_x(v0, ASM)
    h1, t1 = h2_x(v1, ASM)
    h2, t2 = h2_x(v2, ASM)
    h3, t3 = h2_x(v3, ASM)
    x_t = t0 + t1 + t2 + t3
    # [1, 32]: in the words' 2-D layout (4 columns a thread); a [32] one may be laid out 1 element a thread
    nsum4 = h2_quad_sum(h2_nsum(h0, h1, h2, h3, ASM)[None, :], False, ASM)
    xt4 = h2_quad_sum(x_t[None, :], True, ASM)
    acc = h2_acc4(acc, words, h0[None, :], h1[None, :], h2[None, :], h3[None, :], nsum4, xt4, 256.0 * s, o, ASM)
    return acc


@triton.jit
def _x_pair(x_ptr, p, K, EVEN_K: tl.constexpr, X32: tl.constexpr):
    """fp32 x[2 p] and x[2 p + 1] (0 past K; x_ptr the row's start). X32 (16-bit x, 4-byte aligned rows):
    one 32-bit read for both."""
    k = 2 * p
    if X32:
        v = _x_word(x_ptr, p, K, EVEN_K)
        if x_ptr.dtype.element_ty == tl.bfloat16:       # a bfloat16 is the top half of its float32
            x0 = (v << 16).to(tl.float32, bitcast=True)
            x1 = (v & -65536).to(tl.float32, bitcast=True)
        else:
            x0 = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x0 = read_input(x_ptr + k, k < K, EVEN_K).to(tl.float32)
        x1 = read_input(x_ptr + k + 1, k < K, EVEN_K).to(tl.float32)
    return x0, x1


@triton.jit
def _paired_word(offs_j, i: tl.constexpr):
    """Half the code of field i (< 4) of word j within a block, paired layout: the code is
    h 128 + i 32 + 2 j' for j = 16 h + j', so this is h 64 + i 16 + j' = j + 48 h + 16 i, written so the
    compiler sees runs of 16 consecutive values (one wide read of x per run)."""
    return offs_j + (offs_j // 16) * 48 + i * 16


@triton.jit
def _groups_step(words, b, acc, x_base, s_ptr, o_ptr, offs_n, n_mask, offs_j, N, K,
                 GROUP: tl.constexpr, BITS: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """Block b, one group (or field, at groups of 32) at a time."""
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = 32 * FIELDS
    FPG: tl.constexpr = FIELDS if GROUP >= BLOCK_K else GROUP // 32             # fields per group
    BIAS = field_bias(BITS)
    x_row = x_base + offs_j
    for gi in tl.static_range(FIELDS // FPG):
        g = (b * BLOCK_K + gi * FPG * 32) // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32) - BIAS * s
        acc_q = tl.zeros(acc.shape, dtype=tl.float32)                              # (B + q) * x per column
        x_g = tl.zeros((32,), dtype=tl.float32)                                   # x per column
        for f in tl.static_range(FPG):
            i = gi * FPG + f
            xv = _x_field(x_row, b * BLOCK_K + i * 32, offs_j, K, EVEN_K)
            if FPG == 1:
                acc += (biased_field(words, i, BITS, ASM) * s[:, None] + o[:, None]) * xv[None, :]
            else:
                acc_q += biased_field(words, i, BITS, ASM) * xv[None, :]
                x_g += xv
        if FPG > 1:
            acc += s[:, None] * acc_q + o[:, None] * x_g[None, :]
    return acc


@triton.jit
def _split4(v):
    """[R, 4] -> its 4 columns, each [R] (the layout holds a row's 4 in one thread: no data moves)."""
    a, b = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _row_words(w_rows, b, n_mask):
    """Block b's 32 words of each row (ROWS): 8 chunks of 4 (one 16-byte read each), each as 4 [BN] words."""
    m = n_mask[:, None]
    return (_split4(tl.load(w_rows + b * 32, mask=m, other=0)), _split4(tl.load(w_rows + b * 32 + 4, mask=m, other=0)),
            _split4(tl.load(w_rows + b * 32 + 8, mask=m, other=0)),
            _split4(tl.load(w_rows + b * 32 + 12, mask=m, other=0)),
            _split4(tl.load(w_rows + b * 32 + 16, mask=m, other=0)),
            _split4(tl.load(w_rows + b * 32 + 20, mask=m, other=0)),
            _split4(tl.load(w_rows + b * 32 + 24, mask=m, other=0)),
            _split4(tl.load(w_rows + b * 32 + 28, mask=m, other=0)))


@triton.jit
def _x_four(x_ptr, p, K, EVEN_K: tl.constexpr, X32: tl.constexpr):
    """x[2 p[0]] .. x[2 p[1] + 1] (p: [1, 2] consecutive pairs) in fp32, four [1] values, through `_x_pair`."""
    x0, x1 = _x_pair(x_ptr, p, K, EVEN_K, X32)
    a0, b0 = tl.split(tl.reshape(x0, (1, 2)))
    a1, b1 = tl.split(tl.reshape(x1, (1, 2)))
    return a0, a1, b0, b1


@triton.jit
def _rows_step(words, b, acc, x_base, s_ptr, o_ptr, offs_n, n_mask, N, K,
               BITS: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, X32: tl.constexpr):
    """Block b in groups of 32, each thread holding whole rows (ROWS; `_row_words`): field i of a row's 32 words
    is one group, so its 32 codes times x sum in one FMA chain per row, unscaled (shift, and-or, FMA a code),
    and the group's scale and offset apply once per row and group. Each thread reads x for itself (the same
    values for every row it holds); the sums of x per group are one reduction across the program a block.
    Fields i and i + FIELDS / 2 go together (two chains) in a loop over i that is not unrolled: the unrolled
    body of all the fields took Triton over two minutes to compile per variant (sm_90), and a word shifted by
    BITS i once serves both fields (field FIELDS / 2 sits where `biased_field` wants it, or one bit above)."""
    FIELDS: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = FIELDS // 2
    BLOCK_K: tl.constexpr = 32 * FIELDS
    BIAS = field_bias(BITS)
    kx = b * BLOCK_K + tl.arange(0, FIELDS)[:, None] * 32 + tl.arange(0, 32)[None, :]          # [FIELDS, 32]
    x_sums = tl.sum(read_input(x_base + kx, kx < K, EVEN_K).to(tl.float32), axis=1)
    for i in range(HALF):
        p_lo = tl.zeros(acc.shape, dtype=tl.float32)
        p_hi = tl.zeros(acc.shape, dtype=tl.float32)
        for t in tl.static_range(8):
            p_x = (b * BLOCK_K + i * 32 + t * 4) // 2 + tl.arange(0, 2)[None, :]                 # [1, 2] pairs
            x_lo = _x_four(x_base, p_x, K, EVEN_K, X32)
            x_hi = _x_four(x_base, p_x + HALF * 16, K, EVEN_K, X32)
            for c in tl.static_range(4):
                v = words[t][c] >> (BITS * i)
                p_lo += biased_field(v, 0, BITS, ASM) * x_lo[c]
                p_hi += biased_field(v, HALF, BITS, ASM) * x_hi[c]
        acc = _group_term(acc, p_lo, b * FIELDS + i, i, x_sums, s_ptr, o_ptr, offs_n, n_mask, N, BIAS, FIELDS)
        acc = _group_term(acc, p_hi, b * FIELDS + i + HALF, i + HALF, x_sums, s_ptr, o_ptr, offs_n, n_mask, N, BIAS,
                          FIELDS)
    return acc


@triton.jit
def _group_term(acc, p, g, field, x_sums, s_ptr, o_ptr, offs_n, n_mask, N, BIAS, FIELDS: tl.constexpr):
    """acc + s p + (o - BIAS s) sum(x over the group): group g's scale and offset on its chain's sum p."""
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32) - BIAS * s
    return acc + s * p + o * tl.sum(tl.where(tl.arange(0, FIELDS) == field, x_sums, 0.0), axis=0)


@triton.jit
def _block_step(words, b, acc, acc_o, x_base, s_ptr, o_ptr, offs_n, n_mask, offs_j, N, K,
                GROUP: tl.constexpr, BITS: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                PAIRED: tl.constexpr, X32: tl.constexpr):
    if PAIRED:
        acc, acc_o = _halves_step(words, b, acc, acc_o, x_base, s_ptr, o_ptr, offs_n, n_mask,
                                  offs_j, N, K, GROUP, EVEN_K, ASM, X32)
    else:
        acc = _groups_step(words, b, acc, x_base, s_ptr, o_ptr, offs_n, n_mask, offs_j, N, K, GROUP, BITS,
                           EVEN_K, ASM)
    return acc, acc_o


@triton.jit
def quant_gemv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, add_ptr,
                      T, N, K, stride_x, stride_out, words_per_row, blocks_per_split, num_blocks, split_k,
                      GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FENCE: tl.constexpr,
                      NUM_THREADS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, ADD: tl.constexpr,
                      PAIRED: tl.constexpr, X32: tl.constexpr, ROWS: tl.constexpr = False,
                      H2: tl.constexpr = False, EVEN_N: tl.constexpr = False):
    """One token row per program (grid axis 1), BLOCK_N features (axis 0), a range of K blocks (axis 2).
    As a dependent launch (kernels/pdl.py) its first block of words is read before the wait (every
    program has at least one block: the wrapper sizes the splits so). ADD (an fp32 addend [T, N], the
    LoRA delta the launch before wrote): x and every block are read before the wait, which comes just
    before the output (`quant_matmul`), after `read_early`'s fence. PAIRED: the weight is in the paired layout
    (`kernels.quant_pack.paired_layout`, decided by the wrapper), read by `_halves_step`. ROWS (groups of 32):
    each thread holds whole rows of a block (`_rows_step`; BLOCK_N / (32 num_warps) rows a thread).
    H2 (PAIRED, bfloat16 x in 4-byte aligned rows, 16-byte aligned words): `_halves_step_h2`, two blocks a loop
    step in two register sets, each block's words and x requested before the previous block's arithmetic. EVEN_N
    (N a multiple of BLOCK_N): the H2 path reads its words unmasked."""
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + offs_j[None, :]     # [BN, 32]
    x_base = x_ptr + m.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, num_blocks)
    acc_o = tl.zeros((BLOCK_N,), dtype=tl.float32)           # the offsets' term, one per row (PAIRED)
    read_early(ADD and FENCE, NUM_THREADS)                   # ADD: x is read before the wait
    if ROWS:
        offs_n = tl.max_contiguous(offs_n, 1)   # per-row values stay in the rows' layout (no vector reads or writes)
        w_rows4 = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + tl.arange(0, 4)[None, :]      # [BN, 4]
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        row_words = _row_words(w_rows4, b_lo, n_mask)
        if not ADD:
            wait_then_release(USE_PDL)
        total = _rows_step(row_words, b_lo, total, x_base, s_ptr, o_ptr, offs_n, n_mask, N, K, BITS, EVEN_K, ASM,
                           X32)
        for b in range(b_lo + 1, b_hi):
            row_words = _row_words(w_rows4, b, n_mask)
            total = _rows_step(row_words, b, total, x_base, s_ptr, o_ptr, offs_n, n_mask, N, K, BITS, EVEN_K, ASM,
                               X32)
        if ADD:
            wait_then_release(USE_PDL)
    elif H2:
        # Two register sets, no copies: block b + 1 (words and its x) is requested before block b's arithmetic,
        # block b + 2 (into b's registers, free by then) before b + 1's; the last pair's b + 2 re-reads the
        # split's last block. The first block's x comes after the wait (the launch before writes it). Each block's
        # scales and offsets are read in its step, in the words' layout (`tile_value`).
        words, g_a, g_b = _paired_block(w_rows, b_lo, n_mask, GROUP, EVEN_N)
        if not ADD:
            wait_then_release(USE_PDL)
        xv = x_words(x_base, b_lo, offs_j, K, EVEN_K)
        for it in range(0, (b_hi - b_lo) // 2):
            b = b_lo + 2 * it
            words1, g_a1, g_b1 = _paired_block(w_rows, b + 1, n_mask, GROUP, EVEN_N)
            xv1 = x_words(x_base, b + 1, offs_j, K, EVEN_K)
            acc = _halves_step_h2(words, g_a, g_b, xv, acc, offs_n, s_ptr, o_ptr, N, ASM)
            b2 = tl.minimum(b + 2, b_hi - 1)
            words, g_a, g_b = _paired_block(w_rows, b2, n_mask, GROUP, EVEN_N)
            xv = x_words(x_base, b2, offs_j, K, EVEN_K)
            acc = _halves_step_h2(words1, g_a1, g_b1, xv1, acc, offs_n, s_ptr, o_ptr, N, ASM)
        if (b_hi - b_lo) % 2 == 1:
            acc = _halves_step_h2(words, g_a, g_b, xv, acc, offs_n, s_ptr, o_ptr, N, ASM)
        if ADD:
            wait_then_release(USE_PDL)
        total = tl.sum(acc, axis=1)
    else:
        words = tl.load(w_rows + b_lo * 32, mask=n_mask[:, None], other=0)                 # [BN, 32] int32
        if not ADD:
            wait_then_release(USE_PDL)
        acc, acc_o = _block_step(words, b_lo, acc, acc_o, x_base, s_ptr, o_ptr, offs_n, n_mask, offs_j, N, K,
                                 GROUP, BITS, EVEN_K, ASM, PAIRED, X32)
        for b in range(b_lo + 1, b_hi):
            words = tl.load(w_rows + b * 32, mask=n_mask[:, None], other=0)
            acc, acc_o = _block_step(words, b, acc, acc_o, x_base, s_ptr, o_ptr, offs_n, n_mask, offs_j, N, K,
                                     GROUP, BITS, EVEN_K, ASM, PAIRED, X32)
        if ADD:
            wait_then_release(USE_PDL)
        total = tl.sum(acc, axis=1)
        if PAIRED:
            total += acc_o
    one_row_out(total, offs_n, n_mask, m, pid_n, pid_k, split_k, T, N, stride_out, bias_ptr, out_ptr, part_ptr,
                lock_ptr, add_ptr, HAS_BIAS, SPLIT, FENCE, NUM_THREADS, ADD)


@triton.jit
def one_row_out(total, offs_n, n_mask, m, pid_n, pid_k, split_k, T, N, stride_out, bias_ptr, out_ptr, part_ptr,
                lock_ptr, add_ptr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FENCE: tl.constexpr,
                NUM_THREADS: tl.constexpr, ADD: tl.constexpr):
    """A one-row program's [BLOCK_N] fp32 sums of token row m, plus the bias, written out (`quant_split.write_out`:
    split-K partials and the last program's sum; ADD, the addend too)."""
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    write_out(total, bias, out_ptr, out_ptr + m.to(tl.int64) * stride_out + offs_n,
              part_ptr + m.to(tl.int64) * N + offs_n, T * N, n_mask, lock_ptr + m * tl.num_programs(0) + pid_n,
              pid_k, split_k, SPLIT, FENCE, NUM_THREADS, add_ptr + m.to(tl.int64) * N + offs_n, ADD)
