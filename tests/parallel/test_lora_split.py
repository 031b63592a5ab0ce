"""The seed's LoRA partition rule, row by row: column-parallel modules keep A whole and slice B's
rows, row-parallel ones slice A's columns and keep B whole; the shares add up to the whole delta."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.spec import ModelSpec
from compute_service.parallel.lora_split import split_adapter
from compute_service.parallel.shard import local_spec, shard_for
from tp_helpers import random_adapter


def spec(heads: int, kv: int, inter: int = 80) -> ModelSpec:
    return ModelSpec("llama", 2, 64, heads, kv, 16, inter, 96, 1e-5, 1e4, 128, False)


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (4, 4, 4), (8, 2, 8)])
def test_split_rows_follow_the_rule(heads, kv, tp):
    s = spec(heads, kv, inter=16 * tp)
    whole = random_adapter(s, (0, 1, 2, 3, 4, 5, 6, 7), rank=3, seed=heads + kv + tp)
    d, q, kvs = s.head_dim, s.q_size, s.kv_size
    shares = [split_adapter(whole, s, shard_for(s, tp, r)) for r in range(tp)]
    for r, share in enumerate(shares):
        sh = shard_for(s, tp, r)
        loc = local_spec(s, sh)
        assert (share.config == whole.config).all()
        kv_head = (r * (kv // tp) if kv % tp == 0 else r // (tp // kv))
        for wrow, srow in zip(whole.rows(), share.rows()):
            m = wrow.module_id
            if m in (4, 6):                                   # row-parallel: A columns, whole B
                per = q // tp if m == 4 else s.intermediate_size // tp
                assert torch.equal(srow.a, wrow.a[:, r * per:(r + 1) * per])
                assert torch.equal(srow.b, wrow.b)
                continue
            assert torch.equal(srow.a, wrow.a)                # column-parallel: whole A
            qs = slice(r * q // tp, (r + 1) * q // tp)
            ks = slice(kv_head * d, kv_head * d + loc.num_kv_heads * d)
            want = {1: wrow.b[qs], 2: wrow.b[ks], 3: wrow.b[ks],
                    0: torch.cat([wrow.b[qs], wrow.b[q:q + kvs][ks], wrow.b[q + kvs:][ks]]),
                    5: wrow.b[r * 16:(r + 1) * 16], 7: wrow.b[r * 16:(r + 1) * 16]}[m]
            assert torch.equal(srow.b, want), (m, r)
    # Row-parallel shares sum to the whole delta B @ A (what the all-reduce computes).
    for i, wrow in enumerate(whole.rows()):
        if wrow.module_id in (4, 6):
            parts = [list(sh.rows())[i] for sh in shares]
            total = sum(p.b @ p.a for p in parts)
            cols = torch.cat([p.a for p in parts], dim=1)
            assert torch.allclose(torch.cat([p.b @ p.a for p in parts], 1), wrow.b @ cols)
            assert torch.allclose(sum(p.b @ p.a @ torch.ones(p.a.shape[1]) for p in parts),
                                  wrow.b @ wrow.a @ torch.ones(wrow.a.shape[1]), atol=1e-5)
            assert total.shape == (wrow.b.shape[0], parts[0].a.shape[1])


def test_tp_one_is_the_whole_adapter():
    s = spec(4, 2)
    whole = random_adapter(s, (1, 4), rank=2, seed=0)
    assert split_adapter(whole, s, shard_for(s, 1, 0)) is whole


def test_shapes_that_do_not_split_are_refused():
    with pytest.raises(ModelLoadError, match="divide"):
        shard_for(spec(6, 3, inter=96), 2, 0)
    with pytest.raises(ModelLoadError, match="num_heads"):
        shard_for(spec(4, 2), 8, 0)


def test_mlp_rows_follow_the_shards_order():
    """With a layer's act-order down order (`sharded_source`'s `order_mlp`), rank r's gate and up B rows and down
    A columns are the whole model's features order[r * I/tp: (r + 1) * I/tp]; other layers and modules as before."""
    s, tp = spec(4, 2, inter=32), 2
    whole = random_adapter(s, (1, 4, 5, 6, 7), rank=3, seed=5)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    orders = [order, None]                       # layer 0 follows down's order, layer 1 the model's
    for r in range(tp):
        sh = shard_for(s, tp, r)
        plain, ordered = split_adapter(whole, s, sh), split_adapter(whole, s, sh, orders)
        mine = order[sh.inter[0]: sh.inter[1]]
        for wrow, prow, orow in zip(whole.rows(), plain.rows(), ordered.rows()):
            if wrow.layer_idx == 1 or wrow.module_id in (1, 4):
                assert torch.equal(orow.a, prow.a) and torch.equal(orow.b, prow.b)
            elif wrow.module_id == 6:
                assert torch.equal(orow.a, wrow.a[:, mine]) and torch.equal(orow.b, wrow.b)
            else:
                assert torch.equal(orow.a, wrow.a) and torch.equal(orow.b, wrow.b[mine])
