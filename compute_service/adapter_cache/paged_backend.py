"""The CUDA `LoraBackend` over the one adapter pool: the LoRA kernels read adapter rows in place.

One `LoraBatchMeta` is prepared per step (outside CUDA graphs; on CUDA the host
only copies the slot ids, the grouping is built on the device). Each layer's
group that an adapter of the step changes (`active_groups`; the others launch
nothing) then costs, for steps of up to `FUSED_MAX_TOKENS` tokens (decode of
small batches), one fused launch (shrink and expand in one kernel), and above
that one shrink launch over all its slices and one expand launch, where the
pair is faster (docs/kernels.md); either adds into every slice (q/k/v, or
gate/up) of the fused output in place. A decode-sized shrink splits its
reduction and adds partial sums into zeros: each group keeps one buffer for all
layers, zeroed by one launch at the group's layer 0 (the model applies the
layers in order in every forward), instead of a zeroing launch per layer.
Triton kernels on CUDA; on CPU tensors kernels/__init__.py runs their torch
reference, which is for tests only: CPU serving uses
`dense_backend.DenseLoraBackend`.
"""
from __future__ import annotations

import torch

from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.lora_backend import ALL_GROUPS, GROUP_MODULE_IDS
from kernels import LoraBatchMeta, lora_expand, lora_fused, lora_shrink

# Steps of up to this many tokens take the shrink's per-layer buffers zeroed once per step (the shrink splits
# its reduction at these sizes); above it the shrink stores whole sums into one buffer with no zeroing.
LAYER_BUFFER_TOKENS = 128
MAX_GROUP_SLICES = max(len(ids) for ids in GROUP_MODULE_IDS.values())


class PagedLoraBackend:
    """Reads weights from `slots.pool` through `slots.tables`.

    Built before the pool exists (the engine takes it at construction, the pool
    is sized after the KV cache): `allocate()` must follow `slots.allocate()`
    and precede any CUDA graph capture, so every buffer a graph reads (pool,
    row tables, batch metadata, shrink output, fused-kernel workspace) has its
    final address before it is captured. Graph-safe: `prepare` refills those
    buffers in place and the launch configuration depends only on the token
    count (the row alignment the kernels specialise on is fixed when the pool
    is allocated).
    """

    graph_safe = True
    # A one-token step may run the LoRA first, into float32 zeros that the base projection's one-row kernel
    # adds (LlamaModel._project): `apply` then always launches (the fused kernel, for any float32 output),
    # so that kernel follows a launch that did not write its input.
    delta_first = True

    def __init__(self, slots: PagedAdapterSlots, max_num_batched_tokens: int) -> None:
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.meta: LoraBatchMeta | None = None
        self._group_modules: dict[str, list[int]] = {}
        self._shrink_buf = torch.empty(0)
        self._layer_bufs: dict[str, torch.Tensor] = {}
        self._layer_buf_tokens = 0
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused_max_tokens = 0
        self.active_groups = ALL_GROUPS

    def allocate(self) -> LoraBatchMeta:
        """Allocates the batch metadata, shrink output and fused workspace (once; the pool must exist)."""
        if self.meta is not None:
            return self.meta
        tables = self.slots.tables
        if tables is None:
            raise RuntimeError("the adapter pool is not allocated yet: call slots.allocate() first")
        meta = LoraBatchMeta(self.max_num_batched_tokens, tables.max_slots, device=self.slots.device)
        self._group_modules = {g: [tables.module_index(m) for m in ids] for g, ids in GROUP_MODULE_IDS.items()}
        # Shrink output for up to 3 slices at the largest step, fp32 as the kernels want it.
        self._shrink_buf = torch.empty(3 * self.max_num_batched_tokens * tables.max_rank, dtype=torch.float32,
                                       device=self.slots.device)
        # Per group, every layer's shrink output for decode-sized steps: [layers, slices, T, max rank] fp32.
        self._layer_buf_tokens = min(LAYER_BUFFER_TOKENS, self.max_num_batched_tokens)
        self._layer_bufs = {g: torch.zeros(tables.num_layers * MAX_GROUP_SLICES * self._layer_buf_tokens
                                           * tables.max_rank, dtype=torch.float32, device=self.slots.device)
                            for g in GROUP_MODULE_IDS}
        if self.slots.device.type == "cuda":
            from kernels.fused import FUSED_MAX_TOKENS, fused_workspace   # Triton: imported on first use
            # Rank-r sums and counters of the fused kernel; the kernel leaves them zero after each launch.
            self._fused_max_tokens = min(FUSED_MAX_TOKENS, self.max_num_batched_tokens)
            self._workspace = fused_workspace(self._fused_max_tokens, tables.max_rank, self.slots.device)
        self.meta = meta
        return meta

    def prepare(self, token_slot_ids_cpu: torch.Tensor, groups: frozenset[str] = ALL_GROUPS) -> None:
        meta = self.meta if self.meta is not None else self.allocate()
        meta.prepare(token_slot_ids_cpu.to(torch.int32))
        self.active_groups = groups

    def groups_of(self, token_slot_ids: list[int]) -> frozenset[str]:
        return self.slots.groups_of(token_slot_ids)

    def apply(self, layer: int, group: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        if group not in self.active_groups:
            return
        mods = self._group_modules[group]
        y, offsets = as_one_output(outs)
        if y is not None:
            self._shrink_expand(layer, group, 0, mods, x, y, offsets)
            return
        for i, out in enumerate(outs):   # slices not side by side in memory: one pass each
            self._shrink_expand(layer, group, i, [mods[i]], x, out, [0, out.shape[1]])

    def _shrink_expand(self, layer: int, group: str, first: int, mods: list[int], x: torch.Tensor,
                       y: torch.Tensor, offsets: list[int]) -> None:
        """y[:, offsets[i]:offsets[i+1]] += LoRA of slice first + i of the group (x [T, in]): every kernel
        launch of the backend."""
        tables, pool, meta = self.slots.tables, self.slots.pool, self.meta
        assert tables is not None and pool is not None and meta is not None
        T = x.shape[0]
        if T <= self._fused_max_tokens:
            lora_fused(x.contiguous(), pool, tables, meta, layer, mods, y, offsets, self._workspace)
            return
        R = tables.max_rank
        if T <= self._layer_buf_tokens:
            bufs = self._layer_bufs[group][: tables.num_layers * MAX_GROUP_SLICES * T * R]
            bufs = bufs.view(tables.num_layers, MAX_GROUP_SLICES, T, R)
            if layer == 0 and first == 0:
                bufs.zero_()             # every layer's buffer of this group, once per forward
            s = bufs[layer, first: first + len(mods)]
            lora_shrink(x.contiguous(), pool, tables, meta, layer, mods, s, out_zeroed=True)
        else:
            s = self._shrink_buf[: len(mods) * T * R].view(len(mods), T, R)
            lora_shrink(x.contiguous(), pool, tables, meta, layer, mods, s)
        lora_expand(s, pool, tables, meta, layer, mods, y, offsets)


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
