"""Plain-torch definition of paged-attention decode (the test oracle of `kernels.paged_attention`)."""
from __future__ import annotations

import torch


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [B, H, D], caches [blocks, block_size, KVH, D] -> [B, H, D] float32, one sequence at a time."""
    B, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    group = H // KVH
    k_flat = k_cache.reshape(-1, KVH, D).float()
    v_flat = v_cache.reshape(-1, KVH, D).float()
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_flat[slots].repeat_interleave(group, dim=1)             # [n, H, D]
        vals = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), vals)
    return out
