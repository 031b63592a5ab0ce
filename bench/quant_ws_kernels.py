"""Probe kernels for `bench/quant_ws_probe.py`: the one-row 4-bit product (bfloat16 x, groups of 128, the paired
layout of kernels.quant_pack) with warp roles, warps that only copy beside warps that only compute, and a
loads-alone kernel on the engine's one-row grid to compare their streaming with. Not used by the engine.

Both warp-role kernels are persistent: program p takes units p, p + P, ... (a unit: BN rows and a K split of BPS
blocks), each unit's [BN] fp32 sums stored at part[split, N] (the caller sums them). A ring of STAGES slots in
shared memory holds [BN, 32 SUB] words and their groups' [2 SUB, BN] scales and offsets; `ready` / `empty`
memory barriers a slot pass it between the roles, so the copies run on across unit boundaries with no
program-wide barrier.
- `ws_tma_kernel`: one copy warp requests each slot by the tensor memory accelerator (TMA; a SUB-block box, so a
  row's 128 SUB bytes in one request); ROT starts unit u's blocks at (u mod BPS), so the programs' concurrent
  requests spread over the rows' addresses.
- `ws_regs_kernel`: four copy warps load each block into registers (AHEAD: block i + 1 requested before block i
  is stored) and store it into its slot.
The compute warps (the default partition) run kernels.quant_h2's float16-pairs arithmetic on each block, or
(COMPUTE off) only read the words, which times the copies alone.

Written in Triton's explicit-layout dialect (`triton.experimental.gluon`), which the interpreter does not run:
on the CPU they are compiled for sm_90 only (tests/bench/test_quant_ws_probe.py).
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kernels.quant_h2 import _word4_asm, _word4_constraints

WORD4 = gl.constexpr(_word4_asm())
WORD4_C = gl.constexpr(_word4_constraints())
FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

if hasattr(gl.shared_memory_descriptor, "reinterpret"):       # the name differs between Triton releases
    @gluon.jit
    def _rows_view(d, shape: gl.constexpr):
        return d.reinterpret(gl.float16, shape, FLAT)
else:
    @gluon.jit
    def _rows_view(d, shape: gl.constexpr):
        return d._reinterpret(gl.float16, shape, FLAT)

if hasattr(tma, "async_load"):
    @gluon.jit
    def _tma_load(desc, coord, bar, dst):
        tma.async_load(desc, coord, bar, dst)
else:
    @gluon.jit
    def _tma_load(desc, coord, bar, dst):
        tma.async_copy_global_to_shared(desc, coord, bar, dst)


@gluon.jit
def _h2_x(v):
    """kernels.quant_h2.h2_x: (f16x2 of the two bfloat16 in int32 v, divided by 16; their fp32 sum)."""
    x0 = (v << 16).to(gl.float32, bitcast=True)
    x1 = (v & -65536).to(gl.float32, bitcast=True)
    h = gl.inline_asm_elementwise("{ .reg .f32 a, b; mul.f32 a, $1, 0f3D800000; mul.f32 b, $2, 0f3D800000; "
                                  "cvt.rn.f16x2.f32 $0, b, a; }", "=r,f,f", [x0, x1],
                                  dtype=gl.int32, is_pure=True, pack=1)
    return h, x0 + x1


@gluon.jit
def _nsum(x0, x1, x2, x3):
    """kernels.quant_h2.h2_nsum: f16x2 -(x0 + x1 + x2 + x3)."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 s; add.rn.f16x2 s, $1, $2; add.rn.f16x2 s, s, $3; add.rn.f16x2 s, s, $4; neg.f16x2 $0, s; }",
        "=r,r,r,r,r", [x0, x1, x2, x3], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _quad_sum_f32(v):
    """kernels.quant_h2.h2_quad_sum on fp32: each element the sum of its thread's 4 neighbours."""
    return gl.inline_asm_elementwise("{ .reg .f32 s; add.f32 s, $4, $5; add.f32 s, s, $6; add.f32 s, s, $7;\n"
                                     "mov.b32 $0, s; mov.b32 $1, s; mov.b32 $2, s; mov.b32 $3, s; }",
                                     "=f,=f,=f,=f,f,f,f,f", [v], dtype=gl.float32, is_pure=True, pack=4)


@gluon.jit
def _quad_sum_h2(v):
    """kernels.quant_h2.h2_quad_sum on f16x2 pairs."""
    return gl.inline_asm_elementwise("{ .reg .b32 s; add.rn.f16x2 s, $4, $5; add.rn.f16x2 s, s, $6;\n"
                                     "add.rn.f16x2 s, s, $7; mov.b32 $0, s; mov.b32 $1, s; mov.b32 $2, s;\n"
                                     "mov.b32 $3, s; }", "=r,=r,=r,=r,r,r,r,r", [v], dtype=gl.int32,
                                     is_pure=True, pack=4)


@gluon.jit
def _scales(s_rows, o_rows, r, half_a, ROWS: gl.constexpr):
    """A block's scales (times 256) and offsets in the words' layout, from rows r, r + 1 of the [*, BN] shared
    views (its two halves' groups)."""
    s_a = gl.expand_dims(s_rows.index(r).load(ROWS).to(gl.float32), 1)
    s_b = gl.expand_dims(s_rows.index(r + 1).load(ROWS).to(gl.float32), 1)
    o_a = gl.expand_dims(o_rows.index(r).load(ROWS).to(gl.float32), 1)
    o_b = gl.expand_dims(o_rows.index(r + 1).load(ROWS).to(gl.float32), 1)
    return gl.where(half_a, s_a, s_b) * 256.0, gl.where(half_a, o_a, o_b)


@gluon.jit
def _block(acc, wv, s, o, x32, b, pw, COMPUTE: gl.constexpr):
    """acc plus block b's products (its words wv [BN, 32], scales s and offsets o from `_scales`); COMPUTE off:
    the words alone, folded in."""
    xp = x32 + b * 128 + pw
    v0 = gl.load(xp)
    if not COMPUTE:
        return acc + (wv ^ gl.expand_dims(v0, 0)).to(gl.float32)
    v1 = gl.load(xp + 16)
    v2 = gl.load(xp + 32)
    v3 = gl.load(xp + 48)
    h0, t0 = _h2_x(v0)
    h1, t1 = _h2_x(v1)
    h2, t2 = _h2_x(v2)
    h3, t3 = _h2_x(v3)
    nsum4 = _quad_sum_h2(gl.expand_dims(_nsum(h0, h1, h2, h3), 0))
    xt4 = _quad_sum_f32(gl.expand_dims(t0 + t1 + t2 + t3, 0))
    return gl.inline_asm_elementwise(WORD4, WORD4_C, [acc, wv, gl.expand_dims(h0, 0), gl.expand_dims(h1, 0),
                                                      gl.expand_dims(h2, 0), gl.expand_dims(h3, 0), nsum4, xt4, s,
                                                      o], dtype=gl.float32, is_pure=True, pack=4)


