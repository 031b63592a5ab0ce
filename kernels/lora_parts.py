"""A one-token LoRA with no launch of its own: the shrink in the base projection's launch, the expand in the reader's.

At one token the LoRA's bytes are tiny, and what a LoRA launch costs is its chain of dependent round trips on the
projection's path (`kernels.fused`: shrink, atomics, arrival, expand; the one-row base kernel then waits for it to
add the delta). Here the base projection's one-row launch (`kernels.quant_gemv`) takes a few more programs, one a
slice and K split, that read the token's x over their split's K range and the adapter's A rows and store the
rank-r partial products `parts[split, slice, :rank]` (float32, no atomics: every split its own row); the kernel
that reads the projection's output next (RoPE + cache for q/k/v, `kernels.rope_cache`) sums them over the splits
and multiplies them into B^T for the columns it reads, adding the delta to the projection's float32 sum before it
rounds (as the one-row kernel adds the fused launch's delta to its first partial).

One token, so one adapter: its slot is the step's first segment's (`LoraBatchMeta.seg_slots[0]`, -1 where the
token has none: rank 0, no delta), read on the device (graph-safe). Rows are found through the pool's row tables
(`kernels.paged.LoraRowTables`); a module the adapter lacks has rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16             # the one-row kernels split K at most 16 ways


@dataclass
class LoraParts:
    """A one-token LoRA of one group's slices (q/k/v) left as partial shrink products for the reader.

    `parts` [MAX_SPLITS, slices, max_rank] float32 is written by the projection's launch (its first `splits` rows,
    set by that launch) and read by the next kernel; `mods` [slices] int32 are the slices' module indices in the
    row tables, `widths` the slices' output columns, `slot` the step's first segment slot (int32 [>= 1])."""

    pool: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    slot: torch.Tensor
    mods: torch.Tensor
    layer: int
    widths: tuple[int, ...]
    parts: torch.Tensor
    splits: int = 0

    @property
    def num_layers(self) -> int:
        return self.ranks.shape[1]

    @property
    def num_modules(self) -> int:
        return self.ranks.shape[2]

    @property
    def max_rank(self) -> int:
        return self.a_offsets.shape[3]

    def table_args(self) -> tuple:
        """The arguments `shrink_part` and `delta_cols` take after their own, in order."""
        return (self.pool, self.a_offsets, self.b_offsets, self.ranks, self.slot, self.mods, self.parts, self.layer,
                self.num_layers, self.num_modules, self.max_rank, len(self.widths))


def parts_buffer(slices: int, max_rank: int, device: torch.device) -> torch.Tensor:
    """A `LoraParts.parts` buffer for up to `slices` slices of rank up to `max_rank`."""
    return torch.zeros(MAX_SPLITS, slices, max_rank, dtype=torch.float32, device=device)


def check_parts(lp: LoraParts, x: torch.Tensor, splits: int) -> None:
    """The launch's x (one row, the pool's dtype, K = A's width) and split count fit `lp`."""
    if x.shape[0] != 1 or x.dtype != lp.pool.dtype:
        raise ValueError(f"LoRA parts take one row of the pool's dtype {lp.pool.dtype}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if not 1 <= splits <= lp.parts.shape[0] or lp.parts.shape[1] < len(lp.widths) \
            or lp.parts.shape[2] < lp.max_rank:
        raise ValueError(f"parts buffer {tuple(lp.parts.shape)} cannot hold {splits} splits of "
                         f"{len(lp.widths)} slices of rank {lp.max_rank}")


@triton.jit
def _entry(slot_ptr, mods_ptr, s, layer, num_layers, num_modules, ranks_ptr):
    """(flat row-table entry, rank) of slice s for the token's slot (rank 0 where the slot is -1)."""
    slot = tl.load(slot_ptr).to(tl.int64)
    m = tl.load(mods_ptr + s).to(tl.int64)
    e = (tl.maximum(slot, 0) * num_layers + layer) * num_modules + m
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + e), 0)
    return e, rank


