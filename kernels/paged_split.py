"""Split context for paged-attention decode: several programs share one (sequence, KV head)'s keys.

With few sequences the decode grid (sequences x KV heads) leaves most SMs idle and each program walks
its whole context alone, one dependent block of keys after another: at batch 1 an 8B model's 8 KV
heads are 8 programs on 132 SMs. Split, each program attends one chunk of the context and writes its
unnormalized partial (row max, row sum, weighted values, fp32); the program that finds itself last
(the counter of its sequence and KV head) merges the partials in chunk order (deterministic), writes
the output and resets the counter to zero. No extra launch and no host sync, so it runs inside CUDA
graphs. The chunk length is computed on the device from the context length, so a graph captured once
splits every later context as evenly as the fixed number of splits allows.

The counters (int32, zero between launches) are one buffer per device, shared by every decode launch
on it: launches that use it run one at a time on one stream (as the engine's steps do; the quantized
projections' split-K counters rest on the same).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv, next_pow2
from kernels.pdl import gpu_fence

# The most programs one (sequence, KV head) is split over, and the most partial rows (splits x query
# heads of a KV group) the merging program reads at once.
MAX_SPLITS = 16
MAX_MERGE_ROWS = 64
# Contexts of at most this many tokens are not split: the merge (partials stored, counted, read back by the
# last chunk) costs about what 1-2 blocks of keys a program cost (bench/results/paged_decode_no_threshold.json:
# at batch 1 128 tokens took 4.7 us unsplit, 7.8 split in two chunks; 512 tokens 17.9 unsplit, 8.4 in eight).
MIN_SPLIT_CONTEXT = 256
# Waves of programs a split launch aims at: a program's blocks are a chain of dependent loads, so an SM
# runs several at once (four or five fit by registers) to keep its loads in flight.
SPLIT_WAVES = 3
# Counter slots a device's buffer holds: one per (sequence, KV head) of a split launch (which splits only
# while those are fewer than SPLIT_WAVES waves of SMs).
COUNTER_SLOTS = 4096

_counters: dict[torch.device, torch.Tensor] = {}


def max_splits(group: int) -> int:
    """The most chunks a (sequence, KV head) of `group` query heads is split into: MAX_SPLITS, fewer where the
    merge's [chunks, group] rows would pass MAX_MERGE_ROWS. A power of two, and the merge's tile height for
    every split launch of the model (one compiled variant whatever the batch)."""
    return min(MAX_SPLITS, max(1, MAX_MERGE_ROWS // next_pow2(group)))


def decode_splits(batch: int, kv_heads: int, group: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Programs per (sequence, KV head): enough for the grid to fill about SPLIT_WAVES waves of `num_sms`
    SMs, at most one per `block_n` tokens of the longest context the block tables hold, at most
    `max_splits(group)`; 1 (the unsplit kernel) where that comes to fewer than 2, or no context the tables
    hold is longer than MIN_SPLIT_CONTEXT. Depends only on host-known shapes, so a captured graph keeps it."""
    programs = batch * kv_heads
    if programs > COUNTER_SLOTS or max_context <= MIN_SPLIT_CONTEXT:
        return 1
    most = min(max_splits(group), cdiv(max_context, block_n))
    splits = min(most, cdiv(SPLIT_WAVES * num_sms, programs))
    return splits if splits >= 2 else 1


def split_counters(device: torch.device, slots: int) -> torch.Tensor | None:
    """The device's zeroed counters (at least `slots`), None while a CUDA graph is being captured and the
    buffer does not exist yet (the caller then launches unsplit: a buffer made inside a capture would be
    zeroed only by the graph's replays)."""
    if slots > COUNTER_SLOTS:
        raise ValueError(f"{slots} counter slots asked, the buffer holds {COUNTER_SLOTS}")
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters.setdefault(device, torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device))
    return buf


@triton.jit
def split_range(ctx, split, num_splits, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CONTEXT: tl.constexpr):
    """(first token, end, number of non-empty chunks) of chunk `split` of a `ctx`-token context: equal
    chunks of whole BLOCK_N blocks, or one chunk up to MIN_CONTEXT tokens; the whole context unsplit."""
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        chunk = tl.where(ctx <= MIN_CONTEXT, ctx, chunk)
        start = split * chunk
        end = tl.minimum(ctx, start + chunk)
        active = tl.cdiv(ctx, chunk)
    else:
        start = 0
        end = ctx
        active = 1
    return start, end, active


@triton.jit
def merge_partials(m_i, l_i, acc, m_ptr, l_ptr, part_ptr, lock_ptr, out_base, out_stride_h, row0, split, active,
                   group, head_dim, offs_d, d_mask,
                   BLOCK_S: tl.constexpr, BLOCK_GM: tl.constexpr, BLOCK_D: tl.constexpr,
                   FENCE: tl.constexpr, NUM_THREADS: tl.constexpr):
    """Stores this chunk's partial (row max m_i, row sum l_i, unnormalized acc [G', D] of the KV group's
    query heads g < group at rows row0 + split * group + g) and bumps the counter at lock_ptr; the last
    of the `active` chunks merges all of them in chunk order, writes out_base[g * out_stride_h + d] and
    zeroes the counter."""
    offs_g = tl.arange(0, acc.shape[0])
    rows = row0 + split * group + offs_g
    g_mask = offs_g < group
    tl.store(m_ptr + rows, m_i, mask=g_mask)
    tl.store(l_ptr + rows, l_i, mask=g_mask)
    tl.store(part_ptr + rows[:, None].to(tl.int64) * head_dim + offs_d[None, :], acc,
             mask=g_mask[:, None] & d_mask[None, :])
    if FENCE:                                  # the partial stores are visible GPU-wide before the count moves
        gpu_fence(NUM_THREADS)
    tl.debug_barrier()                         # every thread's stores come before the count
    done = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
    if done == active - 1:                     # the last chunk merges, in chunk order
        if FENCE:                              # its loads of the partials come after it saw the count
            gpu_fence(NUM_THREADS)
        s = tl.arange(0, BLOCK_S)
        g = tl.arange(0, BLOCK_GM)
        d = tl.arange(0, BLOCK_D)
        sg_mask = (s[:, None] < active) & (g[None, :] < group)                          # [S, G]
        sg_rows = row0 + s[:, None] * group + g[None, :]
        m_s = tl.load(m_ptr + sg_rows, mask=sg_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(l_ptr + sg_rows, mask=sg_mask, other=0.0, cache_modifier=".cg")
        m_all = tl.max(m_s, axis=0)                                                      # [G]
        m_all = tl.where(g < group, m_all, 0.0)                  # padding heads: no -inf - -inf
        w = tl.where(sg_mask, tl.exp(tl.where(sg_mask, m_s, 0.0) - m_all[None, :]), 0.0)  # [S, G]
        total = tl.sum(w * l_s, axis=0)
        total = tl.where(g < group, total, 1.0)
        sgd_mask = sg_mask[:, :, None] & (d < head_dim)[None, None, :]
        parts = tl.load(part_ptr + sg_rows[:, :, None].to(tl.int64) * head_dim + d[None, None, :],
                        mask=sgd_mask, other=0.0, cache_modifier=".cg")                  # [S, G, D]
        merged = tl.sum(parts * w[:, :, None], axis=0) / total[:, None]                  # [G, D]
        out_mask = (g < group)[:, None] & (d < head_dim)[None, :]
        tl.store(out_base + g[:, None] * out_stride_h + d[None, :], merged.to(out_base.dtype.element_ty),
                 mask=out_mask)
        tl.atomic_xchg(lock_ptr, 0, sem="relaxed", scope="gpu")
