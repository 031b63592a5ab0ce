"""`AdapterSlots` over a paged pool: the level-2 adapter cache the engine schedules against.

Holds the pool tensor and row tables (kernels.paged layout), the residency book
(pages, slots, pins, wants, LRU) and the loads in flight. Not thread-safe: the
runner calls every method between engine steps, on one thread.

It is the one adapter pool of loraplex: the engine's default (sized by
`allocate_for(max_loras)`), the compute service's and the benchmarks' alike.

Two ways in:
- `load(key, adapter)` / `load_rows(key, rows)`: synchronous (the engine's
  `add_adapter`, benchmarks, tests); loading a resident key replaces it;
- `want(key, staged)` with an adapter staged by the runner (`compute_service.runner`),
  then `pump()` each loop turn: grants pages FIFO, queues copies on the side
  stream, and marks copies that finished as resident.
"""
from __future__ import annotations

import itertools
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from compute_service.adapter_cache.checks import check_structure
from compute_service.adapter_cache.errors import AdapterLoadError, AdapterTooLargeError
from compute_service.adapter_cache.layout import PoolLayout, Row, full_adapter_pages, module_features, rows_adapter
from compute_service.adapter_cache.residency import AdapterResidency, Entry, State
from compute_service.adapter_cache.staging import CopyHandle, PinnedRing, Uploaded, pack, upload
from compute_service.engine.errors import CapacityError, InvalidAdapterError
from compute_service.engine.lora_backend import groups_of_modules
from compute_service.engine.mlp_order import orders_table
from compute_service.engine.spec import ModelSpec
from kernels import DEFAULT_MODULE_IDS, LoraRowTables, pages_needed
from loraplex.formats.adapter import Adapter


@dataclass
class LoadTiming:
    """Per-load figures, for stats and the swap benchmark."""

    num_bytes: int
    staged_at: float                # host clock (perf_counter seconds): uploaded, waiting for pages
    copy_started_at: float = 0.0    # pages granted, pack queued
    done_at: float = 0.0            # when a step boundary saw the pack finished
    upload_ms: float = 0.0          # device time of the host-to-device copy (CUDA)
    upload_host_ms: float = 0.0     # worker wall time of the upload
    copy_ms: float = 0.0            # device time of the pack into pages (CUDA)
    mode: str = ""                  # how the bytes travelled: "ring", "register" or "pageable"


@dataclass
class _InFlight:
    job: "Future[CopyHandle]"
    up: Uploaded
    timing: LoadTiming | None = None
    load_id: int = 0

    def done(self) -> bool:
        return self.job.done() and (self.job.exception() is not None or self.job.result().done())


@dataclass
class PoolStats:
    pages_used: int
    pages_total: int
    bytes_used: int
    bytes_total: int
    num_resident: int
    num_loading: int
    num_queued: int
    num_evictions: int
    num_holds: int = 0         # a want per request in the engine naming an adapter, plus a pin per running one
    resident_keys: list[str] = field(default_factory=list)


