"""Helpers of the compute service tests (a uniquely named module: test folders share `conftest` names)."""
from __future__ import annotations

import numpy as np
import torch

from compute_service.adapter_cache.layout import module_features
from compute_service.engine.spec import ModelSpec
from loraplex.formats.adapter import Adapter


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
