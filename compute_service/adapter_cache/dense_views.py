"""Per-adapter contiguous copies of the pool's rows: what the CPU LoRA path multiplies with.

The pool places an adapter's rows wherever pages were free, and the kernels
follow the row tables to them. Plain matmuls need each module's rows side by
side, and gathering them every step would copy the adapter every step; so they
are gathered once per load, per (layer, group):
- `a_t` [in, R]: the A rows of each slice the adapter has in the group, as
  columns side by side (R = the sum of those slices' ranks);
- `b_t` [R, out_total]: B^T block-diagonal over the slices, so slice i's rank
  rows feed only its own output columns (zero elsewhere; a slice the adapter
  lacks is all zero).
A group's LoRA for a run of tokens is then two matmuls: `(x @ a_t) @ b_t`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import LoraRowTables


@dataclass(frozen=True)
class GroupWeights:
    a_t: torch.Tensor   # [in, R]
    b_t: torch.Tensor   # [R, out_total], block-diagonal


# Per layer: group name -> weights; a group the adapter does not touch is absent.
SlotViews = list[dict[str, GroupWeights]]


def _module_rows(pool: torch.Tensor, offsets: torch.Tensor, rank: int, width: int) -> torch.Tensor:
    """[L, rank, width] rows of one module in every layer; rows past a layer's own rank are junk, never read."""
    idx = offsets[:, :rank, None] + torch.arange(width)                 # [L, rank, width] host
    return pool[idx.to(pool.device)]


def slot_views(pool: torch.Tensor, tables: LoraRowTables, slot: int, group_modules: dict[str, list[int]],
               features: dict[int, tuple[int, int]]) -> SlotViews:
    """Gathers `slot`'s rows out of `pool` (module index -> (in, out) in `features`)."""
    shapes = tables.shapes_cpu[slot]                                    # [L, M, 3] (rank, in, out)
    a_off, b_off = tables.a_offsets[slot].cpu(), tables.b_offsets[slot].cpu()
    a_rows: dict[int, torch.Tensor] = {}
    bt_rows: dict[int, torch.Tensor] = {}
    for m, (fin, fout) in features.items():
        rank = int(shapes[:, m, 0].max())
        if rank:
            a_rows[m] = _module_rows(pool, a_off[:, m], rank, fin)
            bt_rows[m] = _module_rows(pool, b_off[:, m], rank, fout)
    views: SlotViews = []
    for layer in range(tables.num_layers):
        groups: dict[str, GroupWeights] = {}
        for group, mods in group_modules.items():
            ranks = [int(shapes[layer, m, 0]) for m in mods]
            if not any(ranks):
                continue
            widths = [features[m][1] for m in mods]
            b_t = torch.zeros(sum(ranks), sum(widths), dtype=pool.dtype, device=pool.device)
            r0 = c0 = 0
            for m, r, w in zip(mods, ranks, widths):
                if r:
                    b_t[r0: r0 + r, c0: c0 + w] = bt_rows[m][layer, :r]
                r0, c0 = r0 + r, c0 + w
            a = torch.cat([a_rows[m][layer, :r] for m, r in zip(mods, ranks) if r])   # [R, in]
            groups[group] = GroupWeights(a.t().contiguous(), b_t)
        views.append(groups)
    return views
