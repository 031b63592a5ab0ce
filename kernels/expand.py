"""LoRA expand (SGMV): y[t, slice cols] += s[i, t, :r] @ B[a(t), layer, module_i].T, reading B^T in place.

One launch covers every slice and adapter. Grid: (slices x column groups,
token tiles). A program maps its tile to a segment on the
device, walks its column group once per BLOCK_R rows of its adapter's true rank
(so a rank-8 and a rank-64 adapter read only their own rows), and adds into `y`
in fp32, rounding to y's dtype once a pass. An adapter of rank <= SMALL_R (16)
in a pool of larger ranks takes tiles of 16 rank rows, not the pool's
(kernels/shrink.py).
Programs past the last tile, past the slice's width or on a module the
adapter lacks exit at once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv, next_pow2
from kernels.meta import LoraBatchMeta
from kernels.paged import LoraRowTables
from kernels.pdl import launch_args, pdl_enabled, wait_then_release
from kernels.shrink import (DECODE_MAX_TOKENS, MAX_RANK_BLOCK, MAX_SLICES, SMALL_RANK, _capturing, _num_sms,
                            check_launch, check_slices, rank_block)
from kernels.dots import dot
from kernels.tiles import segment_tile

MANY_PROGRAMS_PER_SM = 5  # decode launches of at least this many expand programs an SM take 32-row blocks
                          # where the pool's rank would give them 64 (expand_config)


@triton.jit
def _bt_block(pool_ptr, rows0, r_mask0, n0, width, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """The first rank block's B^T rows [BLOCK_R, BLOCK_N] at columns n0.. of the slice."""
    offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    if EVEN_N:
        mask = r_mask0[:, None]
    else:
        mask = r_mask0[:, None] & (offs_n < width)[None, :]
    return tl.load(pool_ptr + rows0[:, None] + offs_n[None, :], mask=mask, other=0.0)


@triton.jit
def _expand_block(n0, bt, s0, toks, m_mask, width, col0, y_ptr, y_stride, BLOCK_N: tl.constexpr,
                  COL_ALIGN: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """y[toks, col0 + n0 : + BLOCK_N] += s0 @ bt for one column block and one rank block (bt: its B^T rows)."""
    offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    # Alignment hints let the compiler move y and B^T 16 bytes at a time; with every slice width a
    # multiple of BLOCK_N the column mask is dropped, which keeps those loads vectorised too.
    cols = tl.max_contiguous(tl.multiple_of(col0 + offs_n, COL_ALIGN), BLOCK_N)
    y_ptrs = y_ptr + toks[:, None] * y_stride + cols[None, :]
    if EVEN_N:
        y_mask = m_mask[:, None]
    else:
        y_mask = m_mask[:, None] & (offs_n < width)[None, :]
    acc = dot(s0, bt, IEEE)                                                                     # [BLOCK_M, BLOCK_N]
    cur = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (cur.to(tl.float32) + acc).to(cur.dtype), mask=y_mask)


