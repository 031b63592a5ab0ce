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
A peer that never arrives must not hang the GPU: a program that has waited `timeout_s` for a flag gives
up, records it in `status` and, compiled, traps, which ends this process's CUDA context, so the step's
read-back raises and the group goes down (compute_service/parallel/group.py) instead of spinning forever.
Under the interpreter (no timer, no trap) the bound is a count of tries and the program only records it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import next_pow2
from kernels.pdl import compiled, launch_args, pdl_enabled, wait_then_release
from kernels.rms_norm import rms_norm_row


INTERPRETER_TRIES = tl.constexpr(1000)      # the interpreter's bound on tries of one flag (no clock there)


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _swap_flag(ptr, cmp, val, SEM: tl.constexpr, status_ptr, timeout_ns, COMPILED: tl.constexpr,
               TRIES: tl.constexpr):
    """Compare-and-swap cmp -> val at ptr (system scope) until it takes; past the timeout (interpreted: TRIES
    tries), records the failure in status and (compiled) traps. TRIES comes from the kernel: a helper reads no
    module-level constexpr (tests/kernels/test_cache_keys.py)."""
    old = tl.atomic_cas(ptr, cmp, val, sem=SEM, scope="sys")
    expired = tl.full([], 0, tl.int32)
    if COMPILED:
        start = _now_ns()
    tries = 1
    while (old != cmp) & (expired == 0):
        old = tl.atomic_cas(ptr, cmp, val, sem=SEM, scope="sys")
        if COMPILED:
            expired = (_now_ns() - start > timeout_ns).to(tl.int32)
        else:
            tries += 1
            expired = (tries >= TRIES).to(tl.int32)
    if old != cmp:
        tl.atomic_xchg(status_ptr, 1)
        if COMPILED:
            _trap()


@triton.jit
def _reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, bufs_ptr, pads_ptr, status_ptr, offset, rank, H,
                                eps, timeout_ns, WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                                COMPILED: tl.constexpr):
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
            _swap_flag(peer_pad + t * WORLD + rank, 0, 1, "release", status_ptr, timeout_ns, COMPILED,
                       INTERPRETER_TRIES)
    own_pad = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            _swap_flag(own_pad + t * WORLD + p, 1, 0, "acquire", status_ptr, timeout_ns, COMPILED,
                       INTERPRETER_TRIES)
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        src = tl.load(bufs_ptr + p).to(tl.pointer_type(dtype))
        acc += tl.load(src + offset + row + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    r = tl.load(res_ptr + row + offs, mask=mask, other=0.0)
    s = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_ptr + row + offs, s, mask=mask)
    tl.store(out_ptr + row + offs, rms_norm_row(s, w, H, eps).to(out_ptr.dtype.element_ty), mask=mask)


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
    status: torch.Tensor,       # [1] int32 on the device: set to 1 when a peer did not arrive in time
    timeout_s: float = 120.0,   # how long a program waits for a peer's flag
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
    if status.dtype != torch.int32 or status.numel() < 1:
        raise ValueError("status must be an int32 tensor of at least one element")
    if T == 0:
        return
    _reduce_add_rms_norm_kernel[(T,)](x, residual, weight, out, buffer_ptrs, pad_ptrs, status, offset, rank, H,
                                      eps, int(timeout_s * 1e9), WORLD=world, BLOCK=next_pow2(H), num_warps=8,
                                      COMPILED=compiled(), **launch_args(pdl_enabled(x.device)))
