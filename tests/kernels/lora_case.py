"""Builds random multi-adapter LoRA cases for the kernel tests: dense weights plus their paged copy."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import LoraBatchMeta, LoraRowTables, pages_needed, write_adapter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    pool: torch.Tensor
    tables: LoraRowTables
    page_elems: int
    dense: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]]  # (slot, layer, module) -> (A [r,in], B [out,r])
    h_in: int
    outs: list[int]                 # out_features per module index


def build_case(
    *, ranks: dict[int, list[int]], h_in: int, outs: list[int], num_layers: int = 2, max_slots: int = 8,
    dtype: torch.dtype = torch.float16, device: str = DEVICE, gen: torch.Generator | None = None,
    absent: set[tuple[int, int, int]] = frozenset(), spare_pages: int = 7, page_elems: int | None = None,
) -> Case:
    """`ranks[slot][module]` gives each adapter's rank per module (0 = absent); same for every layer.

    Pages are handed out in a random order from a pool with spare pages, so every
    adapter's rows are scattered through the pool.
    """
    gen = gen or torch.Generator().manual_seed(torch.seed() % 2**31)
    max_rank = max(max(r) for r in ranks.values())
    module_ids = tuple(range(1, len(outs) + 1))
    tables = LoraRowTables(max_slots, num_layers, max_rank, device=device, module_ids=module_ids)
    # By default not a multiple of any width (rows must not straddle) and not aligned (no vector-load hints).
    page_elems = page_elems or max([h_in, *outs]) * 3 + 5
    per_slot_rows = {}
    total = 0
    for slot, mod_ranks in ranks.items():
        rows = []
        for layer in range(num_layers):
            for m, r in enumerate(mod_ranks):
                if r == 0 or (slot, layer, m) in absent:
                    continue
                a = torch.randn(r, h_in, generator=gen) / h_in**0.5
                b = torch.randn(outs[m], r, generator=gen) / max(r, 1) ** 0.5
                rows.append((module_ids[m], layer, r, a.to(dtype), b.to(dtype)))
        per_slot_rows[slot] = rows
        total += pages_needed([(r, a.shape[1], b.shape[0]) for _, _, r, a, b in rows], page_elems)
    num_pages = total + spare_pages
    # Poison the pool so a kernel that reads a wrong row sees garbage.
    pool = torch.full((num_pages * page_elems,), 1e4, dtype=dtype, device=device)
    free = torch.randperm(num_pages, generator=gen).tolist()
    dense = {}
    for slot, rows in per_slot_rows.items():
        n = pages_needed([(r, a.shape[1], b.shape[0]) for _, _, r, a, b in rows], page_elems)
        mine, free = free[:n], free[n:]
        write_adapter(pool, mine, rows, tables, slot, page_elems)
        for mid, layer, r, a, b in rows:
            dense[(slot, layer, tables.module_index(mid))] = (a, b)
    return Case(pool, tables, page_elems, dense, h_in, outs)


def random_slot_ids(T: int, slots: list[int], frac_none: float, gen: torch.Generator) -> torch.Tensor:
    """Per-token slot ids: `frac_none` of tokens without adapter, the rest spread over `slots`."""
    pick = torch.tensor(slots)[torch.randint(len(slots), (T,), generator=gen)]
    none = torch.rand(T, generator=gen) < frac_none
    return torch.where(none, torch.full_like(pick, -1), pick).to(torch.int32)


def prepare_meta(slot_ids: torch.Tensor, max_slots: int, device: str = DEVICE, max_tokens: int | None = None
                 ) -> LoraBatchMeta:
    meta = LoraBatchMeta(max_tokens or max(1, slot_ids.shape[0]) + 3, max_slots, device=device)
    meta.prepare(slot_ids)
    return meta


def dense_shrink(case: Case, x: torch.Tensor, slot_ids: torch.Tensor, layer: int, mods: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 oracle from the dense weights: (s [slices, T, max_rank], defined-entry mask)."""
    T = x.shape[0]
    R = case.tables.max_rank
    s = torch.zeros(len(mods), T, R, dtype=torch.float32)
    defined = torch.zeros(len(mods), T, R, dtype=torch.bool)
    xf = x.float().cpu()
    ids = slot_ids.cpu()
    for (slot, lay, m), (a, _) in case.dense.items():
        if lay != layer or m not in mods:
            continue
        rows = torch.nonzero(ids == slot).flatten()
        r = a.shape[0]
        for i in [i for i, mm in enumerate(mods) if mm == m]:
            s[i, rows, :r] = xf[rows] @ a.float().t()
            defined[i, rows, :r] = True
    return s, defined


def dense_expand(case: Case, s: torch.Tensor, y0: torch.Tensor, slot_ids: torch.Tensor, layer: int,
                 mods: list[int], offsets: list[int]) -> torch.Tensor:
    """fp32 oracle: y0 + LoRA expand from the dense weights."""
    y = y0.float().cpu().clone()
    sf = s.float().cpu()
    ids = slot_ids.cpu()
    for (slot, lay, m), (_, b) in case.dense.items():
        if lay != layer or m not in mods:
            continue
        rows = torch.nonzero(ids == slot).flatten()
        r = b.shape[1]
        for i in [i for i, mm in enumerate(mods) if mm == m]:
            y[rows, offsets[i]:offsets[i + 1]] += sf[i, rows, :r] @ b.float().t()
    return y


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def assert_untouched(case: Case, y: torch.Tensor, y0: torch.Tensor, ids: torch.Tensor, slots: list[int], layer: int,
                     mods: list[int], offs: list[int]) -> None:
    """Rows without adapter, columns past the slices and slices of modules an adapter lacks are as they were."""
    y, y0 = y.cpu(), y0.cpu()
    no_adapter = ids < 0
    assert torch.equal(y[no_adapter], y0[no_adapter]), "rows without adapter changed"
    assert torch.equal(y[:, offs[-1]:], y0[:, offs[-1]:]), "columns past the slices changed"
    for i, m in enumerate(mods):
        for slot in slots:
            if (slot, layer, m) not in case.dense:
                rows = ids == slot
                assert torch.equal(y[rows, offs[i]:offs[i + 1]], y0[rows, offs[i]:offs[i + 1]])
