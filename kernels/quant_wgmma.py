"""The asynchronous-dot 4-bit kernel: 2-32 rows of a large weight (and 65+ rows of gate/up, DEQ below), 4 bits
in groups of 128 and more (the paired layout), bfloat16 x, sm_90+. `kernels.quant_matmul` runs it where
`kernels.quant_config.pick_config` is given `async_dots` (QuantLinear on such a GPU; LORAPLEX_ASYNC_DOTS=0 keeps
the register-set tiles of `kernels.quant_mma`).

A program owns 64 features (one warpgroup) or 128 (two warpgroups sharing each half block's x: half the copies
of x a feature) by 8 / 16 / 32 / 64 (or 128 / 256, DEQ) rows (BLOCK_M) and a range of K's half blocks (128 codes, one
group). Everything a half block needs goes by asynchronous copies into a ring of NX slots in shared memory, one
copy group a half block: x's [BLOCK_M, 128] tile, the [BLOCK_N, 16] words (swizzled so that each load instruction
reads 32 banks), the group scales, offsets and x's sums; the loop has no global loads (a loop-carried register
copy of a load waits for it in the same iteration). Each half block's words become the dot's register operand
(`w_layout`: a thread loads the words whose pairs are its operand registers), BIAS + q as bfloat16 pairs by one
`lop3` (`quant_tile.biased_pair`), and one K=128 tensor-core dot runs asynchronously while the next half block is
unpacked and the previous one's fp32 sums are scaled: acc += s * D + (o - BIAS s) * sum(x). A loop step covers U
half blocks and ends with its dots complete (a dot running across the loop's back edge makes the assembler wait
after every dot). Split-K: each program stores its fp32 partial and the last of a tile sums them in split order
(`kernels.quant_split`'s protocol, deterministic); a bias is added once. As a dependent launch (kernels/pdl.py)
the first NX half blocks' words, scales and offsets (NX - 2 with SYNC 2) are copied before the wait, x and its
sums after it.
How a half block's copies are made safe to read (SYNC, `ring_sync`): 0, the wait for them, a shared-memory proxy
fence (the dot reads x through the asynchronous proxy) and a block-wide barrier, with a barrier the compiler adds
between the wait and the fence and one before each refill, whose slot every warp must be done with (three a half
block; as measured so far); 1, the barrier before the fence, the order of the compiler's own pipelined dots after
asynchronous copies (Triton 3.9), so it adds none there (two); 2, as 1, and the half's refill goes into half
h - 2's slot (every warp has read it and waited for its dot before reaching that barrier) with no barrier of its
own, a ring of NX slots holding NX - 2 halves ahead (one barrier a half block where the compiler can tell the
ring's slots apart: Triton 3.9; two with 3.6). 1 is the default: every variant passes its GPU tests, and
over the 8B shapes at 1-64 rows the best configuration with 1 was the fastest of all in 14 of 20 cases and
beat 0's in 18 (q/k/v at 16 rows and down at 8: 1.5-2% behind); 2 was 5-9% faster on down at 1 and 8 rows
(docs/quantization-performance.md).
DEQ (tiles of 128 or 256 rows, `DEQ_ROWS`: pick_config's `_wide_config`, 65-383 rows of gate/up): three
accumulators of 128+ rows do not fit the registers (688 bytes of spills at 128 rows), so each half block's weights
go into the operand dequantized, (128 + q) * s + (o - 128 s) in fp32 rounded to bfloat16 once (the dense path's
rounding), and one accumulator chains every dot; half h's dot runs while half h + 1 is dequantized, the ring
holds the next NX - 1 halves, and x's sums are not read (docs/quantization-performance.md, "Wide tiles at 65+ rows").

Written in Triton's explicit-layout dialect (`triton.experimental.gluon`), which the interpreter does not run:
on the CPU only its compiled sm_90 code is checked (tests/kernels/test_quant_wgmma.py). Measured on an H200
(docs/quantization-performance.md, "Asynchronous dots at 2-32 rows").
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kernels.env_switch import env_int
from kernels.pdl import compiled, launch_args, pdl_enabled
from kernels.quant_half_sums import check_sums
from kernels.quant_pack import PackedQuantWeight, paired_layout

# Triton 3.6 and 3.9 name two of the dialect's operations differently
x_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_NS = (64, 128)    # features a program: one or two warpgroups, each warp a 16-row slice of the dot's M
BLOCK_MS = (8, 16, 32, 64, 128, 256)    # rows a program: the dot's N
DEQ_ROWS = 128          # from here the weights are dequantized into the operand (DEQ, one accumulator)


@gluon.constexpr_function
def _x_copy_layout(num_warps, block_m):
    """Threads over x's [block_m, 128] tile for its copies, 16 bytes a thread, or 8 where two warpgroups share an
    8-row tile (a [16, 128] cover would copy each element twice)."""
    if num_warps == 8 and block_m == 8:
        return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[2, num_warps // 2],
                                order=[1, 0])
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[num_warps, 1],
                            order=[1, 0])


@gluon.constexpr_function
def _warp_rows(num_warps):
    """Warp bases of a [16 * num_warps, *] layout whose warp w holds rows 16 w .. 16 w + 15."""
    return [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]


@gluon.jit
def _biased(words, i: gl.constexpr):
    """Fields i and i + 4 of each word as two bfloat16 128 + q in one register (`quant_tile.biased_pair`)."""
    v = words >> (4 * i)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 0xEA;", "=r,r", [v],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _dequantized(words, i: gl.constexpr, s, c):
    """Fields i and i + 4 of each word as `_biased` places them, dequantized: (128 + q) * s + c in fp32 (c = offset
    - 128 scale, so q * scale + offset), each rounded to bfloat16 once (the dense path's rounding)."""
    p = _biased(words, i)
    lo = (p << 16).to(gl.float32, bitcast=True) * s + c
    hi = (p & -65536).to(gl.float32, bitcast=True) * s + c
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _operand(words, A_LAYOUT: gl.constexpr):
    """[BN, 128] bfloat16 128 + q of a half block in k order from its [BN, 16] words (paired layout: k = 32 i +
    2 j + s is field 4 s + i of word j), in the dot's register-operand layout (`quant_mma._half_operand`)."""
    return _pairs_operand(_biased(words, 0), _biased(words, 1), _biased(words, 2), _biased(words, 3), A_LAYOUT)


@gluon.jit
def _dequantized_operand(words, s, c, A_LAYOUT: gl.constexpr):
    """The half block's weights q * scale + offset in bfloat16 ([BN, 1] fp32 s and c, `_dequantized`), laid out as
    `_operand`'s codes."""
    return _pairs_operand(_dequantized(words, 0, s, c), _dequantized(words, 1, s, c), _dequantized(words, 2, s, c),
                          _dequantized(words, 3, s, c), A_LAYOUT)


@gluon.jit
def _pairs_operand(p0, p1, p2, p3, A_LAYOUT: gl.constexpr):
    """The [BN, 128] bfloat16 operand from the four [BN, 16] registers of pairs (fields i and i + 4 of each word:
    p_i) of a half block."""
    BN: gl.constexpr = p0.shape[0]
    j = gl.join(gl.join(p0, p1), gl.join(p2, p3))
    p = gl.reshape(gl.permute(j, (0, 3, 2, 1)), (BN, 64))           # pair p = 16 i + j of each row
    lo = p.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), (BN, 128)), A_LAYOUT)


@gluon.jit
def _fill_weights(i, H, h0, N, GROUP: gl.constexpr, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs,
                  sc_mask):
    """Copy half block i's words, group scales and offsets into ring slot i % NX (masked off past the program's
    H halves): what no kernel of a step writes, so copied before a dependent launch's wait too."""
    slot = i % w_smem.shape[0]
    ok = i < H
    g = ((h0 + gl.minimum(i, H - 1)) * 128) // GROUP
    x_copy(w_smem.index(slot), w_half + i * 16, mask=w_mask & ok)
    x_copy(s_smem.index(slot), s_ptrs + g * N, mask=sc_mask & ok)
    x_copy(o_smem.index(slot), o_ptrs + g * N, mask=sc_mask & ok)


@gluon.jit
def _fill_x(i, H, x_smem, xs_smem, x_half, x_mask, xs_ptrs, xs_mask, SUMS: gl.constexpr = True):
    """Copy half block i's x and, with SUMS (not DEQ), x's sums into ring slot i % NX."""
    slot = i % x_smem.shape[0]
    ok = i < H
    x_copy(x_smem.index(slot), x_half + i * 128, mask=x_mask & ok)
    if SUMS:
        x_copy(xs_smem.index(slot), xs_ptrs + gl.minimum(i, H - 1), mask=xs_mask & ok)


