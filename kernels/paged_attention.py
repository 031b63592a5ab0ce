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
from kernels.addend import with_extra
from kernels.paged_common import check_paged_inputs, fold_keys, load_keys
from kernels import paged_split
from kernels.paged_split import decode_splits, max_splits, merge_partials, split_counters, split_range
from kernels.pdl import compiled, launch_args, pdl_enabled, wait_then_release
from kernels.rope_cache import rope_read
from kernels.split_sum import load_input
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
    ROPE: tl.constexpr = False, pos_ptr=None, slot_ptr=None, cos_ptr=None, sin_ptr=None, k_col=0, v_col=0,
    part_stride=0, NPARTS: tl.constexpr = 0, extra_ptr=None, extra_stride=0, EXTRA: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    """ROPE: q_ptr is the q/k/v projection's output (`kernels.rope_decode`): q (query heads at column
    h * q_stride_h of row b), the new token's k and v (KV head g at k_col + g * head_dim, v_col + ...)
    rotated here, k and v written into the cache at the token's slot. EARLY (with ROPE): the first block of
    earlier keys and values read before the wait."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kvh * group + offs_g
    table = tables_ptr + b * tables_stride
    kv_offset = kvh * cache_stride_h
    ctx = tl.load(ctx_ptr + b)                 # the step's input: read before the wait
    start, end, active = split_range(ctx, split, num_splits, SPLIT, BLOCK_N, MIN_CONTEXT)
    new = ctx - 1                              # the new token's position
    pos = start + offs_n
    if ROPE:
        # Before the wait: the step's inputs, and the first block of keys and values that earlier steps wrote
        # (the kernel before this one, the projection, writes none of them; kernels/pdl.py).
        p = tl.load(pos_ptr + b)
        slot = tl.load(slot_ptr + b)
        dt = out_ptr.dtype.element_ty
        c = tl.load(cos_ptr + p * head_dim + offs_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + p * head_dim + offs_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)
        if EARLY:
            k, v = load_keys(table, pos, (pos < end) & (pos < new), k_ptr, v_ptr, block_size, cache_stride_slot,
                             kv_offset, offs_d, d_mask, USE_PDL)
    wait_then_release(USE_PDL)
    if start < end:                            # chunks past the context (split launches) have nothing to do
        qd_mask = g_mask[:, None] & d_mask[None, :]
        if ROPE:
            if not EARLY:
                k, v = load_keys(table, pos, (pos < end) & (pos < new), k_ptr, v_ptr, block_size,
                                 cache_stride_slot, kv_offset, offs_d, d_mask, False)
            row = q_ptr + b * q_stride_b
            xrow = extra_ptr + b * extra_stride
            half = head_dim // 2
            q = rope_read(row, xrow, heads[:, None] * q_stride_h, offs_d[None, :], qd_mask, half, c[None, :],
                          s[None, :], part_stride, NPARTS, dt, EXTRA)                    # [G, D]
            k_new = rope_read(row, xrow, k_col + kvh * head_dim, offs_d, d_mask, half, c, s, part_stride, NPARTS,
                              dt, EXTRA)                                                  # [D]
            v_new = with_extra(load_input(row + v_col + kvh * head_dim + offs_d, d_mask, part_stride, NPARTS, dt),
                               xrow + v_col + kvh * head_dim + offs_d, d_mask, EXTRA)
            if end == ctx:                     # the chunk that holds the new token writes it into the cache
                tl.store(k_ptr + slot * cache_stride_slot + kv_offset + offs_d, k_new, mask=d_mask)
                tl.store(v_ptr + slot * cache_stride_slot + kv_offset + offs_d, v_new, mask=d_mask)
            is_new = (pos == new)[:, None]
            k = tl.where(is_new, k_new[None, :], k)
            v = tl.where(is_new, v_new[None, :], v)
        else:
            q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                        mask=qd_mask, other=0.0)                                         # [G, D]
            k, v = load_keys(table, pos, pos < end, k_ptr, v_ptr, block_size, cache_stride_slot, kv_offset,
                             offs_d, d_mask, False)
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        m_i, l_i, acc = fold_keys(q, m_i, l_i, acc, k, v, (pos < end)[None, :], scale, IEEE)
        for first in range(start + BLOCK_N, end, BLOCK_N):
            pos = first + offs_n
            n_mask = pos < end
            if ROPE:
                k, v = load_keys(table, pos, n_mask & (pos < new), k_ptr, v_ptr, block_size, cache_stride_slot,
                                 kv_offset, offs_d, d_mask, False)
                is_new = (pos == new)[:, None]
                k = tl.where(is_new, k_new[None, :], k)
                v = tl.where(is_new, v_new[None, :], v)
            else:
                k, v = load_keys(table, pos, n_mask, k_ptr, v_ptr, block_size, cache_stride_slot, kv_offset,
                                 offs_d, d_mask, False)
            m_i, l_i, acc = fold_keys(q, m_i, l_i, acc, k, v, n_mask[None, :], scale, IEEE)
        out_ptrs = out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :]
        if SPLIT:
            if active == 1:                    # a context of one chunk: no partials
                tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qd_mask)
            else:
                pair = b * tl.num_programs(1) + kvh
                merge_partials(m_i, l_i, acc, m_ptr, l_ptr, part_ptr, lock_ptr + pair,
                               out_ptr + b * out_stride_b + kvh * group * out_stride_h, out_stride_h,
                               pair * num_splits * group, split, active, group, head_dim, offs_d, d_mask,
                               BLOCK_S, BLOCK_GM, BLOCK_D, FENCE, NUM_THREADS)
        else:
            tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qd_mask)


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
    launch_decode(q, q.stride(0), q.stride(1), k_cache, v_cache, block_tables, context_lens, out, scale, block_n,
                  num_splits, min_split_context, pdl_enabled(q.device))


def launch_decode(src: torch.Tensor, stride_b: int, stride_h: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, scale: float,
                  block_n: int, num_splits: int | None, min_split_context: int | None, pdl: bool,
                  **rope) -> None:
    """Launches the decode kernel on checked inputs: q (or with `rope`, the `_paged_decode_kernel` ROPE
    arguments, the q/k/v output) at src, query head h of row b at b * stride_b + h * stride_h; out's shape
    [B, H, D] is the step's."""
    B, H, D = out.shape
    _, block_size, KVH, _ = k_cache.shape
    if context_lens.dtype != torch.int32 or block_tables.shape[0] < B or context_lens.shape[0] < B:
        raise ValueError(f"block_tables must have >= {B} rows and context_lens be int32 [>= {B}]")
    if context_lens.device != out.device:
        raise ValueError(f"context_lens is on {context_lens.device}, q on {out.device}")
    if B == 0:
        return
    group = H // KVH
    if min_split_context is None:
        min_split_context = paged_split.MIN_SPLIT_CONTEXT
    if num_splits is None:
        num_splits = decode_splits(B, KVH, group, block_tables.shape[1] * block_size, block_n,
                                   _num_sms(out.device))
    if num_splits > max_splits(group):
        raise ValueError(f"{num_splits} splits asked; the merge takes at most {max_splits(group)} for {group} "
                         f"query heads a KV head")
    locks = split_counters(out.device, B * KVH) if num_splits > 1 else None
    if locks is None:
        num_splits = 1
    if num_splits > 1:
        stats = torch.empty(2, B * KVH * num_splits * group, dtype=torch.float32, device=out.device)
        parts = torch.empty(B * KVH * num_splits * group, D, dtype=torch.float32, device=out.device)
        m_buf, l_buf = stats[0], stats[1]
    else:                                      # not read unsplit: any tensors do
        m_buf = l_buf = parts = out
        locks = context_lens
    _paged_decode_kernel[(B, KVH, num_splits)](
        src, stride_b, stride_h, k_cache, v_cache, k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0), context_lens, out, out.stride(0), out.stride(1),
        m_buf, l_buf, parts, locks, num_splits,
        block_size, group, D, scale,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        IEEE=out.dtype == torch.float32, SPLIT=num_splits > 1, MIN_CONTEXT=min_split_context,
        BLOCK_S=max_splits(group),
        BLOCK_GM=next_pow2(group), FENCE=compiled(), NUM_THREADS=32 * 4,
        num_warps=4, num_stages=2, **rope, **launch_args(pdl),
    )
