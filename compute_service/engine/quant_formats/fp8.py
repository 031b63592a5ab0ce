"""FP8 checkpoints, dequantized at load: the engine has no FP8 kernels, so their weights run in the model dtype
(the memory of a 16-bit model; the point is that they load at all).

Two layouts, by `quantization_config`:
  quant_method "fp8" (block-wise with `weight_block_size: [bn, bk]`, or one scale a tensor):
      P.weight float8 [N, K], P.weight_scale_inv float32 [ceil(N / bn), ceil(K / bk)] (or P.weight_scale [1]):
      w = weight * the scale of its block
  compressed-tensors with float weights (format "float-quantized" or "naive-quantized"):
      P.weight float8 [N, K], P.weight_scale [N, 1] (channel), [1] (tensor) or [N, K / G] (group): w = weight * s
Activation scales (`input_scale`: FP8 activations, static or dynamic) are not used: activations stay in the
model dtype, which follows the original model more closely than FP8 activations would.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError
from compute_service.engine.quant_formats.dequantized import DequantizingSource

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CT_FLOAT_FORMATS = {"float-quantized", "naive-quantized"}


def is_fp8(qcfg: dict[str, Any]) -> bool:
    """Whether a `quantization_config` describes FP8 weights (either layout of the module docstring)."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    if method != "compressed-tensors":
        return False
    groups = list((qcfg.get("config_groups") or {}).values())
    formats = {qcfg.get("format")} | {g.get("format") for g in groups}
    weights = [g.get("weights") or {} for g in groups]
    floats = [w.get("type") == "float" and w.get("num_bits") == 8 for w in weights]
    if not (formats - {None, "mixed-precision"}) <= _CT_FLOAT_FORMATS or not any(floats):
        return False
    if not all(floats):
        raise UnsupportedModelError(f"compressed-tensors groups mixing FP8 and other weights ({weights}) are not "
                                    "supported")
    return True


def _expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A scale per block ([a, b] blocks over [N, K], a channel [N, 1], or one [1] / []) as [N, K]."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, k)
    s = scale.reshape(scale.shape[0], -1) if scale.dim() else scale.reshape(1, 1)
    a, b = s.shape
    if a > n or b > k:
        raise ModelLoadError(f"an FP8 scale of shape {tuple(scale.shape)} does not fit a [{n}, {k}] weight")
    return s.repeat_interleave(-(-n // a), 0)[:n].repeat_interleave(-(-k // b), 1)[:, :k]


def dequantize(name: str, t: torch.Tensor, raw: Callable[[str], torch.Tensor | None],
               place: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """An FP8 weight as float32 (its value times the scale of its block); None for tensors stored otherwise."""
    if t.dtype not in FP8_DTYPES:
        return None
    prefix = name.removesuffix(".weight")
    scale = raw(prefix + ".weight_scale_inv")
    if scale is None:
        scale = raw(prefix + ".weight_scale")
    if scale is None:
        raise ModelLoadError(f"FP8 weight {name!r} has no {prefix}.weight_scale_inv or .weight_scale")
    t = place(t).float()
    return t * scale.float() if t.dim() != 2 else t * _expand(scale.float(), *t.shape)


def fp8_source(raw: Callable[[str], torch.Tensor | None], qcfg: dict[str, Any]) -> DequantizingSource:
    return DequantizingSource(raw, dequantize,
                              f"FP8 checkpoint ({qcfg.get('quant_method')}; activation scales unused)")
