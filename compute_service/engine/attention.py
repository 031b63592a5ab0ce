"""Attention over the paged KV cache (torch reference) and its per-step metadata.

The metadata is built once per step on the host, shared by every layer. Queries
and keys are gathered into padded per-sequence tiles so one SDPA call covers a
batch that mixes prefill chunks and decodes; a mask makes each query see its
own sequence's keys up to its own position. That is the reference (CPU); on
CUDA, kernels read the pages in place instead: `kernels.paged_attention` for
decode-only steps (`DecodeMetadata`) and `kernels.paged_prefill` for prefill
and mixed steps (`PrefillMetadata`), one launch per layer whatever the mix.
(The padded tiles cost a mixed step of 64 decodes and one 34-token prompt on
an H100 ~20-45 ms of host time for SmolLM2: gathers, mask and SDPA per layer.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step indices; B sequences, T tokens, Qmax/Kmax the padded tile sizes."""

    slot_mapping: torch.Tensor      # [T] int64: flat KV slot each new token is written to
    q_gather: torch.Tensor          # [B, Qmax] int64: token index of each padded query (0 for padding)
    kv_gather: torch.Tensor         # [B, Kmax] int64: flat KV slot of each padded key
    mask: torch.Tensor              # [B, 1, Qmax, Kmax] bool: True = may attend
    token_seq: torch.Tensor         # [T] int64: which sequence each token belongs to
    token_pos_in_chunk: torch.Tensor  # [T] int64: its index inside that sequence's chunk

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device) -> "AttentionMetadata":
        """query_lens[b] new tokens of sequence b end at position context_lens[b] - 1."""
        num_seqs = len(query_lens)
        q_max = max(query_lens)
        k_max = max(len(t) for t in block_tables) * block_size
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        clens = torch.tensor(context_lens, dtype=torch.int64)
        starts = torch.cumsum(qlens, 0) - qlens
        tables = torch.zeros(num_seqs, k_max // block_size, dtype=torch.int64)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.int64)
        kv_gather = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(num_seqs, k_max)
        i = torch.arange(q_max)
        q_valid = i[None, :] < qlens[:, None]                              # [B, Qmax]
        q_gather = torch.where(q_valid, starts[:, None] + i[None, :], 0)
        q_pos = (clens - qlens)[:, None] + i[None, :]                      # absolute position of each query
        j = torch.arange(k_max)
        mask = j[None, None, :] <= q_pos[:, :, None]                       # causal, within context
        mask |= ~q_valid[:, :, None] & (j == 0)[None, None, :]             # padding rows: one key, no NaN
        token_seq = torch.repeat_interleave(torch.arange(num_seqs), qlens)
        token_pos = torch.arange(int(qlens.sum())) - starts[token_seq]
        pos = q_pos[token_seq, token_pos]
        slot_mapping = kv_gather[token_seq, pos]
        return cls(slot_mapping.to(device), q_gather.to(device), kv_gather.to(device),
                   mask[:, None].to(device), token_seq.to(device), token_pos.to(device))


@dataclass
class PrefillMetadata:
    """A prefill or mixed step on CUDA: the block tables and the query tiles of `kernels.paged_prefill`."""

    slot_mapping: torch.Tensor      # [T] int64: flat KV slot each new token is written to
    block_tables: torch.Tensor      # [B, max_blocks] int32: page ids per sequence
    tiles: torch.Tensor             # [num_tiles, 4] int32: (first row, tokens, first position, sequence)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device) -> "PrefillMetadata":
        """query_lens[b] new tokens of sequence b end at position context_lens[b] - 1."""
        from kernels.paged_prefill import prefill_tiles

        slots = new_token_slots(query_lens, context_lens, block_tables, block_size)
        tiles = torch.tensor(prefill_tiles(query_lens, context_lens), dtype=torch.int32).view(-1, 4)
        return cls(torch.tensor(slots, dtype=torch.int64).to(device), padded_tables(block_tables).to(device),
                   tiles.to(device))


def padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """The block tables as one int32 [B, longest] host tensor, each row padded with page 0."""
    width = max(len(t) for t in block_tables)
    flat: list[int] = []
    for t in block_tables:
        flat += t
        flat += [0] * (width - len(t))
    return torch.tensor(flat, dtype=torch.int32).view(len(block_tables), width)


def new_token_slots(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                    block_size: int) -> list[int]:
    """The flat KV slot of each new token, sequence after sequence."""
    slots: list[int] = []
    for t, n, ctx in zip(block_tables, query_lens, context_lens):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
    return slots


def step_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                  block_size: int, device: torch.device) -> "AttentionMetadata | PrefillMetadata":
    """A prefill or mixed step's metadata: the paged kernel's on CUDA, the padded-tile reference's elsewhere."""
    builder = PrefillMetadata if device.type == "cuda" else AttentionMetadata
    return builder.build(query_lens, context_lens, block_tables, block_size, device)


@dataclass
class DecodeMetadata:
    """A decode-only step (one new token per sequence) on CUDA; tensors may be a graph's static buffers."""

    slot_mapping: torch.Tensor      # [B] int64: flat KV slot of each new token
    block_tables: torch.Tensor      # [B, max_blocks] int32: page ids per sequence
    context_lens: torch.Tensor      # [B] int32: keys each new token attends to (itself included)

    @classmethod
    def build(cls, context_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device) -> "DecodeMetadata":
        slots = new_token_slots([1] * len(context_lens), context_lens, block_tables, block_size)
        return cls(torch.tensor(slots, dtype=torch.int64).to(device), padded_tables(block_tables).to(device),
                   torch.tensor(context_lens, dtype=torch.int32).to(device))


# Any step's attention metadata.
StepMetadata = AttentionMetadata | PrefillMetadata | DecodeMetadata


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: StepMetadata, scale: float) -> torch.Tensor:
    """Writes k/v into the cache (None: already written there), then attends.

    q [T, H, D], k/v [T, KVH, D], caches [num_blocks, block_size, KVH, D] -> [T, H, D].
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if k is not None and v is not None:
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
    if isinstance(meta, DecodeMetadata):
        from kernels.paged_attention import paged_attention_decode  # Triton: imported on first CUDA decode

        out = torch.empty_like(q)
        paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, out, scale)
        return out
    if isinstance(meta, PrefillMetadata):
        from kernels.paged_prefill import paged_attention_prefill  # Triton: imported on first CUDA prefill

        out = torch.empty_like(q)
        paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.tiles, out, scale)
        return out
    qg = q[meta.q_gather].transpose(1, 2)            # [B, H, Qmax, D]
    kg = k_flat[meta.kv_gather].transpose(1, 2)      # [B, KVH, Kmax, D]
    vg = v_flat[meta.kv_gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=num_kv_heads != q.shape[1])
    return out.transpose(1, 2)[meta.token_seq, meta.token_pos_in_chunk]