@triton.jit
def _expand_kernel(
    s_ptr, s_stride_s, s_stride_t, pool_ptr, b_off_ptr, ranks_ptr, y_ptr, y_stride,
    tok_ptr, seg_starts_ptr, seg_slots_ptr, max_slots,
    layer, num_layers, num_modules, max_rank,
    mod0, mod1, mod2, mod3, off0, off1, off2, off3, off4,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_N: tl.constexpr,
    N_GROUPS: tl.constexpr, ONE_R_BLOCK: tl.constexpr, MAX_SEGS: tl.constexpr, USE_PDL: tl.constexpr,
    ROW_ALIGN: tl.constexpr, COL_ALIGN: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
    SMALL_R: tl.constexpr,
):
    # With programmatic dependent launch (kernels/pdl.py) the step's metadata and the first block of B^T
    # rows are read before the wait for the previous kernel (the shrink), s and y after it; every path
    # waits before it exits.
    # Column groups of one slice vary fastest; each program walks GROUP_N columns in BLOCK_N steps.
    pid_sub = tl.program_id(0)
    pid_tile = tl.program_id(1)
    slice_id = pid_sub // N_GROUPS
    n_start = (pid_sub % N_GROUPS) * GROUP_N
    col0 = tl.where(slice_id == 0, off0, tl.where(slice_id == 1, off1, tl.where(slice_id == 2, off2, off3)))
    col1 = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, tl.where(slice_id == 2, off3, off4)))
    width = col1 - col0
    if n_start >= width:
        wait_then_release(USE_PDL)
        return
    num_tiles, seg, m_start, seg_end = segment_tile(pid_tile, seg_starts_ptr, max_slots, BLOCK_M, MAX_SEGS)
    if pid_tile >= num_tiles:
        wait_then_release(USE_PDL)
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    module = tl.where(slice_id == 0, mod0, tl.where(slice_id == 1, mod1, tl.where(slice_id == 2, mod2, mod3)))
    entry = (slot * num_layers + layer) * num_modules + module
    # Independent loads issued together before the first branch on their values.
    rank = tl.load(ranks_ptr + entry)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    toks = tl.load(tok_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)                       # [BLOCK_M]
    s_row = s_ptr + slice_id * s_stride_s + toks[:, None] * s_stride_t                         # [BLOCK_M, 1]
    n_end = tl.minimum(n_start + GROUP_N, width)
    if (SMALL_R < BLOCK_R) & (rank <= SMALL_R):
        # An adapter of rank <= SMALL_R in a pool of larger ranks: tiles of its size, not the pool's.
        _expand_program(n_start, n_end, rank, entry, s_row, toks, m_mask, pool_ptr, b_off_ptr, max_rank, width,
                        col0, y_ptr, y_stride, BLOCK_N, SMALL_R, True, ROW_ALIGN, COL_ALIGN, EVEN_N, IEEE, USE_PDL)
    else:
        _expand_program(n_start, n_end, rank, entry, s_row, toks, m_mask, pool_ptr, b_off_ptr, max_rank, width,
                        col0, y_ptr, y_stride, BLOCK_N, BLOCK_R, ONE_R_BLOCK, ROW_ALIGN, COL_ALIGN, EVEN_N, IEEE,
                        USE_PDL)


