"""GPTQ checkpoints (`quant_method: gptq`), read and written.

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

import re
from typing import Any, Callable

import torch

from compute_service.engine.errors import UnsupportedModelError
from compute_service.engine.quant_formats.common import act_order_perm, from_zero_points, need
from compute_service.engine.quant_formats.packing import pack_int32, unpack_int32
from compute_service.engine.quantized import QuantizedWeight, integer_zeros

FORMAT = "gptq"
_FORMATS = {"gptq": 1, "gptq_v2": 0}     # checkpoint format -> what was subtracted from the zero points


def _check_bits(bits: int, where: str = "") -> int:
    if bits not in (4, 8):
        raise UnsupportedModelError(f"GPTQ {bits}-bit weights{where} are not supported (4 and 8 bits are)")
    return bits


def module_overrides(dynamic: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """The config's `dynamic` rules for one module: the first pattern that matches its name from the start
    decides; "-:pattern" leaves the module unquantized (None), "+:pattern" or a bare pattern gives its
    overrides (bits, group_size, ...); {} when none matches."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], prefix):
                return None
        elif re.match(pattern.removeprefix("+:"), prefix):
            return dict(overrides or {})
    return {}


def reader(cfg: dict[str, Any], raw: Callable[[str], torch.Tensor | None]
           ) -> Callable[[str], QuantizedWeight | None]:
    """prefix -> the projection's canonical weight, or None where the checkpoint keeps it dense. Per-module
    `dynamic` overrides of bits and group size are followed."""
    default_bits = _check_bits(int(cfg.get("bits", 4)))
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    if fmt not in _FORMATS:
        raise UnsupportedModelError(f"GPTQ checkpoint format {fmt!r} is not supported ({sorted(_FORMATS)} are)")
    zero_shift = _FORMATS[fmt]
    dynamic = dict(cfg.get("dynamic") or {})

    def read(prefix: str) -> QuantizedWeight | None:
        packed = raw(prefix + ".qweight")
        if packed is None:          # stored dense (a "-:" rule of `dynamic`, or a module never quantized)
            return None
        overrides = module_overrides(dynamic, prefix) or {}
        bits = _check_bits(int(overrides.get("bits", default_bits)), f" ({prefix}, from `dynamic`)")
        group_size = int(overrides.get("group_size", cfg.get("group_size", 128)))
        mask = (1 << bits) - 1
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


def quantization_config(bits: int, group_size: int, symmetric: bool, act_order: bool,
                        dense: list[str]) -> dict[str, Any]:
    """The `quantization_config` of a folder written by `tensors` (the original zero convention); `dense`:
    projections kept dense, as `dynamic` rules that leave them unquantized."""
    _check_bits(bits)
    cfg: dict[str, Any] = {"quant_method": FORMAT, "bits": bits, "group_size": group_size, "sym": symmetric,
                           "desc_act": act_order, "checkpoint_format": "gptq"}
    if dense:
        cfg["dynamic"] = {f"-:{re.escape(prefix)}$": {} for prefix in dense}
    return cfg


def tensors(prefix: str, qw: QuantizedWeight, order: torch.Tensor | None = None,
            checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The projection's tensors. `qw` was quantized from the weight's columns taken in `order` (int64 [K]: its
    stored column j is input channel order[j], so each group holds consecutive channels of that order, as
    act-order's are); None: the model's order. The codes are written back in the model's order and g_idx
    names each channel's group."""
    k = qw.shape[1]
    _check_bits(qw.bits)
    q, groups = qw.q, torch.arange(k, device=qw.q.device) // qw.group_size
    if order is not None:
        order = order.to(q.device)
        q = torch.empty_like(q).index_copy_(1, order, q)
        groups = torch.empty_like(groups).index_copy_(0, order, groups)
    z = (integer_zeros(qw).int() - _FORMATS[checkpoint_format]) & ((1 << qw.bits) - 1)       # [N, K/G]
    return {prefix + ".qweight": pack_int32(q.t(), qw.bits, dim=0),                          # [K/f, N]
            prefix + ".qzeros": pack_int32(z.t().to(torch.uint8), qw.bits, dim=1),            # [K/G, N/f]
            prefix + ".scales": qw.scales.t().contiguous(),                                   # [K/G, N]
            prefix + ".g_idx": groups.to(torch.int32)}
