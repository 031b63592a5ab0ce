"""Weight-only quantized weights in one canonical form, whatever file they came from.

    w[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]

`q` holds unsigned codes in [0, 2**bits). A float per-group offset (not an integer
zero point) holds every format without loss: GGUF Q4_1's `d * q + m` (offset = m),
Q4_0's `d * (q - 8)` (offset = -8 d), Q8_0's `d * q` with signed q (codes q + 128,
offset = -128 d), AWQ / GPTQ / compressed-tensors `(q - z) * s` (offset = -z s,
rounded once to float16). Loaders produce this form; `QuantLinear` packs it for
its device. `quantize_rtn` makes one from a dense weight (round to nearest).

Act-order checkpoints (GPTQ `desc_act`, compressed-tensors `actorder`) assign input channels to groups
out of order (`g_idx`); their codes are kept with the channels sorted by group (`perm`: stored column j
is input channel perm[j]), so groups are contiguous for the kernels, which read x[perm].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass
class QuantizedWeight:
    """Codes, per-group scales and offsets of one [N, K] weight (N out, K in features)."""

    q: torch.Tensor          # uint8 [N, K], values in [0, 2**bits)
    scales: torch.Tensor     # float16 [N, K // group_size]
    offsets: torch.Tensor    # float16 [N, K // group_size]
    bits: int                # 4 or 8
    group_size: int          # K % group_size == 0
    perm: torch.Tensor | None = None   # int64 [K]: stored column j is input channel perm[j] (act-order)

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.perm is not None and (tuple(self.perm.shape) != (k,) or self.perm.dtype != torch.int64):
            raise ValueError(f"quantized weight: perm must be int64 [{k}], got {self.perm.dtype} "
                             f"{tuple(self.perm.shape)}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"quantized weight: bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.q.dtype != torch.uint8:
            raise ValueError(f"quantized weight: codes must be uint8, got {self.q.dtype}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"quantized weight: group size {self.group_size} does not divide in features {k}")
        want = (n, k // self.group_size)
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if tuple(t.shape) != want or t.dtype != torch.float16:
                raise ValueError(f"quantized weight: {name} must be float16 {want}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (input channels in the model's order), computed in float32 (the definition the
        kernels are tested against)."""
        n, k = self.shape
        g = self.group_size
        w = self.q.view(n, k // g, g).float() * self.scales.float()[..., None] + self.offsets.float()[..., None]
        w = w.view(n, k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output features [start, end) (a column-parallel shard, or one of a fused projection's parts)."""
        return QuantizedWeight(self.q[start:end], self.scales[start:end], self.offsets[start:end],
                               self.bits, self.group_size, self.perm)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Output features in the order `index` names (row j is this weight's row index[j]); the input order
        is kept (`compute_service.engine.mlp_order`)."""
        index = index.to(self.q.device)
        return QuantizedWeight(self.q.index_select(0, index), self.scales.index_select(0, index),
                               self.offsets.index_select(0, index), self.bits, self.group_size, self.perm)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.q.to(device), self.scales.to(device), self.offsets.to(device),
                               self.bits, self.group_size, None if self.perm is None else self.perm.to(device))

    def same_input_order(self, other: QuantizedWeight) -> bool:
        if self.perm is None or other.perm is None:
            return self.perm is None and other.perm is None
        return bool(torch.equal(self.perm, other.perm.to(self.perm.device)))

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stacks along output features (q/k/v, gate/up fusion); all parts share bits, group size and input
        order."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]):
                raise ValueError("quantized weights to fuse differ in bits, group size or in features: "
                                 f"{[(p.bits, p.group_size, p.shape[1]) for p in parts]}")
            if not p.same_input_order(first):
                raise ValueError("quantized weights to fuse differ in their act-order input channel order")
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.offsets for p in parts]), first.bits, first.group_size, first.perm)


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128, *,
                 symmetric: bool = False) -> QuantizedWeight:
    """Round-to-nearest quantization of a dense [N, K] weight, on whatever device `w` is.

    Asymmetric: per group, scale = (max - min) / (2**bits - 1) and an integer zero point
    z = round(-min / scale) clamped to the code range, so the stored offset is -z * scale
    (what AWQ and asymmetric compressed-tensors hold). Symmetric: scale = absmax / (2**(bits-1) - 1)
    and z = 2**(bits-1) (GPTQ and compressed-tensors symmetric). `integer_zeros(qw)` recovers z.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide in features {k}")
    qmax = 2 ** bits - 1
    wg = w.float().view(n, k // group_size, group_size)
    if symmetric:
        half = 2 ** (bits - 1)
        scale = (wg.abs().amax(-1) / (half - 1)).clamp_min(1e-8)
        zero = torch.full_like(scale, float(half))
    else:
        lo, hi = wg.amin(-1).clamp_max(0.0), wg.amax(-1).clamp_min(0.0)
        scale = ((hi - lo) / qmax).clamp_min(1e-8)
        zero = torch.round(-lo / scale).clamp(0, qmax)
    scale16 = scale.to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny)
    s = scale16.float()
    q = torch.round(wg / s[..., None] + zero[..., None]).clamp(0, qmax).to(torch.uint8)
    offsets = (-zero * s).to(torch.float16)
    return QuantizedWeight(q.view(n, k), scale16, offsets, bits, group_size)


def integer_zeros(qw: QuantizedWeight) -> torch.Tensor:
    """The integer zero points z with offsets == -z * scales (for writers of (q - z) * s formats).

    Raises ValueError when an offset is not such a multiple (a GGUF Q4_1 weight, say)."""
    s = qw.scales.float()
    z = torch.round(-qw.offsets.float() / s)
    back = (-z * s).to(torch.float16)
    if not torch.equal(back, qw.offsets) or bool(((z < 0) | (z > 2 ** qw.bits - 1)).any()):
        raise ValueError("this quantized weight's offsets are not integer zero points times its scales")
    return z.to(torch.uint8)
