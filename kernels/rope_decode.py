"""RoPE, the KV-cache write and the paged-attention decode of a decode step in one launch per layer.

A decode step used to run, after its q/k/v projection, `kernels.rope_cache` (rotate q and k, write k and v
into the cache) and then `kernels.paged_attention` (read q and the cache, attend): two dependent launches,
the second waiting for the first before it could read anything. Here the attention kernel reads the
projection's output itself (a tensor, or a split-K projection's partials, plus a LoRA delta to add), rotates
q and the new token's k, writes k and v into the cache, and attends with the new token's key and value in
registers. Since the kernel before it (the projection) writes no key or value, the first block of earlier
keys and values may be read before the dependent launch's wait (`early`, `kernels/pdl.py`), beside the
projection.
"""
from __future__ import annotations

import torch

from kernels.addend import extra_pdl
from kernels.paged_attention import launch_decode
from kernels.paged_common import check_paged_inputs
from kernels.rope_cache import check_rope_inputs
from kernels.split_sum import SplitSum, summed_input


def rope_attention_decode(
    qkv: torch.Tensor | SplitSum,  # [B, H*D + 2*KVH*D] the q/k/v projection's output, rows contiguous (or partials)
    positions: torch.Tensor,      # [>= B] int64: each new token's position (context_lens[b] - 1)
    slot_mapping: torch.Tensor,   # [>= B] int64: each new token's flat KV slot (that of position context_lens - 1)
    cos: torch.Tensor,            # [P, D] float32
    sin: torch.Tensor,            # [P, D] float32
    k_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D] contiguous
    v_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D] contiguous
    block_tables: torch.Tensor,   # [>= B, max_blocks] int32
    context_lens: torch.Tensor,   # [>= B] int32: keys to attend, the new token's own included
    out: torch.Tensor,            # [B, H, D] contiguous, the caches' dtype
    scale: float,
    extra: torch.Tensor | None = None,   # like qkv (rows contiguous): added to it first (a LoRA delta)
    block_n: int = 64,
    num_splits: int | None = None,
    min_split_context: int | None = None,
    early: bool = False,          # the first block of earlier keys and values read before the wait
) -> None:
    """Semantics, the same values bit for bit (q: a [B, H, D] scratch):
        rope_and_cache(qkv, positions, slot_mapping, cos, sin, q, k_cache, v_cache, extra)
        paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, out, scale, block_n, ...)
    """
    B, H, D, KVH = check_rope_inputs(qkv, positions, slot_mapping, cos, sin, out, k_cache, v_cache, extra)
    check_paged_inputs(out, k_cache, v_cache, out, block_tables, block_n)
    src, nparts, part_stride = summed_input(qkv)
    launch_decode(src, qkv.stride(0), D, k_cache, v_cache, block_tables, context_lens, out, scale, block_n,
                  num_splits, min_split_context, extra_pdl(out.device, extra),
                  ROPE=True, pos_ptr=positions, slot_ptr=slot_mapping, cos_ptr=cos, sin_ptr=sin, k_col=H * D,
                  v_col=(H + KVH) * D, part_stride=part_stride, NPARTS=nparts,
                  extra_ptr=extra if extra is not None else out, extra_stride=0 if extra is None else extra.stride(0),
                  EXTRA=extra is not None, EARLY=early)