class PagedAdapterSlots:
    """The paged adapter cache; `allocate()` must run before use (after the KV cache took its share)."""

    def __init__(self, spec: ModelSpec, max_lora_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.layout: PoolLayout | None = None
        self.pool: torch.Tensor | None = None
        self.tables: LoraRowTables | None = None
        self.residency: AdapterResidency | None = None
        self._staged: dict[str, Uploaded] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self.failed: dict[str, BaseException] = {}  # loads that failed; the runner fails their requests
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Packs run here, so their Python (a few ms per adapter) never sits between two steps.
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="adapter-pack")
        self.upload_mode = "ring"      # see staging.upload
        self.ring: PinnedRing | None = None
        self.timings: dict[str, LoadTiming] = {}   # last load of each key
        # Base-model fingerprint adapters must carry (set by the service; None skips the check).
        self.fingerprint: str | None = None
        # Called as (slot, load_id) in the packing thread once a load's rows are in the pool (host pools only),
        # so a reader may build what it caches per adapter off the step; `generation[slot]` becomes that
        # load_id when the load is seen done, and never for a load that failed.
        self.on_packed: Callable[[int, int], None] | None = None
        self.on_evicted: Callable[[int], None] | None = None   # (slot): its adapter left the pool
        self._load_ids = itertools.count(1)
        # [L, I] int64: each layer's intermediate order, in which gate's and up's B rows and down's A columns
        # are packed (`follow_orders`); None: the model's order.
        self.mlp_orders: torch.Tensor | None = None

    def follow_orders(self, layers: Sequence[Any]) -> None:
        """Packs adapters in the intermediate order of the model's `layers` (`LayerWeights.mlp_order`,
        `compute_service.engine.mlp_order`): the engine calls it before any adapter loads, and so does a
        benchmark that replaces the layers; refused while adapters are in the pool and the order changes."""
        table = orders_table([lw.mlp_order for lw in layers], self.device)
        same = (table is None) == (self.mlp_orders is None) and (table is None or torch.equal(table, self.mlp_orders))
        if not same and (self._in_flight or (self.residency is not None and self.residency.entries())):
            raise RuntimeError("the model's MLP order changed while adapters are in the pool")
        self.mlp_orders = table

    def allocate(self, num_bytes: int, optimal_adapter_size: int = 8, max_slots: int = 0) -> PoolLayout:
        """Preallocates the pool (`num_bytes`) and the row tables."""
        layout = PoolLayout.for_budget(self.spec, num_bytes, self.dtype, self.max_lora_rank,
                                       optimal_adapter_size, max_slots)
        self.layout = layout
        # Filled with NaN so a read through a stale or wrong offset shows up in outputs, never passes silently.
        self.pool = torch.full((layout.num_pages * layout.page_elems,), float("nan"), dtype=self.dtype,
                               device=self.device)
        self.tables = LoraRowTables(layout.max_slots, self.spec.num_layers, layout.max_rank, self.device,
                                    DEFAULT_MODULE_IDS)
        # Every row offset is a page start plus a multiple of one module width: fix their gcd now, so the
        # alignment kernels specialise on (baked into captured CUDA graphs) never drops after a load.
        self.tables.row_align = math.gcd(layout.page_elems, *(w for io in module_features(self.spec).values()
                                                               for w in io))
        if self.device.type == "cuda":
            self.ring = PinnedRing()   # pinned once, at start, never while the batch decodes
        self.residency = AdapterResidency(layout.num_pages, layout.max_slots, layout.page_bytes,
                                          on_evict=self._on_evict)
        # Id of the load whose contents a slot holds, so readers caching per-slot views know when to rebuild.
        self.generation = [0] * layout.max_slots
        # Groups (compute_service.engine.lora_backend) the adapter in each slot changes: what a step launches.
        self.slot_groups: list[frozenset[str]] = [frozenset()] * layout.max_slots
        return layout

    def allocate_for(self, max_adapters: int, optimal_adapter_size: int = 8) -> PoolLayout:
        """A pool holding `max_adapters` adapters of `max_lora_rank` on every module at once (the engine's sizing)."""
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        widest = max(max(f) for f in module_features(self.spec).values())
        page_bytes = optimal_adapter_size * widest * torch.empty((), dtype=self.dtype).element_size()
        per_adapter = full_adapter_pages(self.spec, self.max_lora_rank, optimal_adapter_size * widest)
        return self.allocate(per_adapter * max_adapters * page_bytes, optimal_adapter_size, max_adapters)

    @property
    def max_slots(self) -> int:
        return self._res.max_slots

    @property
    def _res(self) -> AdapterResidency:
        if self.residency is None:
            raise RuntimeError("the adapter pool is not allocated yet")
        return self.residency

    # -- preparing an adapter (may run in a worker thread: touches no shared state) -------------
    def stage_adapter(self, key: str, adapter: Adapter) -> Uploaded:
        """Checks against the model, refuses what can never fit, uploads the rows (see staging.py)."""
        assert self.layout is not None
        checked = check_structure(adapter, self.spec, self.max_lora_rank, self.fingerprint)
        return upload(checked, self._pages_for(key, checked), self.device, self._stream, self.ring, self.upload_mode)

    def _pages_for(self, key: str, checked: Adapter) -> int:
        """Pages a structurally checked adapter takes; refuses one that can never fit."""
        assert self.layout is not None
        shapes = []
        for (module_id, _layer, rank), (fin, fout) in zip(checked.config.tolist(), checked.in_out):
            if module_id == 0:   # fused qkv: one A per q, k, v slice
                shapes += [(rank, fin, self.spec.q_size), (rank, fin, self.spec.kv_size), (rank, fin, self.spec.kv_size)]
            else:
                shapes.append((rank, fin, fout))
        n = pages_needed(shapes, self.layout.page_elems)
        if n > self.layout.num_pages:
            raise AdapterTooLargeError(key, n, self.layout.num_pages, self.layout.page_bytes)
        return n

    # -- the AdapterSlots protocol ---------------------------------------------------------------
    def load(self, key: str, adapter: Adapter) -> int:
        """Synchronous load: stages, evicts idle LRU adapters if needed, copies; returns the slot.

        A resident `key` is replaced (CapacityError while requests use it).
        """
        self._make_replaceable(key)
        return self._load_now(key, self.stage_adapter(key, adapter))

    def load_staged(self, key: str, staged: Uploaded) -> int:
        """`load` of an adapter staged earlier by `stage_adapter` (on another thread)."""
        self._make_replaceable(key)
        return self._load_now(key, staged)

    def load_rows(self, key: str, rows: list[Row]) -> int:
        """Synchronous load of (module_id, layer, rank, A [r, in], B [out, r]) rows, on the pool's device
        or the host (benchmarks build adapters on the GPU); checked like `load`."""
        self._make_replaceable(key)
        adapter = rows_adapter(rows, self.dtype, self.device)
        checked = check_structure(adapter, self.spec, self.max_lora_rank)
        # No stream: the rows are grouped where they already are (no copy).
        return self._load_now(key, upload(checked, self._pages_for(key, checked), self.device, None))

    def _make_replaceable(self, key: str) -> None:
        e = self._res.get(key)
        if e is None:
            return
        if not e.idle:
            raise CapacityError(f"adapter {key} is pinned by requests or still loading and cannot be replaced now")
        self._res.drop(key)

    def _load_now(self, key: str, staged: Uploaded) -> int:
        self.add_staged(key, staged)
        self._res.prefetch(key, staged.num_pages)
        self.pump()
        self.wait_loads()
        if not self.is_ready(key):
            failed = self.failed.pop(key, None)
            self._res.drop(key)
            self._staged.pop(key, None)
            if failed is not None:
                raise failed.cause if isinstance(failed, AdapterLoadError) else failed
            raise CapacityError(f"adapter {key} does not fit now: the pool's slots and pages are pinned by adapters "
                                f"in use ({self.stats().pages_used}/{self.stats().pages_total} pages, "
                                f"{self.max_slots} slots): retry when a request finishes or grow the pool")
        return self._res.slot_of(key)

    def resident(self, key: str) -> bool:
        e = self._res.get(key)
        return e is not None and e.state is not State.QUEUED

    def is_ready(self, key: str) -> bool:
        return self._res.is_ready(key)

    def slot_of(self, key: str) -> int:
        """Slot of a resident key; counts as a use for LRU."""
        return self._res.touch(key)

    def pin(self, key: str) -> None:
        self._res.pin(key)

    def unpin(self, key: str) -> None:
        self._res.unpin(key)

    def pin_count(self, key: str) -> int:
        e = self._res.get(key)
        return e.pins if e is not None else 0

    def keys(self) -> list[str]:
        """Resident keys."""
        return self._res.resident_keys()

    def evict(self, key: str) -> bool:
        e = self._res.get(key)
        if e is None or not e.idle:
            return False
        return self._res.drop(key)

    # -- the asynchronous path -----------------------------------------------------------------------
    def add_staged(self, key: str, staged: Uploaded) -> None:
        if key not in self._staged:
            self._staged[key] = staged
            self.timings[key] = LoadTiming(staged.num_bytes, time.perf_counter(), upload_host_ms=staged.host_ms,
                                           mode=staged.mode)

    def has_staged(self, key: str) -> bool:
        return key in self._staged

    def offer(self, key: str, staged: Uploaded | None) -> bool:
        """Takes `staged` unless the pool already knows `key`; True when `key` is known or staged,
        False when it still has to be fetched."""
        if staged is not None and not self.knows(key):
            self.add_staged(key, staged)
        return self.knows(key) or self.has_staged(key)

    def want(self, key: str, num_pages: int | None = None) -> Entry:
        """A request naming `key` enters the engine; the adapter must be known (resident, queued or staged)."""
        if num_pages is None:
            e = self._res.get(key)
            num_pages = e.num_pages if e is not None else self._staged[key].num_pages
        return self._res.want(key, num_pages)

    def prefetch(self, key: str) -> None:
        """Queues a staged (or known) adapter with no request behind it."""
        e = self._res.get(key)
        self._res.prefetch(key, e.num_pages if e is not None else self._staged[key].num_pages)

    def unwant(self, key: str) -> None:
        if self._res.get(key) is not None:   # absent after a failed load, which forgot it
            self._res.unwant(key)

    def knows(self, key: str) -> bool:
        """True when `key` needs no fetch: it is resident, loading or queued with its pages staged."""
        return self._res.get(key) is not None

    def pump(self) -> list[str]:
        """Grants pages to queued loads, queues their copies, and returns keys whose copies finished."""
        res = self._res
        assert self.pool is not None and self.tables is not None and self.layout is not None
        for e in res.start_loads():
            staged = self._staged.pop(e.key)
            t = self.timings.get(e.key)
            now = time.perf_counter()
            if t is not None:
                t.copy_started_at = now
            load_id = next(self._load_ids)
            job = self._packer.submit(self._pack, staged, list(e.pages), e.slot, load_id)
            self._in_flight[e.key] = _InFlight(job, staged, t, load_id)
        done = []
        for k, f in list(self._in_flight.items()):
            if not f.done():
                continue
            del self._in_flight[k]
            exc = f.job.exception()
            if exc is None and f.up.finite_host is not None and not bool(f.up.finite_host):
                exc = InvalidAdapterError(f"adapter {k}: weights contain NaN or Inf")
            if exc is not None:     # reported to the requests waiting for it
                res.fail_load(k)
                self.failed[k] = AdapterLoadError(k, exc)
                continue
            if f.timing is not None:
                f.timing.done_at = time.perf_counter()
                f.timing.copy_ms = f.job.result().copy_ms()
                f.timing.upload_ms = f.up.upload_ms()
            res.finish_load(k)
            slot = res.slot_of(k)
            self.generation[slot] = f.load_id
            cfg = f.up.adapter.config
            self.slot_groups[slot] = groups_of_modules(int(m) for m in cfg[cfg[:, 2] > 0, 0])
            done.append(k)
        # Staged copies nobody waits for any more (their requests left while queued).
        for k in [k for k in self._staged if res.get(k) is None]:
            del self._staged[k]
        return done

    def _pack(self, staged: Uploaded, pages: list[int], slot: int, load_id: int) -> CopyHandle:
        """The packing thread's job: rows into pages, then `on_packed` where the copy is already done (host)."""
        assert self.pool is not None and self.tables is not None and self.layout is not None
        handle = pack(staged, self.spec, self.pool, self.tables, pages, slot, self.layout, self._stream,
                      self.mlp_orders)
        if self.on_packed is not None and handle.event is None:
            self.on_packed(slot, load_id)
        return handle

    def wait_loads(self) -> None:
        """Blocks until every queued copy finished (synchronous load, tests, shutdown)."""
        for f in list(self._in_flight.values()):
            f.job.exception()          # waits for the pack job
        if self._stream is not None:
            self._stream.synchronize()
        self.pump()

    def drop_staged(self, key: str) -> None:
        if self._res.get(key) is None:
            self._staged.pop(key, None)

    @property
    def loading(self) -> bool:
        return bool(self._in_flight) or self._res.has_queued

    def groups_of(self, token_slot_ids: list[int]) -> frozenset[str]:
        """The groups that the adapters in these slots change (NO_ADAPTER and empty slots change none)."""
        out: frozenset[str] = frozenset()
        for slot in set(token_slot_ids):
            if slot >= 0:
                out |= self.slot_groups[slot]
        return out

    def stats(self) -> PoolStats:
        res = self._res
        assert self.layout is not None
        ents = res.entries()
        return PoolStats(
            pages_used=res.pages.num_used, pages_total=res.pages.num_pages,
            bytes_used=res.pages.num_used * self.layout.page_bytes, bytes_total=self.layout.pool_bytes,
            num_resident=sum(e.state is State.RESIDENT for e in ents),
            num_loading=sum(e.state is State.LOADING for e in ents), num_queued=res.num_queued,
            num_evictions=res.num_evictions, num_holds=sum(e.wants + e.pins for e in ents),
            resident_keys=res.resident_keys())

    def _on_evict(self, e: Entry) -> None:
        assert self.tables is not None
        # Clear the slot's ranks so a stale slot id can never read the pages' next owner.
        self.tables.ranks[e.slot].zero_()
        self.slot_groups[e.slot] = frozenset()
        if self.on_evicted is not None:
            self.on_evicted(e.slot)
