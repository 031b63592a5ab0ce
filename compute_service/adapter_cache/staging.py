"""Moving an adapter onto the device and into its pool pages, off the event loop and off the batch's stream.

1. `upload` (worker thread, before pages are granted): the rows are grouped by
   (module, rank) and only each row's A and B travel, not the padding up to the
   longest row (an 8B rank-64 all-module adapter is 335 MB of factors in 528 MB
   of padded rows). They are gathered, a few threads at a time, from the host
   cache's shared memory into a ring of pinned host buffers allocated once
   (`PinnedRing`), each buffer's DMA to the device queued on the side stream
   while the next one fills: the device receives each group as one contiguous
   `[n, r * (in + out)]` block. No CUDA call that takes the driver's locks for
   long (pinned allocation, host registration) runs while the batch decodes:
   measured on an H200, a cudaHostRegister of a 0.5 GB shm mapping holds up the
   engine thread's kernel launches for tens of milliseconds. Plain pageable
   copies (`mode="pageable"`) remain for comparison. NaN/Inf are checked on the
   device.
2. `pack` (worker thread, once pages and a slot are granted): each group's B is
   transposed, rows of one width concatenated and written into the granted
   pages with one indexed copy per width; the slot's row tables follow the
   layout of `kernels.paged` (rows grouped by width, widths ascending, pages
   filled in order, no row straddling two pages). A handful of tensor ops per
   group, not per row: Python in a side thread competes for the GIL with the
   thread that runs the engine step, so it is kept to the minimum.
On CPU the same code runs on host tensors.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from compute_service.adapter_cache.layout import PoolLayout
from compute_service.engine.errors import InvalidAdapterError
from compute_service.engine.mlp_order import take_intermediate
from compute_service.engine.spec import ModelSpec
from kernels import LoraRowTables, rows_per_page
from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import MODULE_IDS

# Modules whose output (gate, up) or input (down) features are the MLP's intermediate ones (`mlp_order.py`).
INTERMEDIATE_OUT = (MODULE_IDS["mlp_gate"], MODULE_IDS["mlp_h_to_4h"])
INTERMEDIATE_IN = MODULE_IDS["mlp_4h_to_h"]
COPY_THREADS = 4      # host copies into the ring: one thread moves ~5-10 GB/s out of freshly mapped shm
RING_BUFFER_BYTES = 64 << 20


@dataclass(frozen=True)
class RowGroup:
    """The rows of one (module, rank): `rows` [n, rank * (in + out)] is each row's A then B, no padding."""

    module_id: int
    rank: int
    row_ids: np.ndarray                   # int64 [n]: rows of the adapter, in order
    in_out: tuple[int, int]
    rows: torch.Tensor                    # [n, rank * (in + out)] on the pool's device


@dataclass
class Uploaded:
    """An adapter's rows where `pack` reads them (device on CUDA, host on CPU)."""

    adapter: Adapter                       # structurally checked: `in_out` filled
    groups: list[RowGroup]
    num_pages: int
    num_bytes: int                         # bytes moved host -> device (the factors, no padding)
    finite_host: torch.Tensor | None       # pinned bool, valid once `event` is done (CUDA)
    event: "torch.cuda.Event | None"       # upload finished
    start_event: "torch.cuda.Event | None" = None
    host_ms: float = 0.0                   # wall time the worker spent uploading
    mode: str = ""                         # "ring" or "pageable": how the bytes travelled

    def upload_ms(self) -> float:
        if self.event is None or self.start_event is None:
            return 0.0
        return self.start_event.elapsed_time(self.event)


def _group_rows(adapter: Adapter) -> list[tuple[int, int, np.ndarray, tuple[int, int]]]:
    """(module id, rank, row ids, (in, out)) per (module, rank), in first-seen order."""
    cfg = np.asarray(adapter.config)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (module_id, _layer, rank) in enumerate(cfg.tolist()):
        groups.setdefault((module_id, rank), []).append(i)
    return [(m, r, np.asarray(idx, dtype=np.int64), tuple(adapter.in_out[idx[0]])) for (m, r), idx in groups.items()]


