"""EXPERIMENT, not called by `kernels.quant_matmul` (and never picked): the 4-bit pair-codes tile (2-64 rows; 4 bits
in groups of 128 and more, the paired layout, bfloat16 x) with its tensor-core dots issued asynchronously, so
that half block h's dot runs while half block h + 1's codes are unpacked and half block h - 1's sums are scaled.

Why: the register-set tiles (`kernels.quant_mma`) wait for every dot before the next instruction (the compiler
waits after a dot whose result is scaled before the next one; its hottest stalls at 64 rows,
`bench/results/quant_gemv_stalls_rows64.json`). Written in Triton's explicit-layout dialect: the words are read
straight into the layout of the dot's register operand (`w_layout`: a thread holds the words of its operand
rows and pairs), x's half blocks go by asynchronous copies into a ring of NX half blocks in shared memory, and
each loop step covers U half blocks and ends with its dots complete (a dot running across the loop's back edge
makes the assembler wait after every dot: the compiler copies loop-carried values there). The arithmetic is
`quant_mma`'s pair-codes path: BIAS + q as the operand (`biased_pair`'s and-or), one K=128 dot a half block,
fp32 sums times the group scale, and the offsets' term (o - BIAS s) * sum(x) as a second FMA a half block.

State (2026-11-29): compiled for sm_90 with Triton 3.6 and 3.9, two dots in flight (tests/kernels/
test_quant_wgmma.py); its first GPU run (an earlier version, bench/results/quant_async_dots_first_run.json) gave
wrong sums from a ring bug since fixed, and this version has NOT RUN on a GPU. `bench/quant_async_dots.py` times
it against pick_config's tiles; split-K here adds fp32 partials atomically (order-dependent rounding), unlike
`kernels.quant_split`'s ordered sum.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kernels.quant_pack import PackedQuantWeight, paired_layout

# Triton 3.6 and 3.9 name two of the dialect's operations differently
x_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_N = 64        # features a program (4 warps' 16-row slices of the dot's M; the kernel's layouts assume 64)


@gluon.jit
def _biased(words, i: gl.constexpr):
    """Fields i and i + 4 of each word as two bfloat16 128 + q in one register (`quant_tile.biased_pair`)."""
    v = words >> (4 * i)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 0xEA;", "=r,r", [v],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _operand(words, A_LAYOUT: gl.constexpr):
    """[BN, 128] bfloat16 128 + q of a half block in k order from its [BN, 16] words (paired layout: k = 32 i +
    2 j + s is field 4 s + i of word j), in the dot's register-operand layout (`quant_mma._half_operand`)."""
    BN: gl.constexpr = words.shape[0]
    j = gl.join(gl.join(_biased(words, 0), _biased(words, 1)), gl.join(_biased(words, 2), _biased(words, 3)))
    p = gl.reshape(gl.permute(j, (0, 3, 2, 1)), (BN, 64))           # pair p = 16 i + j of each row
    lo = p.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), (BN, 128)), A_LAYOUT)