@triton.jit
def shrink_part(x_row, k_lo, k_hi, s, split, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, slot_ptr, mods_ptr,
                parts_ptr, layer, num_layers, num_modules, max_rank, num_slices,
                RB: tl.constexpr, BLOCK_K: tl.constexpr):
    """parts[split, s, :rank] = A_s[:, k_lo:k_hi] @ x[k_lo:k_hi] in float32 (x_row: the token's x; k_hi <= K).
    x's range is read BLOCK_K columns at a time (once where BLOCK_K covers it), A's rows RB at a time."""
    e, rank = _entry(slot_ptr, mods_ptr, s, layer, num_layers, num_modules, ranks_ptr)
    offs_k = tl.arange(0, BLOCK_K)
    out = parts_ptr + (split * num_slices + s) * max_rank
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + offs_k < k_hi
        xk = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        for r0 in range(0, rank, RB):
            offs_r = r0 + tl.arange(0, RB)
            r_mask = offs_r < rank
            rows = tl.load(a_off_ptr + e * max_rank + offs_r, mask=r_mask, other=0)
            a = tl.load(pool_ptr + rows[:, None] + (k0 + offs_k)[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0)
            acc = tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            if k0 > k_lo:
                acc += tl.load(out + offs_r, mask=r_mask, other=0.0)
            tl.store(out + offs_r, acc, mask=r_mask)


@triton.jit
def delta_cols(cols, mask, s, splits, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, slot_ptr, mods_ptr, parts_ptr,
               layer, num_layers, num_modules, max_rank, num_slices, RB: tl.constexpr):
    """float32 delta of slice s at its columns `cols` (2-D; 0 where masked): the parts summed over the splits (in
    order) times B^T's rows, RB rank rows at a time."""
    e, rank = _entry(slot_ptr, mods_ptr, s, layer, num_layers, num_modules, ranks_ptr)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r0 in range(0, rank, RB):
        offs_r = r0 + tl.arange(0, RB)
        r_mask = offs_r < rank
        rows = tl.load(b_off_ptr + e * max_rank + offs_r, mask=r_mask, other=0)
        r = tl.load(parts_ptr + s * max_rank + offs_r, mask=r_mask, other=0.0)
        for p in range(1, splits):
            r += tl.load(parts_ptr + (p * num_slices + s) * max_rank + offs_r, mask=r_mask, other=0.0)
        b = tl.load(pool_ptr + rows[:, None, None] + cols[None, :, :], mask=r_mask[:, None, None] & mask[None, :, :],
                    other=0.0)
        acc += tl.sum(r[:, None, None] * b.to(tl.float32), axis=0)
    return acc


def reference_delta(x: torch.Tensor, lp: LoraParts, slot: int) -> list[torch.Tensor]:
    """Each slice's delta [1, width] in float32 (torch, for tests): x @ A_s.T @ B_s.T of the slot's rows."""
    out = []
    for i, width in enumerate(lp.widths):
        m = int(lp.mods[i])
        rank = int(lp.ranks[slot, lp.layer, m]) if slot >= 0 else 0
        if rank == 0:
            out.append(torch.zeros(1, width, dtype=torch.float32, device=x.device))
            continue
        a_rows = lp.a_offsets[slot, lp.layer, m, :rank]
        b_rows = lp.b_offsets[slot, lp.layer, m, :rank]
        k = x.shape[1]
        A = torch.stack([lp.pool[int(o): int(o) + k] for o in a_rows]).float()
        BT = torch.stack([lp.pool[int(o): int(o) + width] for o in b_rows]).float()
        out.append((x.float() @ A.T) @ BT)
    return out


def shrink_programs(lp: LoraParts | None) -> int:
    """Programs a launch adds along its feature axis for `lp`'s shrink (one a slice)."""
    return 0 if lp is None else len(lp.widths)
