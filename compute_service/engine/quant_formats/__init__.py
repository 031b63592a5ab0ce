"""Quantized checkpoint formats: readers into `QuantizedWeight` (one file per format) and the choice to keep them.

`--quantization`: `auto` keeps a quantized checkpoint quantized on CUDA (the W4A16/W8A16 kernels), whatever
its size, and dequantizes it on the CPU; `keep` keeps it quantized everywhere (on the CPU
dequantize-then-matmul on every call: a slow reference path, for tests); `none` dequantizes everywhere.

The choice follows the files, as a user of a quantized checkpoint expects: the default SmolLM2 (GGUF
Q4_1) runs 4-bit on the GPU. For a model that small 4-bit saves memory rather than time: its projections
are bound by launch latency, not by their bytes, so from about 8 concurrent sequences the 16-bit library
GEMM is faster and `--quantization none` serves it faster (figures in docs/quantization-performance.md, "The default
model"); from a few GiB of weights up (the Llama-3-8B shape) 4-bit is 3.8x smaller and faster up to
about 64 concurrent sequences (docs/quantization-performance.md, "Engine" and "Served").
"""
from __future__ import annotations

import torch

QUANTIZATION_MODES = ("auto", "keep", "none")


def keeps_quantized(mode: str, device: torch.device) -> bool:
    """Whether a quantized checkpoint stays quantized under `--quantization mode` on `device`."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "keep"
    return device.type == "cuda"
