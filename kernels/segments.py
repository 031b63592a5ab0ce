"""Per-step LoRA batch metadata built on the device: a counting sort of token slot ids in one program.

One launch turns per-token slot ids (-1 = no adapter) into what the LoRA
kernels read: tokens grouped by slot (stable), segment starts, segment slots
and the segment count. A single program counts every slot with one-hot
reductions over blocks of tokens, turns the counts into segment starts with a
prefix sum, and scatters each token to its place (its slot's start plus the
tokens of that slot before it). Nothing depends on the values on the host, so
the launch may sit in a CUDA graph, and the host's only per-step work is the
copy of the slot ids.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import next_pow2


@triton.jit
def _segments_kernel(ids_ptr, T, tok_ptr, seg_starts_ptr, seg_slots_ptr, num_seg_ptr, max_slots,
                     BLOCK_T: tl.constexpr, BINS: tl.constexpr):
    bins = tl.arange(0, BINS)                  # bin s < max_slots: slot s; bin max_slots: no adapter
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        ids = tl.load(ids_ptr + offs, mask=offs < T, other=0)
        key = tl.where(offs < T, tl.where(ids < 0, max_slots, ids), BINS)             # BINS: counted nowhere
        counts += tl.sum((key[:, None] == bins[None, :]).to(tl.int32), 0)
    starts = tl.cumsum(counts, 0) - counts     # exclusive: where each bin's tokens begin
    active = ((counts > 0) & (bins < max_slots)).to(tl.int32)
    seg_idx = tl.cumsum(active, 0) - active    # active slots become segments in slot order
    num_seg = tl.sum(active, 0)
    total = tl.sum(tl.where(bins < max_slots, counts, 0), 0)
    # Entries past the active segments repeat the end (-1 slot); the barrier orders these stores
    # before the active entries overwrite some of them from other threads.
    tl.store(seg_starts_ptr + bins, tl.zeros((BINS,), dtype=tl.int32) + total, mask=bins <= max_slots)
    tl.store(seg_slots_ptr + bins, tl.full((BINS,), -1, dtype=tl.int32), mask=bins < max_slots)
    tl.debug_barrier()
    tl.store(seg_starts_ptr + seg_idx, starts, mask=active != 0)
    tl.store(seg_slots_ptr + seg_idx, bins, mask=active != 0)
    tl.store(num_seg_ptr, num_seg)
    run = starts                               # next free place of each bin
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        ids = tl.load(ids_ptr + offs, mask=offs < T, other=0)
        key = tl.where(offs < T, tl.where(ids < 0, max_slots, ids), BINS)
        onehot = (key[:, None] == bins[None, :]).to(tl.int32)                           # [BLOCK_T, BINS]
        before = tl.cumsum(onehot, 0) - onehot                                          # same bin, earlier
        pos = tl.sum(onehot * (before + run[None, :]), 1)                               # [BLOCK_T]
        tl.store(tok_ptr + pos, offs, mask=offs < T)
        run += tl.sum(onehot, 0)


def build_segments(
    slot_ids: torch.Tensor,          # [>= T] int32, -1 = no adapter, each in [-1, max_slots)
    T: int,
    token_indices: torch.Tensor,     # [>= T] int32 out: token ids grouped by slot, no-adapter tokens last
    seg_starts: torch.Tensor,        # [max_slots + 1] int32 out
    seg_slots: torch.Tensor,         # [max_slots] int32 out
    num_segments: torch.Tensor,      # [1] int32 out
) -> None:
    """Fills the LoRA batch metadata from slot ids, on the ids' device, in one launch.

    Semantics:
        key = where(slot_ids[:T] < 0, max_slots, slot_ids[:T])
        token_indices[:T] = argsort(key, stable=True)
        active = [s for s in range(max_slots) if (key == s).any()]        # in slot order
        seg_slots[:len(active)] = active; seg_slots[len(active):] = -1
        seg_starts[i] = number of tokens whose slot is an active slot before active[i]
        seg_starts[len(active):] = number of tokens with an adapter
        num_segments[0] = len(active)
    """
    max_slots = seg_slots.numel()
    for name, t in (("slot_ids", slot_ids), ("token_indices", token_indices), ("seg_starts", seg_starts),
                    ("seg_slots", seg_slots), ("num_segments", num_segments)):
        if t.dtype != torch.int32 or not t.is_contiguous() or t.device != slot_ids.device:
            raise ValueError(f"{name} must be contiguous int32 on {slot_ids.device}")
    if seg_starts.numel() != max_slots + 1 or num_segments.numel() < 1:
        raise ValueError(f"seg_starts must have {max_slots + 1} entries and num_segments at least one")
    if not 0 <= T <= min(slot_ids.numel(), token_indices.numel()):
        raise ValueError(f"{T} tokens do not fit slot_ids ({slot_ids.numel()}) / token_indices "
                         f"({token_indices.numel()})")
    bins = max(16, next_pow2(max_slots + 1))
    block_t = max(16, min(1024, 8192 // bins))
    _segments_kernel[(1,)](slot_ids, T, token_indices, seg_starts, seg_slots, num_segments, max_slots,
                           BLOCK_T=block_t, BINS=bins, num_warps=8)
