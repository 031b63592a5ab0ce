"""Paged adapter memory: the layout the LoRA kernels read weights from.

One preallocated 1-D `pool` tensor holds `num_pages * page_elems` elements. A
page is `page_elems` contiguous elements and holds rank rows of a single width:
rows of `A` (width `in_features`) or rows of `B` stored transposed (width
`out_features`, so each rank row of `B^T` is contiguous). A page of width `w`
holds `page_elems // w` rows and a row never straddles two pages. An adapter's
rows are grouped by width and streamed into its pages in order, so it occupies
about `rank * (in + out)` elements per module-layer: memory follows the true
rank, with at most one partly filled page per distinct row width.

Kernels find rows through `LoraRowTables`: for each adapter slot, layer and
module, the element offset of every rank row inside the pool. The page
allocator (free list, LRU, pinning) belongs to the GPU adapter cache; this
module only places rows into pages it is given.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

# Module ids served by default (TensorRT-LLM numbering: q, k, v, o, gate, down, up).
DEFAULT_MODULE_IDS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
_POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class LoraRowTables:
    """Per-slot row tables, preallocated on the pool's device.

    - `a_offsets` int64 `[max_slots, num_layers, num_modules, max_rank]`: element
      offset in the pool of each rank row of `A` (0 beyond the rank).
    - `b_offsets` int64, same shape: offset of each rank row of `B^T`.
    - `ranks` int32 `[max_slots, num_layers, num_modules]`: 0 = module absent.
    Module index is dense over `module_ids` (default ids 1..7 -> 0..6).
    Tensors are filled in place, so kernels captured in CUDA graphs stay valid.
    """

    def __init__(
        self,
        max_slots: int,
        num_layers: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        module_ids: Sequence[int] = DEFAULT_MODULE_IDS,
    ) -> None:
        if max_slots < 1 or num_layers < 1 or max_rank < 1:
            raise ValueError(f"max_slots, num_layers, max_rank must be >= 1, got {max_slots}, {num_layers}, {max_rank}")
        if len(set(module_ids)) != len(module_ids) or not module_ids:
            raise ValueError(f"module_ids must be distinct and non-empty, got {list(module_ids)}")
        self.max_slots = max_slots
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.module_ids = tuple(int(m) for m in module_ids)
        self.num_modules = len(self.module_ids)
        self._index = {mid: i for i, mid in enumerate(self.module_ids)}
        shape = (max_slots, num_layers, self.num_modules)
        self.a_offsets = torch.zeros(*shape, max_rank, dtype=torch.int64, device=device)
        self.b_offsets = torch.zeros(*shape, max_rank, dtype=torch.int64, device=device)
        self.ranks = torch.zeros(shape, dtype=torch.int32, device=device)
        # Host copy of each filled entry's (rank, in_features, out_features), for unpack and checks.
        self.shapes_cpu = torch.zeros(*shape, 3, dtype=torch.int64)
        # gcd of every row offset ever written (0 = none yet): lets kernels use wide vector loads.
        self.row_align = 0

    def row_alignment(self, limit: int = 8) -> int:
        """Largest power of two <= limit dividing every row offset (1 when rows are unaligned)."""
        align = limit
        while align > 1 and self.row_align % align:
            align //= 2
        return align

    @property
    def device(self) -> torch.device:
        return self.ranks.device

    def module_index(self, module_id: int) -> int:
        """Dense module index of a module id (what the kernels take)."""
        try:
            return self._index[int(module_id)]
        except KeyError:
            raise ValueError(f"module id {module_id} is not served (served ids: {list(self.module_ids)})") from None

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")


def rows_per_page(width: int, page_elems: int) -> int:
    """How many rows of `width` elements one page holds."""
    if width < 1:
        raise ValueError(f"row width must be >= 1, got {width}")
    if width > page_elems:
        raise ValueError(f"row width {width} exceeds page_elems {page_elems}: pages must hold at least one row")
    return page_elems // width


def pages_needed(row_shapes: Iterable[tuple[int, int, int]], page_elems: int) -> int:
    """Pages for an adapter whose module-layers have shapes (rank, in_features, out_features)."""
    rows_by_width: dict[int, int] = {}
    for rank, fin, fout in row_shapes:
        rows_by_width[fin] = rows_by_width.get(fin, 0) + rank
        rows_by_width[fout] = rows_by_width.get(fout, 0) + rank
    return sum(-(-n // rows_per_page(w, page_elems)) for w, n in rows_by_width.items())


def _row_fields(row: Any) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """(module_id, layer_idx, rank, A [r, in], B [out, r]) from an AdapterRow or a 5-tuple."""
    if hasattr(row, "module_id"):
        return int(row.module_id), int(row.layer_idx), int(row.rank), row.a, row.b
    module_id, layer_idx, rank, a, b = row
    return int(module_id), int(layer_idx), int(rank), a, b


def write_adapter(
    pool: torch.Tensor,          # [num_pages * page_elems]
    page_ids: Sequence[int],     # pages granted to this adapter, pages_needed(...) of them
    rows: Iterable[Any],         # (module_id, layer_idx, rank, A [r, in], B [out, r]) or AdapterRow
    tables: LoraRowTables,
    slot: int,
    page_elems: int,
) -> None:
    """Copies an adapter's A rows and B^T rows into `page_ids` and fills `slot`'s tables.

    Runs on the current CUDA stream (the cache may call it under a side stream).
    Entries of the slot that the adapter does not name end up absent (rank 0).
    """
    tables.check_slot(slot)
    if pool.dim() != 1 or pool.dtype not in _POOL_DTYPES:
        raise ValueError(f"pool must be a 1-D fp16/bf16/fp32 tensor, got {tuple(pool.shape)} {pool.dtype}")
    if pool.numel() % page_elems:
        raise ValueError(f"pool size {pool.numel()} is not a multiple of page_elems {page_elems}")
    num_pages = pool.numel() // page_elems
    page_list = [int(p) for p in page_ids]
    for p in page_list:
        if not 0 <= p < num_pages:
            raise ValueError(f"page id {p} out of range [0, {num_pages})")
    if len(set(page_list)) != len(page_list):
        raise ValueError("page ids must be distinct")

    L, R = tables.num_layers, tables.max_rank
    a_off = torch.zeros(L, tables.num_modules, R, dtype=torch.int64)
    b_off = torch.zeros(L, tables.num_modules, R, dtype=torch.int64)
    ranks = torch.zeros(L, tables.num_modules, dtype=torch.int32)
    shapes = torch.zeros(L, tables.num_modules, 3, dtype=torch.int64)
    by_width: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # width -> [(rows [r, w], offsets dst [r])]

    for row in rows:
        module_id, layer, rank, a, b = _row_fields(row)
        m = tables.module_index(module_id)
        if not 0 <= layer < L:
            raise ValueError(f"module {module_id} layer {layer}: layer out of range [0, {L})")
        if not 1 <= rank <= R:
            raise ValueError(f"module {module_id} layer {layer}: rank {rank} outside [1, {R}]")
        if a.dim() != 2 or a.shape[0] != rank or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"module {module_id} layer {layer}: A {tuple(a.shape)} / B {tuple(b.shape)} do not match rank {rank}")
        if ranks[layer, m]:
            raise ValueError(f"module {module_id} layer {layer} appears twice")
        ranks[layer, m] = rank
        shapes[layer, m] = torch.tensor([rank, a.shape[1], b.shape[0]])
        by_width.setdefault(a.shape[1], []).append((a, a_off[layer, m, :rank]))
        by_width.setdefault(b.shape[0], []).append((b.t(), b_off[layer, m, :rank]))

    need = sum(-(-sum(t.shape[0] for t, _ in grp) // rows_per_page(w, page_elems)) for w, grp in by_width.items())
    if need != len(page_list):
        raise ValueError(f"adapter needs {need} pages of {page_elems} elements, got {len(page_list)}")

    pages_2d = pool.view(num_pages, page_elems)
    tables.row_align = math.gcd(tables.row_align, page_elems, *by_width)
    next_page = 0
    for width in sorted(by_width):
        group = by_width[width]
        per_page = rows_per_page(width, page_elems)
        src = torch.cat([t.to(pool.dtype) for t, _ in group], dim=0)  # [n_rows, width]
        n_pages = -(-src.shape[0] // per_page)
        mine = torch.tensor(page_list[next_page: next_page + n_pages], dtype=torch.int64)
        next_page += n_pages
        # Destination offset of row k: its page start plus its place in the page.
        k = torch.arange(src.shape[0])                                  # host: offsets are small
        dst = mine[k // per_page] * page_elems + (k % per_page) * width
        start = 0
        for t, off_view in group:
            off_view.copy_(dst[start: start + t.shape[0]])
            start += t.shape[0]
        # Pad the group to whole pages so it lands with one indexed copy.
        padded = torch.zeros(n_pages * per_page, width, dtype=pool.dtype, device=src.device)
        padded[: src.shape[0]] = src
        body = padded.view(n_pages, per_page * width).to(pool.device, non_blocking=True)
        pages_2d[mine.to(pool.device), : per_page * width] = body

    tables.a_offsets[slot].copy_(a_off, non_blocking=True)
    tables.b_offsets[slot].copy_(b_off, non_blocking=True)
    tables.ranks[slot].copy_(ranks, non_blocking=True)
    tables.shapes_cpu[slot] = shapes


def clear_slot(tables: LoraRowTables, slot: int) -> None:
    """Marks every module of `slot` absent (its pages may then be reused)."""
    tables.check_slot(slot)
    tables.ranks[slot].zero_()
    tables.a_offsets[slot].zero_()
    tables.b_offsets[slot].zero_()
    tables.shapes_cpu[slot].zero_()


def unpack(
    pool: torch.Tensor, tables: LoraRowTables, slot: int, layer: int, module: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B [out, r]) of one module-layer of `slot`, gathered from the pool (for tests)."""
    tables.check_slot(slot)
    rank, fin, fout = (int(v) for v in tables.shapes_cpu[slot, layer, module])
    if rank == 0:
        raise ValueError(f"slot {slot} layer {layer} module index {module} holds no adapter rows")
    a_off = tables.a_offsets[slot, layer, module, :rank].to(pool.device)
    b_off = tables.b_offsets[slot, layer, module, :rank].to(pool.device)
    a = pool[a_off[:, None] + torch.arange(fin, device=pool.device)]
    bt = pool[b_off[:, None] + torch.arange(fout, device=pool.device)]
    return a, bt.t()