class _Gather:
    """The bytes the device must receive, as one stream: the used part of each row, group after group."""

    def __init__(self, weights: torch.Tensor, groups: list[tuple[int, int, np.ndarray, tuple[int, int]]]) -> None:
        self.src = weights.reshape(weights.shape[0], -1).view(torch.uint8).numpy()   # [N, W * itemsize]
        item = weights.element_size()
        rows, lengths = [], []
        for _m, r, idx, (fin, fout) in groups:
            rows.append(idx)
            lengths.append(np.full(len(idx), r * (fin + fout) * item, dtype=np.int64))
        self.rows = np.concatenate(rows)
        self.lengths = np.concatenate(lengths)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))   # offset of each piece in the stream
        self.num_bytes = int(self.starts[-1])

    def copy_into(self, out: np.ndarray, begin: int, end: int) -> None:
        """Writes stream bytes [begin, end) into `out[: end - begin]`."""
        k = int(np.searchsorted(self.starts, begin, side="right")) - 1
        pos = begin
        while pos < end:
            piece_start, piece_end = int(self.starts[k]), int(self.starts[k + 1])
            lo, hi = pos - piece_start, min(end, piece_end) - piece_start
            np.copyto(out[pos - begin: pos - begin + hi - lo], self.src[self.rows[k], lo:hi])
            pos += hi - lo
            k += 1


