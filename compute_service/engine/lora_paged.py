"""`AdapterSlots` over the kernels' paged pool, and the `LoraBackend` that runs `kernels.lora_shrink/expand`.

A simple page owner for the engine's own use (the compute service's GPU
adapter cache does the same job with async loads): one preallocated pool,
a free list of pages, LRU among unpinned adapters, synchronous loads. Kernels
read rows in place through `LoraRowTables`, so there is no per-step gather.
On CUDA tensors the kernels run in Triton; on CPU tensors in their torch reference.
"""
from __future__ import annotations

from collections import Counter

import torch

import kernels
from compute_service.engine.adapter_check import check_adapter
from compute_service.engine.errors import CapacityError, InvalidAdapterError
from compute_service.engine.lora_backend import GROUP_MODULE_IDS
from compute_service.engine.lora_slots import SlotBook
from compute_service.engine.spec import ModelSpec
from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import module_shape

_MODULE_IDS = (1, 2, 3, 4, 5, 6, 7)


def _shape(spec: ModelSpec, module_id: int) -> tuple[int, int]:
    s = module_shape(module_id, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                     num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                     intermediate_size=spec.intermediate_size)
    return s.in_features, s.out_features


def split_rows(adapter: Adapter, spec: ModelSpec) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    """(module_id, layer, rank, A, B) per row, a fused qkv row (id 0) split into q, k, v rows."""
    rows = []
    for row in adapter.rows():
        if row.module_id == 0:
            for mid, b in zip((1, 2, 3), row.b.split([spec.q_size, spec.kv_size, spec.kv_size], dim=0)):
                rows.append((mid, row.layer_idx, row.rank, row.a, b))
        else:
            rows.append((row.module_id, row.layer_idx, row.rank, row.a, row.b))
    seen = Counter((m, layer) for m, layer, *_ in rows)
    dup = [k for k, n in seen.items() if n > 1]
    if dup:
        raise InvalidAdapterError(f"module {dup[0][0]} layer {dup[0][1]} appears both fused (qkv) and on its own")
    return rows


class PagedAdapterSlots(SlotBook):
    """`AdapterSlots` whose adapters live in `kernels.paged` pages of one pool."""

    def __init__(self, spec: ModelSpec, max_slots: int, max_lora_rank: int, device: torch.device,
                 dtype: torch.dtype, pool_bytes: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.max_slots = max_slots
        self.max_lora_rank = max_lora_rank
        widths = [w for m in _MODULE_IDS for w in _shape(spec, m)]
        self.page_elems = 16 * max(widths)          # 16 rows of the widest module per page
        full = [(max_lora_rank, *_shape(spec, m)) for m in _MODULE_IDS] * spec.num_layers
        elem = torch.empty((), dtype=dtype).element_size()
        num_pages = kernels.pages_needed(full, self.page_elems) * max_slots if pool_bytes is None \
            else pool_bytes // (self.page_elems * elem)
        if num_pages < 1:
            raise CapacityError(f"LoRA pool of {pool_bytes} bytes holds no page of {self.page_elems * elem} bytes")
        self.pool = torch.zeros(num_pages * self.page_elems, dtype=dtype, device=device)
        self.tables = kernels.LoraRowTables(max_slots, spec.num_layers, max_lora_rank, device, _MODULE_IDS)
        self._free_pages = list(range(num_pages))
        self._pages: dict[str, list[int]] = {}

    def load(self, key: str, adapter: Adapter) -> int:
        return self.load_rows(key, split_rows(check_adapter(adapter, self.spec, self.max_lora_rank), self.spec))

    def load_rows(self, key: str, rows: list[tuple[int, int, int, torch.Tensor, torch.Tensor]]) -> int:
        """Makes already validated (module_id, layer, rank, A [r, in], B [out, r]) rows resident under `key`.

        Rows may live on the GPU (tools and benchmarks build adapters there); `load` validates first.
        """
        need = kernels.pages_needed([(r, a.shape[1], b.shape[0]) for _, _, r, a, b in rows], self.page_elems)
        if key in self._slot_of:
            if self._pins[key]:
                raise CapacityError(f"adapter {key!r} is in use by running requests and cannot be replaced now")
            self.evict(key)
        slot = self._take_slot()
        while len(self._free_pages) < need and self._evict_lru():
            pass
        if len(self._free_pages) < need:
            raise CapacityError(f"adapter {key!r} needs {need} LoRA pages, {len(self._free_pages)} are free and "
                                "the rest are pinned: retry later or grow the LoRA pool")
        pages = [self._free_pages.pop() for _ in range(need)]
        kernels.write_adapter(self.pool, pages, rows, self.tables, slot, self.page_elems)
        self._pages[key] = pages
        self._slot_of[key] = slot
        return slot

    def _take_slot(self) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_slots) if s not in used]
        if free:
            return free[0]
        if not self._evict_lru():
            raise CapacityError(f"all {self.max_slots} adapter slots are pinned by running requests")
        return self._take_slot()

    def _evict_lru(self) -> bool:
        for key in self._slot_of:
            if self._pins[key] == 0:
                return self.evict(key)
        return False

    def evict(self, key: str) -> bool:
        if key not in self._slot_of or self._pins[key] > 0:
            return False
        kernels.clear_slot(self.tables, self._slot_of.pop(key))
        self._free_pages.extend(self._pages.pop(key))
        return True


class KernelLoraBackend:
    """`LoraBackend` over `PagedAdapterSlots`: one shrink and one expand per layer group.

    Graph-safe: `prepare` refills preallocated metadata, the kernels' launch
    shapes depend only on the token count, so decode graphs may capture it.
    """

    graph_safe = True

    def __init__(self, slots: PagedAdapterSlots, max_num_tokens: int) -> None:
        self.slots = slots
        self.meta = kernels.LoraBatchMeta(max_num_tokens, slots.max_slots, slots.pool.device)
        t = slots.tables
        self._modules = {g: [t.module_index(m) for m in ids] for g, ids in GROUP_MODULE_IDS.items()}

    def prepare(self, token_slot_ids_cpu: torch.Tensor) -> None:
        self.meta.prepare(token_slot_ids_cpu)

    def apply(self, layer: int, group: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        if self.meta.has_lora is False:
            return
        s = self.slots
        modules = self._modules[group]
        shrunk = torch.empty(len(modules), x.shape[0], s.tables.max_rank, dtype=torch.float32, device=x.device)
        kernels.lora_shrink(x.contiguous(), s.pool, s.tables, self.meta, layer, modules, shrunk)
        y, offsets = as_one_output(outs)
        if y is not None:
            kernels.lora_expand(shrunk, s.pool, s.tables, self.meta, layer, modules, y, offsets)
            return
        for i, out in enumerate(outs):       # slices that are not side by side: one expand each
            kernels.lora_expand(shrunk[i: i + 1].contiguous(), s.pool, s.tables, self.meta, layer, [modules[i]],
                                out, [0, out.shape[1]])


def as_one_output(outs: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[int]]:
    """If the slices are adjacent column ranges of one row-major tensor, that tensor and the boundaries."""
    widths = [o.shape[1] for o in outs]
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    first = outs[0]
    elem = first.element_size()
    adjacent = all(o.stride() == first.stride() and o.stride(1) == 1
                   and o.data_ptr() == first.data_ptr() + offsets[i] * elem for i, o in enumerate(outs))
    if not adjacent or (offsets[-1] > first.stride(0) and first.shape[0] > 1):
        return None, offsets      # not one matrix, or its rows would overlap
    return first.as_strided((first.shape[0], offsets[-1]), first.stride()), offsets