@gluon.jit
def _gpu_fence(NUM_WARPS: gl.constexpr):
    """One GPU-scope fence a thread (`kernels.pdl.gpu_fence`)."""
    gl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.b32 $0, $1;", "=r,r",
                              [gl.arange(0, 32 * NUM_WARPS, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def quant_wgmma_kernel(x_ptr, w_ptr, s_ptr, o_ptr, xs_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, T, N, stride_x,
                       stride_out, words_per_row, num_halves, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                       NX: gl.constexpr, U: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                       FENCE: gl.constexpr, USE_PDL: gl.constexpr, BLOCK_N: gl.constexpr = 64,
                       SYNC: gl.constexpr = 0, DEQ: gl.constexpr = False, DEFER: gl.constexpr = False):
    """out.T tile [BLOCK_N, BLOCK_M] over half blocks pid_k * H .. (pid_k + 1) * H - 1, H = num_halves / SPLIT (a
    multiple of U), + bias. SPLIT > 1: each program stores its fp32 partial ([SPLIT, T, N] part), and the last
    of a tile (its int32 counter in lock, zero before and after) sums them in split order (`kernels.quant_split`'s
    protocol), or with DEFER no program sums them (the first split's with the bias; `kernels.split_sum`). DEQ
    (many rows): each half block's weights dequantized into the operand, one accumulator (module
    docstring); x's sums are not read."""
    pid_m = gl.program_id(0)                        # row tiles of one feature block run side by side (its words
    pid_n = gl.program_id(1)                        # read once from memory, then from L2)
    pid_k = gl.program_id(2)
    NW: gl.constexpr = BLOCK_N // 16                # warps: one or two warpgroups
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # [BLOCK_N, 16] words of a half block: lane l of warp w holds rows 16 w + l / 4 (+ 8) and words l % 4 (+ 4, 8,
    # 12), the words whose pairs are its operand registers
    w_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 4], [0, 8], [8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=_warp_rows(NW), block_bases=[], shape=[BLOCK_N, 16])
    x_reg: gl.constexpr = _x_copy_layout(NW, BLOCK_M)
    x_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NX, BLOCK_M, 128], x_sh)
    # the words of a half block go by asynchronous copies too, into the same ring slot and copy group as its x
    # (16-byte vectors of 4 words; the swizzle puts the 8 rows x 4 words each load instruction reads in 32 banks)
    w_cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[NW, 1],
                                          order=[1, 0])
    w_sh: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=2, max_phase=4, order=[1, 0])
    w_smem = gl.allocate_shared_memory(gl.int32, [NX, BLOCK_N, 16], w_sh)
    # and so do its group scales, offsets and x's sums (no register copies of loads across the loop's back edge)
    sc_cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[NW], order=[0])
    xs_cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[NW], order=[0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_smem = gl.allocate_shared_memory(gl.float16, [NX, BLOCK_N], flat)
    o_smem = gl.allocate_shared_memory(gl.float16, [NX, BLOCK_N], flat)
    xs_smem = gl.allocate_shared_memory(gl.float32, [NX, BLOCK_M], flat)

    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_reg))
    offs_xk = gl.arange(0, 128, layout=gl.SliceLayout(0, x_reg))
    x_mask = (offs_xm[:, None] < T) & (offs_xk[None, :] < 128)
    offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_cp))
    offs_wj = gl.arange(0, 16, layout=gl.SliceLayout(0, w_cp))
    w_mask = (offs_wn[:, None] >= 0) & (offs_wj[None, :] < 16)
    H = num_halves // SPLIT
    h0 = pid_k * H
    x_half = x_ptr + offs_xm[:, None] * stride_x + offs_xk[None, :] + h0 * 128      # int32: T * stride_x < 2**31
    w_half = w_ptr + gl.minimum(offs_wn, N - 1)[:, None] * words_per_row + offs_wj[None, :] + h0 * 16

    offs_sn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=sc_cp)
    offs_sm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=xs_cp)
    s_ptrs = s_ptr + offs_sn
    o_ptrs = o_ptr + offs_sn
    sc_mask = offs_sn < N
    xs_ptrs = xs_ptr + offs_sm * num_halves + h0
    xs_mask = offs_sm < T
    AHEAD: gl.constexpr = NX - 1 if DEQ else NX - 2 if SYNC == 2 else NX      # halves copied before the loop
    for i in gl.static_range(AHEAD):                # the weights of halves 0 .. AHEAD - 1 before the wait
        _fill_weights(i, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
    if USE_PDL:                                     # kernels/pdl.py: x and its sums come from earlier launches
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    for i in gl.static_range(AHEAD):                # a copy group a half (the first one holds every weight above)
        _fill_x(i, H, x_smem, xs_smem, x_half, x_mask, xs_ptrs, xs_mask, not DEQ)     # DEQ reads no sums
        async_copy.commit_group()
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    if DEQ:
        acc = _deq_loop(acc, a_layout, w_layout, H, h0, N, GROUP, NX, w_smem, s_smem, o_smem, x_smem, xs_smem,
                        w_half, w_mask, s_ptrs, o_ptrs, sc_mask, x_half, x_mask, xs_ptrs, xs_mask)
    else:
        acc = _sums_loop(acc, a_layout, w_layout, mma, H, h0, N, GROUP, NX, U, SYNC, w_smem, s_smem, o_smem,
                         x_smem, xs_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask, x_half, x_mask, xs_ptrs, xs_mask)
    async_copy.wait_group(0)
    _store_tile(acc, mma, pid_m, pid_n, pid_k, T, N, bias_ptr, out_ptr, part_ptr, lock_ptr, stride_out,
                BLOCK_N, BLOCK_M, SPLIT, HAS_BIAS, FENCE, NW, DEFER)


@gluon.jit
def _deq_loop(acc, a_layout: gl.constexpr, w_layout: gl.constexpr, H, h0, N, GROUP: gl.constexpr,
              NX: gl.constexpr, w_smem, s_smem, o_smem, x_smem, xs_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask,
              x_half, x_mask, xs_ptrs, xs_mask):
    """DEQ's loop: half h's dot runs while half h + 1 is dequantized; halves h .. h + NX - 2 are in the ring (the
    prologue copied NX - 1), and half h + NX - 1 goes into half h - 1's slot once every warp's dot h - 1 is done."""
    BN: gl.constexpr = w_smem.shape[1]
    a_prev = gl.zeros([BN, 128], gl.bfloat16, a_layout)
    for h in range(0, H):
        async_copy.wait_group(NX - 2)               # groups up to half h + NX - 2 committed: half h's is done
        cta_barrier()
        fence_async_shared()
        slot = h % NX
        s = s_smem.index(slot).load(gl.SliceLayout(1, w_layout)).to(gl.float32)
        c = o_smem.index(slot).load(gl.SliceLayout(1, w_layout)).to(gl.float32) - 128.0 * s
        a = _dequantized_operand(w_smem.index(slot).load(w_layout), s[:, None], c[:, None], a_layout)
        tok = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        acc, a_prev = warpgroup_mma_wait(1, deps=(tok, a_prev))     # dot h - 1 done: its operand and slot free
        a_prev = a
        cta_barrier()                               # every warp (both warpgroups) past its dot h - 1
        nxt = h + NX - 1
        _fill_weights(nxt, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
        _fill_x(nxt, H, x_smem, xs_smem, x_half, x_mask, xs_ptrs, xs_mask, False)
        async_copy.commit_group()
    acc, a_prev = warpgroup_mma_wait(0, deps=(acc, a_prev))
    return acc


@gluon.jit
def _sums_loop(acc, a_layout: gl.constexpr, w_layout: gl.constexpr, mma: gl.constexpr, H, h0, N,
               GROUP: gl.constexpr, NX: gl.constexpr, U: gl.constexpr, SYNC: gl.constexpr, w_smem, s_smem, o_smem,
               x_smem, xs_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask, x_half, x_mask, xs_ptrs, xs_mask):
    """The codes' loop: each half block's dot of 128 + q runs while the next is unpacked and the previous one's
    sums are scaled (module docstring)."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    free_a = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)       # accumulators no running dot holds
    free_b = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for it in range(0, H // U):
        for u in gl.static_range(U):
            h = it * U + u
            if SYNC == 2:
                # copy group g holds half g: halves up to h + NX - 3 are committed, so half h's is done with NX - 3
                # younger ones in flight; past the barrier every warp has read half h - 2's slot and waited for
                # its dot (in half h - 1 or at the step's end), so half h + NX - 2 goes there (below) with no other
                # barrier
                async_copy.wait_group(NX - 3)
                cta_barrier()
                fence_async_shared()
            else:
                # half h's copy group is done: before a loop step's first half the halves up to h + NX - 1 are
                # committed (the previous step's end, or the prologue), before the others up to h + NX - 2
                if u == 0:
                    async_copy.wait_group(NX - 1)
                else:
                    async_copy.wait_group(NX - 2)
                if SYNC == 1:                       # see the module docstring
                    cta_barrier()
                    fence_async_shared()
                else:
                    fence_async_shared()
                    cta_barrier()
            a = _operand(w_smem.index(h % NX).load(w_layout), a_layout)
            tok = warpgroup_mma(a, x_smem.index(h % NX).permute((1, 0)), free_a, use_acc=False, is_async=True)
            s_cur = s_smem.index(h % NX).load(gl.SliceLayout(1, mma)).to(gl.float32)
            c_cur = o_smem.index(h % NX).load(gl.SliceLayout(1, mma)).to(gl.float32) - 128.0 * s_cur
            xs_cur = xs_smem.index(h % NX).load(gl.SliceLayout(0, mma))
            if SYNC == 2:                               # after this half's reads and its dot's issue
                nxt = h + NX - 2
                _fill_weights(nxt, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
                _fill_x(nxt, H, x_smem, xs_smem, x_half, x_mask, xs_ptrs, xs_mask)
                async_copy.commit_group()
            if u > 0:                                           # half h - 1's dot done: its sums, its x slot
                d_done, a_done = warpgroup_mma_wait(1, deps=(tok_prev, a_prev))
                acc = acc + s_prev[:, None] * d_done + c_prev[:, None] * xs_prev[None, :]
                free_a = d_done
                if SYNC != 2:
                    nxt = h - 1 + NX
                    cta_barrier()                       # every warp (both warpgroups) done with the slot
                    _fill_weights(nxt, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs,
                                  sc_mask)
                    _fill_x(nxt, H, x_smem, xs_smem, x_half, x_mask, xs_ptrs, xs_mask)
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
        if SYNC != 2:
            nxt = it * U + U - 1 + NX
            cta_barrier()
            _fill_weights(nxt, H, h0, N, GROUP, w_smem, s_smem, o_smem, w_half, w_mask, s_ptrs, o_ptrs, sc_mask)
            _fill_x(nxt, H, x_smem, xs_smem, x_half, x_mask, xs_ptrs, xs_mask)
            async_copy.commit_group()
    return acc


@gluon.jit
def _store_tile(acc, mma: gl.constexpr, pid_m, pid_n, pid_k, T, N, bias_ptr, out_ptr, part_ptr, lock_ptr,
                stride_out, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT: gl.constexpr,
                HAS_BIAS: gl.constexpr, FENCE: gl.constexpr, NW: gl.constexpr, DEFER: gl.constexpr):
    """out.T's tile (+ bias), or with SPLIT > 1 this program's partial and, by the last of the tile, their sum
    (DEFER: the partial alone, the first split's with the bias)."""
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    n_mask = offs_n < N
    m_mask = offs_m < T
    mask = n_mask[:, None] & m_mask[None, :]
    out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_out + offs_n[:, None]
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
    else:
        bias = gl.zeros([BLOCK_N, 1], gl.float32, mma)
    if SPLIT == 1:
        gl.store(out_ptrs, (acc + bias).to(out_ptr.dtype.element_ty), mask=mask)
    elif DEFER:
        part_ptrs = part_ptr + offs_m[None, :] * N + offs_n[:, None] + pid_k * (T * N)
        if pid_k == 0:
            gl.store(part_ptrs, acc + bias, mask=mask)
        else:
            gl.store(part_ptrs, acc, mask=mask)
    else:
        part_stride = T * N                         # split-K runs for few rows: int32 offsets
        part_ptrs = part_ptr + offs_m[None, :] * N + offs_n[:, None]
        gl.store(part_ptrs + pid_k * part_stride, acc, mask=mask)
        if FENCE:                                   # the partial is visible GPU-wide before the count moves
            _gpu_fence(NW)
        cta_barrier()
        lock = lock_ptr + pid_m * gl.num_programs(1) + pid_n
        done = gl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:                       # the last program of the tile sums the partials in order
            if FENCE:
                _gpu_fence(NW)
            total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            for k in gl.static_range(SPLIT):
                total += gl.load(part_ptrs + k * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(out_ptrs, (total + bias).to(out_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")

ENV = "LORAPLEX_ASYNC_DOTS"
SYNC_ENV = "LORAPLEX_ASYNC_DOTS_SYNC"
SYNCS = (0, 1, 2)


def ring_sync() -> int:
    """LORAPLEX_ASYNC_DOTS_SYNC (for A/B runs): the kernel's SYNC (module docstring), 1 where unset (H200, the
    8B engine at batch 8 / 16 / 32: 2.58 / 2.94 / 3.38 ms a token against 2.60 / 2.95 / 3.43 with 0 and 2.61 /
    3.02 / 3.45 with 2; bench/results/quant_decode_sync_{0,1,2}.json)."""
    v = env_int(SYNC_ENV, lambda v: v in SYNCS, "0, 1 or 2")
    return 1 if v is None else v


def async_dots_enabled(device: torch.device) -> bool:
    """Whether `kernels.quant_config.pick_config` may pick this kernel for a device (its `async_dots`): one that
    runs it (`runs_on`), and LORAPLEX_ASYNC_DOTS not 0 (for A/B runs: 0 keeps the tiles of `kernels.quant_mma`
    at 2-32 rows)."""
    return env_int(ENV, lambda v: v in (0, 1), "0 or 1") != 0 and runs_on(device)


ONE_ROW_ENV = "LORAPLEX_ASYNC_DOTS_ONE_ROW"


def async_one_row_enabled() -> bool:
    """LORAPLEX_ASYNC_DOTS_ONE_ROW=1 (for A/B runs; unset or 0 by default): where this kernel runs at all
    (`async_dots_enabled`), one row with no LoRA launch beside it takes it too, an 8-row tile (pick_config's
    `async_one_row`), instead of the one-row kernels."""
    return env_int(ONE_ROW_ENV, lambda v: v in (0, 1), "0 or 1") == 1


def runs_on(device: torch.device) -> bool:
    """Whether this kernel runs on `device`: a CUDA GPU of sm_90 or later, compiled (the interpreter does not run
    the dialect)."""
    return device.type == "cuda" and compiled() and torch.cuda.get_device_capability(device)[0] >= 9


def quant_wgmma(x: torch.Tensor,              # [T, K] bfloat16, unit stride along K
                w: PackedQuantWeight,         # [N, K], 4 bits in groups of 128+ (paired layout), K % (128 u split) == 0
                bias: torch.Tensor | None,    # [N] bfloat16 or None
                out: torch.Tensor,            # [T, N] bfloat16
                x_sums: torch.Tensor | None,  # [T, K / 128] float32: `quant_matmul.half_sums(x)`; 128+ rows: unread
                block_m: int = 32, split: int = 1, nx: int = 4, u: int = 4,
                partials: torch.Tensor | None = None,  # float32, >= split * T * N elements (split > 1)
                locks: torch.Tensor | None = None,     # int32 zeros, >= cdiv(T, block_m) * cdiv(N, block_n) (split > 1)
                block_n: int = 64,                     # features a program: 64, or 128 (two warpgroups)
                sync: int | None = None,               # SYNC (module docstring; None: `ring_sync`)
                defer: bool = False,                   # split > 1: partials only, out not written (`split_sum`)
                ) -> None:
    """out = x @ W.T + bias with W = q * scale + offset (sm_90+; see the module docstring). `locks` hold zeros
    before and after the call."""
    T, K = x.shape
    N = w.out_features
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"x and out must be bfloat16 with unit stride along features, got {x.dtype} "
                         f"{tuple(x.stride())}, {out.dtype} {tuple(out.stride())}")
    if w.bits != 4 or not paired_layout(w.bits, w.group_size) or K % (128 * u * split):
        raise ValueError(f"needs 4 bits in groups of 128+ and K a multiple of {128 * u * split}: bits {w.bits}, "
                         f"group {w.group_size}, K {K}")
    if block_m not in BLOCK_MS or nx < 3 or block_n not in BLOCK_NS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, block_n 64 or 128 and nx at least 3, got {block_m}, "
                         f"{block_n}, {nx}")
    deq = block_m >= DEQ_ROWS
    grid = (triton.cdiv(T, block_m), triton.cdiv(N, block_n), split)
    if split > 1 and (partials is None or partials.dtype != torch.float32 or partials.numel() < split * T * N
                      or not defer and (locks is None or locks.dtype != torch.int32
                                        or locks.numel() < grid[0] * grid[1])):
        raise ValueError(f"split {split} needs float32 partials of >= {split * T * N} elements and int32 zero locks "
                         f"of >= {grid[0] * grid[1]}")
    if T == 0 or N == 0:
        return
    if deq:                                         # not read
        x_sums = out
    else:
        check_sums(x_sums, T, K, 128, "x_sums")
    pdl = launch_args(pdl_enabled(x.device))
    quant_wgmma_kernel[grid](x, w.words, w.scales, w.offsets, x_sums, bias if bias is not None else out, out,
                             partials if split > 1 else out, locks if split > 1 and not defer else out, T, N,
                             x.stride(0), out.stride(0), w.words.shape[1], K // 128, GROUP=w.group_size,
                             BLOCK_M=block_m, NX=nx, U=u, SPLIT=split, HAS_BIAS=bias is not None, FENCE=True,
                             BLOCK_N=block_n, SYNC=ring_sync() if sync is None else sync, DEQ=deq,
                             DEFER=defer and split > 1, num_warps=block_n // 16, **pdl)
