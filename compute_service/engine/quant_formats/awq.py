"""AWQ checkpoints (`quant_method: awq`, GEMM layout), read and written.

Per projection `P` (K in, N out features, group size G, 4 bits):
  P.qweight  int32 [K, N/8]    codes packed along N in AWQ's interleaved order (`AWQ_ORDER`)
  P.qzeros   int32 [K/G, N/8]  integer zero points, packed the same way
  P.scales   fp16  [K/G, N]
  w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from compute_service.engine.errors import UnsupportedModelError
from compute_service.engine.quant_formats.common import from_zero_points, need
from compute_service.engine.quant_formats.packing import AWQ_ORDER, pack_int32, unpack_int32
from compute_service.engine.quantized import QuantizedWeight, integer_zeros

FORMAT = "awq"


def reader(cfg: dict[str, Any], raw: Callable[[str], torch.Tensor | None]
           ) -> Callable[[str], QuantizedWeight | None]:
    """prefix -> the projection's canonical weight, or None where the checkpoint keeps it dense."""
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    version = str(cfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise UnsupportedModelError(f"AWQ {bits}-bit version {version!r} is not supported (4-bit GEMM is)")
    if not cfg.get("zero_point", True):
        raise UnsupportedModelError("AWQ without zero points (zero_point: false) is not supported")

    def read(prefix: str) -> QuantizedWeight | None:
        packed = raw(prefix + ".qweight")
        if packed is None:
            return None
        q = unpack_int32(packed, 4, dim=1, order=AWQ_ORDER).t()                     # [N, K]
        z = unpack_int32(need(raw, prefix + ".qzeros"), 4, dim=1, order=AWQ_ORDER).t()  # [N, K/G]
        s = need(raw, prefix + ".scales").t()                                        # [N, K/G]
        return from_zero_points(prefix, q, s, z, 4)

    return read


def quantization_config(bits: int, group_size: int, ignore: list[str]) -> dict[str, Any]:
    if bits != 4:
        raise ValueError("the AWQ format holds 4-bit weights only (use --format compressed-tensors for 8 bits)")
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ignore or None}


def tensors(prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The projection's tensors in AWQ's GEMM layout (offsets must be integer zero points times scales)."""
    z = integer_zeros(qw)                                                            # [N, K/G]
    return {prefix + ".qweight": pack_int32(qw.q.t(), 4, dim=1, order=AWQ_ORDER),    # [K, N/8]
            prefix + ".qzeros": pack_int32(z.t(), 4, dim=1, order=AWQ_ORDER),        # [K/G, N/8]
            prefix + ".scales": qw.scales.t().contiguous()}                          # [K/G, N]
