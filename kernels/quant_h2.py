"""Two codes an instruction: the one-row kernel's arithmetic for bfloat16 x on 4-bit weights in the paired layout
(groups of 128 and more, `kernels.quant_pack`), in float16 pairs. Used by `kernels.quant_gemv._halves_step_h2`.

Fields i and i + 4 of a paired-layout word are two neighbouring codes 2p, 2p + 1, so one and-or puts both
in one f16x2 register and one `fma.rn.f16x2` multiplies them by the f16x2 pair (x[2p], x[2p + 1]) / 16. Each
code becomes 1 + q / 16 (q moved under the exponent of 1: exact), the chain of a word's four FMAs starts at
-(the four x pairs' sum) / 16 so that the ones cancel, and the word's sum, q x / 256 over its 8 codes, goes to
fp32 (two conversions and an add). 15 instructions for 8 codes, against 3 a code for the fp32 path.

Numerics: products and the word's partial sums round to float16 (11-bit mantissas), everything after a word is
fp32. Random 4-bit weights, bf16 x: relative error ~1.2e-3 before the output's own bf16 rounding (fp32 path: ~0).
x / 16 is what goes to float16 (exact: bf16 has fewer mantissa bits; below 2**-10 it lands in float16's
subnormals, 2**-21 of x's absolute error at most), so a word's partial sums stay within 8 max|x| / 16: no
overflow while |x| < 2**17 = 131072. An activation beyond that can overflow float16 (inf in the output; the fp32
path and bf16 have no such limit); the served models' projection inputs stay orders of magnitude below it.
"""
import triton
import triton.language as tl


@triton.jit
def _f16_lo(v):
    """float16: the low half of int32 v's bits."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f16_hi(v):
    """float16: the high half of int32 v's bits."""
    return (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f16x2(lo, hi):
    """int32 holding float16 lo (low half) and hi (high half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def h2_word(words, x0, x1, x2, x3, nsum, ASM: tl.constexpr):
    """fp32, words' shape: sum over each word's 8 codes of q x / 256. x0..x3: the f16x2 pairs x / 16 of fields
    (0, 4) .. (3, 7) (`h2_x`); nsum: f16x2 -(x0 + x1 + x2 + x3) (`h2_nsum`)."""
    if ASM:     # fields i, i + 4 to bits 6-9 / 22-25, masked into 1.0's exponent: mask 0x03C003C0, bits 0x3C003C00
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, a; .reg .f16 l, h; .reg .f32 fl, fh;\n"
            "shl.b32 t, $1, 6; lop3.b32 t, t, 62915520, 1006648320, 0xEA; fma.rn.f16x2 a, t, $2, $6;\n"
            "shl.b32 t, $1, 2; lop3.b32 t, t, 62915520, 1006648320, 0xEA; fma.rn.f16x2 a, t, $3, a;\n"
            "shr.u32 t, $1, 2; lop3.b32 t, t, 62915520, 1006648320, 0xEA; fma.rn.f16x2 a, t, $4, a;\n"
            "shr.u32 t, $1, 6; lop3.b32 t, t, 62915520, 1006648320, 0xEA; fma.rn.f16x2 a, t, $5, a;\n"
            "mov.b32 {l, h}, a; cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh; }",
            "=f,r,r,r,r,r,r", [words, x0, x1, x2, x3, nsum], dtype=tl.float32, is_pure=True, pack=1)
    acc_lo = _f16_lo(nsum)          # the interpreter runs no inline assembly: the same fields, chains and roundings
    acc_hi = _f16_hi(nsum)
    for i in tl.static_range(4):
        if i == 0:
            t = words << 6
        elif i == 1:
            t = words << 2
        elif i == 2:
            t = words >> 2
        else:
            t = words >> 6
        t = (t & 0x03C003C0) | 0x3C003C00
        xi = x0 if i == 0 else x1 if i == 1 else x2 if i == 2 else x3
        acc_lo = (_f16_lo(t) * _f16_lo(xi) + acc_lo).to(tl.float16)
        acc_hi = (_f16_hi(t) * _f16_hi(xi) + acc_hi).to(tl.float16)
    return acc_lo.to(tl.float32) + acc_hi.to(tl.float32)


@triton.jit
def h2_x(v, ASM: tl.constexpr):
    """(f16x2 of the two bfloat16 x values in int32 v, divided by 16; the two values' fp32 sum)."""
    x0 = (v << 16).to(tl.float32, bitcast=True)
    x1 = (v & -65536).to(tl.float32, bitcast=True)
    if ASM:
        h = tl.inline_asm_elementwise("{ .reg .f32 a, b; mul.f32 a, $1, 0f3D800000; mul.f32 b, $2, 0f3D800000; "
                                      "cvt.rn.f16x2.f32 $0, b, a; }", "=r,f,f", [x0, x1],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        h = _f16x2((x0 * 0.0625).to(tl.float16), (x1 * 0.0625).to(tl.float16))
    return h, x0 + x1


@triton.jit
def h2_nsum(x0, x1, x2, x3, ASM: tl.constexpr):
    """f16x2: -(x0 + x1 + x2 + x3), lane by lane."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 s; add.rn.f16x2 s, $1, $2; add.rn.f16x2 s, s, $3; add.rn.f16x2 s, s, $4; neg.f16x2 $0, s; }",
            "=r,r,r,r,r", [x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1)
    lo = ((_f16_lo(x0) + _f16_lo(x1)).to(tl.float16) + _f16_lo(x2)).to(tl.float16) + _f16_lo(x3)
    hi = ((_f16_hi(x0) + _f16_hi(x1)).to(tl.float16) + _f16_hi(x2)).to(tl.float16) + _f16_hi(x3)
    return _f16x2(-(lo.to(tl.float16)), -(hi.to(tl.float16)))
