"""The two LoRA interfaces the model and the scheduler see.

`LoraBackend` adds LoRA deltas inside the model's linear layers. `AdapterSlots`
decides which adapters are resident and in which slot. loraplex has one
implementation of the slots, the paged pool of
`compute_service.adapter_cache.paged_slots` (the engine's default, the compute
service's and the benchmarks'), and one backend per device type over it
(`compute_service.adapter_cache.backends`). Layers only ever see slot ids per
token, never request ids or adapter keys.

Groups and the module ids whose deltas land in each output slice:
  "qkv"     -> [q, k, v]      ids 1, 2, 3 (a fused 0 row is split into the three)
  "o"       -> [o]            id 4
  "gate_up" -> [gate, up]     ids 5, 7
  "down"    -> [down]         id 6
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from loraplex.formats.adapter import Adapter

GROUP_MODULE_IDS: dict[str, tuple[int, ...]] = {
    "qkv": (1, 2, 3),
    "o": (4,),
    "gate_up": (5, 7),
    "down": (6,),
}
NO_ADAPTER = -1


@runtime_checkable
class LoraBackend(Protocol):
    """Applies per-token LoRA deltas; one `prepare` per step, then `apply` per layer and group."""

    def prepare(self, token_slot_ids_cpu: torch.Tensor) -> None:
        """[T] int32 slot per token of the step (NO_ADAPTER = -1); called outside CUDA graphs."""
        ...

    def apply(self, layer: int, group: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """x [T, in]; adds `x @ A.T @ B.T` of each token's slot to outs[i] [T, out_i] in place."""
        ...


@runtime_checkable
class AdapterSlots(Protocol):
    """Residency of adapters in a fixed number of slots; pinned ones are never evicted."""

    max_slots: int

    def load(self, key: str, adapter: Adapter) -> int:
        """Makes `adapter` resident under `key` (evicting an unpinned LRU one if full); returns its slot."""
        ...

    def resident(self, key: str) -> bool: ...

    def is_ready(self, key: str) -> bool:
        """True once `key` can be used by a step (loads may be asynchronous)."""
        ...

    def slot_of(self, key: str) -> int:
        """Slot index of a resident key (KeyError if not resident)."""
        ...

    def pin(self, key: str) -> None: ...

    def unpin(self, key: str) -> None: ...

    def evict(self, key: str) -> bool:
        """Drops `key` if resident and unpinned; returns whether it was dropped."""
        ...
