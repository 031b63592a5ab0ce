"""Per-step LoRA batch metadata: tokens grouped by adapter slot, built once per step.

The engine calls `prepare(slot_ids)` once per step, outside any CUDA graph; every
LoRA launch of that step reads the same device tensors. All tensors are
preallocated at maximum size and refilled in place, so graphs captured against
them stay valid, and nothing on the kernels' path syncs with the host.

On a GPU the grouping is built on the device (`kernels/segments.py`, one
launch): the host only copies the slot ids, through a pinned buffer. On the
CPU it is built with torch on the host.
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
    - `slot_ids` int32 `[max_tokens]`: the ids the device build read (device
      build only; a graph may rebuild the grouping from it with
      `kernels.segments.build_segments`).
    `device_build` (default: on CUDA) builds on the device, else with torch on the host.
    """

    def __init__(self, max_tokens: int, max_slots: int, device: torch.device | str = "cpu",
                 device_build: bool | None = None) -> None:
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
        # Host mirror, filled only when prepare() built on the host (the CPU path uses it).
        self._segments_cpu: list[tuple[int, int, int]] | None = []
        # Build with the segments kernel (default on CUDA; True on CPU runs it in Triton's interpreter).
        self.device_build = self.device.type == "cuda" if device_build is None else device_build
        self.slot_ids = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        pin = self.device.type == "cuda"
        self._ids_staging = torch.empty(max_tokens, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None   # the staging buffer may be refilled once this passed

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
        hi = -1
        if on_host and T:
            lo, hi = (int(v) for v in torch.aminmax(slot_ids))
            if hi >= S or lo < -1:
                raise ValueError(f"slot ids must lie in [-1, {S}), got [{lo}, {hi}]")
        if self.device_build:
            self._prepare_on_device(slot_ids.to(torch.int32), T)
            self.has_lora = hi >= 0 if on_host else None
            return
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

    def _prepare_on_device(self, slot_ids: torch.Tensor, T: int) -> None:
        """Copies the ids into the static buffer and groups them there with one kernel launch."""
        from kernels.segments import build_segments  # imported late: the interpreter flag must be set first

        if slot_ids.device.type == "cpu" and self._staged is not None:
            self._staged.synchronize()                   # the previous step's copy has left the buffer
            self._ids_staging[:T].copy_(slot_ids)
            self.slot_ids[:T].copy_(self._ids_staging[:T], non_blocking=True)
            self._staged.record()
        else:
            self.slot_ids[:T].copy_(slot_ids)
        build_segments(self.slot_ids, T, self.token_indices, self.seg_starts, self.seg_slots, self.num_segments)
        self.num_tokens = T
        self._segments_cpu = None

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
