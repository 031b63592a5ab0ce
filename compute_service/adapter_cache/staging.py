"""Moving an adapter onto the device and into its pool pages, off the event loop and off the batch's stream.

1. `upload` (worker thread, before pages are granted): each row's used prefix
   (A then B, no padding) goes into one device buffer, on the side stream.
   The host memory is first registered with CUDA (cudaHostRegister; works for
   a mapped shared-memory segment as for any host tensor), so the copy is a
   DMA at full PCIe speed with no CPU copy at all; where registering fails,
   the driver stages the pageable memory itself (several times slower, still
   off the batch's stream). NaN/Inf are checked on the device.
2. `pack` (worker thread, once pages and a slot are granted):
   `kernels.paged.write_adapter` on the side stream moves A rows and B^T rows
   device-to-device into the pages and fills the slot's row tables; an event
   says when it is done.
On CPU the rows stay views of the host tensor and `pack` is a plain copy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from compute_service.adapter_cache.layout import PoolLayout, Row, rows_pages
from compute_service.engine.errors import InvalidAdapterError
from compute_service.engine.spec import ModelSpec
from kernels import LoraRowTables, write_adapter
from loraplex.formats.adapter import Adapter


@dataclass
class Uploaded:
    """An adapter's rows where `pack` reads them: device views (CUDA) or host views (CPU)."""

    rows: list[Row]
    num_pages: int
    num_bytes: int                         # bytes moved host -> device (rows without padding)
    finite_host: torch.Tensor | None       # pinned bool, valid once `event` is done (CUDA)
    event: "torch.cuda.Event | None"       # upload finished
    start_event: "torch.cuda.Event | None" = None
    host_ms: float = 0.0                   # wall time the worker spent uploading
    registered: bool = False               # DMA straight from registered host memory

    def upload_ms(self) -> float:
        if self.event is None or self.start_event is None:
            return 0.0
        return self.start_event.elapsed_time(self.event)


def _row_views(adapter: Adapter, spec: ModelSpec, src: torch.Tensor, offsets: list[int]) -> list[Row]:
    """(module, layer, rank, A, B) views into `src` at `offsets`; fused qkv split into q, k, v (shared A)."""
    rows: list[Row] = []
    split = [spec.q_size, spec.kv_size, spec.kv_size]
    for i, (module_id, layer, rank) in enumerate(adapter.config.tolist()):
        fin, fout = adapter.in_out[i]
        o = offsets[i]
        a = src[o: o + rank * fin].view(rank, fin)
        b = src[o + rank * fin: o + rank * (fin + fout)].view(fout, rank)
        if module_id == 0:
            rows.extend((m, layer, rank, a, bp) for m, bp in zip((1, 2, 3), b.split(split, dim=0)))
        else:
            rows.append((module_id, layer, rank, a, b))
    return rows


CUDA_HOST_REGISTER_READ_ONLY = 8   # the device only reads: no copy-on-write of a private shm mapping


def _register(t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    try:
        cudart = torch.cuda.cudart()
        for flags in (CUDA_HOST_REGISTER_READ_ONLY, 0):
            if int(cudart.cudaHostRegister(t.data_ptr(), nbytes, flags)) == 0:
                return True
            clear = getattr(cudart, "cudaGetLastError", None)   # clear the failed call's sticky-free error
            if clear is not None:
                clear()
    except Exception:  # noqa: BLE001 - no cudart binding: fall back to pageable copies
        pass
    return False


def upload(adapter: Adapter, spec: ModelSpec, layout: PoolLayout, device: torch.device,
           stream: "torch.cuda.Stream | None", register: bool = True) -> Uploaded:
    """Puts a structurally checked adapter (in_out known) where `pack` can read it."""
    t0 = time.perf_counter()
    used = [int(r) * (fi + fo) for r, (fi, fo) in zip(adapter.config[:, 2].tolist(), adapter.in_out)]
    offsets = [sum(used[:i]) for i in range(len(used))] if used else []
    w = adapter.weights
    if device.type != "cuda" or stream is None:
        rows = [(m, l, r, a, b) for m, l, r, a, b in _row_views(adapter, spec, w.reshape(-1), [
            i * w.shape[1] for i in range(w.shape[0])])]
        if not all(torch.isfinite(a).all() and torch.isfinite(b).all() for _, _, _, a, b in rows):
            raise InvalidAdapterError("adapter weights contain NaN or Inf")
        return Uploaded(rows, rows_pages(rows, layout.page_elems), sum(used) * w.element_size(), None, None)
    w = w.contiguous()
    registered = register and _register(w)
    try:
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            raw = torch.empty(sum(used), dtype=w.dtype, device=device)
            for i, n in enumerate(used):
                raw[offsets[i]: offsets[i] + n].copy_(w[i, :n], non_blocking=True)
            finite_host = torch.empty((), dtype=torch.bool, pin_memory=True)
            finite_host.copy_(torch.isfinite(raw).all(), non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        if registered:
            done.synchronize()       # the DMA reads the host memory: keep it registered until then
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(w.data_ptr())
    rows = _row_views(adapter, spec, raw, offsets)
    return Uploaded(rows, rows_pages(rows, layout.page_elems), sum(used) * w.element_size(), finite_host, done,
                    start, (time.perf_counter() - t0) * 1e3, registered)


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


def pack(up: Uploaded, pool: torch.Tensor, tables: LoraRowTables, page_ids: list[int], slot: int,
         layout: PoolLayout, stream: "torch.cuda.Stream | None") -> CopyHandle:
    """Writes the uploaded rows into the granted pages and fills `slot`'s tables (queued on `stream`)."""
    if len(page_ids) != up.num_pages:
        raise ValueError(f"adapter needs {up.num_pages} pages, granted {len(page_ids)}")
    if stream is None:
        write_adapter(pool, page_ids, up.rows, tables, slot, layout.page_elems)
        return CopyHandle(None)
    # The pages may have belonged to an adapter evicted a moment ago: let kernels already queued on
    # the batch's stream finish reading them before they are overwritten.
    stream.wait_stream(torch.cuda.default_stream(pool.device))
    if up.event is not None:
        stream.wait_event(up.event)
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        write_adapter(pool, page_ids, up.rows, tables, slot, layout.page_elems)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    return CopyHandle(done, (up,), start)