@triton.jit
def _expand_program(n_start, n_end, rank, entry, s_row, toks, m_mask, pool_ptr, b_off_ptr, max_rank, width, col0,
                    y_ptr, y_stride, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ONE_R_BLOCK: tl.constexpr,
                    ROW_ALIGN: tl.constexpr, COL_ALIGN: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """One program's column group in rank blocks of BLOCK_R: the first block's rows read before the wait for
    the shrink, its sums (s) after it."""
    offs_rb = tl.arange(0, BLOCK_R)
    rows0 = tl.load(b_off_ptr + entry * max_rank + offs_rb, mask=offs_rb < max_rank, other=0)  # [BLOCK_R] int64
    rows0 = tl.multiple_of(rows0, ROW_ALIGN)     # 16-byte loads along each B^T row
    r_mask0 = offs_rb < rank
    # The first column block's B^T rows (the adapter's, not the previous kernel's output).
    bt = _bt_block(pool_ptr, rows0, r_mask0, n_start, width, BLOCK_N, EVEN_N)
    wait_then_release(USE_PDL)
    if rank > 0:
        # The first rank block: its s tile is read once and kept in registers for every column block.
        s0 = tl.load(s_row + offs_rb[None, :], mask=m_mask[:, None] & r_mask0[None, :], other=0.0)
        s0 = s0.to(pool_ptr.dtype.element_ty)
        _expand_block(n_start, bt, s0, toks, m_mask, width, col0, y_ptr, y_stride, BLOCK_N, COL_ALIGN, EVEN_N, IEEE)
        for n0 in range(n_start + BLOCK_N, n_end, BLOCK_N):
            bt = _bt_block(pool_ptr, rows0, r_mask0, n0, width, BLOCK_N, EVEN_N)
            _expand_block(n0, bt, s0, toks, m_mask, width, col0, y_ptr, y_stride, BLOCK_N, COL_ALIGN, EVEN_N,
                          IEEE)
        if not ONE_R_BLOCK:
            # A rank above one block: each further block is another pass over the columns, adding into y
            # again (one rounding to y's dtype a block), with the first block's code and registers.
            for r0 in range(BLOCK_R, rank, BLOCK_R):
                tl.debug_barrier()               # the previous pass's stores of y land before this pass reads y
                r_mask = r0 + offs_rb < rank
                rows = tl.load(b_off_ptr + entry * max_rank + r0 + offs_rb, mask=r_mask, other=0)
                rows = tl.multiple_of(rows, ROW_ALIGN)
                sr = tl.load(s_row + r0 + offs_rb[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
                sr = sr.to(pool_ptr.dtype.element_ty)
                for n0 in range(n_start, n_end, BLOCK_N):
                    bt = _bt_block(pool_ptr, rows, r_mask, n0, width, BLOCK_N, EVEN_N)
                    _expand_block(n0, bt, sr, toks, m_mask, width, col0, y_ptr, y_stride, BLOCK_N, COL_ALIGN,
                                  EVEN_N, IEEE)


def _alignment(values: Sequence[int], limit: int = 8) -> int:
    """Largest power of two <= limit dividing every value."""
    align = limit
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def expand_config(T: int, max_rank: int, widths: Sequence[int], max_slots: int, device: torch.device,
                  num_sms: int | None = None) -> dict[str, int]:
    """Block sizes and column grouping; depends only on host-known shapes (graph-stable).

    Each program walks a group of column blocks with its s tile in registers, so
    s is read once per group instead of once per block; groups are as wide as
    possible while the launch keeps about four programs per SM. A decode launch
    that still has MANY_PROGRAMS_PER_SM or more takes rank blocks of 32 rows
    instead of 64 (more programs resident an SM). `num_sms` overrides the
    device's count (tests).
    """
    sms = num_sms or _num_sms(device)
    block_r = rank_block(max_rank)
    if T <= DECODE_MAX_TOKENS:
        # One stage: the two-stage buffers of B^T rows cost more (registers, shared memory) than they hide at a
        # token or so an adapter (bench/lora_step_sweep.py, H200, an 8B's 32 layers, 64 tokens of distinct
        # adapters): rank 16 in a pool of 16 1632 -> 1549 us, of 64 3086 -> 1858, of 256 3658 -> 2550; rank 64
        # in a pool of 64 4365 -> 3377.
        block_m, block_n, num_warps, num_stages = 16, 128, 4, 1
    else:
        block_m, block_n, num_warps, num_stages = 64, 128, 4, 2
    tiles = cdiv(T, block_m) + min(max_slots, T)
    blocks = tiles * sum(cdiv(w, block_n) for w in widths)
    per_group = max(1, blocks // (4 * sms))
    per_group = 1 << (per_group.bit_length() - 1)                     # a power of two, rounded down
    group_n = block_n * min(per_group, cdiv(max(widths), block_n))
    programs = tiles * sum(cdiv(w, group_n) for w in widths)
    if T <= DECODE_MAX_TOKENS and block_r == MAX_RANK_BLOCK and programs >= MANY_PROGRAMS_PER_SM * sms:
        # 64-row blocks hold 104 registers (sm_90, one stage), so 4 programs fit an SM and a launch of 5-8
        # programs an SM (the grouping's power-of-two rounding) runs in two waves; 32-row blocks hold 72 (7
        # fit). H200, an 8B's 32 layers, 32 / 64 tokens of distinct adapters, pool of rank 256
        # (bench/results/lora_step_sweep_pool256.json): rank 16 on q/k/v (6.2 programs an SM) 248 -> 188 / 339
        # -> 269 us, gate/up (7.2) 598 -> 404 / 1124 -> 770; rank 64 346 -> 351 / 585 -> 594, 1136 -> 1093 /
        # 2149 -> 2124. o and down (4.1 an SM) keep 64 rows: 32 cost a rank-64 adapter two passes, 208 -> 299 /
        # 328 -> 533 us. The whole step (bench/results/lora_rank_pad.json): rank 16 in a pool of 64 -11 / -12%,
        # of 256 -9 / -10%; rank 64 within +0.8%.
        block_r = MAX_RANK_BLOCK // 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, GROUP_N=group_n,
                num_warps=num_warps, num_stages=num_stages)


def lora_expand_triton(
    s: torch.Tensor,                 # [num_slices, T, >= tables.max_rank] float32, contiguous (shrink's out)
    pool: torch.Tensor,              # [num_pages * page_elems]
    tables: LoraRowTables,
    meta: LoraBatchMeta,             # prepared for these T tokens
    layer: int,
    module_indices: Sequence[int],   # dense module index per slice (1..4 slices)
    y: torch.Tensor,                 # [T, >= slice_offsets[-1]] same dtype as pool, rows contiguous
    slice_offsets: Sequence[int],    # num_slices + 1 increasing column boundaries in y
    config: dict[str, int] | None = None,  # overrides of expand_config's choices (for tuning)
) -> None:
    """Expand for every slice and adapter in one launch, adding into `y` in place.

    Semantics:
        for t with slot a = a(t) >= 0, for i, m in enumerate(module_indices):
            r = tables.ranks[a, layer, m]
            y[t, off[i]:off[i+1]] += s[i, t, :r] @ B[a, layer, m].T      (fp32 add, then y's dtype; a rank
                                                                           above BLOCK_R: once a BLOCK_R rows)
        rows of tokens without adapter, and slices of absent modules, are left as they were.
    """
    check_launch(s, pool, tables, meta, layer, module_indices)
    num_slices = len(module_indices)
    T = y.shape[0]
    offs = check_slices(y, slice_offsets, num_slices, pool)
    if s.dtype != torch.float32 or not s.is_contiguous():
        raise ValueError(f"s must be contiguous float32, got {s.dtype}")
    if s.dim() != 3 or s.shape[0] != num_slices or s.shape[1] != T or s.shape[2] < tables.max_rank:
        raise ValueError(f"s must be [{num_slices}, {T}, >= {tables.max_rank}], got {tuple(s.shape)}")
    if T != meta.num_tokens:
        raise ValueError(f"meta was prepared for {meta.num_tokens} tokens, y has {T}")
    if T == 0 or (meta.has_lora is False and not _capturing(y.device)):
        return  # host-known empty batch; a graph being captured always gets the launch
    widths = [b - a for a, b in zip(offs, offs[1:])]
    cfg = expand_config(T, tables.max_rank, widths, meta.max_slots, y.device)
    cfg.update(config or {})
    mods = list(module_indices) + [0] * (MAX_SLICES - num_slices)
    offs = offs + [offs[-1]] * (MAX_SLICES + 1 - len(offs))
    if cfg["GROUP_N"] % cfg["BLOCK_N"]:
        raise ValueError(f"GROUP_N {cfg['GROUP_N']} must be a multiple of BLOCK_N {cfg['BLOCK_N']}")
    n_groups = cdiv(max(widths), cfg["GROUP_N"])
    pdl = bool(cfg.get("PDL", pdl_enabled(y.device)))
    tiles = cdiv(T, cfg["BLOCK_M"]) + min(meta.max_slots, T)
    grid = (num_slices * n_groups, tiles)
    _expand_kernel[grid](
        s, s.stride(0), s.stride(1), pool, tables.b_offsets, tables.ranks, y, y.stride(0),
        meta.token_indices, meta.seg_starts, meta.seg_slots, meta.max_slots,
        layer, tables.num_layers, tables.num_modules, tables.max_rank,
        *mods, *offs,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"], GROUP_N=cfg["GROUP_N"],
        N_GROUPS=n_groups, ONE_R_BLOCK=cfg["BLOCK_R"] >= tables.max_rank, MAX_SEGS=next_pow2(meta.max_slots),
        ROW_ALIGN=tables.row_alignment(), COL_ALIGN=_alignment(offs),
        EVEN_N=all(w % cfg["BLOCK_N"] == 0 for w in widths), IEEE=pool.dtype == torch.float32,
        SMALL_R=min(SMALL_RANK, cfg["BLOCK_R"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_args(pdl),
    )
