"""Paged-attention decode: one new query token per sequence against its keys/values in the paged KV cache.

Reads the engine's block tables directly (no gather into padded tiles). Grid:
(sequences, KV heads, splits); each program handles all query heads of its KV group
(grouped-query attention) so every key/value row is read from DRAM once, and
walks its part of the context `BLOCK_N` tokens at a time with an online softmax
in fp32. The token at position p lives in page `block_tables[b, p // block_size]`
at offset `p % block_size`; pages are looked up per token, so any block size
works. Context lengths live on the device: no host sync, graph-safe. With few
sequences the context is split over several programs a (sequence, KV head)
whose partials the last of them merges (`kernels/paged_split.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import next_pow2
from kernels.paged_common import attend_keys, check_paged_inputs
from kernels import paged_split
from kernels.paged_split import decode_splits, max_splits, merge_partials, split_counters, split_range
from kernels.pdl import compiled, launch_args, pdl_enabled, wait_then_release
from kernels.shrink import _num_sms


@triton.jit(do_not_specialize=["num_splits"])      # one compiled split variant whatever the count (16 or not)
def _paged_decode_kernel(
    q_ptr, q_stride_b, q_stride_h, k_ptr, v_ptr, cache_stride_slot, cache_stride_h,
    tables_ptr, tables_stride, ctx_ptr, out_ptr, out_stride_b, out_stride_h,
    m_ptr, l_ptr, part_ptr, lock_ptr, num_splits,
    block_size, group, head_dim, scale,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, MIN_CONTEXT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_GM: tl.constexpr,
    FENCE: tl.constexpr, NUM_THREADS: tl.constexpr, USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kvh * group + offs_g
    ctx = tl.load(ctx_ptr + b)                 # the step's input: read before the wait
    wait_then_release(USE_PDL)
    start, end, active = split_range(ctx, split, num_splits, SPLIT, BLOCK_N, MIN_CONTEXT)
    if start < end:                            # chunks past the context (split launches) have nothing to do
        q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)                 # [G, D]
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            pos = first + offs_n
            n_mask = pos < end
            m_i, l_i, acc = attend_keys(q, m_i, l_i, acc, tables_ptr + b * tables_stride, pos, n_mask,
                                        n_mask[None, :], k_ptr, v_ptr, block_size, cache_stride_slot,
                                        kvh * cache_stride_h, offs_d, d_mask, scale, IEEE)
        out_ptrs = out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :]
        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            if active == 1:                    # a context of one chunk: no partials
                tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
            else:
                pair = b * tl.num_programs(1) + kvh
                merge_partials(m_i, l_i, acc, m_ptr, l_ptr, part_ptr, lock_ptr + pair,
                               out_ptr + b * out_stride_b + kvh * group * out_stride_h, out_stride_h,
                               pair * num_splits * group, split, active, group, head_dim, offs_d, d_mask,
                               BLOCK_S, BLOCK_GM, BLOCK_D, FENCE, NUM_THREADS)
        else:
            tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


def paged_attention_decode(
    q: torch.Tensor,              # [B, H, D] one query token per sequence
    k_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,   # [>= B, max_blocks] int32: page ids of each sequence
    context_lens: torch.Tensor,   # [>= B] int32: keys to attend (the new token's own included), >= 1
    out: torch.Tensor,            # [B, H, D], q's dtype
    scale: float,
    block_n: int = 64,            # tokens per loop iteration (power of two, >= 16)
    num_splits: int | None = None,  # programs per (sequence, KV head); None: `decode_splits`'s choice
    min_split_context: int | None = None,   # longer contexts only are split; None: MIN_SPLIT_CONTEXT
) -> None:
    """Attention of each sequence's newest token over its whole context, written into `out`.

    Semantics:
        for b, h: g = h // (H // KVH); n = context_lens[b]
            slots = [block_tables[b, p // bs] * bs + p % bs for p in range(n)]
            keys = k_cache.view(-1, KVH, D)[slots, g]; vals = v_cache.view(-1, KVH, D)[slots, g]
            out[b, h] = softmax(q[b, h] @ keys.T * scale) @ vals      (fp32 math)
    """
    check_paged_inputs(q, k_cache, v_cache, out, block_tables, block_n)
    B, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    if context_lens.dtype != torch.int32 or block_tables.shape[0] < B or context_lens.shape[0] < B:
        raise ValueError(f"block_tables must have >= {B} rows and context_lens be int32 [>= {B}]")
    if context_lens.device != q.device:
        raise ValueError(f"context_lens is on {context_lens.device}, q on {q.device}")
    if B == 0:
        return
    group = H // KVH
    if min_split_context is None:
        min_split_context = paged_split.MIN_SPLIT_CONTEXT
    if num_splits is None:
        num_splits = decode_splits(B, KVH, group, block_tables.shape[1] * block_size, block_n, _num_sms(q.device))
    if num_splits > max_splits(group):
        raise ValueError(f"{num_splits} splits asked; the merge takes at most {max_splits(group)} for {group} "
                         f"query heads a KV head")
    locks = split_counters(q.device, B * KVH) if num_splits > 1 else None
    if locks is None:
        num_splits = 1
    if num_splits > 1:
        stats = torch.empty(2, B * KVH * num_splits * group, dtype=torch.float32, device=q.device)
        parts = torch.empty(B * KVH * num_splits * group, D, dtype=torch.float32, device=q.device)
        m_buf, l_buf = stats[0], stats[1]
    else:                                      # not read unsplit: any tensors do
        m_buf = l_buf = parts = out
        locks = context_lens
    pdl = pdl_enabled(q.device)
    _paged_decode_kernel[(B, KVH, num_splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0), context_lens, out, out.stride(0), out.stride(1),
        m_buf, l_buf, parts, locks, num_splits,
        block_size, group, D, scale,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        IEEE=q.dtype == torch.float32, SPLIT=num_splits > 1, MIN_CONTEXT=min_split_context,
        BLOCK_S=max_splits(group),
        BLOCK_GM=next_pow2(group), FENCE=compiled(), NUM_THREADS=32 * 4,
        num_warps=4, num_stages=2, **launch_args(pdl),
    )
