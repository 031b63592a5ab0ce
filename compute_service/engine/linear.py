"""A base projection as an object: `Linear(x)` is `x @ weight.T + bias`.

The model calls its projections (qkv, o, gate_up, down) through this interface,
so a layer whose weights are stored another way (quantized, sharded) only has to
provide the same call; the LoRA deltas are added to its output by the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """Dense weight [N, K] in the model dtype, optional bias [N]; `__call__([T, K]) -> [T, N]`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight             # [N, K]
        self.bias = bias                 # [N] or None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads from memory (weight and bias)."""
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)                            # [T, N]
