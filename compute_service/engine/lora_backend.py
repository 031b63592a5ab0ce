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

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import MODULE_IDS

GROUP_MODULE_IDS: dict[str, tuple[int, ...]] = {
    "qkv": (1, 2, 3),
    "o": (4,),
    "gate_up": (5, 7),
    "down": (6,),
}
NO_ADAPTER = -1
ALL_GROUPS: frozenset[str] = frozenset(GROUP_MODULE_IDS)


def groups_of_modules(module_ids: Iterable[int]) -> frozenset[str]:
    """The groups whose outputs an adapter with these module ids (rank > 0) changes."""
    ids = set(module_ids)
    if MODULE_IDS["attn_qkv"] in ids:          # fused q/k/v rows land in the q, k and v slices
        ids |= set(GROUP_MODULE_IDS["qkv"])
    return frozenset(g for g, mods in GROUP_MODULE_IDS.items() if ids.intersection(mods))


@runtime_checkable
class LoraBackend(Protocol):
    """Applies per-token LoRA deltas; one `prepare` per step, then `apply` per layer and group.

    `active_groups` (set by `prepare`) are the groups `apply` launches anything for; the others are
    skipped, so a batch whose adapters change only q/k/v costs no launches on o, gate/up and down. A
    CUDA graph captured with some active groups may be replayed only for steps whose `groups_of` is a
    subset of them (the graphs key on it); by default `prepare` activates every group."""

    active_groups: frozenset[str]
    # Optional `delta_first = True`: `apply` takes float32 outputs and always launches a GPU kernel for them,
    # so the model may run a one-token step's LoRA before the base projection (LlamaModel._project).

    def prepare(self, token_slot_ids_cpu: torch.Tensor, groups: frozenset[str] = ALL_GROUPS) -> None:
        """[T] int32 slot per token of the step (NO_ADAPTER = -1); called outside CUDA graphs."""
        ...

    def groups_of(self, token_slot_ids: list[int]) -> frozenset[str]:
        """The groups that the adapters in these slots change (empty for base-only slots)."""
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
