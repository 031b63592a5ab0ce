"""Sizing of the adapter pool and conversion of an adapter into page-ready rows.

Page size keeps the seed's meaning of `lora_cache_optimal_adapter_size`: a
page holds that many rank rows of the widest row width of the model, so a
module-layer of "optimal" rank at the widest width fills exactly one page and
narrower rows pack more per page. Rows of one width from all of an adapter's
module-layers are packed together (kernels.paged), so the waste is at most one
partly filled page per distinct width, whatever the mix of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compute_service.engine.spec import ModelSpec
from kernels import DEFAULT_MODULE_IDS, pages_needed
from loraplex.formats.adapter import Adapter

# Row tables cost 2 int64 offsets per (slot, layer, module, rank row); cap the
# slot count so tables stay a small share of the pool.
MAX_SLOTS_CAP = 256
TABLES_SHARE = 0.25


def module_features(spec: ModelSpec) -> dict[int, tuple[int, int]]:
    """module id -> (in_features, out_features) for the served modules 1-7."""
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {1: (h, q), 2: (h, kv), 3: (h, kv), 4: (q, h), 5: (h, i), 6: (i, h), 7: (h, i)}


@dataclass(frozen=True)
class PoolLayout:
    """How big a page is, how many there are, and how many adapters may be resident."""

    page_elems: int
    num_pages: int
    max_slots: int
    num_layers: int
    max_rank: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        return self.page_elems * torch.empty((), dtype=self.dtype).element_size()

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def table_bytes_per_slot(self) -> int:
        return table_bytes_per_slot(self.num_layers, self.max_rank)

    @classmethod
    def for_budget(cls, spec: ModelSpec, num_bytes: int, dtype: torch.dtype, max_rank: int,
                   optimal_adapter_size: int = 8, max_slots: int = 0) -> "PoolLayout":
        """Pages of `optimal_adapter_size` widest rows filling `num_bytes`; slots auto-sized when 0."""
        if optimal_adapter_size < 1:
            raise ValueError(f"optimal adapter size must be >= 1, got {optimal_adapter_size}")
        widest = max(max(f) for f in module_features(spec).values())
        page_elems = optimal_adapter_size * widest
        elem = torch.empty((), dtype=dtype).element_size()
        num_pages = num_bytes // (page_elems * elem)
        if num_pages < 1:
            raise ValueError(f"adapter pool of {num_bytes} bytes holds no page of {page_elems * elem} bytes; "
                             "raise --lora-gpu-cache-bytes")
        if max_slots <= 0:
            by_bytes = int(num_bytes * TABLES_SHARE) // table_bytes_per_slot(spec.num_layers, max_rank)
            max_slots = max(1, min(num_pages, MAX_SLOTS_CAP, by_bytes))
        return cls(page_elems, num_pages, max_slots, spec.num_layers, max_rank, dtype)


def table_bytes_per_slot(num_layers: int, max_rank: int) -> int:
    m = len(DEFAULT_MODULE_IDS)
    return num_layers * m * (2 * max_rank * 8 + 4)


Row = tuple[int, int, int, torch.Tensor, torch.Tensor]  # (module_id, layer, rank, A [r, in], B [out, r])


def adapter_rows(adapter: Adapter, spec: ModelSpec) -> list[Row]:
    """The adapter's rows for modules 1-7; a fused qkv row (module 0) becomes q, k and v rows sharing A."""
    rows: list[Row] = []
    split = [spec.q_size, spec.kv_size, spec.kv_size]
    for row in adapter.rows():
        if row.module_id == 0:
            for mid, b in zip((1, 2, 3), row.b.split(split, dim=0)):
                rows.append((mid, row.layer_idx, row.rank, row.a, b))
        else:
            rows.append((row.module_id, row.layer_idx, row.rank, row.a, row.b))
    return rows


def rows_pages(rows: list[Row], page_elems: int) -> int:
    """Pages the rows take in the pool."""
    return pages_needed([(r, a.shape[1], b.shape[0]) for _, _, r, a, b in rows], page_elems)


def full_adapter_pages(spec: ModelSpec, max_rank: int, page_elems: int) -> int:
    """Pages of the largest adapter the model admits: `max_rank` on every module of every layer."""
    shapes = [(max_rank, fin, fout) for fin, fout in module_features(spec).values()] * spec.num_layers
    return pages_needed(shapes, page_elems)


def rows_adapter(rows: list[Row], dtype: torch.dtype, device: torch.device) -> Adapter:
    """The converted adapter (config + weights [N, W] on `device`) of (module_id, layer, rank, A, B) rows."""
    width = max(a.numel() + b.numel() for _, _, _, a, b in rows)
    weights = torch.zeros(len(rows), width, dtype=dtype, device=device)
    for i, (_, _, _, a, b) in enumerate(rows):
        weights[i, : a.numel()] = a.flatten()
        weights[i, a.numel(): a.numel() + b.numel()] = b.flatten()
    config = np.asarray([[m, layer, r] for m, layer, r, _, _ in rows], dtype=np.int32)
    return Adapter(config=config, weights=weights)
