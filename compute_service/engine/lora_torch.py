"""Torch reference `LoraBackend`: per run of tokens sharing a slot, `out += (x @ A.T) @ B.T`.

Tokens of one sequence are contiguous in the flat batch, so runs are long
(a whole prefill chunk) and each costs two small matmuls, not one per token.
"""
from __future__ import annotations

import torch

from compute_service.engine.lora_backend import GROUP_MODULE_IDS, NO_ADAPTER
from compute_service.engine.lora_slots import InMemoryAdapterSlots


def token_runs(token_slot_ids: list[int]) -> list[tuple[int, int, int]]:
    """[(start, end, slot)] for maximal runs of equal slot ids, runs without an adapter left out."""
    runs = []
    start = 0
    for i in range(1, len(token_slot_ids) + 1):
        if i == len(token_slot_ids) or token_slot_ids[i] != token_slot_ids[start]:
            if token_slot_ids[start] != NO_ADAPTER:
                runs.append((start, i, token_slot_ids[start]))
            start = i
    return runs


class TorchLoraBackend:
    """Reads dense A/B tensors from `InMemoryAdapterSlots`."""

    def __init__(self, slots: InMemoryAdapterSlots) -> None:
        self.slots = slots
        self._runs: list[tuple[int, int, int]] = []

    def prepare(self, token_slot_ids_cpu: torch.Tensor) -> None:
        self._runs = token_runs(token_slot_ids_cpu.tolist())

    def apply(self, layer: int, group: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        module_ids = GROUP_MODULE_IDS[group]
        for start, end, slot in self._runs:
            weights = self.slots.weights(slot)
            xs = x[start:end]
            for out, module_id in zip(outs, module_ids):
                for pair in weights.get((layer, module_id), ()):
                    out[start:end] += (xs @ pair.a.T) @ pair.b.T
