"""A simple in-memory `AdapterSlots`: each slot holds dense per-module A/B tensors on the model's device.

Loads are synchronous, so a loaded adapter is ready at once. LRU among
unpinned adapters when all slots are taken. The compute service replaces this
with a paged GPU pool; the torch backend below reads these tensors.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from compute_service.engine.adapter_check import check_adapter
from compute_service.engine.errors import CapacityError
from compute_service.engine.spec import ModelSpec
from loraplex.formats.adapter import Adapter


@dataclass(frozen=True)
class LoraPair:
    a: torch.Tensor   # [rank, in]
    b: torch.Tensor   # [out, rank], scale folded in


# (layer, module_id) -> pairs whose deltas add up (a fused qkv row gives one pair to each of 1, 2, 3)
SlotWeights = dict[tuple[int, int], list[LoraPair]]


def slot_weights(adapter: Adapter, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> SlotWeights:
    out: SlotWeights = {}
    split = [spec.q_size, spec.kv_size, spec.kv_size]
    for row in adapter.rows():
        a = row.a.to(device=device, dtype=dtype).contiguous()
        b = row.b.to(device=device, dtype=dtype)
        if row.module_id == 0:      # fused qkv: one A, B split by output rows into q, k, v
            for module_id, b_part in zip((1, 2, 3), b.split(split, dim=0)):
                out.setdefault((row.layer_idx, module_id), []).append(LoraPair(a, b_part.contiguous()))
        else:
            out.setdefault((row.layer_idx, row.module_id), []).append(LoraPair(a, b.contiguous()))
    return out


class SlotBook:
    """Residency book-keeping shared by the engine's slot managers: key -> slot in LRU order, pin counts.

    Loads are synchronous in the engine, so a resident adapter is ready at once.
    """

    def __init__(self) -> None:
        self._slot_of: OrderedDict[str, int] = OrderedDict()   # LRU order: oldest use first
        self._pins: Counter[str] = Counter()

    def resident(self, key: str) -> bool:
        return key in self._slot_of

    def is_ready(self, key: str) -> bool:
        return key in self._slot_of

    def slot_of(self, key: str) -> int:
        slot = self._slot_of[key]
        self._slot_of.move_to_end(key)
        return slot

    def pin(self, key: str) -> None:
        if key not in self._slot_of:
            raise KeyError(f"adapter {key!r} is not resident")
        self._pins[key] += 1

    def unpin(self, key: str) -> None:
        if self._pins[key] <= 0:
            raise RuntimeError(f"adapter {key!r} is not pinned")
        self._pins[key] -= 1

    def pin_count(self, key: str) -> int:
        return self._pins[key]


class InMemoryAdapterSlots(SlotBook):
    """`AdapterSlots` over plain tensors, `max_slots` adapters resident at once."""

    def __init__(self, spec: ModelSpec, max_slots: int, max_lora_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        super().__init__()
        self.spec = spec
        self.max_slots = max_slots
        self.max_lora_rank = max_lora_rank
        self.device = device
        self.dtype = dtype
        self._weights: list[SlotWeights | None] = [None] * max_slots

    def load(self, key: str, adapter: Adapter) -> int:
        checked = check_adapter(adapter, self.spec, self.max_lora_rank)
        if key in self._slot_of:
            slot = self._slot_of[key]
        else:
            slot = self._free_slot()
            self._slot_of[key] = slot
        self._weights[slot] = slot_weights(checked, self.spec, self.device, self.dtype)
        self._slot_of.move_to_end(key)
        return slot

    def _free_slot(self) -> int:
        used = set(self._slot_of.values())
        for s in range(self.max_slots):
            if s not in used:
                return s
        for key in self._slot_of:             # least recently used first
            if self._pins[key] == 0:
                slot = self._slot_of.pop(key)
                self._weights[slot] = None
                return slot
        raise CapacityError(f"all {self.max_slots} adapter slots are pinned by running requests; "
                            "retry when one finishes or raise max_loras")


    def evict(self, key: str) -> bool:
        if key not in self._slot_of or self._pins[key] > 0:
            return False
        self._weights[self._slot_of.pop(key)] = None
        return True

    def keys(self) -> list[str]:
        return list(self._slot_of)

    def weights(self, slot: int) -> SlotWeights:
        w = self._weights[slot]
        if w is None:
            raise KeyError(f"adapter slot {slot} is empty")
        return w
