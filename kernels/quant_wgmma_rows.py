"""The asynchronous-dot 4-bit kernel for many rows (64-256 a program): 4 bits in groups of 128 and more (the paired
layout), bfloat16 x, sm_90+. NOT PICKED by `kernels.quant_config.pick_config` (only with LORAPLEX_ASYNC_ROWS=1):
measured on an H200 slower than the bf16 GEMMs at 128-255 rows and than the tiles on most 8B shapes
(docs/quantization.md, "Open: 128-256 streams", with what it would take).

`kernels.quant_wgmma` starts each half block's dot from zero and scales it into the running sum after it, which
takes three accumulators a program and spills at 128 rows. Here the group scale goes onto the weights instead,
before the dot: a thread turns each of its words' code pairs into bfloat16 `128 + q` (`quant_wgmma._biased`),
widens them to fp32, forms `s * (128 + q) + (o - 128 s)` with fp32 scales and offsets (one rounding, to
bfloat16, as the dequantize-then-GEMM path rounds its weights) and the dots accumulate into one accumulator,
chained asynchronously, one in flight while the next half block is unpacked: no sums of x, no scaling after the
dot. The ring of half blocks in shared memory (x's [BLOCK_M, 128] tile and the [BLOCK_N, 16] words, scales and
offsets, one copy group a half) and its synchronisation are `quant_wgmma`'s with SYNC 1 (wait, barrier, fence;
a barrier before each refill). One program per output tile and range of K (split-K as `kernels.quant_wgmma`'s,
its `_store_tile`: for o and down, whose 4096 features make 32-64 tiles at these row counts; NOT RUN on a GPU
yet). As a dependent launch (kernels/pdl.py) the first NX half blocks' words, scales and offsets are copied
before the wait, x after it.

Written in Triton's explicit-layout dialect, which the interpreter does not run: on the CPU only its compiled
sm_90 code is checked (tests/kernels/test_quant_wgmma_rows.py); its GPU tests pass on an H200 (6f5083b).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kernels.env_switch import env_int
from kernels.pdl import launch_args, pdl_enabled
from kernels.quant_pack import PackedQuantWeight
from kernels.quant_wgmma import BLOCK_NS, _biased, _fill_weights, _fill_x_tile, _half_sources, _mma_layout, \
    _pairs_operand, _ring, _store_tile, _wait_then_release, _words_layout, async_copy, check_operands, cta_barrier, \
    runs_on

BLOCK_MS = (64, 128, 256)   # rows a program: the dot's N
ENV = "LORAPLEX_ASYNC_ROWS"


def async_rows_enabled() -> bool:
    """LORAPLEX_ASYNC_ROWS=1 (for A/B runs; unset or 0 by default): where the asynchronous-dot kernel runs at all
    (`kernels.quant_wgmma.async_dots_enabled`), 65-255 rows of a large 4-bit weight take this kernel
    (pick_config's `async_rows`) instead of the tiles."""
    return env_int(ENV, lambda v: v in (0, 1), "0 or 1") == 1


@gluon.jit
def _scaled(words, i: gl.constexpr, s, c):
    """Fields i and i + 4 of each word as two bfloat16 s * q + o in one register: `128 + q` from `_biased`
    widened to fp32, times the row's scale plus c = o - 128 s (fp32), rounded once."""
    return gl.inline_asm_elementwise(
        "{ .reg .f32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xffff0000; fma.rn.f32 lo, lo, $2, $3; "
        "fma.rn.f32 hi, hi, $2, $3; cvt.rn.bf16x2.f32 $0, hi, lo; }",
        "=r,r,r,r", [_biased(words, i), s, c], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def quant_wgmma_rows_kernel(x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, T, N, stride_x,
                            stride_out, words_per_row, num_halves, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, NX: gl.constexpr, U: gl.constexpr, HAS_BIAS: gl.constexpr,
                            USE_PDL: gl.constexpr, SPLIT: gl.constexpr = 1, FENCE: gl.constexpr = 1):
    """out.T tile [BLOCK_N, BLOCK_M] over half blocks pid_k * H .. (pid_k + 1) * H - 1, H = num_halves / SPLIT (a
    multiple of U), + bias; SPLIT > 1: quant_wgmma's split-K (`_store_tile`)."""
    pid_m = gl.program_id(0)                        # row tiles of one feature block run side by side (its words
    pid_n = gl.program_id(1)                        # read once from memory, then from L2)
    pid_k = gl.program_id(2)
    NW: gl.constexpr = BLOCK_N // 16                # warps: one or two warpgroups
    mma: gl.constexpr = _mma_layout(NW, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    w_layout: gl.constexpr = _words_layout(NW)
    row_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    x_smem, w_smem, s_smem, o_smem = _ring(NX, BLOCK_M, BLOCK_N)
    H = num_halves // SPLIT
    h0 = pid_k * H
    x_half, x_mask, w_half, w_mask, s_ptrs, o_ptrs, sc_mask = _half_sources(
        x_ptr, w_ptr, s_ptr, o_ptr, T, N, stride_x, words_per_row, h0, BLOCK_M, BLOCK_N, NW)
    for i in gl.static_range(NX):                   # the weights of the first NX halves before the wait
        _fill_weights(i, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
    if USE_PDL:                                     # kernels/pdl.py: x comes from earlier launches
        _wait_then_release()
    for i in gl.static_range(NX):                   # a copy group a half (the first one holds every weight above)
        _fill_x_tile(i, H, x_smem, x_half, x_mask)
        async_copy.commit_group()
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for it in range(0, H // U):
        for u in gl.static_range(U):
            h = it * U + u
            if u == 0:                              # as quant_wgmma with SYNC 1
                async_copy.wait_group(NX - 1)
            else:
                async_copy.wait_group(NX - 2)
            cta_barrier()
            fence_async_shared()
            slot = h % NX
            s = s_smem.index(slot).load(row_layout).to(gl.float32)
            c = o_smem.index(slot).load(row_layout).to(gl.float32) - 128.0 * s
            words = w_smem.index(slot).load(w_layout)
            a = _pairs_operand(_scaled(words, 0, s[:, None], c[:, None]), _scaled(words, 1, s[:, None], c[:, None]),
                               _scaled(words, 2, s[:, None], c[:, None]), _scaled(words, 3, s[:, None], c[:, None]),
                               a_layout)
            acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
            if u > 0:                                   # half h - 1's dot done: its slot is free
                acc, a_done = warpgroup_mma_wait(1, deps=(acc, a_prev))
                cta_barrier()                           # every warp done with the slot
                nxt = h - 1 + NX
                _fill_weights(nxt, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
                _fill_x_tile(nxt, H, x_smem, x_half, x_mask)
                async_copy.commit_group()
            a_prev = a
        acc, a_done = warpgroup_mma_wait(0, deps=(acc, a_prev))
        cta_barrier()
        nxt = it * U + U - 1 + NX
        _fill_weights(nxt, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
        _fill_x_tile(nxt, H, x_smem, x_half, x_mask)
        async_copy.commit_group()
    async_copy.wait_group(0)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_m < T)[None, :]
    out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_out + offs_n[:, None]
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
    else:
        bias = gl.zeros([BLOCK_N, 1], gl.float32, mma)
    _store_tile(acc, bias, out_ptr, out_ptrs, mask, part_ptr, lock_ptr, offs_m, offs_n, T, N, SPLIT, FENCE, NW)


def quant_wgmma_rows(x: torch.Tensor,              # [T, K] bfloat16, unit stride along K
                     w: PackedQuantWeight,         # [N, K], 4 bits in groups of 128+ (paired layout), K % (128 u) == 0
                     bias: torch.Tensor | None,    # [N] bfloat16 or None
                     out: torch.Tensor,            # [T, N] bfloat16
                     block_m: int = 128, block_n: int = 128, nx: int = 4, u: int = 2, split: int = 1,
                     partials: torch.Tensor | None = None,  # float32, >= split * T * N elements (split > 1)
                     locks: torch.Tensor | None = None,     # int32 zeros, >= cdiv(T, block_m) * cdiv(N, block_n)
                     ) -> None:
    """out = x @ W.T + bias with W = q * scale + offset rounded to bfloat16 (sm_90+; see the module docstring).
    split > 1: K's half blocks in `split` ranges, one program each, summed as `kernels.quant_wgmma` does; `locks`
    hold zeros before and after the call."""
    T, K = x.shape
    N = w.out_features
    check_operands(x, w, out, 128 * u * split)
    if block_m not in BLOCK_MS or block_n not in BLOCK_NS or nx < 3 or split < 1:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, block_n one of {BLOCK_NS}, nx at least 3 and split at "
                         f"least 1, got {block_m}, {block_n}, {nx}, {split}")
    grid = (triton.cdiv(T, block_m), triton.cdiv(N, block_n), split)
    if split > 1 and (partials is None or partials.dtype != torch.float32 or partials.numel() < split * T * N
                      or locks is None or locks.dtype != torch.int32 or locks.numel() < grid[0] * grid[1]
                      or split * T * N >= 2 ** 31):
        raise ValueError(f"split {split} needs float32 partials of >= {split * T * N} (< 2**31) elements and int32 "
                         f"zero locks of >= {grid[0] * grid[1]}")
    if not runs_on(x.device):
        raise ValueError("the many-row asynchronous-dot kernel runs on a compiled sm_90+ GPU only")
    if T == 0 or N == 0:
        return
    pdl = launch_args(pdl_enabled(x.device))
    quant_wgmma_rows_kernel[grid](x, w.words, w.scales, w.offsets, bias if bias is not None else out, out,
                                  partials if split > 1 else out, locks if split > 1 else out, T, N, x.stride(0),
                                  out.stride(0), w.words.shape[1], K // 128, GROUP=w.group_size, BLOCK_M=block_m,
                                  BLOCK_N=block_n, NX=nx, U=u, HAS_BIAS=bias is not None, SPLIT=split, FENCE=True,
                                  num_warps=block_n // 16, **pdl)
