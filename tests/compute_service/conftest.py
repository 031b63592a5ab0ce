"""Fixtures of the compute service tests: a tiny random Llama on disk and random converted adapters."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import save_tiny, tiny_model  # noqa: E402  (the engine tests' tiny-model builder)

from compute_service.adapter_cache.layout import module_features  # noqa: E402
from compute_service.engine.spec import ModelSpec  # noqa: E402
from loraplex.formats.adapter import Adapter  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny(tiny_model("llama", seed=3), tmp_path_factory.mktemp("tiny") / "llama")


def random_adapter(spec: ModelSpec, rank: int, seed: int, modules=(1, 2, 3, 4, 5, 6, 7),
                   dtype: torch.dtype = torch.float32, scale: float = 0.3) -> Adapter:
    """Every layer x module at `rank`, fresh random A and B (never zeros), converted form."""
    gen = torch.Generator().manual_seed(seed)
    feats = dict(module_features(spec))
    feats[0] = (spec.hidden_size, spec.q_size + 2 * spec.kv_size)   # fused qkv
    cfg, rows, in_out = [], [], []
    for layer in range(spec.num_layers):
        for m in modules:
            fin, fout = feats[m]
            a = torch.randn(rank, fin, generator=gen) * scale / fin ** 0.5
            b = torch.randn(fout, rank, generator=gen) * scale / rank ** 0.5
            cfg.append([m, layer, rank])
            rows.append(torch.cat([a.flatten(), b.flatten()]))
            in_out.append((fin, fout))
    width = max(r.numel() for r in rows)
    w = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        w[i, : r.numel()] = r
    return Adapter(config=np.asarray(cfg, dtype=np.int32), weights=w.to(dtype).contiguous(), in_out=tuple(in_out))
