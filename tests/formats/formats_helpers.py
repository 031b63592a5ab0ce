"""Builders shared by the format tests: the seed's worked example and hand-made PEFT folders."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplex.formats import ModelSpec

SEED_CONFIG = [[1, 0, 2], [2, 0, 4], [1, 1, 2], [2, 1, 4], [1, 2, 2], [1, 3, 8]]
# 4 heads of dim 1 and 4 KV heads: q and k both map 4 -> 4, as in the seed
SEED_SPEC = ModelSpec(num_layers=4, hidden_size=4, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=1, intermediate_size=8)


def seed_tensors(gen: torch.Generator) -> tuple[np.ndarray, torch.Tensor, list]:
    """config, weights [6, 64] and the (A, B) pairs they were built from."""
    pairs = [(torch.randn(r, 4, generator=gen), torch.randn(4, r, generator=gen)) for _, _, r in SEED_CONFIG]
    weights = torch.zeros(len(pairs), 64)
    for i, (a, b) in enumerate(pairs):
        flat = torch.cat([a.flatten(), b.flatten()])
        weights[i, : flat.numel()] = flat
    return np.array(SEED_CONFIG, dtype=np.int32), weights, pairs


def write_peft_folder(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """A hand-made PEFT folder (for shapes and options PEFT itself would not produce)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps({**base, **config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder
