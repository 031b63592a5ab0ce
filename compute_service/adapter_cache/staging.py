"""Moving an adapter onto the device and into its pool pages, off the event loop and off the batch's stream.

1. `upload` (worker thread, before pages are granted): the converted weights
   `[N, W]` go to the device on the side stream, staged through a small ring
   of pinned host buffers allocated once (`PinnedRing`): a CPU copy fills one
   buffer while the DMA of the other runs at full PCIe speed. No CUDA call
   that takes the driver's locks for long (pinned allocation, host
   registration) runs while the batch decodes: measured on an H200, a
   cudaHostRegister of a 0.5 GB shm mapping holds up the engine thread's
   kernel launches for tens of milliseconds. Registering the host memory
   instead (`mode="register"`) or plain pageable copies (`mode="pageable"`)
   remain for comparison. NaN/Inf are checked on the device.
2. `pack` (worker thread, once pages and a slot are granted): rows are
   gathered per (module, rank) group, B transposed, rows of one width
   concatenated and written into the granted pages with one indexed copy per
   width; the slot's row tables follow the layout of `kernels.paged`
   (rows grouped by width, widths ascending, pages filled in order, no row
   straddling two pages). A handful of tensor ops per group, not per row:
   Python in a side thread competes for the GIL with the thread that runs the
   engine step, so it is kept to the minimum.
On CPU the same code runs on host tensors.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from compute_service.adapter_cache.layout import PoolLayout
from compute_service.engine.errors import InvalidAdapterError
from compute_service.engine.spec import ModelSpec
from kernels import LoraRowTables, rows_per_page
from loraplex.formats.adapter import Adapter

CUDA_HOST_REGISTER_READ_ONLY = 8   # the device only reads: no copy-on-write of a private shm mapping


@dataclass
class Uploaded:
    """An adapter's converted weights where `pack` reads them (device on CUDA, host on CPU)."""

    adapter: Adapter                       # structurally checked: `in_out` filled
    weights: torch.Tensor                  # [N, W] on the pool's device
    num_pages: int
    num_bytes: int                         # bytes moved host -> device
    finite_host: torch.Tensor | None       # pinned bool, valid once `event` is done (CUDA)
    event: "torch.cuda.Event | None"       # upload finished
    start_event: "torch.cuda.Event | None" = None
    host_ms: float = 0.0                   # wall time the worker spent uploading
    mode: str = ""                         # "ring", "register" or "pageable": how the bytes travelled

    def upload_ms(self) -> float:
        if self.event is None or self.start_event is None:
            return 0.0
        return self.start_event.elapsed_time(self.event)


