"""Sharded reading: from safetensors a rank reads only its slices (never a whole sharded tensor), and
they equal the slices of the whole tensors; row-parallel biases stay on rank 0."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.loader import read_model_source
from compute_service.parallel.shard import shard_for, sharded_source
from tp_helpers import save_tiny_llama


def test_safetensors_slices_equal_whole_slices_and_skip_whole_reads(tmp_path):
    folder = save_tiny_llama(tmp_path, 4, 1, seed=4, qwen=True)
    spec, get, _ = read_model_source(folder)
    whole_reads: list[str] = []

    class Counting:                       # the real source, counting whole-tensor reads
        def __call__(self, name):
            whole_reads.append(name)
            return get(name)

        def rows(self, name, a, b):
            return get.rows(name, a, b)

        def columns(self, name, a, b):
            return get.columns(name, a, b)

    for rank in (0, 1):
        shard = shard_for(spec, 2, rank)
        local = sharded_source(spec, shard, Counting())
        p = "model.layers.1."
        assert torch.equal(local(p + "self_attn.q_proj.weight"), get(p + "self_attn.q_proj.weight")[slice(*shard.q)])
        assert torch.equal(local(p + "self_attn.k_proj.bias"), get(p + "self_attn.k_proj.bias")[slice(*shard.kv)])
        assert torch.equal(local(p + "mlp.down_proj.weight"), get(p + "mlp.down_proj.weight")[:, slice(*shard.inter)])
        assert torch.equal(local(p + "self_attn.o_proj.weight"), get(p + "self_attn.o_proj.weight")[:, slice(*shard.q)])
        assert local(p + "mlp.up_proj.weight").shape == (spec.intermediate_size // 2, spec.hidden_size)
        assert torch.equal(local("model.embed_tokens.weight"), get("model.embed_tokens.weight"))
    assert all("proj" not in n for n in whole_reads), whole_reads
    assert shard_for(spec, 2, 0).kv == shard_for(spec, 2, 1).kv == (0, spec.head_dim)   # one KV head, replicated


def test_act_order_shards_keep_rows_quantized_and_read_columns_dense(tmp_path):
    """A column-parallel rank keeps whole rows of an act-order weight (its channel order with them); a
    row-parallel rank's range of input channels is spread over every group there, so it reads that
    projection dense."""
    from compute_service.engine.quantized import QuantizedWeight, quantize_rtn

    folder = save_tiny_llama(tmp_path, 4, 2, seed=4, intermediate_size=128)
    spec, get, _ = read_model_source(folder)
    perm = torch.randperm(spec.hidden_size, generator=torch.Generator().manual_seed(1))

    def quantized(prefix):
        qw = quantize_rtn(get(prefix + ".weight"), 4, 16)
        return QuantizedWeight(qw.q, qw.scales, qw.offsets, 4, 16, perm) if prefix.endswith("o_proj") or \
            prefix.endswith("q_proj") else qw

    get.quantized = quantized
    shard = shard_for(spec, 2, 1)
    local = sharded_source(spec, shard, get)
    p = "model.layers.0."
    q = local.quantized(p + "self_attn.q_proj")
    assert q is not None and torch.equal(q.perm, perm) and q.shape == (shard.q[1] - shard.q[0], spec.hidden_size)
    assert local.quantized(p + "self_attn.o_proj") is None
    down = local.quantized(p + "mlp.down_proj")                # in order: whole groups of its channels
    assert down is not None and down.perm is None and down.shape[1] == (shard.inter[1] - shard.inter[0])


@pytest.mark.parametrize("inter,follows", [(128, True), (80, False)])
def test_act_order_down_shards_follow_its_order(tmp_path, inter, follows):
    """`order_mlp`: a rank whose range of down's stored columns holds whole groups keeps them quantized (no
    perm) and gate's and up's rows of the same features, dense reads likewise; a range that cuts a group
    (80 = 40 | 40, groups of 16) leaves the model's order and down dense."""
    from compute_service.engine.quantized import QuantizedWeight, quantize_rtn

    folder = save_tiny_llama(tmp_path, 4, 2, seed=4, intermediate_size=inter)
    spec, get, _ = read_model_source(folder)
    perm = torch.randperm(inter, generator=torch.Generator().manual_seed(1))
    wholes = {}

    def quantized(prefix):
        w = get(prefix + ".weight")
        if prefix.endswith("down_proj"):
            qw = quantize_rtn(w[:, perm], 4, 16)
            qw = QuantizedWeight(qw.q, qw.scales, qw.offsets, 4, 16, perm)
        else:
            qw = quantize_rtn(w, 4, 16)
        wholes[prefix] = qw
        return qw

    get.quantized = quantized
    shard = shard_for(spec, 2, 1)
    a, b = shard.inter
    local = sharded_source(spec, shard, get, order_mlp=True)
    p = "model.layers.0.mlp."
    down = local.quantized(p + "down_proj")
    gate = local.quantized(p + "gate_proj")
    if not follows:
        assert down is None and local.mlp_orders() == [None, None]
        assert torch.equal(gate.dequantize(), wholes[p + "gate_proj"].dequantize()[a:b])
        return
    mine = perm[a:b]
    assert down.perm is None and torch.equal(down.dequantize(), wholes[p + "down_proj"].dequantize()[:, mine])
    assert torch.equal(gate.dequantize(), wholes[p + "gate_proj"].dequantize()[mine])
    assert torch.equal(local(p + "up_proj.weight"), get(p + "up_proj.weight")[mine])
    assert torch.equal(local(p + "down_proj.weight"), get(p + "down_proj.weight")[:, mine])
    assert torch.equal(local.mlp_orders()[0], perm) and local.mlp_orders()[1] is None   # layer 1 not read yet
    plain = sharded_source(spec, shard, get)                       # without order_mlp: as before
    assert plain.quantized(p + "down_proj") is None and plain.mlp_orders() == [None, None]
