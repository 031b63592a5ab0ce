"""Two codes an instruction: the one-row kernel's arithmetic for bfloat16 x on 4-bit weights in the paired layout
(groups of 128 and more, `kernels.quant_pack`), in float16 pairs. Used by `kernels.quant_gemv._halves_step_h2`.

Fields i and i + 4 of a paired-layout word are two neighbouring codes 2p, 2p + 1, so one and-or puts both
in one f16x2 register and one `fma.rn.f16x2` multiplies them by the f16x2 pair (x[2p], x[2p + 1]) / 16. Each
code becomes 1 + q / 16 (q moved under the exponent of 1: exact), and a chain of FMAs starts at minus its x pairs'
sum / 16 so that the ones cancel; the chain's sum, q x / 256 over its codes, goes to fp32 (two conversions and an
add), where the group's scale and offset apply.

`h2_acc4`: a thread's 4 neighbouring words of a row (16-byte reads) lie in one group half (one scale), so one
chain of 16 FMAs sums their 32 codes, converted to fp32 once and scaled once: ~12 instructions a word plus a
quarter of the conversion and scale (the 8B's loop: 1310 instructions and 168 registers, against 1547 and 254
for one chain a word, the path before it).

Numerics: products and the chain's partial sums round to float16 (11-bit mantissas), everything after a chain is
fp32. Random 4-bit weights on the 8B shapes, bf16 x: relative error ~3.0e-3 with the output's own bf16 rounding
(one chain a word: 2.1e-3; the fp32 path ~1.65e-3). x / 16 is what goes to float16 (exact: bf16 has fewer mantissa
bits; below 2**-10 it lands in float16's subnormals, 2**-21 of x's absolute error at most), so a chain of 4 words'
partial sums stay within 32 max|x| / 16: no overflow while |x| < 2**15 = 32768. An
activation beyond that can overflow float16 (inf in the output; the fp32 path and bf16 have no such limit).
Nothing checks the bound at run time (the start-up log states it); for a model whose projection inputs reach it,
LORAPLEX_FP16_PAIRS=0 in the compute process's environment keeps the one-row kernel's fp32 products
(`fp16_pairs_enabled`), or `--quantization none` dequantizes the model.
"""
import os

import triton
import triton.language as tl

ENV = "LORAPLEX_FP16_PAIRS"
RANGE = 2**15       # |x| below which the chains of 4 words cannot overflow float16


def fp16_pairs_enabled() -> bool:
    """Whether the one-row kernel may take this path (`kernels.quant_matmul`); LORAPLEX_FP16_PAIRS=0: never."""
    return os.environ.get(ENV, "1") != "0"


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


@triton.constexpr_function
def _word4_asm() -> str:
    """PTX for `h2_acc4` (pack 4): operands $0-3 acc out; in: acc $4-7, words $8-11, x0 $12-15, x1 $16-19,
    x2 $20-23, x3 $24-27, nsum4 $28-31, xt4 $32-35, s256 $36-39, o $40-43. A constexpr function, not a
    module-level constexpr: a helper that reads one gives its callers a cache key that depends on which kernel
    the process hashed first (tests/kernels/test_cache_keys.py)."""
    shifts = ("shl.b32 t, {w}, 6", "shl.b32 t, {w}, 2", "shr.u32 t, {w}, 2", "shr.u32 t, {w}, 6")
    lines = ["{ .reg .b32 t, a; .reg .f16 l, h; .reg .f32 fl, fh, r;", "mov.b32 a, $28;"]
    for w in range(4):
        for i, sh in enumerate(shifts):
            lines.append(sh.format(w=f"${8 + w}") + "; lop3.b32 t, t, 62915520, 1006648320, 0xEA; "
                         f"fma.rn.f16x2 a, t, ${12 + 4 * i + w}, a;")
    lines += ["mov.b32 {l, h}, a; cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 r, fl, fh;",
              "fma.rn.f32 $0, $40, $32, $4; fma.rn.f32 $0, $36, r, $0;",
              "mov.b32 $1, $5; mov.b32 $2, $6; mov.b32 $3, $7; }"]
    return "\n".join(lines)


@triton.constexpr_function
def _word4_constraints() -> str:
    """`_word4_asm`'s operand constraints."""
    return "=f,=f,=f,=f," + ",".join(["f"] * 4 + ["r"] * 24 + ["f"] * 12)