@gluon.jit
def _slot_barriers(STAGES: gl.constexpr):
    """Each slot's `ready` (its copies landed) and `empty` (its words read) memory barriers, initialised."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ready, empty


@gluon.jit
def _compute_role(x_ptr, part_ptr, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS, N,
                  BN: gl.constexpr, STAGES: gl.constexpr, W: gl.constexpr, COMPUTE: gl.constexpr,
                  ROT: gl.constexpr, SUB: gl.constexpr):
    """The default partition: takes each slot when ready, frees it once read, stores each unit's sums."""
    pid = gl.program_id(0)
    ROWS: gl.constexpr = gl.SliceLayout(1, W)
    offs_j = gl.arange(0, 32, layout=gl.SliceLayout(0, W))
    offs_r = gl.arange(0, BN, layout=ROWS)
    half_a = gl.expand_dims(offs_j < 16, 0)
    pw = offs_j + (offs_j // 16) * 48                       # kernels.quant_gemv._paired_word(j, 0)
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    s_rows = _rows_view(scales, [STAGES * 2 * SUB, BN])
    o_rows = _rows_view(offsets, [STAGES * 2 * SUB, BN])
    i = 0
    for u in range(pid, n_units, P):
        ks = u % SPLIT
        acc = gl.zeros([BN, 32], gl.float32, W)
        for kb in range(0, BPS, SUB):
            slot = i % STAGES
            bs = ks * BPS + (kb + u * ROT * SUB) % BPS
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            for sb in gl.static_range(SUB):
                wv = words.index(slot).slice(sb * 32, 32, dim=1).load(W)
                s = 0.0
                o = 0.0
                if COMPUTE:
                    s, o = _scales(s_rows, o_rows, (slot * SUB + sb) * 2, half_a, ROWS)
                if sb == SUB - 1:           # the slot read: free it before the last block's arithmetic
                    fence_async_shared()
                    mbarrier.arrive(empty.index(slot), count=1)
                acc = _block(acc, wv, s, o, x32, bs + sb, pw, COMPUTE)
            i += 1
        gl.store(part_ptr + ks * N + (u // SPLIT) * BN + offs_r, gl.sum(acc, axis=1))


@gluon.jit
def _tma_role(w_desc, s_desc, o_desc, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS,
              BN: gl.constexpr, STAGES: gl.constexpr, ROT: gl.constexpr, SUB: gl.constexpr):
    """One copy warp: each slot's words, scales and offsets by TMA, once the compute warps have freed it."""
    pid = gl.program_id(0)
    i = 0
    for u in range(pid, n_units, P):
        n0 = (u // SPLIT) * BN
        for kb in range(0, BPS, SUB):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * s_desc.block_type.nbytes)
            b = (u % SPLIT) * BPS + (kb + u * ROT * SUB) % BPS
            _tma_load(w_desc, [n0, b * 32], bar, words.index(slot))
            _tma_load(s_desc, [2 * b, n0], bar, scales.index(slot))
            _tma_load(o_desc, [2 * b, n0], bar, offsets.index(slot))
            i += 1


@gluon.jit
def ws_tma_kernel(x_ptr, w_desc, s_desc, o_desc, part_ptr, N, n_units, SPLIT, BPS,
                  BN: gl.constexpr, STAGES: gl.constexpr, COMPUTE: gl.constexpr, ROT: gl.constexpr,
                  num_warps: gl.constexpr):
    W: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    SUB: gl.constexpr = w_desc.block_type.shape[1] // 32
    words = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 32 * SUB], w_desc.layout)
    scales = gl.allocate_shared_memory(gl.float16, [STAGES, 2 * SUB, BN], s_desc.layout)
    offsets = gl.allocate_shared_memory(gl.float16, [STAGES, 2 * SUB, BN], o_desc.layout)
    ready, empty = _slot_barriers(STAGES)
    P = gl.num_programs(0)
    gl.warp_specialize([
        (_compute_role, (x_ptr, part_ptr, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS, N, BN,
                         STAGES, W, COMPUTE, ROT, SUB)),
        (_tma_role, (w_desc, s_desc, o_desc, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS, BN,
                     STAGES, ROT, SUB)),
    ], [1], [24])


@gluon.jit
def _regs_role(w_ptr, s_ptr, o_ptr, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS, N,
               words_per_row, BN: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr):
    """Four copy warps: each block's words, scales and offsets through registers into its slot."""
    L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    LS: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    pid = gl.program_id(0)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    sidx = (gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, LS)), 1) * N
            + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, LS)), 0))
    i = 0
    for u in range(pid, n_units, P):
        n0 = (u // SPLIT) * BN
        b0 = (u % SPLIT) * BPS
        base = w_ptr + gl.expand_dims((n0 + rows).to(gl.int64) * words_per_row, 1) + gl.expand_dims(cols, 0)
        nxt = gl.load(base + b0 * 32)
        for kb in range(BPS):
            cur = nxt
            b = b0 + kb
            sv = gl.load(s_ptr + sidx + 2 * b * N + n0)
            ov = gl.load(o_ptr + sidx + 2 * b * N + n0)
            if AHEAD:
                nxt = gl.load(base + gl.minimum(b + 1, b0 + BPS - 1) * 32)
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            words.index(slot).store(cur)
            scales.index(slot).store(sv)
            offsets.index(slot).store(ov)
            mbarrier.arrive(ready.index(slot), count=1)
            if not AHEAD:
                nxt = gl.load(base + gl.minimum(b + 1, b0 + BPS - 1) * 32)
            i += 1


@gluon.jit
def ws_regs_kernel(x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, N, n_units, SPLIT, BPS, words_per_row,
                   BN: gl.constexpr, STAGES: gl.constexpr, COMPUTE: gl.constexpr, AHEAD: gl.constexpr,
                   COPY_REGS: gl.constexpr, num_warps: gl.constexpr):
    W: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    words = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 32], PLAIN)
    scales = gl.allocate_shared_memory(gl.float16, [STAGES, 2, BN], PLAIN)
    offsets = gl.allocate_shared_memory(gl.float16, [STAGES, 2, BN], PLAIN)
    ready, empty = _slot_barriers(STAGES)
    P = gl.num_programs(0)
    gl.warp_specialize([
        (_compute_role, (x_ptr, part_ptr, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS, N, BN,
                         STAGES, W, COMPUTE, 0, 1)),
        (_regs_role, (w_ptr, s_ptr, o_ptr, words, scales, offsets, ready, empty, n_units, P, SPLIT, BPS, N,
                      words_per_row, BN, STAGES, AHEAD)),
    ], [4], [COPY_REGS])


@triton.jit
def loads_kernel(w_ptr, out_ptr, words_per_row, BPS, BN: tl.constexpr, STAGES: tl.constexpr):
    """Loads alone on the one-row kernels' grid: program (n, k) reads its BPS blocks of [BN, 32] words into
    registers (the compiler's pipeline STAGES deep) and stores a fold of them."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    p = w_ptr + rows[:, None].to(tl.int64) * words_per_row + pid_k * BPS * 32 + tl.arange(0, 32)[None, :]
    acc = tl.zeros((BN, 32), dtype=tl.int32)
    for b in tl.range(0, BPS, num_stages=STAGES):
        acc ^= tl.load(p + b * 32)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))
