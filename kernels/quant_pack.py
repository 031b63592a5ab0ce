"""The GPU layout of a weight-only quantized matrix: codes packed in int32 words, group scales transposed.

Canonical form (what loaders produce, see compute_service/engine/quantized.py):
`w[n, k] = q[n, k] * scales[n, k // G] + offsets[n, k // G]`, q uint8 in [0, 2**bits).

Packed form, read in place by `kernels.quant_matmul`:
- the group size is a multiple of 32 that divides the block (32, 64, 128; 256 for 4 bits) or is a multiple
  of it (a group then spans whole blocks);
- in features are padded up to a multiple of `block_k(bits)` = 32 * (32 // bits) (256 for 4 bits, 128 for
  8) with zero codes and zero scales/offsets, so padded columns contribute exactly 0;
- `words` int32 [N, Kp * bits / 32]: one block of 32 words per row holds `block_k` codes, and field i
  (bits [bits*i, bits*(i+1))) of word j of block b holds code k = b * block_k + i * 32 + j. Unpacking field
  i of a block's 32 words gives 32 consecutive codes, all inside one group (the group size is a multiple of
  32), so the kernel needs one scale and one offset per row per field and no reshuffle in registers;
- 4 bits in groups of 128 or more (`paired_layout`): the block's codes are placed so that fields i and
  i + 4 of a word, 16 bits apart, are two neighbouring codes of one half block (one group): field
  i' + 4 s (i' < 4, s < 2) of word 16 h + j' (h < 2, j' < 16) holds code k = b * 256 + h * 128 + i' * 32
  + 2 j' + s. Words 0-15 of a block hold its first 128 codes, words 16-31 the next 128. One and-or of
  `word >> 4 i'` gives two neighbouring codes as the two 16-bit halves of a register, which is how the
  tensor cores take a 16-bit operand: no byte shuffle between the unpacking and the dot
  (`kernels.quant_mma._pairs_step`);
- `scales`, `offsets` float16 [ceil(Kp / G), N]: group-major, so a tile of rows reads them contiguously.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUB_K = 32           # codes per field run: one field of a block's 32 words


def block_k(bits: int) -> int:
    """In features covered by one block of 32 words (the kernel's K step)."""
    return SUB_K * (32 // bits)


@dataclass
class PackedQuantWeight:
    """A quantized [N, K] weight in the kernel's layout (see the module docstring)."""

    words: torch.Tensor       # int32 [N, Kp * bits // 32]
    scales: torch.Tensor      # float16 [num_groups_padded, N]
    offsets: torch.Tensor     # float16 [num_groups_padded, N]
    bits: int
    group_size: int
    in_features: int          # K before padding

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    @property
    def padded_in_features(self) -> int:
        return self.words.shape[1] * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return self.words.nbytes + self.scales.nbytes + self.offsets.nbytes


def paired_layout(bits: int, group_size: int) -> bool:
    """Whether a weight is packed in the paired layout (module docstring): 4 bits, groups of 128 or more."""
    return bits == 4 and group_size % 128 == 0


def check_packable(n: int, k: int, bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"packed quantized weights hold 4 or 8 bits, got {bits}")
    blk = block_k(bits)
    if group_size % SUB_K or k % group_size or (blk % group_size and group_size % blk):
        raise ValueError(f"group size must be a multiple of {SUB_K} that divides or is a multiple of {blk} "
                         f"and divides in features {k}, got {group_size}")


def pack_quantized(q: torch.Tensor,         # uint8 [N, K], codes in [0, 2**bits)
                   scales: torch.Tensor,    # float16 [N, K // G]
                   offsets: torch.Tensor,   # float16 [N, K // G]
                   bits: int, group_size: int) -> PackedQuantWeight:
    """Packs canonical codes for the kernel, on q's device (a few temporaries of q's size)."""
    n, k = q.shape
    check_packable(n, k, bits, group_size)
    fields, blk = 32 // bits, block_k(bits)
    kp = -(-k // blk) * blk
    shifts = (torch.arange(fields, device=q.device, dtype=torch.int64) * bits).view(1, 1, fields, 1)
    words = torch.empty(n, kp * bits // 32, dtype=torch.int32, device=q.device)
    rows = max(1, 2**26 // kp)                  # int64 temporaries of at most 512 MiB per chunk of rows
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        codes = torch.zeros(r1 - r0, kp, dtype=torch.uint8, device=q.device)
        codes[:, :k] = q[r0:r1]
        if paired_layout(bits, group_size):     # k = h 128 + i' 32 + 2 j' + s -> field s 4 + i', word h 16 + j'
            codes = codes.view(r1 - r0, kp // blk, 2, 4, 16, 2).permute(0, 1, 5, 3, 2, 4)
        codes = codes.reshape(r1 - r0, kp // blk, fields, SUB_K).to(torch.int64)   # [rows, block, field i, word j]
        w = (codes << shifts).sum(dim=2)                                   # [rows, block, 32], in [0, 2**32)
        words[r0:r1] = torch.where(w >= 2**31, w - 2**32, w).view(r1 - r0, -1).to(torch.int32)
    num_groups = -(-kp // group_size)

    def transpose_padded(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(num_groups, n, dtype=torch.float16, device=q.device)
        out[: t.shape[1]] = t.t()
        return out

    return PackedQuantWeight(words, transpose_padded(scales), transpose_padded(offsets), bits, group_size, k)


def unpack_quantized(p: PackedQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], scales float16 [N, K // G], offsets float16 [N, K // G]): `pack_quantized`'s inverse."""
    n, k, bits = p.out_features, p.in_features, p.bits
    fields = 32 // bits
    words = p.words.view(n, -1, 1, SUB_K)                                 # [n, block, 1, 32] int32
    shifts = (torch.arange(fields, device=words.device, dtype=torch.int32) * bits).view(1, 1, fields, 1)
    codes = (words >> shifts) & (2**bits - 1)                             # [n, block, field, word]; no sign bits
    if paired_layout(bits, p.group_size):       # field s 4 + i', word h 16 + j' -> k = h 128 + i' 32 + 2 j' + s
        codes = codes.view(n, -1, 2, 4, 2, 16).permute(0, 1, 4, 3, 5, 2)
    codes = codes.reshape(n, -1)[:, :k]
    ng = k // p.group_size
    return (codes.to(torch.uint8).contiguous(), p.scales[:ng].t().contiguous(),
            p.offsets[:ng].t().contiguous())
