"""The seed's LoRA partition rule under tensor parallelism, over converted adapter rows.

Column-parallel modules (q 1, k 2, v 3, fused qkv 0, gate 5, up 7): every rank keeps the whole
A [r, in] and its slice of B [out/tp, r]. Row-parallel modules (o 4, down 6): every rank keeps its
slice of A [r, in/tp] and the whole B [out, r]; their LoRA output joins the base layer's partial
output before the layer's all-reduce, so LoRA adds no collective. The adapter arrives whole; each
rank keeps only its share (`split_adapter`), with the rank's feature slices from `shard.Shard`.
"""
from __future__ import annotations

import numpy as np
import torch

from compute_service.engine.spec import ModelSpec
from compute_service.parallel.shard import Shard
from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import module_shape

COLUMN_PARALLEL = (0, 1, 2, 3, 5, 7)
ROW_PARALLEL = (4, 6)


def _b_rows(module_id: int, spec: ModelSpec, shard: Shard) -> torch.Tensor:
    """Indices of B's rows (output features) a rank keeps, for a column-parallel module."""
    def span(r: tuple[int, int], offset: int = 0) -> torch.Tensor:
        return torch.arange(r[0] + offset, r[1] + offset)

    if module_id == 1:
        return span(shard.q)
    if module_id in (2, 3):
        return span(shard.kv)
    if module_id == 0:      # fused [q; k; v]
        return torch.cat([span(shard.q), span(shard.kv, spec.q_size), span(shard.kv, spec.q_size + spec.kv_size)])
    return span(shard.inter)


def split_row(module_id: int, a: torch.Tensor, b: torch.Tensor, spec: ModelSpec, shard: Shard,
              mlp_order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B [out, r]) of the whole model -> the rank's (A, B) by the rule. `mlp_order`: the layer's
    act-order down order, whose positions `shard.inter` the rank's MLP shards hold (`sharded_source`)."""
    features = None if mlp_order is None else mlp_order[shard.inter[0]:shard.inter[1]]
    if module_id in (5, 7) and features is not None:
        return a, b[features.to(b.device)]
    if module_id in COLUMN_PARALLEL:
        return a, b[_b_rows(module_id, spec, shard)]
    if module_id == 4:
        return a[:, shard.q[0]:shard.q[1]], b
    if module_id == 6:
        return (a[:, shard.inter[0]:shard.inter[1]] if features is None else a[:, features.to(a.device)]), b
    raise ValueError(f"module id {module_id} has no tensor-parallel split in a Llama-family decoder")


def split_adapter(adapter: Adapter, spec: ModelSpec, shard: Shard,
                  mlp_orders: list[torch.Tensor | None] | None = None) -> Adapter:
    """The rank's share of a whole adapter (rows in the same order; metadata kept); `mlp_orders`: each
    layer's order its MLP shards follow (`split_row`)."""
    if shard.tp == 1:
        return adapter
    in_out = adapter.in_out or tuple(
        (s.in_features, s.out_features) for s in (module_shape(
            int(m), hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size) for m in adapter.config[:, 0]))
    whole = Adapter(adapter.config, adapter.weights, in_out, adapter.metadata)
    rows, shapes = [], []
    for row in whole.rows():
        order = None if mlp_orders is None else mlp_orders[row.layer_idx]
        a, b = split_row(row.module_id, row.a, row.b, spec, shard, order)
        rows.append(torch.cat([a.reshape(-1), b.reshape(-1)]))
        shapes.append((a.shape[1], b.shape[0]))
    width = max((r.numel() for r in rows), default=0)
    weights = torch.zeros(len(rows), width, dtype=adapter.weights.dtype)
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r
    return Adapter(np.array(adapter.config, dtype=np.int32, copy=True), weights, tuple(shapes), adapter.metadata)
