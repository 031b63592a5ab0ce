"""x made ready for the one-row kernel's float16 pairs (`kernels.quant_h2`) by the kernel that writes x.

The one-row kernel on the paired layout with bfloat16 x (`kernels.quant_gemv`'s H2 path and
`kernels.quant_gemv_tma`) turns every x pair into a float16 pair of x / 16 and sums those pairs and x over each
thread's 4 columns of a block before any code of the block is multiplied: ~130 of a 128-row block's ~700
instructions a thread, repeated by every program that reads the same x (every feature tile, and in each tile by
every thread that holds the same columns). Here the kernel that writes x (the norms, the SwiGLU; or a launch of
its own, `x_pairs_into`) writes that form once, and the one-row kernel loads it (READY) instead.

The form, one row of int32 words a token ([T, `pairs_width(K)`], K a multiple of 256, the paired layout's block):
- words [0, K / 2): word p holds float16 x[2 p] / 16 (low half) and x[2 p + 1] / 16 (high half), rounded to nearest
  (the `kernels.quant_h2.h2_x` pairs);
- words K / 2 + 2 q and K / 2 + 2 q + 1, for each quad q = 8 b + 4 h + c of block b (half h, columns 4 c .. 4 c + 3
  of the half's 16): the quad's float16 pair sum, negated, and its float32 sum of x (as bits). The quad is the 16
  pairs 128 b + 64 h + 16 i + 4 c + j (i, j < 4): the pairs one thread of the one-row kernel multiplies by one
  group scale in one chain (`kernels.quant_h2.h2_acc4`'s nsum4 and xt4). Each sum is taken in the order the
  kernel took it (per column over i, then over the quad's 4 columns; float16 rounding after every add), so the
  kernel's output is the same bit for bit either way.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv
from kernels.pdl import compiled, launch_args, pdl_enabled, wait_then_release
from kernels.quant_h2 import _f16_hi, _f16_lo, _f16x2, sixteenths
from kernels.quant_half_sums import slice_width

BLOCK = 256                 # codes of the paired layout's block (x values a block of words multiplies)
BLOCKS = 4                  # blocks a program of `x_pairs_into` converts


ENV = "LORAPLEX_X_PAIRS"


def pairs_mode() -> str:
    """LORAPLEX_X_PAIRS, for A/B runs: unset or 1, the form is read where `kernels.quant_matmul.reads_pairs`'
    rule says it pays; 0, never (the one-row kernel converts x itself); all, on every launch of the one-row
    float16-pairs kernels (either form of them) that can read it."""
    raw = os.environ.get(ENV, "1").strip() or "1"
    if raw not in ("0", "1", "all"):
        raise ValueError(f"{ENV} must be 0, 1 or all, got {raw!r}")
    return raw


def pairs_width(k: int) -> int:
    """int32 words of a token's row of the form: K / 2 pair words, then two words for each of the K / 32 quads."""
    return k // 2 + k // 16


def pairs_apply(k: int) -> bool:
    """Whether x of K features has the form (K a whole number of the paired layout's blocks)."""
    return k > 0 and k % BLOCK == 0


@triton.jit
def _slice(v, idx, k: tl.constexpr, AXIS: tl.constexpr):
    """int32 v's elements at idx == k along AXIS (1 or 2 of a 3-D tensor), exactly (integer sums of one value
    and zeros)."""
    return tl.sum(tl.where(idx == k, v, 0), axis=AXIS)


@triton.jit
def _f16_sum4(v, idx, AXIS: tl.constexpr, NEG: tl.constexpr):
    """f16x2 words: lane by lane ((v0 + v1) + v2) + v3 over AXIS (each add rounded to float16), negated if NEG."""
    a = _slice(v, idx, 0, AXIS)
    lo = _f16_lo(a)
    hi = _f16_hi(a)
    for k in tl.static_range(1, 4):
        b = _slice(v, idx, k, AXIS)
        lo = (lo + _f16_lo(b)).to(tl.float16)
        hi = (hi + _f16_hi(b)).to(tl.float16)
    if NEG:
        lo = -lo
        hi = -hi
    return _f16x2(lo, hi)


