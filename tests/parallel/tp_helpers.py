"""Helpers for the tensor-parallel tests: tiny random models and random converted adapters."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from compute_service.engine.spec import ModelSpec
from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import module_shape

# name -> (heads, kv heads): kv 2 splits evenly over tp=2; kv 1 does not divide, so it is replicated.
SHAPES = {"kv2": (4, 2), "kv1": (4, 1)}


def save_tiny_llama(folder: Path, heads: int, kv_heads: int, seed: int, qwen: bool = False,
                    intermediate_size: int = 80) -> Path:
    """A random fp32 model (Qwen2 with its q/k/v biases, else Llama) with widened weights, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    dims = dict(vocab_size=96, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128)
    if qwen:
        model = Qwen2ForCausalLM(Qwen2Config(**dims, tie_word_embeddings=False, rms_norm_eps=1e-6))
    else:
        model = LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=False, rms_norm_eps=1e-5))
    with torch.no_grad():       # widened so logits differ clearly between tokens and adapters matter
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def random_adapter(spec: ModelSpec, modules: tuple[int, ...], rank: int, seed: int) -> Adapter:
    """Random rows (never zero) for `modules` on every layer, B scaled so deltas matter."""
    g = torch.Generator().manual_seed(seed)
    rows, config, in_out = [], [], []
    for layer in range(spec.num_layers):
        for m in modules:
            s = module_shape(m, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                             num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                             intermediate_size=spec.intermediate_size)
            a = torch.randn(rank, s.in_features, generator=g) * 0.2
            b = torch.randn(s.out_features, rank, generator=g) * 0.2
            rows.append(torch.cat([a.flatten(), b.flatten()]))
            config.append([m, layer, rank])
            in_out.append((s.in_features, s.out_features))
    width = max(r.numel() for r in rows)
    weights = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r
    return Adapter(np.asarray(config, dtype=np.int32), weights, tuple(in_out))
