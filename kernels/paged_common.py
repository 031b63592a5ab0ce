"""What the two paged-attention kernels share: the input checks of their wrappers and the loop body that
attends a block of keys read in place from the paged KV cache (online softmax in fp32)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dots import dot


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                       block_tables: torch.Tensor, block_n: int) -> None:
    """q and out [rows, H, D] of one 16/32-bit dtype, caches [blocks, block_size, KVH, D], int32 tables."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"want q [rows, H, D] and equal caches [blocks, block_size, KVH, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    H, D = q.shape[1:]
    KVH, Dc = k_cache.shape[2:]
    if Dc != D or H % KVH:
        raise ValueError(f"head dims {D}/{Dc} differ or {H} query heads are not a multiple of {KVH} KV heads")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype \
            or v_cache.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"q, caches and out must share one of fp16/bf16/fp32, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}, {out.dtype}")
    if out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if q.stride(2) != 1 or out.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("q and out need contiguous head rows; caches must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 [sequences, max_blocks] with contiguous rows")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("out", out)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")


@triton.jit
def attend_keys(q, m_i, l_i, acc, table_ptr, pos, n_mask, visible, k_ptr, v_ptr, block_size,
                cache_stride_slot, kv_offset, offs_d, d_mask, scale, IEEE: tl.constexpr):
    """Folds keys at positions `pos` [N] (valid where n_mask) of one sequence (its page list at table_ptr)
    into the rows of q [R, D] where `visible` [R or 1, N]; returns the new (row max, row sum, acc [R, D])."""
    page = tl.load(table_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    kv_rows = (page * block_size + pos % block_size) * cache_stride_slot + kv_offset    # [N] flat KV rows
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
    s = dot(q, tl.trans(k), IEEE)
    s = tl.where(visible, s * scale, float("-inf"))                                   # [R, N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
    if IEEE:
        pv = dot(p, v.to(tl.float32), True)
    else:
        pv = dot(p.to(v.dtype), v, False)
    return m_new, l_i, acc * alpha[:, None] + pv
