"""Device-side helpers of the quantized matmul kernels: turning packed words into floats.

Layout (kernels.quant_pack): a block of 32 int32 words per row holds BLOCK_K = 32 * (32 // BITS) codes; field
i of word j holds code k = i * 32 + j of the block, except in the paired layout (4 bits, groups of 128+),
where field i' + 4 s of word 16 h + j' holds code h * 128 + i' * 32 + 2 j' + s. A code becomes a float with no
conversion instruction: OR-ing it under the mantissa of a power of two B gives B + code exactly.
"""
import triton
import triton.language as tl


@triton.jit
def _mask_into(v, BITS: tl.constexpr, ASM: tl.constexpr):
    """(v & (2**BITS - 1) << POS) | MAGIC (see `biased_field`) as one instruction on a GPU (ASM): written
    as an and and an or, the compiler emits two (it keeps one immediate per instruction), and at one row
    this is most of the quantized matmul's integer work (10-14% of its time on an H200)."""
    if ASM:
        if BITS == 4:       # mask 0xF << 16, magic 0x43000000 (128.0); lut 0xEA = (a & b) | c
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983040, 1124073472, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:               # mask 0xFF << 15, magic 0x43800000 (256.0)
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 8355840, 1132462080, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:                   # Triton's interpreter runs no inline assembly
        POS: tl.constexpr = 16 if BITS == 4 else 15
        MAGIC: tl.constexpr = 0x43000000 if BITS == 4 else 0x43800000
        r = (v & (((1 << BITS) - 1) << POS)) | MAGIC
    return r.to(tl.float32, bitcast=True)


@triton.jit
def biased_field(words, i: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """fp32, words' shape: field i of every word as BIAS + code, BIAS = 128 (4 bits) or 256 (8 bits).

    The field is moved to bit 16 (4 bits) / 15 (8 bits) with one shift and masked into the mantissa of
    BIAS with one and-or (`_mask_into`): two integer instructions per code and no subtract."""
    POS: tl.constexpr = 16 if BITS == 4 else 15                       # lowest mantissa bit worth 1 under BIAS
    if BITS * i >= POS:
        v = words >> (BITS * i - POS)
    else:
        v = words << (POS - BITS * i)
    return _mask_into(v, BITS, ASM)


@triton.jit
def field_bias(BITS: tl.constexpr):
    """The BIAS that `biased_field` adds to every code."""
    return 128.0 if BITS == 4 else 256.0


@triton.jit
def biased_pair(words, i: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """Fields i and i + 4 of 4-bit words (i < 4) as BIAS + code in x's 16-bit type, both from one and-or of
    `words >> 4 i`: the two fields land in the low and high halves, each under a 16-bit BIAS (bf16 128,
    fp16 1024; `pair_bias`), exact. One shift and one instruction (on a GPU) for two codes, no conversion.
    Returns (field i, field i + 4), each words' shape."""
    MAGIC: tl.constexpr = 0x43004300 if BF16 else 0x64006400
    v = words >> (4 * i)
    if ASM:             # mask 0x000F000F; lut 0xEA = (a & b) | c
        if BF16:
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1677747200, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = (v & 0x000F000F) | MAGIC
    DT: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    lo = r.to(tl.int16).to(DT, bitcast=True)
    hi = (r >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def pair_bias(BF16: tl.constexpr):
    """The BIAS that `biased_pair` adds to every code."""
    return 128.0 if BF16 else 1024.0


@triton.jit
def dequant_block(words, s_ptr, o_ptr, b, N, offs_n, n_mask, GROUP: tl.constexpr, BITS: tl.constexpr,
                  PAIRED: tl.constexpr = False):
    """fp32 [BLOCK_N, BLOCK_K]: the weights of block b (words [BLOCK_N, 32]) in k order,
    q * scale + offset with one rounding (q * scale is exact in fp32: an 8-bit integer times a float16).

    Built as [BLOCK_N, fields, 32] (field i is k = i * 32 + j), so the reshape is k order with no shuffle
    of codes between fields; the group of field i is (b * BLOCK_K + i * 32) // GROUP. PAIRED (the paired
    layout, `kernels.quant_pack`): the group of word j is (b * 256 + (j // 16) * 128) // GROUP, and the
    [BLOCK_N, 2 (s), 4 (i'), 2 (h), 16 (j')] codes are permuted into k order."""
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_N: tl.constexpr = words.shape[0]
    fi = tl.arange(0, FIELDS)
    codes = (words[:, None, :] >> (fi * BITS)[None, :, None]) & ((1 << BITS) - 1)
    q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0            # 2**23 + code - 2**23
    if PAIRED:
        half = tl.arange(0, 32) // 16
        g_off = ((b * 256 + half * 128) // GROUP).to(tl.int64)[None, :] * N + offs_n[:, None]      # [BN, 32]
        s = tl.load(s_ptr + g_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
        o = tl.load(o_ptr + g_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
        w = tl.reshape(q * s[:, None, :] + o[:, None, :], (BLOCK_N, 2, 4, 2, 16))
        return tl.reshape(tl.permute(w, (0, 3, 2, 4, 1)), (BLOCK_N, 256))
    g_off = ((b * (32 * FIELDS) + fi * 32) // GROUP).to(tl.int64)[None, :] * N + offs_n[:, None]   # [BN, F]
    s = tl.load(s_ptr + g_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    o = tl.load(o_ptr + g_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    w = q * s[:, :, None] + o[:, :, None]
    return tl.reshape(w, (BLOCK_N, 32 * FIELDS))


@triton.jit
def dequant_field(words, s_ptr, o_ptr, g, N, offs_n, n_mask, i: tl.constexpr, BITS: tl.constexpr):
    """fp32 [BLOCK_N, 32]: field i of a block's words (words [BLOCK_N, 32]) as weights of group g,
    q * scale + offset with one rounding."""
    q = (((words >> (BITS * i)) & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return q * s[:, None] + o[:, None]
