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

import logging
from typing import Any, Callable

import torch

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

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


class Fp8Source:
    """Tensor source by HF name over an FP8 checkpoint: FP8 weights come back dequantized in float32
    (on `work_device` where the loader set one); nothing is kept quantized (`quantized` gives None)."""

    format_name = None              # no projection stays quantized: a dense checkpoint to the loader

    def __init__(self, raw: Callable[[str], torch.Tensor | None], qcfg: dict[str, Any]) -> None:
        self._raw = raw
        self.work_device: torch.device | None = None
        log.info("FP8 checkpoint (%s): weights dequantized at load to the model dtype (no FP8 kernels; "
                 "activation scales unused)", qcfg.get("quant_method"))

    def __call__(self, name: str) -> torch.Tensor | None:
        t = self._raw(name)
        if t is None or t.dtype not in FP8_DTYPES:
            return t
        prefix = name.removesuffix(".weight")
        scale = self._raw(prefix + ".weight_scale_inv")
        if scale is None:
            scale = self._raw(prefix + ".weight_scale")
        if scale is None:
            raise ModelLoadError(f"FP8 weight {name!r} has no {prefix}.weight_scale_inv or .weight_scale")
        if self.work_device is not None:
            t, scale = t.to(self.work_device), scale.to(self.work_device)
        if t.dim() != 2:
            return t.float() * scale.float()
        return t.float() * _expand(scale.float(), *t.shape)

    def quantized(self, prefix: str) -> None:
        return None
