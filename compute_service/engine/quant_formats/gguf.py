"""GGUF Q4_0 / Q4_1 / Q8_0 tensors in the canonical form, exactly; Q4_K and Q5_K to float16 rounding.

Each row of K values is K/32 blocks of 32; a block starts with a float16 scale d:
  Q4_0  d, 16 bytes of nibbles          w = d * (q - 8)     -> offset -8 d
  Q4_1  d, m (float16), 16 bytes        w = d * q + m       -> offset m
  Q8_0  d, 32 int8 values               w = d * q           -> codes q + 128, offset -128 d
In the 16 nibble bytes, the low nibbles are elements 0..15 and the high nibbles 16..31.
The offsets of Q4_0 and Q8_0 are powers of two times d, so float16 holds them exactly (barring overflow).

The K-quants come in super-blocks of 256 values, 8 sub-blocks of 32 with 6-bit scales and minimums:
  Q4_K  d, dmin (float16), 12 bytes of sub-block scales / minimums, 128 bytes of nibbles
  Q5_K  the same, then 32 bytes of fifth bits, then 128 bytes of nibbles
  sub-block s:  w = d sc_s q - dmin m_s         -> group of 32, scale d sc_s, offset -dmin m_s
Sub-block scales: bytes 0-3 hold sc_0..3 (low 6 bits), 4-7 m_0..3, bytes 8-11 the low 4 bits of sc_4..7
(low nibble) and m_4..7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 (sc) and 4-7 (m).
The nibble bytes are 4 chunks of 32: chunk c's low nibbles are sub-block 2c, its high nibbles 2c + 1; Q5_K's
fifth bit of element l of sub-block s is bit s of byte l of the 32. A product of a float16 and a 6-bit
integer needs up to 17 significant bits: the scales and offsets are rounded to float16 once (relative 2^-11,
well inside the codes' own step). Q5_K's 5-bit codes are held as 8-bit codes. Q6_K (16-value sub-blocks),
Q2_K and Q3_K are dequantized.
"""
from __future__ import annotations

import numpy as np
import torch

from compute_service.engine.quantized import QuantizedWeight

BLOCK = 32
# GGML type id -> (name, bytes a block, bits): the types the canonical form holds exactly ...
EXACT_TYPES = {2: ("Q4_0", 18, 4), 3: ("Q4_1", 20, 4), 8: ("Q8_0", 34, 8)}
# ... and the K-quants it holds to float16 rounding of their scales (bytes a super-block of 256)
K_TYPES = {12: ("Q4_K", 144, 4), 13: ("Q5_K", 176, 8)}
KEPT_TYPES = {**EXACT_TYPES, **K_TYPES}


def type_name(tensor_type: int) -> str:
    return KEPT_TYPES[int(tensor_type)][0]


def block_weight(data: np.ndarray, tensor_type: int, exact_only: bool = False) -> QuantizedWeight | None:
    """Raw rows [N, blocks * block bytes] uint8 of a KEPT_TYPES tensor -> canonical weight; None for other
    types (and for the K-quants with `exact_only`), or when a scale or offset overflows float16 (the caller
    then dequantizes)."""
    kind = (EXACT_TYPES if exact_only else KEPT_TYPES).get(int(tensor_type))
    if kind is None:
        return None
    name, nbytes, bits = kind
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, nbytes)                       # [N, blocks, bytes]
    if name in ("Q4_K", "Q5_K"):
        return _k_quant(blocks, name == "Q5_K")
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


def _k_quant(blocks: np.ndarray, fifth_bit: bool) -> QuantizedWeight | None:
    """Q4_K / Q5_K super-blocks [N, K/256, bytes] -> canonical weight in groups of 32 (module docstring)."""
    n, nb = blocks.shape[:2]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)          # [N, nb]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    b = blocks[..., 4:16]
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 0x0F) | ((b[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=-1)
    nib = blocks[..., -128:].reshape(n, nb, 4, 1, 32)                                  # 4 chunks of 32 bytes
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=3)                                # [N, nb, 4, 2, 32]
    if fifth_bit:
        high = blocks[..., 16:48][:, :, None, None, :]                                # [N, nb, 1, 1, 32]
        sub = np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)                     # sub-block 2c + h
        q = q + ((high >> sub) & 1) * 16
    scales = (d[..., None] * sc).astype(np.float16)                                   # [N, nb, 8]
    offsets = (-(dmin[..., None] * mn)).astype(np.float16)
    if not (np.isfinite(scales).all() and np.isfinite(offsets).all()):
        return None
    return QuantizedWeight(torch.from_numpy(q.astype(np.uint8).reshape(n, nb * 256)),
                           torch.from_numpy(scales.reshape(n, nb * 8)), torch.from_numpy(offsets.reshape(n, nb * 8)),
                           8 if fifth_bit else 4, BLOCK)
