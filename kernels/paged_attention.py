"""Paged-attention decode: one new query token per sequence against its keys/values in the paged KV cache.

Reads the engine's block tables directly (no gather into padded tiles). Grid:
(sequences, KV heads); each program handles all query heads of its KV group
(grouped-query attention) so every key/value row is read from DRAM once, and
walks the sequence's context `BLOCK_N` tokens at a time with an online softmax
in fp32. The token at position p lives in page `block_tables[b, p // block_size]`
at offset `p % block_size`; pages are looked up per token, so any block size
works. Context lengths live on the device: no host sync, graph-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import next_pow2


@triton.jit
def _paged_decode_kernel(
    q_ptr, q_stride_b, q_stride_h, k_ptr, v_ptr, cache_stride_slot, cache_stride_h,
    tables_ptr, tables_stride, ctx_ptr, out_ptr, out_stride_b, out_stride_h,
    block_size, group, head_dim, scale,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kvh * group + offs_g
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)                     # [G, D]
    ctx = tl.load(ctx_ptr + b)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(0, ctx, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < ctx
        page = tl.load(tables_ptr + b * tables_stride + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        slot = page * block_size + pos % block_size                                    # [N] flat KV slot
        row = slot * cache_stride_slot + kvh * cache_stride_h
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s * scale, float("-inf"))                       # [G, N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_attention_decode(
    q: torch.Tensor,              # [B, H, D] one query token per sequence
    k_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,   # [>= B, max_blocks] int32: page ids of each sequence
    context_lens: torch.Tensor,   # [>= B] int32: keys to attend (the new token's own included), >= 1
    out: torch.Tensor,            # [B, H, D], q's dtype
    scale: float,
    block_n: int = 64,            # tokens per loop iteration (power of two, >= 16)
) -> None:
    """Attention of each sequence's newest token over its whole context, written into `out`.

    Semantics:
        for b, h: g = h // (H // KVH); n = context_lens[b]
            slots = [block_tables[b, p // bs] * bs + p % bs for p in range(n)]
            keys = k_cache.view(-1, KVH, D)[slots, g]; vals = v_cache.view(-1, KVH, D)[slots, g]
            out[b, h] = softmax(q[b, h] @ keys.T * scale) @ vals      (fp32 math)
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"want q [B, H, D] and equal caches [blocks, block_size, KVH, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, H, D = q.shape
    _, block_size, KVH, Dc = k_cache.shape
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
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] < B or context_lens.shape[0] < B or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [>= {B}, max_blocks] with contiguous rows and "
                         f"context_lens int32 [>= {B}]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens), ("out", out)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if B == 0:
        return
    group = H // KVH
    grid = (B, KVH)
    _paged_decode_kernel[grid](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0), context_lens, out, out.stride(0), out.stride(1),
        block_size, group, D, scale,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )
