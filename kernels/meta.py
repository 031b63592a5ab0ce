"""Per-step LoRA batch metadata: tokens grouped by adapter slot, built once per step.

The engine calls `prepare(slot_ids)` once per step, outside any CUDA graph; every
shrink/expand launch of that step reads the same device tensors. All tensors
are preallocated at maximum size and refilled with `copy_`, so graphs captured
against them stay valid, and nothing on the kernels' path syncs with the host.
"""
from __future__ import annotations

import torch


class LoraBatchMeta:
    """Tokens sorted by adapter slot, as segments.

    After `prepare(slot_ids [T])` (slot -1 = no adapter):
    - `token_indices` int32 `[max_tokens]`: token ids with an adapter, sorted by
      slot (stable); tokens without adapter are not in any segment.
    - `seg_starts` int32 `[max_slots + 1]`: segment i covers
      `token_indices[seg_starts[i]:seg_starts[i+1]]`; entries past the active
      segments repeat the end.
    - `seg_slots` int32 `[max_slots]`: slot of each segment (-1 past the active ones).
    - `num_segments` int32 `[1]`: number of active (non-empty) segments.
    - `num_tokens` host int: T of the last prepare; `has_lora` host bool or None
      (None when the slot ids lived on the GPU and were not inspected).
    """

    def __init__(self, max_tokens: int, max_slots: int, device: torch.device | str = "cpu") -> None:
        if max_tokens < 1 or max_slots < 1:
            raise ValueError(f"max_tokens and max_slots must be >= 1, got {max_tokens}, {max_slots}")
        self.max_tokens = max_tokens
        self.max_slots = max_slots
        self.token_indices = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.seg_starts = torch.zeros(max_slots + 1, dtype=torch.int32, device=device)
        self.seg_slots = torch.full((max_slots,), -1, dtype=torch.int32, device=device)
        self.num_segments = torch.zeros(1, dtype=torch.int32, device=device)
        self.num_tokens = 0
        self.has_lora: bool | None = False
        # Host mirror, filled only when prepare() got host slot ids (the CPU path uses it).
        self._segments_cpu: list[tuple[int, int, int]] | None = []

    @property
    def device(self) -> torch.device:
        return self.token_indices.device

    def prepare(self, slot_ids: torch.Tensor) -> None:
        """Refills every tensor from per-token slot ids `[T]` (-1 = no adapter)."""
        if slot_ids.dim() != 1:
            raise ValueError(f"slot_ids must be 1-D [T], got shape {tuple(slot_ids.shape)}")
        T = slot_ids.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens exceed max_tokens {self.max_tokens}")
        S = self.max_slots
        on_host = slot_ids.device.type == "cpu"
        if on_host and T and (int(slot_ids.max()) >= S or int(slot_ids.min()) < -1):
            raise ValueError(f"slot ids must lie in [-1, {S}), got [{int(slot_ids.min())}, {int(slot_ids.max())}]")
        # Build on the host when ids are on the host (cheaper than many tiny device ops), then one copy each.
        work = slot_ids.to(torch.int64)
        key = torch.where(work < 0, torch.full_like(work, S), work)          # no adapter sorts last
        order = torch.sort(key, stable=True).indices                          # [T]
        counts = torch.bincount(key, minlength=S + 1)[:S]                     # [S] tokens per slot
        active = counts > 0
        # Active slots first, in slot order, without a host sync (no nonzero()).
        slot_order = torch.sort((~active).to(torch.int8), stable=True).indices  # [S]
        seg_lens = counts[slot_order] * active[slot_order]
        seg_starts = torch.zeros(S + 1, dtype=torch.int64, device=work.device)
        seg_starts[1:] = torch.cumsum(seg_lens, 0)
        seg_slots = torch.where(active[slot_order], slot_order, torch.full_like(slot_order, -1))
        num_segments = active.sum().reshape(1)

        self.token_indices[:T].copy_(order.to(torch.int32), non_blocking=True)
        self.seg_starts.copy_(seg_starts.to(torch.int32), non_blocking=True)
        self.seg_slots.copy_(seg_slots.to(torch.int32), non_blocking=True)
        self.num_segments.copy_(num_segments.to(torch.int32), non_blocking=True)
        self.num_tokens = T
        if on_host:
            n = int(num_segments)
            starts = seg_starts.tolist()
            slots = seg_slots.tolist()
            self._segments_cpu = [(slots[i], starts[i], starts[i + 1]) for i in range(n)]
            self.has_lora = n > 0
        else:
            self._segments_cpu = None
            self.has_lora = None

    def segments_cpu(self) -> list[tuple[int, int, int]]:
        """[(slot, start, end)] of active segments, on the host (syncs if prepared from device ids)."""
        if self._segments_cpu is None:
            n = int(self.num_segments.item())
            starts = self.seg_starts.tolist()
            slots = self.seg_slots.tolist()
            self._segments_cpu = [(slots[i], starts[i], starts[i + 1]) for i in range(n)]
        return self._segments_cpu

    def token_indices_cpu(self) -> torch.Tensor:
        """Sorted token ids of the last prepare, on the host."""
        return self.token_indices[: self.num_tokens].cpu()
