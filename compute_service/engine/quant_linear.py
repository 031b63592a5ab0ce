"""A base projection whose weight is stored weight-only quantized (4 or 8 bits, group-wise).

Same call as `Linear` (`__call__([T, K]) -> [T, N]`, `in_features`, `out_features`,
`nbytes`), so the model, the LoRA backend (which adds its deltas to the output, in
the activations' dtype) and CUDA graphs do not change.

CPU: dequantize-then-matmul on every call (the reference path; slow, meant for tests
and small models).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compute_service.engine.quantized import QuantizedWeight


class QuantLinear:
    """Quantized weight [N, K] (canonical form, see `quantized.py`), optional bias [N] in the model dtype."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device) -> None:
        self.qweight = qweight.to(device)
        self.bias = None if bias is None else bias.to(device)
        self.device = device

    @property
    def bits(self) -> int:
        return self.qweight.bits

    @property
    def group_size(self) -> int:
        return self.qweight.group_size

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: packed codes, scales, offsets (and bias)."""
        n, k = self.qweight.shape
        codes = n * k * self.bits // 8
        return (codes + self.qweight.scales.nbytes + self.qweight.offsets.nbytes
                + (0 if self.bias is None else self.bias.nbytes))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] dense weight (for fingerprints, sharding and tests)."""
        return self.qweight.dequantize(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.dequantize(x.dtype)                                  # [N, K]
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))   # [T, N]
