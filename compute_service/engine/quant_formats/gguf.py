"""GGUF Q4_0 / Q4_1 / Q8_0 tensors in the canonical form, exactly.

Each row of K values is K/32 blocks of 32; a block starts with a float16 scale d:
  Q4_0  d, 16 bytes of nibbles          w = d * (q - 8)     -> offset -8 d
  Q4_1  d, m (float16), 16 bytes        w = d * q + m       -> offset m
  Q8_0  d, 32 int8 values               w = d * q           -> codes q + 128, offset -128 d
In the 16 nibble bytes, the low nibbles are elements 0..15 and the high nibbles 16..31.
The offsets of Q4_0 and Q8_0 are powers of two times d, so float16 holds them exactly (barring overflow).
"""
from __future__ import annotations

import numpy as np
import torch

from compute_service.engine.quantized import QuantizedWeight

BLOCK = 32
# GGML type id -> (name, bytes a block, bits)
KEPT_TYPES = {2: ("Q4_0", 18, 4), 3: ("Q4_1", 20, 4), 8: ("Q8_0", 34, 8)}


def type_name(tensor_type: int) -> str:
    return KEPT_TYPES[int(tensor_type)][0]


def block_weight(data: np.ndarray, tensor_type: int) -> QuantizedWeight | None:
    """Raw rows [N, K/32 * block bytes] uint8 of a Q4_0/Q4_1/Q8_0 tensor -> canonical weight; None for
    other types, or when an offset overflows float16 (the caller then dequantizes)."""
    kind = KEPT_TYPES.get(int(tensor_type))
    if kind is None:
        return None
    name, nbytes, bits = kind
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, nbytes)                       # [N, K/32, bytes]
    d = blocks[..., :2].copy().view(np.float16)[..., 0]                               # [N, K/32]
    if name == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, K/32, 32]
        offsets = d.astype(np.float32) * -128.0
    else:
        nib = blocks[..., nbytes - 16:]                                               # [N, K/32, 16]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)                           # [N, K/32, 32]
        if name == "Q4_0":
            offsets = d.astype(np.float32) * -8.0
        else:
            offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    offsets16 = offsets.astype(np.float16)
    if not np.isfinite(offsets16).all():
        return None
    return QuantizedWeight(torch.from_numpy(q.reshape(n, -1).copy()), torch.from_numpy(d.copy()),
                           torch.from_numpy(offsets16), bits, BLOCK)
