"""Fused LoRA (shrink + expand in one launch): y[t, slice cols] += (x[t] @ A.T) @ B.T.

One launch covers every slice (q/k/v, or gate/up) and every adapter of the
batch, with the parallel structure of a separate shrink and expand but no
second launch and no zeroing launch. Grid: (programs per tile, token tiles).
A program maps its tile to a segment (one adapter) on the device and takes a
ticket from its tile's counter; tickets below `slices x K splits` are shrink
work (one K split of one slice: partial sums of the rank-r product added with
fp32 atomics into the caller's workspace, then an arrival published), the
rest are expand work (one column group of one slice: wait until every split
of that slice has arrived, read the rank-r product, multiply it into B^T and
add into `y`). Rank blocks are at most 64 rows (a larger rank is summed block
after block) and an adapter of rank <= 16 in a pool of larger ranks takes
tiles of 16 rows, so an adapter's cost follows its own rank rather than the
pool's largest (docs/kernels.md); the workspace keeps the pool's padded largest
rank (R_PAD) columns a slice. Because roles follow the order in which programs take tickets,
an expand program only ever waits for shrink programs that are already
running, whatever order the hardware starts programs in. The last expand
program of a tile leaves the workspace rows and counters of the tile at zero,
so the workspace is all zeros between launches.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.expand import _alignment
from kernels.host_ints import cdiv, next_pow2
from kernels.meta import LoraBatchMeta
from kernels.paged import LoraRowTables
from kernels.pdl import launch_args, pdl_enabled, wait_then_release
from kernels.shrink import (DECODE_MAX_TOKENS, MAX_SLICES, SMALL_RANK, _capturing, _num_sms, check_input,
                            check_launch, check_slices, rank_block)
from kernels.dots import dot
from kernels.tiles import pick4, segment_tile, shrink_tile, table_entry

MIN_K_PER_SPLIT = 256      # a K split reads at least this many columns of x and A
# At or below this many tokens one fused launch beats a shrink + expand pair (whole decode step on an H200:
# -17% at B=1, -2% at B=8, +12% at B=32; docs/kernels.md); above it the pair is faster.
FUSED_MAX_TOKENS = 16
COUNTERS = 1 << 16         # counters in a default workspace (8 per token tile)
# Column groups of a one-token launch that writes a float32 delta (the one-row base kernel runs beside it).
DELTA_MAX_GROUPS = 48


@triton.jit
def _rows(off_ptr, entry, max_rank, r0, R: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Pool offsets of the A or B^T rows r0 .. r0 + R of table entry `entry` (0 past the table's rank)."""
    offs_r = r0 + tl.arange(0, R)
    rows = tl.load(off_ptr + entry * max_rank + offs_r, mask=offs_r < max_rank, other=0)
    return tl.multiple_of(rows, ROW_ALIGN)


@triton.jit
def _shrink_part(x_ptr, x_stride, toks, m_mask, pool_ptr, rows, r0, rank, k_lo, k_hi, K, s_row,
                 BLOCK_M: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """Partial sums of rank rows r0 .. r0 + R (pool offsets `rows`) over one K split, added into s_row."""
    offs_r = r0 + tl.arange(0, R)
    r_mask = offs_r < rank
    acc = shrink_tile(x_ptr, x_stride, toks, m_mask, pool_ptr, rows, r_mask, k_lo, k_hi, K, BLOCK_M, R, BLOCK_K,
                      EVEN_K, IEEE)
    tl.atomic_add(s_row + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :], sem="relaxed")