@triton.jit
def h2_quad_sum(v, F32: tl.constexpr, ASM: tl.constexpr):
    """[1, 32]: every element the sum of its group of 4 neighbours (j // 4), f16x2 lane by lane (F32: fp32 values),
    added in order. 2-D so that the compiler lays it out as the words (a thread's 4 consecutive columns: the
    asm's pack of 4); a [32] vector may be given one element a thread, which a pack of 4 cannot take."""
    if ASM:
        if F32:
            s = tl.inline_asm_elementwise("{ .reg .f32 s; add.f32 s, $4, $5; add.f32 s, s, $6; add.f32 s, s, $7;\n"
                                          "mov.b32 $0, s; mov.b32 $1, s; mov.b32 $2, s; mov.b32 $3, s; }",
                                          "=f,=f,=f,=f,f,f,f,f", [v], dtype=tl.float32, is_pure=True, pack=4)
        else:
            s = tl.inline_asm_elementwise("{ .reg .b32 s; add.rn.f16x2 s, $4, $5; add.rn.f16x2 s, s, $6;\n"
                                          "add.rn.f16x2 s, s, $7; mov.b32 $0, s; mov.b32 $1, s; mov.b32 $2, s;\n"
                                          "mov.b32 $3, s; }", "=r,=r,=r,=r,r,r,r,r", [v], dtype=tl.int32,
                                          is_pure=True, pack=4)
    else:
        g = tl.reshape(v, (v.shape[1] // 4, 4))
        idx = tl.arange(0, 4)[None, :]
        if F32:
            s = tl.sum(tl.where(idx == 0, g, 0.0), axis=1)
            for w in tl.static_range(1, 4):
                s = s + tl.sum(tl.where(idx == w, g, 0.0), axis=1)
        else:
            lo = _f16_lo(tl.sum(tl.where(idx == 0, g, 0), axis=1))
            hi = _f16_hi(tl.sum(tl.where(idx == 0, g, 0), axis=1))
            for w in tl.static_range(1, 4):
                gw = tl.sum(tl.where(idx == w, g, 0), axis=1)
                lo = (lo + _f16_lo(gw)).to(tl.float16)
                hi = (hi + _f16_hi(gw)).to(tl.float16)
            s = _f16x2(lo, hi)
        s = tl.reshape(tl.broadcast_to(s[:, None], (v.shape[1] // 4, 4)), (1, v.shape[1]))
    return s


@triton.jit
def _first4(v, like):
    """[BN, 8]: the first of each group of 4 neighbouring elements of v (broadcast to like's [BN, 32])."""
    g = tl.reshape(v + tl.zeros_like(like), (like.shape[0], like.shape[1] // 4, 4))
    return tl.sum(tl.where(tl.arange(0, 4)[None, None, :] == 0, g, 0.0), axis=2)


@triton.jit
def h2_acc4(acc, words, x0, x1, x2, x3, nsum4, xt4, s256, o, ASM: tl.constexpr):
    """acc ([BN, 32] fp32) plus, in the first element of each group of 4 neighbouring words (one row, one half:
    a thread's 4 consecutive elements), s256 (q x / 256 summed over the group's 32 codes, one float16 chain a lane
    started at nsum4) + o xt4; the other three elements unchanged. x0..x3: the f16x2 pairs x / 16 of fields
    (0, 4) .. (3, 7) of each word's column (`h2_x`); nsum4: f16x2 -(the group's 16 pairs' sum) (`h2_quad_sum`);
    xt4: the group's fp32 sum of x; s256, o: the group's scale times 256 and its offset (equal across it)."""
    if ASM:
        return tl.inline_asm_elementwise(_word4_asm(), _word4_constraints(),
                                         [acc, words, x0, x1, x2, x3, nsum4, xt4, s256, o], dtype=tl.float32,
                                         is_pure=True, pack=4)
    BN: tl.constexpr = words.shape[0]
    idx = tl.arange(0, 4)[None, None, :]
    wg = tl.reshape(words, (BN, 8, 4))
    start = tl.sum(tl.where(idx == 0, tl.reshape(nsum4 + tl.zeros_like(words), (BN, 8, 4)), 0), axis=2)
    a_lo = _f16_lo(start)
    a_hi = _f16_hi(start)
    x0g = tl.reshape(x0 + tl.zeros_like(words), (BN, 8, 4))                 # each x pair per word, [BN, 8, 4]
    x1g = tl.reshape(x1 + tl.zeros_like(words), (BN, 8, 4))
    x2g = tl.reshape(x2 + tl.zeros_like(words), (BN, 8, 4))
    x3g = tl.reshape(x3 + tl.zeros_like(words), (BN, 8, 4))
    for w in tl.static_range(4):
        ww = tl.sum(tl.where(idx == w, wg, 0), axis=2)                                     # [BN, 8]
        for i in tl.static_range(4):
            if i == 0:
                t = ww << 6
            elif i == 1:
                t = ww << 2
            elif i == 2:
                t = ww >> 2
            else:
                t = ww >> 6
            t = (t & 0x03C003C0) | 0x3C003C00
            xg = x0g if i == 0 else x1g if i == 1 else x2g if i == 2 else x3g
            xw = tl.sum(tl.where(idx == w, xg, 0), axis=2)
            a_lo = (_f16_lo(t) * _f16_lo(xw) + a_lo).to(tl.float16)
            a_hi = (_f16_hi(t) * _f16_hi(xw) + a_hi).to(tl.float16)
    r = a_lo.to(tl.float32) + a_hi.to(tl.float32)                                          # [BN, 8]
    add = _first4(s256, acc) * r + _first4(o, acc) * _first4(xt4, acc)
    acc3 = tl.reshape(acc, (BN, 8, 4)) + tl.where(idx == 0, add[:, :, None], 0.0)
    return tl.reshape(acc3, (BN, 32))