def _register(t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    try:
        cudart = torch.cuda.cudart()
        for flags in (CUDA_HOST_REGISTER_READ_ONLY, 0):
            if int(cudart.cudaHostRegister(t.data_ptr(), nbytes, flags)) == 0:
                return True
            clear = getattr(cudart, "cudaGetLastError", None)   # forget the failed call's error
            if clear is not None:
                clear()
    except Exception:  # noqa: BLE001 - no cudart binding: fall back to pageable copies
        pass
    return False


class PinnedRing:
    """`num_buffers` pinned host buffers of `buffer_bytes`, reused by every upload (one upload at a time)."""

    def __init__(self, buffer_bytes: int = 32 << 20, num_buffers: int = 2) -> None:
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)]
        self.events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._lock = threading.Lock()
        self.host_views = [b.numpy() for b in self.buffers]

    def copy(self, src: torch.Tensor, dst: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        """src (host) -> dst (device), both contiguous and of equal bytes, queued on `stream`."""
        with self._lock:
            self._copy(src, dst, stream)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        s, d = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
        s_np = s.numpy()
        size = self.buffers[0].numel()
        for i, off in enumerate(range(0, s.numel(), size)):
            j = i % len(self.buffers)
            n = min(size, s.numel() - off)
            ev = self.events[j]
            if ev is not None:
                ev.synchronize()                     # its previous DMA is done: the buffer may be refilled
            # numpy's copy is one thread and drops the GIL: torch's would fan out over every core.
            np.copyto(self.host_views[j][:n], s_np[off: off + n])
            with torch.cuda.stream(stream):
                d[off: off + n].copy_(self.buffers[j][:n], non_blocking=True)
                ev = torch.cuda.Event(blocking=True)   # waits sleep instead of spinning a core
                ev.record(stream)
            self.events[j] = ev


def upload(adapter: Adapter, num_pages: int, device: torch.device, stream: "torch.cuda.Stream | None",
           ring: PinnedRing | None = None, mode: str = "ring") -> Uploaded:
    """Puts a structurally checked adapter's weights where `pack` reads them.

    mode: "ring" (through `ring`), "register" (cudaHostRegister the host memory) or "pageable".
    """
    t0 = time.perf_counter()
    w = adapter.weights.contiguous()
    nbytes = w.numel() * w.element_size()
    if device.type != "cuda" or stream is None:
        if not bool(torch.isfinite(w).all()):
            raise InvalidAdapterError("adapter weights contain NaN or Inf")
        return Uploaded(adapter, w, num_pages, nbytes, None, None)
    registered = mode == "register" and _register(w)
    try:
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dev = torch.empty(w.shape, dtype=w.dtype, device=device)
        if mode == "ring" and ring is not None:
            ring.copy(w, dev, stream)
        else:
            with torch.cuda.stream(stream):
                dev.copy_(w, non_blocking=True)
        with torch.cuda.stream(stream):
            finite_host = torch.empty((), dtype=torch.bool, pin_memory=True)
            finite_host.copy_(torch.isfinite(dev).all(), non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        if registered:
            done.synchronize()       # the DMA reads the host memory: keep it registered until then
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(w.data_ptr())
    used = "ring" if mode == "ring" and ring is not None else ("register" if registered else "pageable")
    return Uploaded(adapter, dev, num_pages, nbytes, finite_host, done, start,
                    (time.perf_counter() - t0) * 1e3, used)


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


def _row_blocks(up: Uploaded, spec: ModelSpec, tables: LoraRowTables):
    """Yields (width, rows [n*r, width], kind "a"|"b", module index, layers, rank, (in, out)) per group."""
    cfg = np.asarray(up.adapter.config)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (module_id, _layer, rank) in enumerate(cfg.tolist()):
        groups.setdefault((module_id, rank), []).append(i)
    for (module_id, r), idx in groups.items():
        fin, fout = up.adapter.in_out[idx[0]]
        n = len(idx)
        block = up.weights[torch.tensor(idx, device=up.weights.device), : r * (fin + fout)]   # [n, r*(in+out)]
        a = block[:, : r * fin].reshape(n * r, fin)
        b = block[:, r * fin:].reshape(n, fout, r)
        layers = cfg[idx, 1]
        if module_id == 0:      # fused qkv: q, k and v each get the shared A and their slice of B
            parts = zip((1, 2, 3), b.split([spec.q_size, spec.kv_size, spec.kv_size], dim=1))
        else:
            parts = zip((module_id,), (b,))
        for m, bm in parts:
            mi = tables.module_index(m)
            yield fin, a, "a", mi, layers, r, (fin, bm.shape[1])
            yield bm.shape[1], bm.transpose(1, 2).reshape(n * r, bm.shape[1]), "b", mi, layers, r, (fin, bm.shape[1])


def pack(up: Uploaded, spec: ModelSpec, pool: torch.Tensor, tables: LoraRowTables, page_ids: list[int], slot: int,
         layout: PoolLayout, stream: "torch.cuda.Stream | None") -> CopyHandle:
    """Writes the adapter's rows into the granted pages and fills `slot`'s tables (queued on `stream`)."""
    if len(page_ids) != up.num_pages:
        raise ValueError(f"adapter needs {up.num_pages} pages, granted {len(page_ids)}")
    if stream is None:
        _pack(up, spec, pool, tables, page_ids, slot, layout)
        return CopyHandle(None)
    # The pages may have belonged to an adapter evicted a moment ago: let kernels already queued on
    # the batch's stream finish reading them before they are overwritten.
    stream.wait_stream(torch.cuda.default_stream(pool.device))
    if up.event is not None:
        stream.wait_event(up.event)
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        _pack(up, spec, pool, tables, page_ids, slot, layout)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    return CopyHandle(done, (up,), start)


def _pack(up: Uploaded, spec: ModelSpec, pool: torch.Tensor, tables: LoraRowTables, page_ids: list[int],
          slot: int, layout: PoolLayout) -> None:
    L, M, R, pe = tables.num_layers, tables.num_modules, tables.max_rank, layout.page_elems
    offs = {"a": np.zeros((L, M, R), dtype=np.int64), "b": np.zeros((L, M, R), dtype=np.int64)}
    ranks = np.zeros((L, M), dtype=np.int32)
    shapes = np.zeros((L, M, 3), dtype=np.int64)
    by_width: dict[int, list] = {}
    for width, rows, kind, mi, layers, r, fio in _row_blocks(up, spec, tables):
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
        body = torch.zeros(n_pages * per_page, width, dtype=pool.dtype, device=pool.device)
        torch.cat([p[0] for p in parts], out=body[:n_rows]) if len(parts) > 1 else body[:n_rows].copy_(parts[0][0])
        pages_2d[torch.from_numpy(mine).to(pool.device), : per_page * width] = body.view(n_pages, per_page * width)
    if next_page != len(page_ids):
        raise ValueError(f"adapter filled {next_page} pages, granted {len(page_ids)}")
    tables.a_offsets[slot].copy_(torch.from_numpy(offs["a"]))
    tables.b_offsets[slot].copy_(torch.from_numpy(offs["b"]))
    tables.ranks[slot].copy_(torch.from_numpy(ranks))
    tables.shapes_cpu[slot] = torch.from_numpy(shapes)
