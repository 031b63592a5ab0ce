"""Writing x in an act-order projection's channel order.

An act-order checkpoint stores a projection's input channels sorted by quantization group: the projection reads
x in that order (`QuantLinear.input_perm`: stored channel j is the model's channel perm[j]). Gathering x in a
launch of its own before each projection costs a launch, and the projection's dependent launch can no longer
read its weight ahead of it (H200, the 4-bit 8B at one token: 3.06 ms a token against 2.03 in the stored order,
bench/results/quant_decode_act_order.json). The kernels that write x anyway (the norms, `kernels.rms_norm`; the
SwiGLU, `kernels.silu_mul`) write it in that order instead, and also in the model's order where a LoRA launch
reads it (its A is in the model's order).
"""
from __future__ import annotations

import torch


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
