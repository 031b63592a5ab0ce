"""Plain-torch definitions of paged attention (the test oracles of `kernels.paged_attention` and
`kernels.paged_prefill`)."""
from __future__ import annotations

import torch


def _flat_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(block size, query heads per KV head, caches as float32 [slots, KVH, D], a float32 output like q)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    return (block_size, q.shape[1] // kv_heads, k_cache.reshape(-1, kv_heads, head_dim).float(),
            v_cache.reshape(-1, kv_heads, head_dim).float(), torch.empty(q.shape, dtype=torch.float32, device=q.device))


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [B, H, D], caches [blocks, block_size, KVH, D] -> [B, H, D] float32, one sequence at a time."""
    block_size, group, k_flat, v_flat, out = _flat_caches(q, k_cache, v_cache)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_flat[slots].repeat_interleave(group, dim=1)             # [n, H, D]
        vals = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), vals)
    return out


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_lens: list[int], context_lens: list[int],
                                scale: float) -> torch.Tensor:
    """q [T, H, D] (sequence b's query_lens[b] tokens ending at position context_lens[b] - 1, one sequence
    after another) -> [T, H, D] float32: each token attends causally to its sequence's keys."""
    block_size, group, k_flat, v_flat, out = _flat_caches(q, k_cache, v_cache)
    row = 0
    for b, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_flat[slots].repeat_interleave(group, dim=1)             # [ctx, H, D]
        vals = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[row:row + n].float(), keys) * scale
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[row:row + n] = torch.einsum("htn,nhd->thd", scores.softmax(dim=-1), vals)
        row += n
    return out
