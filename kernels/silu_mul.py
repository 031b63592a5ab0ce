"""SwiGLU activation in one launch: silu(gate) * up from the fused gate/up projection output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.addend import check_extra, extra_pdl, with_extra
from kernels.host_ints import cdiv, next_pow2
from kernels.pdl import launch_args, wait_then_release
from kernels.perm import check_perm
from kernels.quant_half_sums import slice_width, store_slice_sums
from kernels.split_sum import SplitSum, load_input, summed_input


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, sums_ptr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                     SUMS: tl.constexpr = 0, extra_ptr=None, EXTRA: tl.constexpr = False, part_stride=0,
                     NPARTS: tl.constexpr = 0, perm_ptr=None, PERM: tl.constexpr = 0, model_out_ptr=None,
                     MODEL_OUT: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    src = offs          # the model's channel of each value here, and its place in out (perm_ptr: read before the
    dst = offs          # wait, it is the model's)
    if PERM == 1:       # perm: out[j] = result[perm[j]], gathered
        src = tl.load(perm_ptr + offs, mask=mask, other=0)
    if PERM == 2:       # its inverse: out[inverse[j]] = result[j], scattered
        dst = tl.load(perm_ptr + offs, mask=mask, other=0)
    wait_then_release(USE_PDL)
    dt = out_ptr.dtype.element_ty
    g = load_input(gu_ptr + t * 2 * inter + src, mask, part_stride, NPARTS, dt)     # NPARTS: partials summed
    u = load_input(gu_ptr + t * 2 * inter + inter + src, mask, part_stride, NPARTS, dt)
    g = with_extra(g, extra_ptr + t * 2 * inter + src, mask, EXTRA)
    u = with_extra(u, extra_ptr + t * 2 * inter + inter + src, mask, EXTRA)
    gf = g.to(tl.float32)
    act = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)      # silu rounds to the model dtype, as torch
    y = (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * inter + dst, y, mask=mask)
    if MODEL_OUT:       # with PERM: the row in the model's order too, for a LoRA launch to read
        tl.store(model_out_ptr + t * inter + src, y, mask=mask)
    if SUMS:            # SUMS: the slices' width, dividing BLOCK (not with PERM 2: this block is not out's)
        first = tl.program_id(1) * (BLOCK // SUMS)
        store_slice_sums(y, sums_ptr, t * (inter // SUMS) + first, inter // SUMS - first, SUMS)


def silu_mul(gate_up: torch.Tensor | SplitSum,   # [T, 2I] contiguous: gate columns first, then up (or partials)
             out: torch.Tensor,       # [T, I]
             sums: torch.Tensor | None = None,   # [T, I / width] float32: out's sums over each width-wide slice
             extra: torch.Tensor | None = None,  # [T, 2I] contiguous like gate_up: added to it first
             perm: torch.Tensor | None = None,   # [I] int32: out in this channel order (a projection's act-order)
             model_out: torch.Tensor | None = None,  # [T, I]: with perm, also receives out in the model's order
             inverse: torch.Tensor | None = None,  # [I] int32: perm's inverse (inverse[perm[j]] = j), optional
             ) -> None:
    """Semantics: gate_up = gate_up + extra if extra is not None   (model dtype, as torch adds them; not stored)
    out = F.silu(gate_up[:, :I]) * gate_up[:, I:]   (each op rounded to the model dtype);
    sums = out.float().reshape(T, I // width, width).sum(-1)   (width = I // sums.shape[1]; fp32, some order).
    With `perm` (`kernels.perm`): out[:, j] is the result's channel perm[j], the sums are out's, and `model_out`
    (if given) receives the result in the model's order. Where `inverse` is given too and no sums are asked, the
    kernel reads gate_up in its order and scatters out (one access out of order a value, where gathering makes
    one an input and a partial: H200, the 4-bit 8B at one token, the SwiGLU ended ~6 us after gate/up gathering
    two partials of each input, ~1.2 us without act-order); else it gathers its inputs."""
    if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be contiguous [T, 2I], got {tuple(gate_up.shape)}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out.shape != (T, inter) or not out.is_contiguous() or out.dtype != gate_up.dtype:
        raise ValueError(f"out must be contiguous [{T}, {inter}] of dtype {gate_up.dtype}")
    width = slice_width(sums, T, inter)
    check_extra(extra, gate_up, "gate_up", contiguous=True)
    check_perm(perm, model_out, out, inter)
    if inverse is not None:
        if perm is None:
            raise ValueError("inverse is perm's inverse: give perm too")
        check_perm(inverse, None, out, inter)
    mode, index = (0, out) if perm is None else (2, inverse) if inverse is not None and not width else (1, perm)
    if T == 0:
        return
    src, nparts, part_stride = summed_input(gate_up)
    # partials (several times the bytes of gate_up) over more programs: 4 times as many at one row
    block = max(min(256 if nparts else 1024, next_pow2(inter)), width)
    pdl = extra_pdl(gate_up.device, extra)
    _silu_mul_kernel[(T, cdiv(inter, block))](src, out, sums if sums is not None else out, inter, BLOCK=block,
                                              num_warps=4, SUMS=width,
                                              extra_ptr=extra if extra is not None else out,
                                              EXTRA=extra is not None, part_stride=part_stride, NPARTS=nparts,
                                              perm_ptr=index, PERM=mode,
                                              model_out_ptr=model_out if model_out is not None else out,
                                              MODEL_OUT=model_out is not None, **launch_args(pdl))
