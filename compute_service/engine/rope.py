"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama), plain or Llama-3 scaled."""
from __future__ import annotations

import math

import torch

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
