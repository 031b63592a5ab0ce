"""RoPE on q and k plus the KV-cache write, in one launch per layer.

Reads the fused q/k/v projection output of each token, rotates q and k
(rotate-half layout, cos/sin tables indexed by position), writes the rotated q
to `q_out` and the rotated k and the v straight into the paged cache slot of
the token. Replaces ~20 elementwise launches (two rotations, cat, casts, two
index copies). Rounds where the torch version does in the model dtype: cos/sin
cast to it, each product and the sum rounded to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.addend import check_extra, extra_pdl, with_extra
from kernels.host_ints import next_pow2
from kernels.pdl import launch_args, wait_then_release
from kernels.split_sum import SplitSum, load_input, summed_input


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """First and second halves of x * cos + rotate_half(x) * sin, each op rounded to x's dtype."""
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rope_cache_kernel(qkv_ptr, qkv_stride, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr,
                       v_cache_ptr, num_heads, num_kv_heads, head_dim, half, kv_per_program,
                       BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr, extra_ptr=None, extra_stride=0,
                       EXTRA: tl.constexpr = False, part_stride=0, NPARTS: tl.constexpr = 0):
    """Token program_id(0); KV heads kv_per_program * program_id(1) onwards and their query heads (grouped-query
    attention: num_heads / num_kv_heads a KV head). NPARTS > 0: qkv_ptr holds split-K partials
    (`kernels.split_sum`), summed as they are read."""
    t = tl.program_id(0).to(tl.int64)
    kv0 = tl.program_id(1) * kv_per_program
    q_per_program = kv_per_program * (num_heads // num_kv_heads)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    row = qkv_ptr + t * qkv_stride
    xrow = extra_ptr + t * extra_stride               # the extra's row, columns as qkv's (EXTRA)
    dt = q_out_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + pos * head_dim + j, mask=jm, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * head_dim + half + j, mask=jm, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * head_dim + j, mask=jm, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * head_dim + half + j, mask=jm, other=0.0).to(dt).to(tl.float32)
    wait_then_release(USE_PDL)       # positions, slots and the tables above are the step's inputs

    hl = tl.arange(0, BLOCK_H)
    h = kv0 * (num_heads // num_kv_heads) + hl
    m = ((hl < q_per_program) & (h < num_heads))[:, None] & jm[None, :]
    base = h[:, None] * head_dim + j[None, :]
    o1, o2 = _rotate(_read(row, xrow, base, m, part_stride, NPARTS, dt, EXTRA),
                     _read(row, xrow, base + half, m, part_stride, NPARTS, dt, EXTRA),
                     c1[None, :], c2[None, :], s1[None, :], s2[None, :])
    q_row = q_out_ptr + t * num_heads * head_dim
    tl.store(q_row + base, o1, mask=m)
    tl.store(q_row + base + half, o2, mask=m)

    kv_width = num_kv_heads * head_dim
    gi = tl.arange(0, BLOCK_KVH)
    g = kv0 + gi
    gm = (gi < kv_per_program) & (g < num_kv_heads)
    m = gm[:, None] & jm[None, :]
    base = num_heads * head_dim + g[:, None] * head_dim + j[None, :]      # k's columns of qkv
    o1, o2 = _rotate(_read(row, xrow, base, m, part_stride, NPARTS, dt, EXTRA),
                     _read(row, xrow, base + half, m, part_stride, NPARTS, dt, EXTRA),
                     c1[None, :], c2[None, :], s1[None, :], s2[None, :])
    k_row = k_cache_ptr + slot * kv_width
    kbase = g[:, None] * head_dim + j[None, :]
    tl.store(k_row + kbase, o1, mask=m)
    tl.store(k_row + kbase + half, o2, mask=m)

    d = tl.arange(0, BLOCK_D)
    m = gm[:, None] & (d < head_dim)[None, :]
    vbase = g[:, None] * head_dim + d[None, :]
    v = _read(row, xrow, num_heads * head_dim + kv_width + vbase, m, part_stride, NPARTS, dt, EXTRA)
    tl.store(v_cache_ptr + slot * kv_width + vbase, v, mask=m)


@triton.jit
def _read(row, xrow, cols, mask, part_stride, NPARTS: tl.constexpr, dt: tl.constexpr, EXTRA: tl.constexpr):
    """qkv's row at `cols` in the model dtype (NPARTS: the partials summed), plus the extra's (EXTRA)."""
    return with_extra(load_input(row + cols, mask, part_stride, NPARTS, dt), xrow + cols, mask, EXTRA)


def rope_and_cache(
    qkv: torch.Tensor | SplitSum,  # [T, H*D + 2*KVH*D] fused projection output, rows contiguous (or partials)
    positions: torch.Tensor,      # [T] int64
    slot_mapping: torch.Tensor,   # [T] int64 flat KV slot of each token
    cos: torch.Tensor,            # [P, D] float32
    sin: torch.Tensor,            # [P, D] float32
    q_out: torch.Tensor,          # [T, H, D] contiguous
    k_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D] contiguous
    v_cache: torch.Tensor,        # [num_blocks, block_size, KVH, D] contiguous
    extra: torch.Tensor | None = None,   # like qkv (rows contiguous): added to it first
) -> None:
    """Semantics (rot(x) = x * cos[p] + cat(-x[D/2:], x[:D/2]) * sin[p], in the model dtype):
        qkv = qkv + extra if extra is not None        (model dtype, as torch adds them; not stored)
        q, k, v = qkv.split([H*D, KVH*D, KVH*D], -1)
        q_out[t] = rot(q[t].view(H, D));  k_cache.view(-1, KVH, D)[slot[t]] = rot(k[t].view(KVH, D))
        v_cache.view(-1, KVH, D)[slot[t]] = v[t].view(KVH, D)
    """
    T, H, D = q_out.shape
    KVH = k_cache.shape[2]
    if qkv.dim() != 2 or qkv.shape != (T, (H + 2 * KVH) * D) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [{T}, {(H + 2 * KVH) * D}] with contiguous rows, got {tuple(qkv.shape)}")
    if D % 2 or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"head dim {D} must be even and match caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if not (q_out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q_out and the caches must be contiguous")
    if len({qkv.dtype, q_out.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError("qkv, q_out and the caches must share one dtype")
    if cos.dtype != torch.float32 or sin.shape != cos.shape or cos.shape[1] != D or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise ValueError(f"cos/sin must be contiguous float32 [P, {D}]")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64 or positions.shape[0] < T \
            or slot_mapping.shape[0] < T:
        raise ValueError(f"positions and slot_mapping must be int64 [>= {T}]")
    check_extra(extra, qkv, "qkv")
    if T == 0:
        return
    if H % KVH:
        raise ValueError(f"{H} query heads do not group over {KVH} KV heads")
    pdl = extra_pdl(qkv.device, extra)
    src, nparts, part_stride = summed_input(qkv)
    # One program a token, or with partials to sum (several times the bytes) one a KV head and its query heads
    kv_per_program = 1 if nparts else KVH
    _rope_cache_kernel[(T, KVH // kv_per_program)](
        src, qkv.stride(0), positions, slot_mapping, cos, sin, q_out, k_cache, v_cache, H, KVH, D, D // 2,
        kv_per_program, BLOCK_H=next_pow2(kv_per_program * (H // KVH)), BLOCK_KVH=next_pow2(kv_per_program),
        BLOCK_HALF=next_pow2(D // 2), BLOCK_D=next_pow2(D), num_warps=4,
        extra_ptr=extra if extra is not None else q_out, extra_stride=extra.stride(0) if extra is not None else 0,
        EXTRA=extra is not None, part_stride=part_stride, NPARTS=nparts, **launch_args(pdl))
