"""Writing x in an act-order projection's channel order.

An act-order checkpoint stores a projection's input channels sorted by quantization group: the projection reads
x in that order (`QuantLinear.input_perm`: stored channel j is the model's channel perm[j]). Gathering x in a
launch of its own before each projection costs a launch, and the projection's dependent launch can no longer
read its weight ahead of it (H200, the 4-bit 8B at one token: 3.06 ms a token against 2.03 in the stored order,
bench/results/quant_decode_act_order.json). The kernels that write x anyway (the norms, `kernels.rms_norm`; the
SwiGLU, `kernels.silu_mul`) write it in that order instead, and also in the model's order where a LoRA launch
reads it (its A is in the model's order). Where no such kernel writes x (o's x comes from attention),
`gather_columns` gathers it in a launch that lets the projection after it start reading its weight at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv
from kernels.pdl import launch_args, pdl_enabled, wait_then_release

GATHER_BLOCK = 1024


@triton.jit
def _gather_kernel(x_ptr, perm_ptr, out_ptr, K, x_stride, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    src = tl.load(perm_ptr + offs, mask=mask, other=0)          # the model's: read before the wait
    wait_then_release(USE_PDL)     # the next launch (the projection) reads its weight while this gathers x
    tl.store(out_ptr + t * K + offs, tl.load(x_ptr + t * x_stride + src, mask=mask), mask=mask)


def gather_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x[:, perm] ([T, K], rows with unit stride; perm int32 [K]) as a new contiguous tensor, in one dependent
    launch (kernels/pdl.py) where the device takes them: a library gather is launched without, so that the
    projection after it could read nothing before it ended."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, K] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    t, k = x.shape
    check_perm(perm, None, x, k)
    out = torch.empty(t, k, dtype=x.dtype, device=x.device)
    if t:
        _gather_kernel[(t, cdiv(k, GATHER_BLOCK))](x, perm, out, k, x.stride(0), BLOCK=GATHER_BLOCK, num_warps=4,
                                                   **launch_args(pdl_enabled(x.device)))
    return out


def check_perm(perm: torch.Tensor | None, model_out: torch.Tensor | None, out: torch.Tensor, width: int) -> None:
    """Raises unless `perm` (if any) is contiguous int32 [width] on out's device, and `model_out` (allowed only
    with a perm) is a contiguous tensor like `out`."""
    if perm is None:
        if model_out is not None:
            raise ValueError("model_out is written only with a perm (out is in the model's order without one)")
        return
    if perm.shape != (width,) or perm.dtype != torch.int32 or not perm.is_contiguous() or perm.device != out.device:
        raise ValueError(f"perm must be contiguous int32 [{width}] on {out.device}, got {perm.dtype} "
                         f"{tuple(perm.shape)} on {perm.device}")
    if model_out is not None and (model_out.shape != out.shape or model_out.dtype != out.dtype
                                  or not model_out.is_contiguous() or model_out.device != out.device):
        raise ValueError(f"model_out must be contiguous {out.dtype} {tuple(out.shape)} like out, got "
                         f"{model_out.dtype} {tuple(model_out.shape)}")
