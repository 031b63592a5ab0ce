"""What every checkpoint reader shares: (q - z) * s in the canonical form, and the checks on it."""
from __future__ import annotations

import logging

import torch

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError
from compute_service.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)


def from_zero_points(name: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, perm: torch.Tensor | None = None) -> QuantizedWeight:
    """Codes q [N, K], scales [N, K/G] (any float dtype), integer zero points z [N, K/G] -> the canonical
    weight with offsets = float16(-z * s), so w = (q - z) * s up to that one rounding. `perm` (act-order,
    `act_order_perm`): group j // G of the scales is the group of input channel perm[j]; the codes are
    stored in that order."""
    n, k = q.shape
    if scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1]:
        raise ModelLoadError(f"{name}: scales of shape {tuple(scales.shape)} do not fit a [{n}, {k}] weight")
    if tuple(zeros.shape) != tuple(scales.shape):
        raise ModelLoadError(f"{name}: zero points of shape {tuple(zeros.shape)}, scales {tuple(scales.shape)}")
    s16 = scales.to(torch.float16)
    if scales.dtype != torch.float16 and not torch.equal(s16.to(scales.dtype), scales):
        _report_rounding(name, scales)
    offsets = (-zeros.float() * s16.float()).to(torch.float16)
    if perm is not None:
        q = q.index_select(1, perm.to(q.device))
    return QuantizedWeight(q.contiguous(), s16.contiguous(), offsets.contiguous(), bits, k // scales.shape[1],
                           None if perm is None else perm.to(q.device))


_FP16 = torch.finfo(torch.float16)
_reported: set[tuple[str, torch.dtype]] = set()


def _report_rounding(name: str, scales: torch.Tensor) -> None:
    """Scales that float16 (the kernels' scale type) does not hold exactly: an error when they overflow it,
    else one warning per kind of rounding and dtype (the other projections at DEBUG)."""
    magnitude = scales.float().abs()
    if bool((magnitude > _FP16.max).any()):
        raise ModelLoadError(f"{name}: a scale of {float(magnitude.max()):.4g} is beyond float16's range "
                             f"({_FP16.max:.0f}); this checkpoint cannot be kept quantized (--quantization none)")
    tiny = magnitude[(magnitude > 0) & (magnitude < _FP16.tiny)]
    if tiny.numel():
        kind = "subnormal"
        message = (f"%s: %s scales down to {float(tiny.min()):.3g} are below float16's normal range "
                   f"({_FP16.tiny:.3g}) and lose precision there")
    else:
        kind = "mantissa"
        message = "%s: %s scales rounded to float16's 11 significant bits (within 2^-11 relative)"
    key = (kind, scales.dtype)
    log.log(logging.DEBUG if key in _reported else logging.WARNING,
            message + ("" if key in _reported else "; further projections are logged at DEBUG"), name, scales.dtype)
    _reported.add(key)


def act_order_perm(name: str, g_idx: torch.Tensor | None, k: int, group_size: int) -> torch.Tensor | None:
    """None for groups in order (no g_idx, or g_idx = k // G); for act-order (desc_act / actorder), the input
    channels sorted by group (int64 [K], stable): stored in that order, each group's G channels are
    contiguous. A g_idx that does not give every group exactly G channels is refused."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).cpu().flatten()
    if g.numel() != k or k % group_size:
        raise ModelLoadError(f"{name}: g_idx has {g.numel()} entries for {k} input channels")
    if torch.equal(g, torch.arange(k, dtype=torch.int64) // group_size):
        return None
    counts = torch.bincount(g, minlength=k // group_size) if bool((g >= 0).all()) else None
    if counts is None or counts.numel() != k // group_size or bool((counts != group_size).any()):
        raise UnsupportedModelError(f"{name}: g_idx does not put {group_size} input channels in each of the "
                                    f"{k // group_size} groups; this act-order layout is not supported")
    return torch.sort(g, stable=True).indices


def need(raw, name: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    t = raw(name)
    if t is None:
        raise ModelLoadError(f"quantized checkpoint lacks tensor {name!r}")
    return t  # type: ignore[no-any-return]
