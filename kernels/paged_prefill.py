"""Paged attention for prefill and mixed steps: any number of new query tokens per sequence, causal.

One launch per layer covers a whole step that mixes prompt chunks and decodes,
reading keys and values from the paged KV cache in place (no gather into padded
tiles, no mask tensor). The step's query tokens are cut into tiles of at most
TILE_TOKENS consecutive tokens of one sequence; a tile is one row of `tiles`
(int32), built on the host by `prefill_tiles`:

    [first token's row in q, number of query tokens, first token's position, sequence's row in block_tables]

Grid: (tiles, KV heads). A program holds its tile's tokens times the KV group's
query heads as BLOCK_R (a power of two) rows (row r = token r // group, head r % group, so each
key/value row is read once per tile for the whole group), walks keys 0 ... the
tile's last position BLOCK_N at a time with an online softmax in fp32, and
masks each row causally (key position <= the row's own position). A decode
sequence is a tile of one token. Everything the kernel reads per step is on the
device; the block-table width is not specialised on, so no step compiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import next_pow2
from kernels.paged_common import attend_keys, check_paged_inputs

TILE_TOKENS = 16    # query tokens of one sequence per program
MAX_GROUP = 16      # query heads per KV head a program can hold (TILE_TOKENS x group rows)


def prefill_tiles(query_lens: list[int], context_lens: list[int]) -> list[int]:
    """The flat int list of tiles (4 ints each) for sequences whose query_lens[b] new tokens end at
    position context_lens[b] - 1, laid out one after another in q."""
    tiles: list[int] = []
    row = 0
    for b, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        first = ctx - n
        for off in range(0, n, TILE_TOKENS):
            tiles += (row + off, min(TILE_TOKENS, n - off), first + off, b)
        row += n
    return tiles


@triton.jit(do_not_specialize=["tables_stride"])
def _paged_prefill_kernel(
    q_ptr, q_stride_t, q_stride_h, k_ptr, v_ptr, cache_stride_slot, cache_stride_h,
    tables_ptr, tables_stride, tiles_ptr, out_ptr, out_stride_t, out_stride_h,
    block_size, group, head_dim, scale,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(tiles_ptr + tile * 4)
    num_q = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    seq = tl.load(tiles_ptr + tile * 4 + 3)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    r_mask = offs_r < num_q * group
    tok = tl.where(r_mask, offs_r // group, 0)                 # padding rows repeat token 0 (never stored)
    heads = kvh * group + offs_r % group
    d_mask = offs_d < head_dim
    rows = (row0 + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)                    # [R, D]
    q_pos = pos0 + tok                                                                 # [R]
    end = pos0 + num_q                                                                 # keys 0 .. end - 1
    m_i = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    # Key 0 is visible to every row, so after the first block no row's maximum is -inf (no NaN).
    for start in range(0, end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < end
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = attend_keys(q, m_i, l_i, acc, tables_ptr + seq * tables_stride, pos, n_mask, visible,
                                    k_ptr, v_ptr, block_size, cache_stride_slot, kvh * cache_stride_h, offs_d, d_mask,
                                    scale, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * out_stride_t + heads[:, None] * out_stride_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_attention_prefill(
    q: torch.Tensor,              # [T, H, D] the step's new query tokens, sequence after sequence
    k_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D] (the new tokens' K/V already written)
    v_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,   # [B, max_blocks] int32: page ids of each sequence
    tiles: torch.Tensor,          # [num_tiles, 4] int32 from `prefill_tiles`
    out: torch.Tensor,            # [T, H, D], q's dtype
    scale: float,
    block_n: int = 64,            # keys per loop iteration (power of two, >= 16)
) -> None:
    """Causal attention of every new token over its sequence's keys up to its own position, into `out`.

    Semantics, for each tile (row0, n, pos0, b) and i < n, h: g = h // (H // KVH); t = row0 + i; p = pos0 + i
        slots = [block_tables[b, j // bs] * bs + j % bs for j in range(p + 1)]
        out[t, h] = softmax(q[t, h] @ k_cache.view(-1, KVH, D)[slots, g].T * scale) @ v_cache...[slots, g]
    """
    check_paged_inputs(q, k_cache, v_cache, out, block_tables, block_n)
    T, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 4 or not tiles.is_contiguous():
        raise ValueError(f"tiles must be contiguous int32 [num_tiles, 4], got {tiles.dtype} {tuple(tiles.shape)}")
    if tiles.device != q.device:
        raise ValueError(f"tiles is on {tiles.device}, q on {q.device}")
    group = H // KVH
    if group > MAX_GROUP:
        raise ValueError(f"{group} query heads per KV head: at most {MAX_GROUP} fit a program")
    if tiles.shape[0] == 0:
        return
    rows = next_pow2(TILE_TOKENS * group)
    grid = (tiles.shape[0], KVH)
    _paged_prefill_kernel[grid](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0), tiles, out, out.stride(0), out.stride(1),
        block_size, group, D, scale,
        BLOCK_R=rows, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        IEEE=q.dtype == torch.float32, num_warps=4 if rows <= 64 else 8, num_stages=2,
    )
