"""Batched multi-LoRA math over paged adapter memory (Triton on CUDA, torch on CPU).

Public API:
- layout: `LoraRowTables`, `pages_needed`, `rows_per_page`, `write_adapter`, `clear_slot`, `unpack`;
- per-step metadata: `LoraBatchMeta`;
- math: `lora_fused` (shrink and expand in one launch: what the engine runs), `lora_shrink`,
  `lora_expand` (dispatching), and their `*_ref` torch definitions (`lora_apply_ref` for the fused one).

`lora_fused`/`lora_shrink`/`lora_expand` run the Triton kernels on CUDA tensors and the torch
reference on CPU tensors; `use_triton=True` forces the kernels (on CPU this
needs TRITON_INTERPRET=1 set before this package is imported).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.meta import LoraBatchMeta
from kernels.paged import (
    DEFAULT_MODULE_IDS,
    LoraRowTables,
    clear_slot,
    pages_needed,
    rows_per_page,
    unpack,
    write_adapter,
)
from kernels.reference import lora_apply_ref, lora_expand_ref, lora_shrink_ref

__all__ = [
    "DEFAULT_MODULE_IDS", "LoraBatchMeta", "LoraRowTables", "clear_slot", "lora_expand", "lora_expand_ref",
    "lora_apply_ref", "lora_fused", "lora_shrink", "lora_shrink_ref", "pages_needed", "rows_per_page", "unpack", "write_adapter",
]


def _want_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    return t.is_cuda if use_triton is None else use_triton


def lora_shrink(
    x: torch.Tensor,                 # [T, H_in]
    pool: torch.Tensor,              # [num_pages * page_elems]
    tables: LoraRowTables,
    meta: LoraBatchMeta,
    layer: int,
    module_indices: Sequence[int],   # dense module index per slice
    out: torch.Tensor,               # [num_slices, T, >= tables.max_rank] float32
    use_triton: bool | None = None,
    out_zeroed: bool = False,        # the caller zeroed `out` (the kernel then launches no zeroing of its own)
) -> None:
    """out[i, t, :r] = x[t] @ A[a(t), layer, module_indices[i]].T; other entries unspecified."""
    if _want_triton(x, use_triton):
        from kernels.shrink import lora_shrink_triton  # imported late: the interpreter flag must be set first
        lora_shrink_triton(x, pool, tables, meta, layer, module_indices, out, out_zeroed=out_zeroed)
    else:
        lora_shrink_ref(x, pool, tables, meta, layer, module_indices, out)


def lora_expand(
    s: torch.Tensor,                 # [num_slices, T, >= tables.max_rank] float32
    pool: torch.Tensor,
    tables: LoraRowTables,
    meta: LoraBatchMeta,
    layer: int,
    module_indices: Sequence[int],
    y: torch.Tensor,                 # [T, >= slice_offsets[-1]]
    slice_offsets: Sequence[int],    # num_slices + 1 column boundaries in y
    use_triton: bool | None = None,
) -> None:
    """y[t, off[i]:off[i+1]] += s[i, t, :r] @ B[a(t), layer, module_indices[i]].T."""
    if _want_triton(s, use_triton):
        from kernels.expand import lora_expand_triton
        lora_expand_triton(s, pool, tables, meta, layer, module_indices, y, slice_offsets)
    else:
        lora_expand_ref(s, pool, tables, meta, layer, module_indices, y, slice_offsets)


def lora_fused(
    x: torch.Tensor, pool: torch.Tensor, tables: LoraRowTables, meta: LoraBatchMeta, layer: int,
    module_indices: Sequence[int], y: torch.Tensor, slice_offsets: Sequence[int],
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None, use_triton: bool | None = None,
) -> None:
    """y[t, off[i]:off[i+1]] += (x[t] @ A[a(t), layer, m_i].T) @ B[a(t), layer, m_i].T, in one launch.

    Shapes as `lora_shrink` (x [T, H_in]) and `lora_expand` (y [T, >= slice_offsets[-1]]); `workspace` is
    `kernels.fused.fused_workspace(max_tokens, max_cols, device)`, needed on the GPU for small batches.
    """
    if _want_triton(x, use_triton):
        from kernels.fused import lora_fused_triton
        lora_fused_triton(x, pool, tables, meta, layer, module_indices, y, slice_offsets, workspace)
    else:
        lora_apply_ref(x, pool, tables, meta, layer, module_indices, y, slice_offsets)
