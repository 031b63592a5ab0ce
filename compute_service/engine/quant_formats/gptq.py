"""GPTQ checkpoints (`quant_method: gptq`), read.

Per projection `P` (K in, N out features, group size G, b bits, f = 32 / b codes a word):
  P.qweight  int32 [K/f, N]    codes packed along K, sequentially
  P.qzeros   int32 [K/G, N/f]  zero points packed along N, sequentially; the original format
                               (`checkpoint_format: gptq`) stores z - 1, `gptq_v2` stores z
  P.scales   fp16  [K/G, N]
  P.g_idx    int32 [K]         group of each input channel (act-order when not k // G: kept sorted
                               by group, `common.act_order_perm`)
  w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from compute_service.engine.errors import UnsupportedModelError
from compute_service.engine.quant_formats.common import act_order_perm, from_zero_points, need
from compute_service.engine.quant_formats.packing import unpack_int32
from compute_service.engine.quantized import QuantizedWeight

FORMAT = "gptq"
_FORMATS = {"gptq": 1, "gptq_v2": 0}     # checkpoint format -> what was subtracted from the zero points


def reader(cfg: dict[str, Any], raw: Callable[[str], torch.Tensor | None]
           ) -> Callable[[str], QuantizedWeight | None]:
    """prefix -> the projection's canonical weight, or None where the checkpoint keeps it dense."""
    bits = int(cfg.get("bits", 4))
    if bits not in (4, 8):
        raise UnsupportedModelError(f"GPTQ {bits}-bit weights are not supported (4 and 8 bits are)")
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    if fmt not in _FORMATS:
        raise UnsupportedModelError(f"GPTQ checkpoint format {fmt!r} is not supported ({sorted(_FORMATS)} are)")
    zero_shift, mask = _FORMATS[fmt], (1 << bits) - 1
    group_size = int(cfg.get("group_size", 128))

    def read(prefix: str) -> QuantizedWeight | None:
        packed = raw(prefix + ".qweight")
        if packed is None:
            return None
        q = unpack_int32(packed, bits, dim=0).t()                                 # [N, K]
        z = (unpack_int32(need(raw, prefix + ".qzeros"), bits, dim=1).int() + zero_shift) & mask
        s = need(raw, prefix + ".scales")                                          # [K/G, N]
        n, k = q.shape
        z = z[:, :n]
        g = k // s.shape[0] if s.shape[0] else k
        if group_size > 0 and g != group_size:
            raise UnsupportedModelError(f"{prefix}: scales imply group size {g}, the config says {group_size}")
        perm = act_order_perm(prefix, raw(prefix + ".g_idx"), k, g)
        return from_zero_points(prefix, q, s.t(), z.t(), bits, perm)

    return read