class PinnedRing:
    """`num_buffers` pinned host buffers of `buffer_bytes`, reused by every upload (one upload at a time)."""

    def __init__(self, buffer_bytes: int = RING_BUFFER_BYTES, num_buffers: int = 2,
                 copy_threads: int = COPY_THREADS) -> None:
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)]
        self.events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._lock = threading.Lock()
        self.host_views = [b.numpy() for b in self.buffers]
        self._copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="ring-copy")
        self.copy_threads = copy_threads

    def copy(self, gather: _Gather, dst: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        """The gathered stream (host) -> dst (device, flat uint8 of equal bytes), queued on `stream`."""
        with self._lock:
            self._copy(gather, dst, stream)

    def _fill(self, gather: _Gather, out: np.ndarray, begin: int, end: int) -> None:
        # numpy's copies drop the GIL: a few threads copy disjoint slices at once.
        step = max(1 << 20, -(-(end - begin) // self.copy_threads))
        parts = [(a, min(end, a + step)) for a in range(begin, end, step)]
        list(self._copiers.map(lambda p: gather.copy_into(out[p[0] - begin:], p[0], p[1]), parts))

    def _copy(self, gather: _Gather, dst: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        size = self.buffers[0].numel()
        for i, off in enumerate(range(0, gather.num_bytes, size)):
            j = i % len(self.buffers)
            n = min(size, gather.num_bytes - off)
            ev = self.events[j]
            if ev is not None:
                ev.synchronize()                     # its previous DMA is done: the buffer may be refilled
            self._fill(gather, self.host_views[j], off, off + n)
            with torch.cuda.stream(stream):
                dst[off: off + n].copy_(self.buffers[j][:n], non_blocking=True)
                ev = torch.cuda.Event(blocking=True)   # waits sleep instead of spinning a core
                ev.record(stream)
            self.events[j] = ev


def _device_groups(flat: torch.Tensor, groups, dtype: torch.dtype) -> list[RowGroup]:
    """Splits the uploaded stream (flat, in `dtype`) into each group's [n, r*(in+out)] block."""
    out, off = [], 0
    for m, r, idx, (fin, fout) in groups:
        width = r * (fin + fout)
        out.append(RowGroup(m, r, idx, (fin, fout), flat[off: off + len(idx) * width].view(len(idx), width)))
        off += len(idx) * width
    return out


def _finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`: its smallest and largest values are finite (both NaN if any value is), one
    reduction pass instead of a mask as large as `t` (3-5x faster on the CPU)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def upload(adapter: Adapter, num_pages: int, device: torch.device, stream: "torch.cuda.Stream | None",
           ring: PinnedRing | None = None, mode: str = "ring") -> Uploaded:
    """Puts a structurally checked adapter's rows where `pack` reads them.

    mode: "ring" (gathered through `ring`) or "pageable" (gathered on the host, then one pageable copy).
    """
    t0 = time.perf_counter()
    w = adapter.weights
    if w.stride(-1) != 1:
        w = w.contiguous()
    groups = _group_rows(adapter)
    if device.type != "cuda" or stream is None:
        blocks = [RowGroup(m, r, idx, fio, w[torch.from_numpy(idx), : r * sum(fio)]) for m, r, idx, fio in groups]
        if not all(_finite(g.rows) for g in blocks):
            raise InvalidAdapterError("adapter weights contain NaN or Inf")
        nbytes = sum(g.rows.numel() for g in blocks) * w.element_size()
        return Uploaded(adapter, blocks, num_pages, nbytes, None, None)
    gather = _Gather(w, groups)
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dev = torch.empty(gather.num_bytes, dtype=torch.uint8, device=device)
    if mode == "ring" and ring is not None:
        ring.copy(gather, dev, stream)
        used = "ring"
    else:
        host = np.empty(gather.num_bytes, dtype=np.uint8)
        gather.copy_into(host, 0, gather.num_bytes)
        with torch.cuda.stream(stream):
            dev.copy_(torch.from_numpy(host))
        used = "pageable"
    flat = dev.view(w.dtype)
    with torch.cuda.stream(stream):
        # One reduction pass and two scalars (the smallest and largest value are NaN/Inf iff some value
        # is), not an isfinite mask as large as the adapter.
        lo, hi = torch.aminmax(flat)
        finite_host = torch.empty((), dtype=torch.bool, pin_memory=True)
        finite_host.copy_(torch.isfinite(lo) & torch.isfinite(hi), non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    return Uploaded(adapter, _device_groups(flat, groups, w.dtype), num_pages, gather.num_bytes, finite_host, done,
                    start, (time.perf_counter() - t0) * 1e3, used)


@dataclass
class CopyHandle:
    """A queued pack: done when `event` is (None on CPU: done at once). Holds the buffers until then."""

    event: "torch.cuda.Event | None"
    keep_alive: tuple[object, ...] = ()
    start_event: "torch.cuda.Event | None" = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def copy_ms(self) -> float:
        """Device time of the pack (CUDA only, once done; 0 on CPU)."""
        if self.event is None or self.start_event is None:
            return 0.0
        return self.start_event.elapsed_time(self.event)


def _row_blocks(up: Uploaded, spec: ModelSpec, tables: LoraRowTables, mlp_orders: torch.Tensor | None = None):
    """Yields (width, rows [n*r, width], kind "a"|"b", module index, layers, rank, (in, out)) per group;
    `mlp_orders` ([L, I], `mlp_order.orders_table`): gate's and up's B rows and down's A columns taken in it."""
    cfg = np.asarray(up.adapter.config)
    for g in up.groups:
        module_id, r, (fin, fout), n = g.module_id, g.rank, g.in_out, len(g.row_ids)
        a = g.rows[:, : r * fin].reshape(n * r, fin)
        b = g.rows[:, r * fin:].reshape(n, fout, r)
        layers = cfg[g.row_ids, 1]
        if mlp_orders is not None and module_id in INTERMEDIATE_OUT:
            b = take_intermediate(b, layers, mlp_orders, 1)
        elif mlp_orders is not None and module_id == INTERMEDIATE_IN:
            a = take_intermediate(a.view(n, r, fin), layers, mlp_orders, 2).view(n * r, fin)
        if module_id == 0:      # fused qkv: q, k and v each get the shared A and their slice of B
            parts = zip((1, 2, 3), b.split([spec.q_size, spec.kv_size, spec.kv_size], dim=1))
        else:
            parts = zip((module_id,), (b,))
        for m, bm in parts:
            mi = tables.module_index(m)
            yield fin, a, "a", mi, layers, r, (fin, bm.shape[1])
            yield bm.shape[1], bm.transpose(1, 2).reshape(n * r, bm.shape[1]), "b", mi, layers, r, (fin, bm.shape[1])


def pack(up: Uploaded, spec: ModelSpec, pool: torch.Tensor, tables: LoraRowTables, page_ids: list[int], slot: int,
         layout: PoolLayout, stream: "torch.cuda.Stream | None", mlp_orders: torch.Tensor | None = None) -> CopyHandle:
    """Writes the adapter's rows into the granted pages and fills `slot`'s tables (queued on `stream`), the MLP's
    intermediate features in `mlp_orders` (`PagedAdapterSlots.follow_orders`)."""
    if len(page_ids) != up.num_pages:
        raise ValueError(f"adapter needs {up.num_pages} pages, granted {len(page_ids)}")
    if stream is None:
        _pack(up, spec, pool, tables, page_ids, slot, layout, mlp_orders)
        return CopyHandle(None)
    # The pages may have belonged to an adapter evicted a moment ago: let kernels already queued on
    # the batch's stream finish reading them before they are overwritten.
    stream.wait_stream(torch.cuda.default_stream(pool.device))
    if up.event is not None:
        stream.wait_event(up.event)
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        _pack(up, spec, pool, tables, page_ids, slot, layout, mlp_orders)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    return CopyHandle(done, (up,), start)


def _pack(up: Uploaded, spec: ModelSpec, pool: torch.Tensor, tables: LoraRowTables, page_ids: list[int],
          slot: int, layout: PoolLayout, mlp_orders: torch.Tensor | None) -> None:
    L, M, R, pe = tables.num_layers, tables.num_modules, tables.max_rank, layout.page_elems
    offs = {"a": np.zeros((L, M, R), dtype=np.int64), "b": np.zeros((L, M, R), dtype=np.int64)}
    ranks = np.zeros((L, M), dtype=np.int32)
    shapes = np.zeros((L, M, 3), dtype=np.int64)
    by_width: dict[int, list] = {}
    for width, rows, kind, mi, layers, r, fio in _row_blocks(up, spec, tables, mlp_orders):
        by_width.setdefault(width, []).append((rows, kind, mi, layers, r, fio))
    pages = np.asarray(page_ids, dtype=np.int64)
    pages_2d = pool.view(-1, pe)
    # Kernels assume every row offset is a multiple of this (kernels.paged keeps it the same way);
    # lowered before the slot's tables can name the new rows.
    tables.row_align = math.gcd(tables.row_align, pe, *by_width)
    next_page = 0
    for width in sorted(by_width):
        parts = by_width[width]
        per_page = rows_per_page(width, pe)
        n_rows = sum(p[0].shape[0] for p in parts)
        n_pages = -(-n_rows // per_page)
        mine = pages[next_page: next_page + n_pages]
        next_page += n_pages
        k = np.arange(n_rows)
        dst = mine[k // per_page] * pe + (k % per_page) * width          # element offset of each row
        start = 0
        for rows, kind, mi, layers, r, fio in parts:
            n = len(layers)
            offs[kind][layers, mi, :r] = dst[start: start + n * r].reshape(n, r)
            ranks[layers, mi] = r
            shapes[layers, mi] = (r, *fio)
            start += n * r
        # Every row is written below; only the last page's unused tail needs zeros (one pass, not two).
        body = torch.empty(n_pages * per_page, width, dtype=pool.dtype, device=pool.device)
        body[n_rows:].zero_()
        torch.cat([p[0] for p in parts], out=body[:n_rows]) if len(parts) > 1 else body[:n_rows].copy_(parts[0][0])
        pages_2d[torch.from_numpy(mine).to(pool.device), : per_page * width] = body.view(n_pages, per_page * width)
    if next_page != len(page_ids):
        raise ValueError(f"adapter filled {next_page} pages, granted {len(page_ids)}")
    tables.a_offsets[slot].copy_(torch.from_numpy(offs["a"]))
    tables.b_offsets[slot].copy_(torch.from_numpy(offs["b"]))
    tables.ranks[slot].copy_(torch.from_numpy(ranks))
    tables.shapes_cpu[slot] = torch.from_numpy(shapes)