@triton.jit
def _f32_sum4(v, idx, AXIS: tl.constexpr):
    """fp32: ((v0 + v1) + v2) + v3 over AXIS, in that order."""
    s = tl.sum(tl.where(idx == 0, v, 0.0), axis=AXIS)
    for k in tl.static_range(1, 4):
        s = s + tl.sum(tl.where(idx == k, v, 0.0), axis=AXIS)
    return s


@triton.jit
def quad_offsets(first_quad, NQ: tl.constexpr):
    """[NQ, 4, 8]: the places in a row of x of the values of quads first_quad .. first_quad + NQ - 1, quad-major
    (quad q = 8 b + 4 h + c: values 256 b + 128 h + 32 i + 8 c + e, e < 8 the column pairs 4 c .. 4 c + 3 of the
    half's 16), the shape `store_x_pairs` takes. A kernel that computes x at these places (the SwiGLU) holds each
    quad's values in one warp, with the 8 values of a pair-quarter together: its sums need no shared memory."""
    q = first_quad + tl.arange(0, NQ)[:, None, None]
    return (q // 4) * 128 + (q % 4) * 8 + tl.arange(0, 4)[None, :, None] * 32 + tl.arange(0, 8)[None, None, :]


@triton.jit
def row_quads(v):
    """[H / 32, 4, 8]: a whole row v ([BLOCK] in order, BLOCK a multiple of 256) rearranged quad-major
    (`quad_offsets`)."""
    NB: tl.constexpr = v.shape[0] // 256
    return tl.reshape(tl.permute(tl.reshape(v, (NB * 2, 4, 4, 8)), (0, 2, 1, 3)), (NB * 8, 4, 8))


@triton.jit
def store_x_pairs(v, row_ptr, k, first_quad, count, ASM: tl.constexpr):
    """Writes the form of v ([NQ, 4, 8]: the values of quads first_quad .. of x's row as stored, quad-major,
    `quad_offsets`; any float dtype) into the row at row_ptr (int32; x of k features), its first `count` quads
    (ASM: compiled, `kernels.quant_h2.sixteenths`)."""
    NQ: tl.constexpr = v.shape[0]
    lo, hi = tl.split(tl.reshape(v.to(tl.float32), (NQ, 4, 4, 2)))           # [NQ, 4 (i), 4 (column)]
    words = sixteenths(lo, hi, ASM)
    qi = tl.arange(0, NQ)
    q = first_quad + qi[:, None, None]
    p = (q // 4) * 64 + (q % 4) * 4 + tl.arange(0, 4)[None, :, None] * 16 + tl.arange(0, 4)[None, None, :]
    tl.store(row_ptr + p, words, mask=(qi < count)[:, None, None])
    # per column over i in order, then per quad over its 4 columns in order (the one-row kernel's order)
    idx_i = tl.arange(0, 4)[None, :, None]
    idx_c = tl.arange(0, 4)[None, :]
    nsum = _f16_sum4(_f16_sum4(words, idx_i, 1, False), idx_c, 1, True)                 # [NQ]
    xt = _f32_sum4(_f32_sum4(lo + hi, idx_i, 1), idx_c, 1)
    quads = tl.join(nsum, xt.to(tl.int32, bitcast=True))                               # [NQ, 2]
    two = tl.arange(0, 2)[None, :]
    tl.store(row_ptr + k // 2 + 2 * (first_quad + qi[:, None]) + two, quads, mask=(qi < count)[:, None])


@triton.jit
def _x_pairs_kernel(x_ptr, out_ptr, stride_x, K, NB: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * NB * 8
    offs = quad_offsets(first, NB * 8)
    wait_then_release(USE_PDL)
    v = tl.load(x_ptr + t * stride_x + offs, mask=offs < K, other=0.0)
    store_x_pairs(v, out_ptr + t * (K // 2 + K // 16), K, first, K // 32 - first, ASM)


def check_pairs(pairs: torch.Tensor, T: int, K: int, name: str = "x_pairs") -> None:
    """Raises unless `pairs` is contiguous int32 [T, pairs_width(K)] with K a whole number of blocks."""
    if not pairs_apply(K) or pairs.dtype != torch.int32 or pairs.shape != (T, pairs_width(K)) \
            or not pairs.is_contiguous():
        raise ValueError(f"{name} must be contiguous int32 [{T}, {pairs_width(K) if pairs_apply(K) else '-'}] "
                         f"for x of {K} features (a multiple of {BLOCK}); got {pairs.dtype} {tuple(pairs.shape)}")


def side_output(side: torch.Tensor | None, T: int, K: int) -> tuple[int, bool]:
    """What a kernel that writes x ([T, K]) writes beside it into `side` (`kernels.rms_norm.add_rms_norm`,
    `kernels.silu_mul.silu_mul`): (width, False), x's sums over each width-wide slice (float32 [T, K / width],
    `kernels.quant_half_sums.slice_width`; width 0 without `side`), or (0, True), this form (int32 [T,
    pairs_width(K)]), each checked."""
    if side is not None and side.dtype == torch.int32:
        check_pairs(side, T, K, "the x pairs")
        return 0, True
    return slice_width(side, T, K), False


def x_pairs_into(x: torch.Tensor,      # [T, K] 16-bit, unit stride along K, K a multiple of 256
                 out: torch.Tensor,    # [T, pairs_width(K)] int32 contiguous
                 ) -> None:
    """Semantics: out = the form of x (the module's docstring), by a launch of its own."""
    T, K = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit stride along K, got strides {x.stride()}")
    check_pairs(out, T, K, "out")
    if T == 0:
        return
    _x_pairs_kernel[(T, cdiv(K // BLOCK, BLOCKS))](x, out, x.stride(0), K, NB=BLOCKS, num_warps=4, ASM=compiled(),
                                                   **launch_args(pdl_enabled(x.device)))


def x_pairs(x: torch.Tensor) -> torch.Tensor:
    """The form of x ([T, K], K a multiple of 256) in a new buffer (`x_pairs_into`)."""
    out = torch.empty(x.shape[0], pairs_width(x.shape[1]), dtype=torch.int32, device=x.device)
    x_pairs_into(x, out)
    return out


def x_pairs_reference(x: torch.Tensor) -> torch.Tensor:
    """The form of x computed with torch on x's device (float16 sums rounded after every add, as the kernels
    round them; for tests)."""
    T, K = x.shape
    xf = x.float().reshape(T, K // 2, 2)
    h = (xf * 0.0625).to(torch.float16)                                                 # [T, K / 2, 2]
    words = h.view(torch.int16).to(torch.int32)
    words = (words[..., 0] & 0xFFFF) | (words[..., 1] << 16)
    hh = h.reshape(T, K // 256, 2, 4, 16, 2)                    # block, half, i, column, lane
    col = hh[:, :, :, 0]
    for i in range(1, 4):
        col = (col + hh[:, :, :, i]).to(torch.float16)
    col = col.reshape(T, K // 256, 2, 4, 4, 2)                  # ..., quad, its column, lane
    quad = col[..., 0, :]
    for j in range(1, 4):
        quad = (quad + col[..., j, :]).to(torch.float16)
    nsum = (-quad).view(torch.int16).to(torch.int32)
    nsum = ((nsum[..., 0] & 0xFFFF) | (nsum[..., 1] << 16)).reshape(T, K // 32)
    t = xf.sum(-1).reshape(T, K // 256, 2, 4, 16)
    xcol = t[:, :, :, 0]
    for i in range(1, 4):
        xcol = xcol + t[:, :, :, i]
    xcol = xcol.reshape(T, K // 256, 2, 4, 4)
    xt = xcol[..., 0]
    for j in range(1, 4):
        xt = xt + xcol[..., j]
    quads = torch.stack([nsum, xt.reshape(T, K // 32).view(torch.int32)], dim=-1).reshape(T, K // 16)
    return torch.cat([words, quads], dim=1).contiguous()
