"""Fused residual add + RMSNorm: one launch instead of ~8 elementwise ops per norm (decode is launch-bound).

Rounds exactly where Hugging Face Llama does in the model dtype: the residual
sum is stored in the model dtype, the normalisation runs in fp32, the result is
cast to the model dtype before the weight multiplies it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.addend import check_extra, extra_pdl, with_extra
from kernels.host_ints import next_pow2
from kernels.pdl import launch_args, wait_then_release
from kernels.perm import check_perm
from kernels.quant_half_sums import slice_width, store_slice_sums
from kernels.split_sum import SplitSum, load_input, summed_input


@triton.jit
def rms_norm_row(s, w, H, eps):
    """fp32 [BLOCK]: RMSNorm of one row s (model dtype, 0 past H) times w (fp32), the normalised row
    rounded to s's dtype before the weight, as transformers does."""
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / H
    return (sf * tl.rsqrt(var + eps)).to(s.dtype).to(tl.float32) * w


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, sums_ptr, H, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                         SUMS: tl.constexpr = 0, extra_ptr=None, EXTRA: tl.constexpr = False, part_stride=0,
                         NPARTS: tl.constexpr = 0, perm_ptr=None, PERM: tl.constexpr = False, model_out_ptr=None,
                         MODEL_OUT: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)     # weights: read before the wait
    if PERM:
        perm = tl.load(perm_ptr + offs, mask=mask, other=0)            # the model's: read before the wait too
    wait_then_release(USE_PDL)
    x = load_input(x_ptr + t * H + offs, mask, part_stride, NPARTS, out_ptr.dtype.element_ty)   # NPARTS: summed
    x = with_extra(x, extra_ptr + t * H + offs, mask, EXTRA)
    if HAS_RES:
        r = tl.load(res_ptr + t * H + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + t * H + offs, x, mask=mask)
    y = rms_norm_row(x, w, H, eps).to(out_ptr.dtype.element_ty)
    if PERM:            # out in the projection's stored channel order, model_out (if any) in the model's
        if MODEL_OUT:
            tl.store(model_out_ptr + t * H + offs, y, mask=mask)
        y = tl.where(mask, tl.gather(y, perm, 0), 0.0).to(y.dtype)
    tl.store(out_ptr + t * H + offs, y, mask=mask)
    if SUMS:            # SUMS: the slices' width
        store_slice_sums(y, sums_ptr, t * (H // SUMS), H // SUMS, SUMS)


def add_rms_norm(
    x: torch.Tensor | SplitSum,       # [T, H] contiguous (or a split-K projection's partials, kernels.split_sum)
    residual: torch.Tensor | None,    # [T, H] contiguous, or None (no add)
    weight: torch.Tensor,             # [H]
    eps: float,
    out: torch.Tensor,                # [T, H] normalised output
    residual_out: torch.Tensor | None = None,   # [T, H] receives x + residual (may alias residual)
    sums: torch.Tensor | None = None,           # [T, H / width] float32: out's sums over each width-wide slice
    extra: torch.Tensor | None = None,          # [T, H] contiguous like x: added to x first
    perm: torch.Tensor | None = None,           # [H] int32: out in this channel order (a projection's act-order)
    model_out: torch.Tensor | None = None,      # [T, H]: with perm, also receives the output in the model's order
) -> None:
    """Semantics:
        x = x + extra if extra is not None                         (model dtype, as torch adds them)
        s = (x + residual) if residual is not None else x          (model dtype); residual_out[:] = s
        out = weight * (s.float() * rsqrt(mean(s.float() ** 2, -1) + eps)).to(dtype)
        sums = out.float().reshape(T, H // width, width).sum(-1)   (width = H // sums.shape[1]; fp32, some order)
    With `perm` (a permutation of the H channels, `QuantLinear.input_perm`): out[:, j] is the normalised row's
    channel perm[j] (so that an act-order projection reads out as it is, with no gather of its own), the sums
    are out's, and `model_out` (if given) receives the row in the model's order (for a LoRA launch's read).
    """
    if x.dim() != 2 or not x.is_contiguous() or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError(f"x and out must be contiguous [T, H] of one shape, got {tuple(x.shape)}, {tuple(out.shape)}")
    T, H = x.shape
    if weight.shape != (H,) or weight.dtype != x.dtype or out.dtype != x.dtype:
        raise ValueError(f"weight must be [{H}] and out of x's dtype {x.dtype}")
    if residual is not None:
        if residual_out is None or residual.shape != x.shape or residual_out.shape != x.shape \
                or not residual.is_contiguous() or not residual_out.is_contiguous() or residual.dtype != x.dtype:
            raise ValueError("residual and residual_out must be contiguous tensors like x")
    width = slice_width(sums, T, H)
    check_extra(extra, x, "x", contiguous=True)
    check_perm(perm, model_out, out, H)
    if T == 0:
        return
    pdl = extra_pdl(x.device, extra)
    # Partials (8 rows of 4096 float32 at one row of the 8B's o and down) are read by one program: on 32 warps,
    # for loads enough in flight (H200, the 4-bit 8B at batch 1: 2.09 ms a token against 2.13 on 16 warps and
    # 2.23 with o and down summing in their own launch; on 8 warps the norm took ~3.3 us more than that sum)
    src, nparts, part_stride = summed_input(x)
    _add_rms_norm_kernel[(T,)](src, residual if residual is not None else out, weight, out,
                               residual_out if residual_out is not None else out,
                               sums if sums is not None else out, H, eps,
                               HAS_RES=residual is not None, BLOCK=next_pow2(H), num_warps=32 if nparts else 8,
                               SUMS=width,
                               extra_ptr=extra if extra is not None else out, EXTRA=extra is not None,
                               part_stride=part_stride, NPARTS=nparts,
                               perm_ptr=perm if perm is not None else out, PERM=perm is not None,
                               model_out_ptr=model_out if model_out is not None else out,
                               MODEL_OUT=model_out is not None, **launch_args(pdl))