@gluon.jit
def quant_wgmma_kernel(x_ptr, w_ptr, s_ptr, o_ptr, xs_ptr, out_ptr, part_ptr, T, N, stride_x, stride_out,
                       words_per_row, num_halves, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, NX: gl.constexpr,
                       U: gl.constexpr, SPLIT: gl.constexpr):
    """out.T tile [64, BLOCK_M] over half blocks pid_k * H .. (pid_k + 1) * H - 1, H = num_halves / SPLIT (a
    multiple of U). SPLIT 1 writes out (x's dtype); more add fp32 partials into part ([T, N], zeroed)."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # [64, 16] words of a half block: lane l of warp w holds rows 16 w + l / 4 (+ 8) and words l % 4 (+ 4, 8,
    # 12), the words whose pairs are its operand registers
    w_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 4], [0, 8], [8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    x_reg: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                           order=[1, 0])
    x_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NX, BLOCK_M, 128], x_sh)

    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_reg))
    offs_xk = gl.arange(0, 128, layout=gl.SliceLayout(0, x_reg))
    x_mask = (offs_xm[:, None] < T) & (offs_xk[None, :] < 128)
    offs_wn = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, w_layout))
    offs_wj = gl.arange(0, 16, layout=gl.SliceLayout(0, w_layout))
    offs_n = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    n_mask = offs_n < N
    m_mask = offs_m < T
    H = num_halves // SPLIT
    h0 = pid_k * H
    x_half = x_ptr + offs_xm[:, None] * stride_x + offs_xk[None, :] + h0 * 128      # int32: T * stride_x < 2**31
    w_half = w_ptr + gl.minimum(offs_wn, N - 1)[:, None] * words_per_row + offs_wj[None, :] + h0 * 16

    for i in gl.static_range(NX):                   # x of halves 0 .. NX - 1, a copy group a half
        x_copy(x_smem.index(i), x_half + i * 128, mask=x_mask & (i < H))
        async_copy.commit_group()
    w1 = gl.load(w_half)
    w2 = gl.load(w_half + gl.minimum(1, H - 1) * 16)
    s1 = gl.load(s_ptr + ((h0 * 128) // GROUP) * N + offs_n, mask=n_mask, other=0.0).to(gl.float32)
    o1 = gl.load(o_ptr + ((h0 * 128) // GROUP) * N + offs_n, mask=n_mask, other=0.0).to(gl.float32)
    x1 = gl.load(xs_ptr + offs_m * num_halves + h0, mask=m_mask, other=0.0)
    acc = gl.zeros([64, BLOCK_M], gl.float32, mma)
    free_a = gl.zeros([64, BLOCK_M], gl.float32, mma)       # accumulators no running dot holds
    free_b = gl.zeros([64, BLOCK_M], gl.float32, mma)
    for it in range(0, H // U):
        for u in gl.static_range(U):
            h = it * U + u
            # half h's copy group is done: before a loop step's first half the halves up to h + NX - 1 are
            # committed (the previous step's end, or the prologue), before the others up to h + NX - 2
            if u == 0:
                async_copy.wait_group(NX - 1)
            else:
                async_copy.wait_group(NX - 2)
            fence_async_shared()
            cta_barrier()
            a = _operand(w1, a_layout)
            tok = warpgroup_mma(a, x_smem.index(h % NX).permute((1, 0)), free_a, use_acc=False, is_async=True)
            s_cur = s1
            c_cur = o1 - 128.0 * s1
            xs_cur = x1
            w1 = w2                                             # words two half blocks ahead, scales one
            w2 = gl.load(w_half + gl.minimum(h + 2, H - 1) * 16)
            g1 = ((h0 + gl.minimum(h + 1, H - 1)) * 128) // GROUP
            s1 = gl.load(s_ptr + g1 * N + offs_n, mask=n_mask, other=0.0).to(gl.float32)
            o1 = gl.load(o_ptr + g1 * N + offs_n, mask=n_mask, other=0.0).to(gl.float32)
            x1 = gl.load(xs_ptr + offs_m * num_halves + h0 + gl.minimum(h + 1, H - 1), mask=m_mask, other=0.0)
            if u > 0:                                           # half h - 1's dot done: its sums, its x slot
                d_done, a_done = warpgroup_mma_wait(1, deps=(tok_prev, a_prev))
                acc = acc + s_prev[:, None] * d_done + c_prev[:, None] * xs_prev[None, :]
                free_a = d_done
                nxt = h - 1 + NX
                x_copy(x_smem.index(nxt % NX), x_half + nxt * 128, mask=x_mask & (nxt < H))
                async_copy.commit_group()
            else:
                free_a = free_b
            tok_prev = tok
            a_prev = a
            s_prev = s_cur
            c_prev = c_cur
            xs_prev = xs_cur
        d_done, a_done = warpgroup_mma_wait(0, deps=(tok_prev, a_prev))
        acc = acc + s_prev[:, None] * d_done + c_prev[:, None] * xs_prev[None, :]
        free_b = d_done
        nxt = it * U + U - 1 + NX
        x_copy(x_smem.index(nxt % NX), x_half + nxt * 128, mask=x_mask & (nxt < H))
        async_copy.commit_group()
    async_copy.wait_group(0)
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT == 1:
        out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_out + offs_n[:, None]
        gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        gl.atomic_add(part_ptr + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask, sem="relaxed")


def quant_wgmma(x: torch.Tensor,              # [T, K] bfloat16, unit stride along K
                w: PackedQuantWeight,         # [N, K], 4 bits in groups of 128+ (paired layout), K % (128 U SPLIT) == 0
                out: torch.Tensor,            # [T, N] bfloat16 (split 1)
                x_sums: torch.Tensor,         # [T, K / 128] float32: `quant_matmul.half_sums(x)`
                block_m: int = 32, split: int = 1, nx: int = 4, u: int = 4,
                partials: torch.Tensor | None = None,  # [T, N] float32 zeros (split > 1): out.float() after
                ) -> None:
    """out = x @ W.T with W = q * scale + offset (sm_90+, the experiment above; see the module docstring)."""
    T, K = x.shape
    N = w.out_features
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be bfloat16 [T, K] with unit stride along K, got {x.dtype} {tuple(x.stride())}")
    if w.bits != 4 or not paired_layout(w.bits, w.group_size) or K % (128 * u * split):
        raise ValueError(f"needs 4 bits in groups of 128+ and K a multiple of {128 * u * split}: bits {w.bits}, "
                         f"group {w.group_size}, K {K}")
    if block_m not in (16, 32, 64) or nx < 3:
        raise ValueError(f"block_m must be 16, 32 or 64 and nx at least 3, got {block_m}, {nx}")
    if split > 1 and (partials is None or partials.dtype != torch.float32 or partials.shape != (T, N)):
        raise ValueError("split > 1 adds into partials: float32 [T, N] zeros")
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(T, block_m), split)
    quant_wgmma_kernel[grid](x, w.words, w.scales, w.offsets, x_sums, out, partials if split > 1 else out, T, N,
                             x.stride(0), out.stride(0), w.words.shape[1], K // 128, GROUP=w.group_size,
                             BLOCK_M=block_m, NX=nx, U=u, SPLIT=split, num_warps=4)
