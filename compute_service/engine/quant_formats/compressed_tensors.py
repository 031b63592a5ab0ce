"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, format `pack-quantized`), read and written.

Per projection `P` (K in, N out features, group size G, b bits, f = 32 / b codes a word):
  P.weight_packed      int32 [N, K/f]    signed codes q in [-2**(b-1), 2**(b-1)) stored as q + 2**(b-1),
                                         packed along K, sequentially
  P.weight_scale       fp16/bf16 [N, K/G]
  P.weight_zero_point  int32 [N/f, K/G]  (asymmetric only) signed zero points + 2**(b-1), packed along N
  P.weight_shape       int [2]           (N, K)
  w[n, k] = (q[n, k] - zp[n, k // G]) * s[n, k // G]
With the unsigned codes the readers store, that is (u - uz) * s, uz = zp + 2**(b-1) (2**(b-1) when symmetric).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError
from compute_service.engine.quant_formats.common import act_order_perm, from_zero_points, need
from compute_service.engine.quant_formats.packing import pack_int32, unpack_int32
from compute_service.engine.quantized import QuantizedWeight, integer_zeros

FORMAT = "compressed-tensors"
PACKED = "pack-quantized"


def _check_config(cfg: dict[str, Any]) -> None:
    formats = {cfg.get("format")} | {g.get("format") for g in (cfg.get("config_groups") or {}).values()}
    formats -= {None, "mixed-precision"}
    if formats != {PACKED}:
        raise UnsupportedModelError(f"compressed-tensors format {sorted(map(str, formats))} is not supported "
                                    f"(weight-only {PACKED!r} is)")
    for name, group in (cfg.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if group.get("input_activations") or w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise UnsupportedModelError(f"compressed-tensors group {name!r}: only weight-only 4- or 8-bit int "
                                        f"quantization is supported, got weights {w} and input activations "
                                        f"{group.get('input_activations')}")


def reader(cfg: dict[str, Any], raw: Callable[[str], torch.Tensor | None]
           ) -> Callable[[str], QuantizedWeight | None]:
    """prefix -> the projection's canonical weight, or None where the checkpoint keeps it dense.

    Bits, group size and symmetry are read from each projection's tensors, so mixed groups load too."""
    _check_config(cfg)

    def read(prefix: str) -> QuantizedWeight | None:
        packed = raw(prefix + ".weight_packed")
        if packed is None:
            return None
        n, k = (int(x) for x in need(raw, prefix + ".weight_shape").tolist())
        if packed.shape[0] != n or (32 * packed.shape[1]) % k:
            raise ModelLoadError(f"{prefix}: weight_packed {tuple(packed.shape)} does not fit shape {(n, k)}")
        bits = 32 * packed.shape[1] // k
        if bits not in (4, 8):
            raise UnsupportedModelError(f"{prefix}: {bits}-bit codes are not supported (4 and 8 bits are)")
        q = unpack_int32(packed, bits, dim=1)[:, :k]                                  # [N, K] unsigned
        s = need(raw, prefix + ".weight_scale")                                       # [N, K/G]
        zp = raw(prefix + ".weight_zero_point")
        if zp is None:
            z = torch.full(s.shape, 1 << (bits - 1), dtype=torch.int32, device=s.device)
        elif zp.dtype == torch.int32 and zp.shape[0] != n:
            z = unpack_int32(zp, bits, dim=0)[:n].int()                                # [N, K/G] unsigned
        else:                                                                          # stored unpacked, signed
            z = zp.int() + (1 << (bits - 1))
        perm = act_order_perm(prefix, raw(prefix + ".weight_g_idx"), k, k // s.shape[1]) if s.shape[1] else None
        return from_zero_points(prefix, q, s, z, bits, perm)

    return read


def quantization_config(bits: int, group_size: int, symmetric: bool, ignore: list[str]) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": PACKED, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None,
                                          "format": PACKED}},
            "ignore": ignore, "kv_cache_scheme": None}


def tensors(prefix: str, qw: QuantizedWeight, symmetric: bool) -> dict[str, torch.Tensor]:
    """The projection's tensors; symmetric weights must have the zero point 2**(bits-1) everywhere."""
    z = integer_zeros(qw)                                                             # [N, K/G] unsigned
    half = 1 << (qw.bits - 1)
    out = {prefix + ".weight_packed": pack_int32(qw.q, qw.bits, dim=1),               # [N, K/f]
           prefix + ".weight_scale": qw.scales.contiguous(),                          # [N, K/G]
           prefix + ".weight_shape": torch.tensor(qw.shape, dtype=torch.int64)}
    if symmetric:
        if not bool((z == half).all()):
            raise ValueError(f"{prefix}: a symmetric weight needs zero point {half} in every group")
    else:
        out[prefix + ".weight_zero_point"] = pack_int32(z, qw.bits, dim=0)            # [N/f, K/G]
    return out
