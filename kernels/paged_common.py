"""What the two paged-attention kernels share: the input checks of their wrappers, the loop body that
attends a block of keys read in place from the paged KV cache (online softmax in fp32), and the decode
output's store (in the model's channel order, or in an act-order projection's: `store_heads`)."""
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


def check_order(order: torch.Tensor | None, model_out: torch.Tensor | None, out: torch.Tensor) -> None:
    """Raises unless `order` (if any) is contiguous int32 [H * D] on out's device with out contiguous, and
    `model_out` (allowed only with an order) is a contiguous tensor like `out`."""
    if order is None:
        if model_out is not None:
            raise ValueError("model_out is written only with an order (out is in the model's order without one)")
        return
    width = out.shape[1] * out.shape[2]
    if order.shape != (width,) or order.dtype != torch.int32 or not order.is_contiguous() \
            or order.device != out.device:
        raise ValueError(f"order must be contiguous int32 [{width}] on {out.device}, got {order.dtype} "
                         f"{tuple(order.shape)} on {order.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous to receive its rows in an order")
    if model_out is not None and (model_out.shape != out.shape or model_out.dtype != out.dtype
                                  or not model_out.is_contiguous() or model_out.device != out.device):
        raise ValueError(f"model_out must be contiguous {out.dtype} {tuple(out.shape)} like out, got "
                         f"{model_out.dtype} {tuple(model_out.shape)}")


@triton.jit
def store_heads(vals, out_row, model_row, order_ptr, out_stride_h, heads, offs_d, mask, head_dim,
                ORDERED: tl.constexpr, MODEL_OUT: tl.constexpr):
    """Stores vals [G, D], query heads `heads` of one token, into its row: at out_row[h * out_stride_h + d], or
    with ORDERED at out_row[order_ptr[h * head_dim + d]] (the row in an act-order projection's channel order:
    order is `QuantLinear.input_perm_inverse`) and with MODEL_OUT also at model_row[h * out_stride_h + d]."""
    vals = vals.to(out_row.dtype.element_ty)
    model_cols = heads[:, None] * out_stride_h + offs_d[None, :]
    if ORDERED:
        cols = tl.load(order_ptr + heads[:, None] * head_dim + offs_d[None, :], mask=mask, other=0)
        tl.store(out_row + cols, vals, mask=mask)
        if MODEL_OUT:
            tl.store(model_row + model_cols, vals, mask=mask)
    else:
        tl.store(out_row + model_cols, vals, mask=mask)


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
