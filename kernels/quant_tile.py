"""Device-side helpers of the quantized matmul kernels: turning packed words into floats.

Layout (kernels.quant_pack): a block of 32 int32 words per row holds BLOCK_K = 32 * (32 // BITS) codes;
field i of word j holds code k = i * 32 + j of the block. A code becomes a float with no conversion
instruction: OR-ing it under the mantissa of a power of two B gives B + code exactly.
"""
import triton
import triton.language as tl


@triton.jit
def biased_field(words, i: tl.constexpr, BITS: tl.constexpr):
    """fp32, words' shape: field i of every word as BIAS + code, BIAS = 128 (4 bits) or 256 (8 bits).

    The field is moved to bit 16 (4 bits) / 15 (8 bits) with one shift and masked into the mantissa of
    BIAS with one and-or: two integer instructions per code and no subtract."""
    POS: tl.constexpr = 16 if BITS == 4 else 15                       # lowest mantissa bit worth 1 under BIAS
    MAGIC: tl.constexpr = 0x43000000 if BITS == 4 else 0x43800000      # 128.0 / 256.0
    if BITS * i >= POS:
        v = words >> (BITS * i - POS)
    else:
        v = words << (POS - BITS * i)
    return ((v & (((1 << BITS) - 1) << POS)) | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def field_bias(BITS: tl.constexpr):
    """The BIAS that `biased_field` adds to every code."""
    return 128.0 if BITS == 4 else 256.0


@triton.jit
def dequant_block(words, s_ptr, o_ptr, b, N, offs_n, n_mask, GROUP: tl.constexpr, BITS: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_K]: the weights of block b (words [BLOCK_N, 32]) in k order,
    q * scale + offset with one rounding (q * scale is exact in fp32: an 8-bit integer times a float16).

    Built as [BLOCK_N, fields, 32] (field i is k = i * 32 + j), so the reshape is k order with no shuffle
    of codes between fields; the group of field i is (b * BLOCK_K + i * 32) // GROUP."""
    FIELDS: tl.constexpr = 32 // BITS
    BLOCK_N: tl.constexpr = words.shape[0]
    fi = tl.arange(0, FIELDS)
    codes = (words[:, None, :] >> (fi * BITS)[None, :, None]) & ((1 << BITS) - 1)
    q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0            # 2**23 + code - 2**23
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
