"""Quantized checkpoint formats: readers into `QuantizedWeight` (one file per format) and the choice to keep them.

`--quantization`: `auto` keeps a quantized checkpoint quantized on CUDA (the W4A16/W8A16 kernels)
and dequantizes it on the CPU; `keep` keeps it quantized on the CPU too (dequantize-then-matmul on
every call: a slow reference path, for tests); `none` dequantizes everywhere.
"""
from __future__ import annotations

import torch

QUANTIZATION_MODES = ("auto", "keep", "none")


def keeps_quantized(mode: str, device: torch.device) -> bool:
    """Whether a quantized checkpoint stays quantized under `--quantization mode` on `device`."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    return mode == "keep" or (mode == "auto" and device.type == "cuda")
