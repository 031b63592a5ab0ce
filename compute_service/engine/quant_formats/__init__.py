"""Quantized checkpoint formats: readers into `QuantizedWeight` (one file per format) and the choice to keep them.

`--quantization`: `auto` keeps a quantized checkpoint quantized on CUDA (the W4A16/W8A16 kernels) when
its projections would take at least `AUTO_KEEP_MIN_BYTES` dequantized, and dequantizes it otherwise
(smaller models, and the CPU); `keep` keeps it quantized everywhere (on the CPU dequantize-then-matmul on
every call: a slow reference path, for tests); `none` dequantizes everywhere.

Why the size: a small model's projections are bound by launch latency, not by their bytes, so reading
4-bit codes saves little and the 16-bit library GEMM is faster. Measured on an H100
(bench/results/default_model_quant.json): the default SmolLM2-135M (212 MB of projections in bf16) kept
4-bit decodes at about 1.0x bf16 at batch 1 and 0.7-0.9x at batches 8 and 64; the Llama-3-8B shape (14 GB)
at 1.73x / 1.25x / 1.12x / 0.89x at batches 1 / 8 / 32 / 64 (bench/results/quant_decode.json), and it
takes 3.8x less memory.
"""
from __future__ import annotations

import torch

from compute_service.adapter_cache.layout import module_features
from compute_service.engine.spec import ModelSpec

QUANTIZATION_MODES = ("auto", "keep", "none")


AUTO_KEEP_MIN_BYTES = 1 << 30     # dequantized projection bytes from which `auto` keeps a model quantized


def dense_projection_bytes(spec: ModelSpec, elem_bytes: int = 2) -> int:
    """Bytes of every layer's q/k/v, o, gate/up and down weights in a 16-bit dtype."""
    per_layer = sum(fin * fout for fin, fout in module_features(spec).values())
    return per_layer * spec.num_layers * elem_bytes


def keeps_quantized(mode: str, device: torch.device, spec: ModelSpec | None = None) -> bool:
    """Whether a quantized checkpoint stays quantized under `--quantization mode` on `device` (`spec`: the
    model's, for `auto`'s size rule; None = large enough)."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "keep"
    return device.type == "cuda" and (spec is None or dense_projection_bytes(spec) >= AUTO_KEEP_MIN_BYTES)
