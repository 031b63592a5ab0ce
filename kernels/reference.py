"""Plain torch definitions of the LoRA kernels: the CPU path and the test oracle.

For tokens `x [T, H_in]`, each token t served by adapter slot a(t) (or none),
and one module with `num_slices` output slices (q/k/v of one shrink, gate/up of
another):

    shrink: s[i, t, :r]      = x[t] @ A[a(t), layer, module_i].T        (r = rank of that entry)
    expand: y[t, off_i:off_i+1] += s[i, t, :r] @ B[a(t), layer, module_i].T

The LoRA scale is already folded into B. Entries of `s` beyond r and rows of
tokens with no adapter are not part of the result: the reference writes zeros
there, the Triton kernels may leave them as they were, and expand never reads
them. Tokens with no adapter, and modules an adapter lacks, leave `y` as it was.
Arithmetic is fp32 whatever the storage dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.meta import LoraBatchMeta
from kernels.paged import LoraRowTables


def _segments(meta_or_slot_ids: LoraBatchMeta | torch.Tensor, max_slots: int) -> list[tuple[int, torch.Tensor]]:
    """[(slot, token ids)] for every adapter present in the batch."""
    if isinstance(meta_or_slot_ids, LoraBatchMeta):
        meta = meta_or_slot_ids
        order = meta.token_indices_cpu().to(torch.int64)
        return [(slot, order[s:e]) for slot, s, e in meta.segments_cpu() if e > s]
    slot_ids = meta_or_slot_ids.detach().to("cpu", torch.int64)
    out = []
    for slot in torch.unique(slot_ids).tolist():
        if slot < 0:
            continue
        if slot >= max_slots:
            raise ValueError(f"slot id {slot} out of range [0, {max_slots})")
        out.append((slot, torch.nonzero(slot_ids == slot).flatten()))
    return out


def _gather_rows(pool: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """Rows [r, width] of the pool starting at `offsets` [r]."""
    offsets = offsets.to(pool.device)
    return pool[offsets[:, None] + torch.arange(width, device=pool.device)]


def _check_common(x_or_s: torch.Tensor, pool: torch.Tensor, tables: LoraRowTables, layer: int,
                  module_indices: Sequence[int]) -> None:
    if pool.dim() != 1:
        raise ValueError(f"pool must be 1-D, got shape {tuple(pool.shape)}")
    if not 0 <= layer < tables.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {tables.num_layers})")
    if not module_indices:
        raise ValueError("module_indices must name at least one slice")
    for m in module_indices:
        if not 0 <= m < tables.num_modules:
            raise ValueError(f"module index {m} out of range [0, {tables.num_modules})")


def lora_shrink_ref(
    x: torch.Tensor,                 # [T, H_in]
    pool: torch.Tensor,              # [num_pages * page_elems]
    tables: LoraRowTables,
    meta_or_slot_ids: LoraBatchMeta | torch.Tensor,
    layer: int,
    module_indices: Sequence[int],   # dense module index per slice
    out: torch.Tensor,               # [num_slices, T, max_rank] float32
) -> None:
    """Semantics: out[i, t, :r] = x[t] @ A[a(t), layer, module_indices[i]].T (fp32)."""
    _check_common(x, pool, tables, layer, module_indices)
    num_slices, T = len(module_indices), x.shape[0]
    if out.dim() != 3 or out.shape[0] != num_slices or out.shape[1] != T:
        raise ValueError(f"out must be [{num_slices}, {T}, max_rank], got {tuple(out.shape)}")
    out.zero_()
    ranks = tables.ranks.cpu()
    for slot, toks in _segments(meta_or_slot_ids, tables.max_slots):
        toks_dev = toks.to(x.device)
        xs = x.index_select(0, toks_dev).float()                      # [n, H_in]
        for i, m in enumerate(module_indices):
            r = int(ranks[slot, layer, m])
            if r == 0:
                continue
            if r > out.shape[2]:
                raise ValueError(f"rank {r} exceeds out's last dim {out.shape[2]}")
            a = _gather_rows(pool, tables.a_offsets[slot, layer, m, :r], x.shape[1]).float()  # [r, H_in]
            out[i, toks_dev, :r] = (xs @ a.t()).to(out.dtype)


def lora_expand_ref(
    s: torch.Tensor,                 # [num_slices, T, max_rank]
    pool: torch.Tensor,              # [num_pages * page_elems]
    tables: LoraRowTables,
    meta_or_slot_ids: LoraBatchMeta | torch.Tensor,
    layer: int,
    module_indices: Sequence[int],   # dense module index per slice
    y: torch.Tensor,                 # [T, >= slice_offsets[-1]]
    slice_offsets: Sequence[int],    # num_slices + 1 column boundaries in y
) -> None:
    """Semantics: y[t, off[i]:off[i+1]] += s[i, t, :r] @ B[a(t), layer, module_indices[i]].T."""
    _check_common(s, pool, tables, layer, module_indices)
    num_slices, T = len(module_indices), y.shape[0]
    if len(slice_offsets) != num_slices + 1:
        raise ValueError(f"slice_offsets needs {num_slices + 1} boundaries, got {list(slice_offsets)}")
    if s.dim() != 3 or s.shape[0] != num_slices or s.shape[1] != T:
        raise ValueError(f"s must be [{num_slices}, {T}, max_rank], got {tuple(s.shape)}")
    if slice_offsets[-1] > y.shape[1]:
        raise ValueError(f"slice_offsets end {slice_offsets[-1]} beyond y's {y.shape[1]} columns")
    ranks = tables.ranks.cpu()
    for slot, toks in _segments(meta_or_slot_ids, tables.max_slots):
        toks_dev = toks.to(y.device)
        for i, m in enumerate(module_indices):
            r = int(ranks[slot, layer, m])
            if r == 0:
                continue
            c0, c1 = int(slice_offsets[i]), int(slice_offsets[i + 1])
            bt = _gather_rows(pool, tables.b_offsets[slot, layer, m, :r], c1 - c0).float()  # [r, out_i]
            delta = s[i].index_select(0, toks_dev)[:, :r].float() @ bt                     # [n, out_i]
            cur = y[toks_dev, c0:c1].float()
            y[toks_dev, c0:c1] = (cur + delta).to(y.dtype)


def lora_apply_ref(
    x: torch.Tensor,                 # [T, H_in]
    pool: torch.Tensor,
    tables: LoraRowTables,
    meta_or_slot_ids: LoraBatchMeta | torch.Tensor,
    layer: int,
    module_indices: Sequence[int],
    y: torch.Tensor,                 # [T, >= slice_offsets[-1]]
    slice_offsets: Sequence[int],
) -> None:
    """Shrink then expand through a temporary fp32 buffer: y += LoRA(x) for every slice."""
    s = torch.empty(len(module_indices), x.shape[0], tables.max_rank, dtype=torch.float32, device=x.device)
    lora_shrink_ref(x, pool, tables, meta_or_slot_ids, layer, module_indices, s)
    lora_expand_ref(s, pool, tables, meta_or_slot_ids, layer, module_indices, y, slice_offsets)


def quant_matmul_ref(
    x: torch.Tensor,                 # [T, K]
    q: torch.Tensor,                 # uint8 [N, K] codes
    scales: torch.Tensor,            # [N, K // G]
    offsets: torch.Tensor,           # [N, K // G]
    bias: torch.Tensor | None = None,   # [N]
) -> torch.Tensor:
    """fp32 [T, N]: x @ W.T + bias with W[n, k] = q[n, k] * scales[n, k // G] + offsets[n, k // G], all in fp32
    (the weight-only quantized matmul's definition; `kernels.quant_matmul` rounds W to x's dtype)."""
    n, k = q.shape
    g = k // scales.shape[1]
    w = q.float().view(n, k // g, g) * scales.float()[..., None] + offsets.float()[..., None]
    y = x.float() @ w.view(n, k).t()
    return y if bias is None else y + bias.float()
