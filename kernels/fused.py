"""Fused LoRA (shrink + expand in one launch): y[t, slice cols] += (x[t] @ A.T) @ B.T, rank-r product on chip.

One launch covers every slice (q/k/v, or gate/up) and every adapter of the
batch. Grid: (column groups x K splits, token tiles). A program maps its tile
to a segment (one adapter) on the device, computes the rank-r shrink of its
tokens over its share of H_in in registers, multiplies it straight into its
column group of B^T, and adds the result into `y`; nothing rank-sized ever
goes to memory and no zeroing launch is needed.

Prefill (many tokens) uses one K split: every program owns its whole
reduction and adds into `y` directly. Decode (few tokens per adapter) splits
H_in so that a batch of 1-8 tokens still spreads over the GPU; since the
expand is linear in the shrink, each split adds its partial product into an
fp32 workspace with atomics, and the last split to arrive for a (tile, column
group) - known from an arrival counter - reads the sum back (leaving zeros),
adds it into `y` with one rounding, and resets the counter. The workspace is
therefore all zeros between launches and is owned by the caller.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.expand import _alignment
from kernels.meta import LoraBatchMeta
from kernels.paged import LoraRowTables
from kernels.shrink import (DECODE_MAX_TOKENS, MAX_SLICES, _capturing, _next_pow2, _num_sms, check_input,
                            check_launch, check_slices)
from kernels.tiles import pick4, segment_tile, shrink_tile, table_entry

MIN_K_PER_SPLIT = 256      # a K split reads at least this many columns of x and A
COUNTERS = 1 << 16         # arrival counters in a default workspace


@triton.jit
def _fused_kernel(
    x_ptr, x_stride, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, y_ptr, y_stride,
    part_ptr, part_stride, cnt_ptr,
    tok_ptr, seg_starts_ptr, seg_slots_ptr, max_slots,
    layer, num_layers, num_modules, max_rank, K, K_PER_SPLIT, GROUP_N,
    mod0, mod1, mod2, mod3, off0, off1, off2, off3, off4, grp1, grp2, grp3, NUM_GROUPS,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, MAX_SEGS: tl.constexpr, EVEN_K: tl.constexpr, ROW_ALIGN: tl.constexpr,
    COL_ALIGN: tl.constexpr,
):
    # K splits vary fastest, so the splits that meet in one counter run together.
    pid_sub = tl.program_id(0)
    pid_tile = tl.program_id(1)
    grp = pid_sub // SPLIT_K
    split = pid_sub % SPLIT_K
    # Column groups are numbered slice after slice; grpN is the first group of slice N.
    slice_id = (grp >= grp1).to(tl.int32) + (grp >= grp2).to(tl.int32) + (grp >= grp3).to(tl.int32)
    col0 = pick4(slice_id, off0, off1, off2, off3)
    n_start = (grp - pick4(slice_id, 0, grp1, grp2, grp3)) * GROUP_N
    n_end = tl.minimum(n_start + GROUP_N, pick4(slice_id, off1, off2, off3, off4) - col0)
    num_tiles, seg, m_start, seg_end = segment_tile(pid_tile, seg_starts_ptr, max_slots, BLOCK_M, MAX_SEGS)
    if pid_tile >= num_tiles:
        return
    entry = table_entry(seg_slots_ptr, seg, pick4(slice_id, mod0, mod1, mod2, mod3), layer, num_layers, num_modules)
    # Independent loads issued together before the first branch on their values.
    rank = tl.load(ranks_ptr + entry)
    offs_r = tl.arange(0, BLOCK_R)
    in_table = offs_r < max_rank
    a_rows = tl.multiple_of(tl.load(a_off_ptr + entry * max_rank + offs_r, mask=in_table, other=0), ROW_ALIGN)
    b_rows = tl.multiple_of(tl.load(b_off_ptr + entry * max_rank + offs_r, mask=in_table, other=0), ROW_ALIGN)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    toks = tl.load(tok_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)                    # [BLOCK_M]
    if rank == 0:
        return                                 # the same for every split of the group: no counter touched
    r_mask = offs_r < rank

    # Shrink over this split's columns of x and A: s [BLOCK_M, BLOCK_R] stays in registers.
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = shrink_tile(x_ptr, x_stride, toks, m_mask, pool_ptr, a_rows, r_mask, k_lo, k_hi, K,
                      BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K)
    s = acc.to(pool_ptr.dtype.element_ty)

    # Expand into this program's column group.
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
        n_mask = offs_n < n_end
        bt = tl.load(pool_ptr + b_rows[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                     other=0.0)
        d = tl.dot(s, bt)                                                                      # [BLOCK_M, BLOCK_N]
        cols = tl.max_contiguous(tl.multiple_of(col0 + offs_n, COL_ALIGN), BLOCK_N)
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            y_ptrs = y_ptr + toks[:, None] * y_stride + cols[None, :]
            cur = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (cur.to(tl.float32) + d).to(cur.dtype), mask=mask)
        else:
            tl.atomic_add(part_ptr + toks[:, None] * part_stride + cols[None, :], d, mask=mask, sem="relaxed")

    if SPLIT_K > 1:
        # Every thread's partial sums are issued before the arrival is published (release); the last
        # split to arrive sees them all (acquire) and folds them into y.
        tl.debug_barrier()
        counter = cnt_ptr + pid_tile * NUM_GROUPS + grp
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            for n0 in range(n_start, n_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                cols = tl.max_contiguous(tl.multiple_of(col0 + offs_n, COL_ALIGN), BLOCK_N)
                mask = m_mask[:, None] & (offs_n < n_end)[None, :]
                zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part_ptrs = part_ptr + toks[:, None] * part_stride + cols[None, :]
                d = tl.atomic_add(part_ptrs, zero, mask=mask, sem="relaxed")   # read where the sums were made
                tl.store(part_ptrs, zero, mask=mask)                          # and leave zeros for the next launch
                y_ptrs = y_ptr + toks[:, None] * y_stride + cols[None, :]
                cur = tl.load(y_ptrs, mask=mask, other=0.0)
                tl.store(y_ptrs, (cur.to(tl.float32) + d).to(cur.dtype), mask=mask)
            tl.atomic_xchg(counter, 0)


def _groups(widths: Sequence[int], group_n: int) -> int:
    return sum(triton.cdiv(w, group_n) for w in widths)


def fused_config(T: int, K: int, widths: Sequence[int], max_rank: int, max_slots: int, device: torch.device,
                 num_sms: int | None = None) -> dict[str, int]:
    """Tile sizes, K split and column-group width; depends only on host-known shapes (graph-stable).

    Every (tile, column group) re-reads its adapter's A and every K split re-reads
    its B^T columns (from L2), so a tile's traffic is r * (K * groups + N * splits).
    Among the choices that give the launch about two programs per SM (counting
    the upper bound of token tiles), the one with the least traffic wins; K is
    split only at decode sizes (the workspace holds DECODE_MAX_TOKENS rows).
    """
    block_r = max(16, _next_pow2(max_rank))
    block_k = min(256, max(32, 8192 // block_r))
    block_n = min(128, max(32, 8192 // block_r))
    if T <= DECODE_MAX_TOKENS:
        block_m, num_warps = 16, 4
    else:
        block_m, num_warps = max(16, min(64, 4096 // block_r)), 8
    tiles = triton.cdiv(T, block_m) + min(max_slots, T)
    target = 2 * (num_sms or _num_sms(device))
    max_split = max(1, K // MIN_K_PER_SPLIT) if T <= DECODE_MAX_TOKENS else 1
    best: tuple | None = None
    split = 1
    while split <= max_split:
        k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
        real_split = triton.cdiv(K, k_per_split)
        group_n = block_n
        while True:
            groups = _groups(widths, group_n)
            programs = tiles * groups * real_split
            traffic = K * groups + sum(widths) * real_split
            key = (programs < target, traffic if programs >= target else -programs, programs)
            if best is None or key < best[0]:
                best = (key, real_split, k_per_split, group_n)
            if group_n >= max(widths):
                break
            group_n *= 2
        split *= 2
    assert best is not None
    _, split, k_per_split, group_n = best
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, SPLIT_K=split,
                K_PER_SPLIT=k_per_split, GROUP_N=group_n, num_warps=num_warps, num_stages=2)


def fused_workspace(max_tokens: int, max_cols: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial [max_tokens, max_cols] float32, counters [COUNTERS] int32), both zero; kept zero by the kernel."""
    return (torch.zeros(max_tokens, max_cols, dtype=torch.float32, device=device),
            torch.zeros(COUNTERS, dtype=torch.int32, device=device))


