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
    """[L, rank, width] rows of one module in every layer; rows past a layer's own rank are junk, never read.
    One index per row into a sliding-window view of the pool (one per element cost 10x the time)."""
    windows = pool.unfold(0, width, 1)                                    # [N - width + 1, width], a view
    index = offsets[:, :rank].reshape(-1).to(pool.device)
    return windows.index_select(0, index).view(offsets.shape[0], rank, width)


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
    views: SlotViews = [{} for _ in range(tables.num_layers)]
    for group, mods in group_modules.items():
        ranks = shapes[:, mods, 0]                                      # [L, len(mods)]
        # The same ranks in every layer: all layers at once; else layer by layer.
        spans = ([range(tables.num_layers)] if bool((ranks == ranks[0]).all())
                 else [range(layer, layer + 1) for layer in range(tables.num_layers)])
        for layers in spans:
            _group_weights(views, layers, group, mods, [int(r) for r in ranks[layers.start]], features,
                           a_rows, bt_rows, pool)
    return views


def _group_weights(views: SlotViews, layers: range, group: str, mods: list[int], ranks: list[int],
                   features: dict[int, tuple[int, int]], a_rows: dict[int, torch.Tensor],
                   bt_rows: dict[int, torch.Tensor], pool: torch.Tensor) -> None:
    """One group's weights for `layers` (which share `ranks`), built as [len(layers), ...] tensors; each
    layer's are views of them."""
    if not any(ranks):
        return
    widths = [features[m][1] for m in mods]
    sel = slice(layers.start, layers.stop)
    b_t = torch.zeros(len(layers), sum(ranks), sum(widths), dtype=pool.dtype, device=pool.device)
    r0 = c0 = 0
    for m, r, w in zip(mods, ranks, widths):
        if r:
            b_t[:, r0: r0 + r, c0: c0 + w] = bt_rows[m][sel, :r]
        r0, c0 = r0 + r, c0 + w
    a_t = torch.cat([a_rows[m][sel, :r] for m, r in zip(mods, ranks) if r], dim=1).transpose(1, 2).contiguous()
    for i, layer in enumerate(layers):
        views[layer][group] = GroupWeights(a_t[i], b_t[i])
