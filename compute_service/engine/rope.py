"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama), plain or Llama-3 scaled; a GGUF's
per-frequency divisors (`rope_freqs`) read back as the Llama-3 scaling that gives them."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from compute_service.engine.errors import UnsupportedModelError
from compute_service.engine.spec import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with Llama-3 scaling when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a
    # smooth blend in between (same formula as transformers' `_compute_llama3_parameters`).
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def llama3_scaling_from_divisors(divisors: Sequence[float], head_dim: int, theta: float) -> RopeScaling | None:
    """The Llama-3 scaling that turns frequency i by `inv_freq[i] / divisors[i]` a position: how a GGUF file
    gives it (the `rope_freqs` tensor that GGUF converters write for Llama 3.1 and later, in place of the
    scaling's parameters; also a uniform divisor, "linear" scaling). None when every divisor is 1.

    The largest divisor is `factor`. Between the unscaled (divisor 1) and the fully scaled frequencies the
    smooth blend depends on the parameters only through old / (high - low) and low / (high - low) (old the
    original context length), fitted to the blend's divisors; the parameters returned are one set with those
    two ratios, so the angles equal the file's at every frequency of the model (checked to 1e-4, else
    UnsupportedModelError: the divisors are not a Llama-3 scaling)."""
    d = np.asarray(divisors, dtype=np.float64)
    if d.shape != (head_dim // 2,) or not np.isfinite(d).all() or (d <= 0).any():
        raise UnsupportedModelError(f"rope_freqs: expected {head_dim // 2} positive divisors (head_dim "
                                    f"{head_dim}), got shape {tuple(d.shape)}")
    if np.allclose(d, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(d.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)      # increasing
    short, full = np.isclose(d, 1.0, rtol=1e-5), np.isclose(d, factor, rtol=1e-5)
    medium = ~short & ~full
    ws, wm, wf = wavelen[short], wavelen[medium], wavelen[full]
    if factor <= 1 or (ws.size and ws.max() >= wavelen[~short].min()) or (wm.size and wm.max() >= wf.min()):
        raise UnsupportedModelError("rope_freqs: the divisors are not a Llama-3 scaling (1 for the shortest "
                                    f"wavelengths, rising to the largest for the longest): {d.round(4).tolist()}")
    w_short = ws.max() if ws.size else (wm.min() if wm.size else wf.min()) / 4   # shortest band's top
    blend = (1 / d[medium] - 1 / factor) / (1 - 1 / factor)      # the blend's weight of the unscaled frequency
    if wm.size >= 2:        # blend = a / wavelen - b, a = old / (high - low), b = low / (high - low)
        a, b = np.linalg.lstsq(np.stack([1 / wm, -np.ones_like(wm)], axis=1), blend, rcond=None)[0]
    elif wm.size == 1:      # the band's ends: high_end in (w_short, wm], low_end in [wm, first fully scaled)
        # with u = low_end / wm and v = wm / high_end the blend there is (u - 1) / (u v - 1): v(u) rises
        # from 1 at u = 1; take u halfway (log scale) to the largest u both ends allow.
        s0, room = blend[0], wf.min() / wm[0]
        if s0 * wm[0] / w_short < 1:
            room = min(room, (1 - s0) / (1 - s0 * wm[0] / w_short))
        u = math.sqrt(room)
        low_end, high_end = u * wm[0], wm[0] * s0 * u / (u - 1 + s0)
        b = high_end / (low_end - high_end)
        a = b * low_end
    else:                   # an empty band: both ends in the gap
        gap = wf.min() / w_short
        high_end, low_end = w_short * gap ** (1 / 3), w_short * gap ** (2 / 3)
        b = high_end / (low_end - high_end)
        a = b * low_end
    if not (a > 0 and b > 0):
        raise UnsupportedModelError(f"rope_freqs: the blended divisors {d[medium].round(4).tolist()} fit no "
                                    "Llama-3 scaling")
    old = max(1, int(round(float(a / b))))
    low = float(old * b / a)
    scaling = RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=float(low + old / a),
                          original_max_position_embeddings=old)
    want = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)) / d
    got = inv_frequencies(head_dim, theta, scaling).double().numpy()
    if np.abs(got / want - 1).max() > 1e-4:
        raise UnsupportedModelError(f"rope_freqs: no Llama-3 scaling gives these divisors (closest off by "
                                    f"{np.abs(got / want - 1).max():.1e}): {d.round(4).tolist()}")
    return scaling


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions), indexed per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 device: torch.device) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)                 # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                  # [P, D]
        self.cos = emb.cos().to(device)                          # float32; cast per use like HF
        self.sin = emb.sin().to(device)
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D], positions [T] -> rotated x (same dtype)."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)       # [T, 1, D]
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
