"""Tensor parallelism: the all-reduce of a row-parallel layer's partial output, the residual add and the
next RMSNorm, in one launch over GPU peer memory.

Without it a decode layer ends twice in three launches: the partial output copied into a buffer the
peers can read, a one-shot all-reduce (a barrier, the peers' rows summed) and the add + norm.
Here program t (one per token row):
1. copies its row of the partial output into this rank's half of a peer-mapped buffer;
2. meets program t of every other rank (a flag set in each peer's signal pad, release at system scope;
   then its own flags from every peer awaited and cleared, acquire);
3. sums the rows of every rank in rank order in fp32 (so every rank gets the same bits), rounds to the
   model dtype, adds the residual, stores it, and writes the normalised row (rounded as `add_rms_norm`).

The caller alternates between two halves of the buffer (`offset`), so no barrier is needed at the end:
a rank writes a half again only two calls later, after meeting every peer at the call in between, by
which time every peer's earlier kernel has finished reading it (each kernel waits for the one before).
A peer that never arrives leaves the programs waiting, like any collective; the group's watchdog and
timeouts deal with a dead rank (compute_service/parallel/group.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import next_pow2
from kernels.pdl import launch_args, pdl_enabled, wait_then_release


@triton.jit
def _reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, bufs_ptr, pads_ptr, offset, rank, H, eps,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64) * H
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)     # weights: read before the wait
    wait_then_release(USE_PDL)
    dtype = x_ptr.dtype.element_ty
    part = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
    own = tl.load(bufs_ptr + rank).to(tl.pointer_type(dtype))
    tl.store(own + offset + row + offs, part, mask=mask)
    tl.debug_barrier()                                    # every thread's copy is out before the flag
    for p in tl.static_range(WORLD):
        if p != rank:
            peer_pad = tl.load(pads_ptr + p).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(peer_pad + t * WORLD + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    own_pad = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            while tl.atomic_cas(own_pad + t * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        src = tl.load(bufs_ptr + p).to(tl.pointer_type(dtype))
        acc += tl.load(src + offset + row + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    r = tl.load(res_ptr + row + offs, mask=mask, other=0.0)
    s = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_ptr + row + offs, s, mask=mask)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / H
    y = (sf * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def reduce_add_rms_norm(
    x: torch.Tensor,            # [T, H] contiguous: this rank's partial sums
    residual: torch.Tensor,     # [T, H] contiguous: h, updated in place to h + sum over ranks of x
    weight: torch.Tensor,       # [H]
    eps: float,
    out: torch.Tensor,          # [T, H]: norm(h)
    buffer_ptrs: torch.Tensor,  # [world] int64 on the device: every rank's peer-mapped buffer
    pad_ptrs: torch.Tensor,     # [world] int64 on the device: every rank's signal pad (int32 flags)
    offset: int,                # elements into each buffer: the half this call uses
    rank: int,
) -> None:
    """Semantics (every rank calls it with its own x; all get the same bits):
        s = sum over ranks of x, in fp32 in rank order, rounded to the dtype
        residual[:] = (s + residual) rounded to the dtype;  out = add_rms_norm's norm of residual
    The buffers must hold offset + T * H elements of x's dtype and the pads T * world flags."""
    if x.dim() != 2 or not x.is_contiguous() or x.shape != residual.shape or x.shape != out.shape \
            or not residual.is_contiguous() or not out.is_contiguous():
        raise ValueError(f"x, residual and out must be contiguous [T, H] of one shape, got {tuple(x.shape)}, "
                         f"{tuple(residual.shape)}, {tuple(out.shape)}")
    T, H = x.shape
    if weight.shape != (H,) or {weight.dtype, residual.dtype, out.dtype} != {x.dtype}:
        raise ValueError(f"weight must be [{H}] and every tensor of x's dtype {x.dtype}")
    world = buffer_ptrs.numel()
    if pad_ptrs.numel() != world or not 0 <= rank < world:
        raise ValueError(f"{world} buffers, {pad_ptrs.numel()} pads, rank {rank}")
    if T == 0:
        return
    _reduce_add_rms_norm_kernel[(T,)](x, residual, weight, out, buffer_ptrs, pad_ptrs, offset, rank, H, eps,
                                      WORLD=world, BLOCK=next_pow2(H), num_warps=8,
                                      **launch_args(pdl_enabled(x.device)))
