"""Staging an adapter in (pinned) host memory and copying it into pool pages.

`stage` lays the adapter's rows out as whole pages in a host buffer, exactly as
they will sit in the pool, but numbered 0..n-1; it runs in a worker thread, so
the CPU work (casting, packing) never holds up the step loop. `start_copy` then
moves the staged pages into the pages the cache granted and fills the slot's
row tables, renumbering local page offsets into pool offsets. On CUDA the
copies are queued on a side stream from pinned memory (full PCIe speed, and
the running batch's kernels are not delayed) and an event says when they are
done; on CPU they are plain copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compute_service.adapter_cache.layout import PoolLayout, Row, rows_pages
from kernels import DEFAULT_MODULE_IDS, LoraRowTables, write_adapter


@dataclass
class Staged:
    """An adapter packed into `num_pages` host pages, with slot tables relative to page 0."""

    pages: torch.Tensor       # [num_pages, page_elems] pool dtype, pinned on CUDA hosts
    a_offsets: torch.Tensor   # [L, M, R] int64 local element offsets
    b_offsets: torch.Tensor
    ranks: torch.Tensor       # [L, M] int32
    shapes: torch.Tensor      # [L, M, 3] int64 (rank, in, out)

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def num_bytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()


def stage(rows: list[Row], layout: PoolLayout, pin: bool) -> Staged:
    """Packs rows into host pages numbered from 0 (pinned when `pin`, for asynchronous H2D copies)."""
    n = rows_pages(rows, layout.page_elems)
    pages = torch.empty(n * layout.page_elems, dtype=layout.dtype, pin_memory=pin)
    tables = LoraRowTables(1, layout.num_layers, layout.max_rank, device="cpu", module_ids=DEFAULT_MODULE_IDS)
    write_adapter(pages, list(range(n)), rows, tables, 0, layout.page_elems)
    ranks = tables.ranks[0]
    # Pin the small tables too, so their copies are asynchronous like the pages'.
    a_off, b_off = tables.a_offsets[0], tables.b_offsets[0]
    if pin:
        a_off, b_off, ranks = a_off.pin_memory(), b_off.pin_memory(), ranks.pin_memory()
    return Staged(pages.view(n, layout.page_elems), a_off, b_off, ranks, tables.shapes_cpu[0].clone())


def _runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """(local start, pool start, length) of runs of consecutive pool page ids."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(page_ids):
        if runs and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, p, 1))
    return runs


def _relocate(local: torch.Tensor, page_ids: list[int], page_elems: int, rank_mask: torch.Tensor) -> torch.Tensor:
    """Local element offsets -> pool offsets (entries beyond each rank stay 0)."""
    ids = torch.tensor(page_ids, dtype=torch.int64)
    out = ids[local // page_elems] * page_elems + local % page_elems
    return torch.where(rank_mask, out, torch.zeros_like(out))


@dataclass
class CopyHandle:
    """A queued copy: done when `event` is (None on CPU: done at once). Holds the host buffers until then."""

    event: "torch.cuda.Event | None"
    keep_alive: tuple[object, ...] = ()
    start_event: "torch.cuda.Event | None" = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def copy_ms(self) -> float:
        """Device time of the copies (CUDA only, once done; 0 on CPU)."""
        if self.event is None or self.start_event is None:
            return 0.0
        return self.start_event.elapsed_time(self.event)


def start_copy(staged: Staged, pool: torch.Tensor, tables: LoraRowTables, page_ids: list[int], slot: int,
               layout: PoolLayout, stream: "torch.cuda.Stream | None") -> CopyHandle:
    """Queues the pages and the slot's tables (on `stream` when given, else synchronously)."""
    if len(page_ids) != staged.num_pages:
        raise ValueError(f"staged {staged.num_pages} pages, granted {len(page_ids)}")
    R = layout.max_rank
    mask = torch.arange(R)[None, None, :] < staged.ranks[:, :, None]
    a_off = _relocate(staged.a_offsets, page_ids, layout.page_elems, mask)
    b_off = _relocate(staged.b_offsets, page_ids, layout.page_elems, mask)
    pages_2d = pool.view(-1, layout.page_elems)
    if stream is None:
        for lo, p, n in _runs(page_ids):
            pages_2d[p: p + n].copy_(staged.pages[lo: lo + n])
        tables.a_offsets[slot].copy_(a_off)
        tables.b_offsets[slot].copy_(b_off)
        tables.ranks[slot].copy_(staged.ranks)
        tables.shapes_cpu[slot] = staged.shapes
        return CopyHandle(None)
    a_off, b_off = a_off.pin_memory(), b_off.pin_memory()
    # The side stream waits for work already queued on the main stream, so pages that an
    # evicted adapter used are not overwritten under a kernel still reading them.
    stream.wait_stream(torch.cuda.current_stream(pool.device))
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for lo, p, n in _runs(page_ids):
            pages_2d[p: p + n].copy_(staged.pages[lo: lo + n], non_blocking=True)
        tables.a_offsets[slot].copy_(a_off, non_blocking=True)
        tables.b_offsets[slot].copy_(b_off, non_blocking=True)
        tables.ranks[slot].copy_(staged.ranks, non_blocking=True)
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
    tables.shapes_cpu[slot] = staged.shapes
    # Host buffers must outlive the copies: the handle keeps them until it is polled done.
    return CopyHandle(event, (staged, a_off, b_off), start)