@triton.jit
def _expand_one_block(pool_ptr, rows, rank, s_row, toks, m_mask, n_start, n_end, col0, y_ptr, y_stride,
                      R: tl.constexpr, BLOCK_N: tl.constexpr, COL_ALIGN: tl.constexpr, IEEE: tl.constexpr):
    """y[toks, col0 + n_start : col0 + n_end] += s @ B^T for an adapter of rank <= R: its sums read once."""
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    s = tl.load(s_row + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0, cache_modifier=".cg")
    s = s.to(pool_ptr.dtype.element_ty)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
        n_mask = offs_n < n_end
        bt = tl.load(pool_ptr + rows[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        _add_cols(y_ptr, y_stride, toks, m_mask, col0, offs_n, n_mask, dot(s, bt, IEEE), BLOCK_N, COL_ALIGN)


@triton.jit
def _expand_blocks(pool_ptr, b_off_ptr, entry, max_rank, rank, s_row, toks, m_mask, n_start, n_end, col0, y_ptr,
                   y_stride, BLOCK_M: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, COL_ALIGN: tl.constexpr,
                   ROW_ALIGN: tl.constexpr, IEEE: tl.constexpr):
    """As _expand_one_block for a rank above R: every column block sums the rank in blocks of R rows."""
    offs_rb = tl.arange(0, R)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
        n_mask = offs_n < n_end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, R):
            r_mask = r0 + offs_rb < rank
            rows = _rows(b_off_ptr, entry, max_rank, r0, R, ROW_ALIGN)
            s = tl.load(s_row + r0 + offs_rb[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0,
                        cache_modifier=".cg")
            bt = tl.load(pool_ptr + rows[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                         other=0.0)
            acc += dot(s.to(pool_ptr.dtype.element_ty), bt, IEEE)
        _add_cols(y_ptr, y_stride, toks, m_mask, col0, offs_n, n_mask, acc, BLOCK_N, COL_ALIGN)


@triton.jit
def _add_cols(y_ptr, y_stride, toks, m_mask, col0, offs_n, n_mask, acc, BLOCK_N: tl.constexpr,
              COL_ALIGN: tl.constexpr):
    """y[toks, col0 + offs_n] += acc (float32 sums, one rounding to y's dtype)."""
    cols = tl.max_contiguous(tl.multiple_of(col0 + offs_n, COL_ALIGN), BLOCK_N)
    y_ptrs = y_ptr + toks[:, None] * y_stride + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    cur = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (cur.to(tl.float32) + acc).to(cur.dtype), mask=mask)


@triton.jit
def _fused_kernel(
    x_ptr, x_stride, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, y_ptr, y_stride,
    s_ptr, s_stride, cnt_ptr,
    tok_ptr, seg_starts_ptr, seg_slots_ptr, max_slots,
    layer, num_layers, num_modules, max_rank, R_PAD, K, K_PER_SPLIT, GROUP_N,
    mod0, mod1, mod2, mod3, off0, off1, off2, off3, off4, grp1, grp2, grp3, num_groups,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, MAX_SEGS: tl.constexpr, EVEN_K: tl.constexpr,
    ROW_ALIGN: tl.constexpr, COL_ALIGN: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
    SMALL_R: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    # With programmatic dependent launch (kernels/pdl.py) the step's metadata is read before the wait for
    # the previous kernel; the workspace (which the previous launch leaves zero at its end), x and y after.
    pid_tile = tl.program_id(1)
    num_tiles, seg, m_start, seg_end = segment_tile(pid_tile, seg_starts_ptr, max_slots, BLOCK_M, MAX_SEGS)
    if pid_tile >= num_tiles:
        wait_then_release(USE_PDL)
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    toks = tl.load(tok_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)                    # [BLOCK_M]
    wait_then_release(USE_PDL)
    cnt = cnt_ptr + pid_tile * 8         # [0] tickets, [1 + slice] shrink splits arrived, [5] expands done
    ticket = tl.atomic_add(cnt, 1, sem="relaxed")
    # Rank blocks: an adapter of rank <= SMALL_R in a pool of larger ranks takes tiles of SMALL_R rows, others
    # of BLOCK_R, a rank above BLOCK_R block after block (none when the pool's ranks fit one block: ONE_BLOCK);
    # its sums sit at R_PAD columns a slice.
    small = (SMALL_R < BLOCK_R)
    if ticket < NUM_SLICES * SPLIT_K:
        # Shrink: one K split of one slice, partial sums into the workspace.
        slice_id = ticket // SPLIT_K
        entry = table_entry(seg_slots_ptr, seg, pick4(slice_id, mod0, mod1, mod2, mod3), layer, num_layers,
                            num_modules)
        rows_b = _rows(a_off_ptr, entry, max_rank, 0, BLOCK_R, ROW_ALIGN)
        rows_s = _rows(a_off_ptr, entry, max_rank, 0, SMALL_R, ROW_ALIGN)
        rank = tl.load(ranks_ptr + entry)
        if rank > 0:
            k_lo = (ticket % SPLIT_K) * K_PER_SPLIT
            k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
            s_row = s_ptr + toks[:, None] * s_stride + slice_id * R_PAD
            if small & (rank <= SMALL_R):
                _shrink_part(x_ptr, x_stride, toks, m_mask, pool_ptr, rows_s, 0, rank, k_lo, k_hi, K, s_row,
                             BLOCK_M, SMALL_R, BLOCK_K, EVEN_K, IEEE)
            elif ONE_BLOCK | (rank <= BLOCK_R):
                _shrink_part(x_ptr, x_stride, toks, m_mask, pool_ptr, rows_b, 0, rank, k_lo, k_hi, K, s_row,
                             BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)
            else:
                for r0 in range(0, rank, BLOCK_R):
                    rows = _rows(a_off_ptr, entry, max_rank, r0, BLOCK_R, ROW_ALIGN)
                    _shrink_part(x_ptr, x_stride, toks, m_mask, pool_ptr, rows, r0, rank, k_lo, k_hi, K, s_row,
                                 BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)
            tl.debug_barrier()           # every thread's sums are issued before the arrival is published
            tl.atomic_add(cnt + 1 + slice_id, 1, sem="release")
    else:
        # Expand: one column group of one slice, once every split of the slice has arrived.
        grp = ticket - NUM_SLICES * SPLIT_K
        slice_id = (grp >= grp1).to(tl.int32) + (grp >= grp2).to(tl.int32) + (grp >= grp3).to(tl.int32)
        col0 = pick4(slice_id, off0, off1, off2, off3)
        n_start = (grp - pick4(slice_id, 0, grp1, grp2, grp3)) * GROUP_N
        n_end = tl.minimum(n_start + GROUP_N, pick4(slice_id, off1, off2, off3, off4) - col0)
        entry = table_entry(seg_slots_ptr, seg, pick4(slice_id, mod0, mod1, mod2, mod3), layer, num_layers,
                            num_modules)
        rows_b = _rows(b_off_ptr, entry, max_rank, 0, BLOCK_R, ROW_ALIGN)
        rows_s = _rows(b_off_ptr, entry, max_rank, 0, SMALL_R, ROW_ALIGN)
        rank = tl.load(ranks_ptr + entry)
        if rank > 0:
            while tl.atomic_add(cnt + 1 + slice_id, 0, sem="acquire") < SPLIT_K:
                pass
            s_row = s_ptr + toks[:, None] * s_stride + slice_id * R_PAD
            if small & (rank <= SMALL_R):
                _expand_one_block(pool_ptr, rows_s, rank, s_row, toks, m_mask, n_start, n_end, col0, y_ptr, y_stride,
                                  SMALL_R, BLOCK_N, COL_ALIGN, IEEE)
            elif ONE_BLOCK | (rank <= BLOCK_R):
                _expand_one_block(pool_ptr, rows_b, rank, s_row, toks, m_mask, n_start, n_end, col0, y_ptr, y_stride,
                                  BLOCK_R, BLOCK_N, COL_ALIGN, IEEE)
            else:
                _expand_blocks(pool_ptr, b_off_ptr, entry, max_rank, rank, s_row, toks, m_mask, n_start, n_end, col0,
                               y_ptr, y_stride, BLOCK_M, BLOCK_R, BLOCK_N, COL_ALIGN, ROW_ALIGN, IEEE)
        tl.debug_barrier()               # this program's reads of the workspace are done
        if tl.atomic_add(cnt + 5, 1, sem="acq_rel") == num_groups - 1:
            # The tile's last expand: every ticket was taken and every read done; leave zeros behind.
            zero = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            offs_r = tl.arange(0, BLOCK_R)
            for i in tl.static_range(NUM_SLICES):
                for r0 in range(0, R_PAD, BLOCK_R):
                    tl.store(s_ptr + toks[:, None] * s_stride + i * R_PAD + r0 + offs_r[None, :], zero,
                             mask=m_mask[:, None])
            tl.store(cnt + tl.arange(0, 8), tl.zeros((8,), dtype=tl.int32))


def max_tiles(T: int, block_m: int, max_slots: int) -> int:
    """Upper bound of token tiles: segments of n_i tokens take sum(cdiv(n_i, block_m)) tiles."""
    return cdiv(T, block_m) + min(max_slots, T) - 1


def _groups(widths: Sequence[int], group_n: int) -> int:
    return sum(cdiv(w, group_n) for w in widths)


def fused_config(T: int, K: int, widths: Sequence[int], max_rank: int, max_slots: int, device: torch.device,
                 num_sms: int | None = None, delta: bool = False) -> dict[str, int]:
    """Tile sizes, K split and column-group width; depends only on host-known shapes (graph-stable).

    H_in is split until the shrink programs cover the GPU about twice (each split
    reading at least MIN_K_PER_SPLIT columns), so a batch of 1-8 tokens still
    spreads over every SM; column groups are as narrow as possible while the
    expand programs stay within about four per SM (counting the upper bound of
    token tiles). Every byte of A and B is read once per token tile either way.

    `delta` (one token into a float32 delta, which the one-row base kernel launched next adds): at most
    DELTA_MAX_GROUPS column groups. That kernel starts beside this launch, and every expand program waiting here
    for its splits holds registers on an SM where the base kernel's programs (4-bit: two at 255 registers each
    when this was measured, three at 168 since its chains of 4 words) would otherwise fit; those that do not fit
    start when this launch ends and run their whole chain of blocks after it. On the 8B's gate/up (224 groups of
    128 columns; 28 of 1024 with the cap) this launch takes longer (~10 -> 17.6-18.8 us) but the 4-bit kernel
    beside it runs 34.1-34.3 us from its start to its end instead of 38.8-39.3, and a one-token step with a
    rank-16 adapter on every module took 3320 us against 3470 under the profiler (one run; q/k/v at 24 groups
    there); splitting the base kernel's K in two as well bought nothing more (3336-3368 against 3326 as landed,
    another run). H200, `bench/results/lora_one_token_contention.json`, with the variants that did not pay (56
    groups, 16 programs). q/k/v (48 groups), o and down (32) keep theirs. Beside the bf16 one-row kernel (shorter
    programs) it is even: 4610 -> 4565 us a step under the profiler.

    Rank blocks of at most 64 rows whatever the pool's largest rank (`max_rank` then sizes only the
    workspace's columns): with blocks as large as the pool's rank, 256 by default, rank-16 adapters paid for
    tiles of 256 rows.
    """
    block_r = rank_block(max_rank)
    block_k = min(256, max(32, 8192 // block_r))
    block_n = min(128, max(32, 8192 // block_r))
    if T <= DECODE_MAX_TOKENS:
        block_m, num_warps = 16, 4
    else:
        block_m, num_warps = max(16, min(64, 4096 // block_r)), 8
    tiles = max_tiles(T, block_m, max_slots)
    sms = num_sms or _num_sms(device)
    split = 1
    while tiles * len(widths) * split < 2 * sms and K // (2 * split) >= MIN_K_PER_SPLIT:
        split *= 2
    k_per_split = cdiv(cdiv(K, split), block_k) * block_k
    group_n = block_n
    cap = DELTA_MAX_GROUPS if delta and T == 1 else None
    while group_n < max(widths) and (tiles * _groups(widths, group_n) > 4 * sms
                                     or (cap is not None and _groups(widths, group_n) > cap)):
        group_n *= 2
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
                SPLIT_K=cdiv(K, k_per_split), K_PER_SPLIT=k_per_split, GROUP_N=group_n,
                num_warps=num_warps, num_stages=3)


def workspace_rank(max_rank: int) -> int:
    """Workspace columns a slice (the kernel's R_PAD): the largest rank padded to a power of two, at least 16
    (a multiple of every rank block)."""
    return max(16, next_pow2(max_rank))


def fused_workspace(max_tokens: int, max_rank: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank-r sums [max_tokens, 4 slices x padded rank] float32, counters [COUNTERS] int32), all zero.

    The kernel leaves both at zero after every launch, so one workspace serves every launch on a stream.
    """
    cols = MAX_SLICES * workspace_rank(max_rank)
    return (torch.zeros(max_tokens, cols, dtype=torch.float32, device=device),
            torch.zeros(COUNTERS, dtype=torch.int32, device=device))


def lora_fused_triton(
    x: torch.Tensor,                 # [T, H_in] same dtype as pool, rows contiguous
    pool: torch.Tensor,              # [num_pages * page_elems]
    tables: LoraRowTables, meta: LoraBatchMeta, layer: int,     # meta prepared for these T tokens
    module_indices: Sequence[int],   # dense module index per slice (1..4 slices)
    y: torch.Tensor,                 # [T, >= slice_offsets[-1]] pool's dtype or float32, rows contiguous
    slice_offsets: Sequence[int],    # num_slices + 1 increasing column boundaries in y
    workspace: tuple[torch.Tensor, torch.Tensor] | None,   # fused_workspace(>= T, >= tables.max_rank, device)
    config: dict[str, int] | None = None,  # overrides of fused_config's choices (for tuning and tests)
) -> None:
    """Shrink and expand of every slice and adapter in one launch, adding into `y` in place.

    Semantics:
        for t with slot a = a(t) >= 0, for i, m in enumerate(module_indices):
            r = tables.ranks[a, layer, m]
            s = x[t].float() @ A[a, layer, m].float().T                 # [r] fp32, rounded to y's dtype
            y[t, off[i]:off[i+1]] += s @ B[a, layer, m].T               (fp32 add, then y's dtype)
        rows of tokens without adapter, and slices of absent modules, are left as they were.
        (kernels.reference.lora_apply_ref is the definition.)
    """
    check_launch(x, pool, tables, meta, layer, module_indices)
    T, K = x.shape
    num_slices = len(module_indices)
    check_input(x, pool)
    offs = check_slices(y, slice_offsets, num_slices, pool, float32_ok=True)
    if y.shape[0] != T or meta.num_tokens != T:
        raise ValueError(f"x has {T} rows, y {y.shape[0]}, and meta was prepared for {meta.num_tokens} tokens")
    if workspace is None:
        raise ValueError("the fused kernel needs a workspace (kernels.fused.fused_workspace)")
    if T == 0 or (meta.has_lora is False and not _capturing(x.device) and y.dtype != torch.float32):
        # Host-known empty batch; a graph being captured always gets the launch, and so does a float32 y:
        # that is a delta a base kernel adds, which reads its input before waiting for this launch
        # (kernels/dense_gemv.py) and so must follow a launch that did not write that input.
        return
    widths = [b - a for a, b in zip(offs, offs[1:])]
    cfg = fused_config(T, K, widths, tables.max_rank, meta.max_slots, x.device, delta=y.dtype == torch.float32)
    if config:
        cfg.update(config)
        cfg["K_PER_SPLIT"] = cdiv(cdiv(K, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        cfg["SPLIT_K"] = cdiv(K, cfg["K_PER_SPLIT"])
    r_pad = workspace_rank(tables.max_rank)
    if cfg["GROUP_N"] % cfg["BLOCK_N"] or cfg["BLOCK_R"] < 16 or r_pad % cfg["BLOCK_R"]:
        raise ValueError(f"GROUP_N must be a multiple of BLOCK_N and BLOCK_R a power of two in [16, {r_pad}], "
                         f"got {cfg}")
    group_counts = [cdiv(w, cfg["GROUP_N"]) for w in widths] + [0] * (MAX_SLICES - num_slices)
    firsts = [sum(group_counts[:i]) for i in range(1, MAX_SLICES)]
    num_groups = sum(group_counts)
    tiles = max_tiles(T, cfg["BLOCK_M"], meta.max_slots)
    sums, counters = workspace
    if (sums.dtype != torch.float32 or sums.dim() != 2 or sums.stride(1) != 1 or sums.shape[0] < T
            or sums.shape[1] < num_slices * r_pad or sums.device != x.device):
        raise ValueError(f"workspace sums must be float32 [>= {T}, >= {num_slices * r_pad}] on {x.device}")
    if counters.dtype != torch.int32 or counters.numel() < 8 * tiles or counters.device != x.device:
        raise ValueError(f"workspace counters must be int32 with >= {8 * tiles} entries on {x.device}")
    mods = list(module_indices) + [0] * (MAX_SLICES - num_slices)
    offs = offs + [offs[-1]] * (MAX_SLICES + 1 - len(offs))
    grid = (num_slices * cfg["SPLIT_K"] + num_groups, tiles)
    pdl = bool(cfg.get("PDL", pdl_enabled(x.device)))
    _fused_kernel[grid](
        x, x.stride(0), pool, tables.a_offsets, tables.b_offsets, tables.ranks, y, y.stride(0),
        sums, sums.stride(0), counters,
        meta.token_indices, meta.seg_starts, meta.seg_slots, meta.max_slots,
        layer, tables.num_layers, tables.num_modules, tables.max_rank, r_pad, K, cfg["K_PER_SPLIT"], cfg["GROUP_N"],
        *mods, *offs, *firsts, num_groups,
        NUM_SLICES=num_slices, BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"],
        BLOCK_N=cfg["BLOCK_N"], SPLIT_K=cfg["SPLIT_K"], MAX_SEGS=next_pow2(meta.max_slots),
        EVEN_K=(K % cfg["BLOCK_K"] == 0), ROW_ALIGN=tables.row_alignment(), COL_ALIGN=_alignment(offs),
        IEEE=pool.dtype == torch.float32, SMALL_R=min(SMALL_RANK, cfg["BLOCK_R"]), ONE_BLOCK=r_pad <= cfg["BLOCK_R"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch_args(pdl),
    )
