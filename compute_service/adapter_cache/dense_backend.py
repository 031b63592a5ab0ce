"""The CPU `LoraBackend` over the one adapter pool: gathered batched matmuls per adapter.

Once per step the tokens are grouped by adapter slot; then each layer's group
costs, per adapter present, one matmul through the A rows of all its slices
and one through the block-diagonal B^T (`dense_views`), added into the fused
output in place. Weights are read from per-adapter contiguous copies made once
per load, never gathered per step; a run of consecutive tokens (a sequence's
prefill chunk, or neighbours sharing an adapter) is a view of the activations,
not a copy. Works on any device; it is not graph-safe (shapes follow the batch).
"""
from __future__ import annotations

import torch

from compute_service.adapter_cache.dense_views import SlotViews, slot_views
from compute_service.adapter_cache.layout import module_features
from compute_service.adapter_cache.paged_backend import as_one_output
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.lora_backend import ALL_GROUPS, GROUP_MODULE_IDS, NO_ADAPTER

Rows = slice | torch.Tensor      # the tokens of one adapter: a run, or their indices [n]


def group_tokens(token_slot_ids: list[int], device: torch.device) -> list[tuple[int, Rows]]:
    """[(slot, rows)] per adapter slot present, rows a slice when its tokens are consecutive."""
    by_slot: dict[int, list[int]] = {}
    for t, slot in enumerate(token_slot_ids):
        if slot != NO_ADAPTER:
            by_slot.setdefault(slot, []).append(t)
    out: list[tuple[int, Rows]] = []
    for slot, toks in by_slot.items():
        if toks[-1] - toks[0] + 1 == len(toks):
            out.append((slot, slice(toks[0], toks[-1] + 1)))
        else:
            out.append((slot, torch.tensor(toks, dtype=torch.int64, device=device)))
    return out


class DenseLoraBackend:
    """Reads per-adapter views built from `slots.pool`: in the pool's packing thread as each load lands
    (host pools), else on the first step that uses the slot; rebuilt when the slot's generation changes."""

    graph_safe = False

    def __init__(self, slots: PagedAdapterSlots, max_num_batched_tokens: int = 0) -> None:
        self.slots = slots
        self._views: dict[int, tuple[int, SlotViews]] = {}      # slot -> (generation, views)
        self._segments: list[tuple[SlotViews, Rows]] = []
        self._group_modules: dict[str, list[int]] = {}
        self._features: dict[int, tuple[int, int]] = {}
        self.active_groups = ALL_GROUPS

    def allocate(self) -> None:
        """Reads the pool's module table (the pool must be allocated); nothing to preallocate."""
        tables = self.slots.tables
        if tables is None:
            raise RuntimeError("the adapter pool is not allocated yet: call slots.allocate() first")
        self._group_modules = {g: [tables.module_index(m) for m in ids] for g, ids in GROUP_MODULE_IDS.items()}
        self._features = {tables.module_index(m): io for m, io in module_features(self.slots.spec).items()}
        self.slots.on_packed = self._build
        self.slots.on_evicted = self._forget

    def prepare(self, token_slot_ids_cpu: torch.Tensor, groups: frozenset[str] = ALL_GROUPS) -> None:
        if not self._group_modules:
            self.allocate()
        device = self.slots.device
        self._segments = [(self._views_of(slot), rows)
                          for slot, rows in group_tokens(token_slot_ids_cpu.tolist(), device)]
        self.active_groups = groups

    def groups_of(self, token_slot_ids: list[int]) -> frozenset[str]:
        return self.slots.groups_of(token_slot_ids)

    def _views_of(self, slot: int) -> SlotViews:
        cached = self._views.get(slot)
        if cached is None or cached[0] != self.slots.generation[slot]:
            return self._build(slot, self.slots.generation[slot])
        return cached[1]

    def _build(self, slot: int, load_id: int) -> SlotViews:
        """Gathers `slot`'s views (any thread: a dict store is atomic, and a step holds the views it uses)."""
        assert self.slots.pool is not None and self.slots.tables is not None
        views = slot_views(self.slots.pool, self.slots.tables, slot, self._group_modules, self._features)
        self._views[slot] = (load_id, views)
        return views

    @property
    def cached_slots(self) -> list[int]:
        """Slots whose adapter copies are held (resident adapters only, once evictions are seen)."""
        return sorted(self._views)

    def _forget(self, slot: int) -> None:
        """Drops an evicted adapter's copies (it is idle: no step holds them)."""
        self._views.pop(slot, None)

    def apply(self, layer: int, group: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        if not self._segments or group not in self.active_groups:
            return
        y, offsets = as_one_output(outs)
        for views, rows in self._segments:
            w = views[layer].get(group)
            if w is None:
                continue
            run = isinstance(rows, slice)
            xs = x[rows] if run else x.index_select(0, rows)
            if y is not None and run:
                y[rows].addmm_(xs @ w.a_t, w.b_t)
                continue
            delta = (xs @ w.a_t) @ w.b_t                                  # [n, out_total]
            if y is not None:
                y.index_add_(0, rows, delta)
                continue
            for out, c0, c1 in zip(outs, offsets, offsets[1:]):
                if run:
                    out[rows] += delta[:, c0:c1]
                else:
                    out.index_add_(0, rows, delta[:, c0:c1])