def lora_fused_triton(
    x: torch.Tensor,                 # [T, H_in] same dtype as pool, rows contiguous
    pool: torch.Tensor,              # [num_pages * page_elems]
    tables: LoraRowTables, meta: LoraBatchMeta, layer: int,     # meta prepared for these T tokens
    module_indices: Sequence[int],   # dense module index per slice (1..4 slices)
    y: torch.Tensor,                 # [T, >= slice_offsets[-1]] same dtype as pool, rows contiguous
    slice_offsets: Sequence[int],    # num_slices + 1 increasing column boundaries in y
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,  # fused_workspace(...): needed when K is split
    config: dict[str, int] | None = None,  # overrides of fused_config's choices (for tuning and tests)
) -> None:
    """Shrink and expand of every slice and adapter in one launch, adding into `y` in place.

    Semantics:
        for t with slot a = a(t) >= 0, for i, m in enumerate(module_indices):
            r = tables.ranks[a, layer, m]
            s = x[t].float() @ A[a, layer, m].float().T                 # [r], rounded to y's dtype
            y[t, off[i]:off[i+1]] += s @ B[a, layer, m].T               (fp32 add, then y's dtype)
        rows of tokens without adapter, and slices of absent modules, are left as they were.
        (kernels.reference.lora_apply_ref is the definition.)
    """
    check_launch(x, pool, tables, meta, layer, module_indices)
    T, K = x.shape
    num_slices = len(module_indices)
    check_input(x, pool)
    offs = check_slices(y, slice_offsets, num_slices, pool)
    if y.shape[0] != T or meta.num_tokens != T:
        raise ValueError(f"x has {T} rows, y {y.shape[0]}, and meta was prepared for {meta.num_tokens} tokens")
    if T == 0 or (meta.has_lora is False and not _capturing(x.device)):
        return  # host-known empty batch; a graph being captured always gets the launch
    widths = [b - a for a, b in zip(offs, offs[1:])]
    cfg = fused_config(T, K, widths, tables.max_rank, meta.max_slots, x.device)
    if config:
        cfg.update(config)
        cfg["K_PER_SPLIT"] = triton.cdiv(triton.cdiv(K, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        cfg["SPLIT_K"] = triton.cdiv(K, cfg["K_PER_SPLIT"])
    if cfg["GROUP_N"] % cfg["BLOCK_N"] or cfg["BLOCK_R"] < tables.max_rank:
        raise ValueError(f"GROUP_N must be a multiple of BLOCK_N and BLOCK_R >= max rank, got {cfg}")
    group_counts = [triton.cdiv(w, cfg["GROUP_N"]) for w in widths] + [0] * (MAX_SLICES - num_slices)
    firsts = [sum(group_counts[:i]) for i in range(1, MAX_SLICES)]
    num_groups = sum(group_counts)
    tiles = triton.cdiv(T, cfg["BLOCK_M"]) + min(meta.max_slots, T)
    part, counters = torch.empty(0, device=x.device), torch.empty(0, dtype=torch.int32, device=x.device)
    if cfg["SPLIT_K"] > 1:
        if workspace is None:
            raise ValueError("a K split needs a workspace (kernels.fused.fused_workspace)")
        part, counters = workspace
        if (part.dtype != torch.float32 or part.dim() != 2 or part.stride(1) != 1 or part.shape[0] < T
                or part.shape[1] < offs[-1] or part.device != x.device):
            raise ValueError(f"workspace partial must be float32 [>= {T}, >= {offs[-1]}] on {x.device}")
        if counters.dtype != torch.int32 or counters.numel() < tiles * num_groups or counters.device != x.device:
            raise ValueError(f"workspace counters must be int32 with >= {tiles * num_groups} entries")
    mods = list(module_indices) + [0] * (MAX_SLICES - num_slices)
    offs = offs + [offs[-1]] * (MAX_SLICES + 1 - len(offs))
    grid = (num_groups * cfg["SPLIT_K"], tiles)
    _fused_kernel[grid](
        x, x.stride(0), pool, tables.a_offsets, tables.b_offsets, tables.ranks, y, y.stride(0),
        part, part.stride(0) if part.dim() == 2 else 0, counters,
        meta.token_indices, meta.seg_starts, meta.seg_slots, meta.max_slots,
        layer, tables.num_layers, tables.num_modules, tables.max_rank, K, cfg["K_PER_SPLIT"], cfg["GROUP_N"],
        *mods, *offs, *firsts, num_groups,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        SPLIT_K=cfg["SPLIT_K"], MAX_SEGS=_next_pow2(meta.max_slots), EVEN_K=(K % cfg["BLOCK_K"] == 0),
        ROW_ALIGN=tables.row_alignment(), COL_ALIGN=_alignment(offs),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
