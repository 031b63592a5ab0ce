"""An act-order down projection's stored order taken by gate/up's rows (`compute_service.engine.mlp_order`):
down reads act as the SwiGLU computes it, and adapters on gate, up and down are packed in the same order.

The engine on a GPTQ act-order checkpoint of the tiny llama with LORAPLEX_MLP_ORDER 1 and 0 gives the same tokens
and logits for a mixed batch (an adapter on the MLP's three projections, one on q/v, and no adapter), and the
order-on run matches the PEFT model of the weights the checkpoint defines."""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.engine.mlp_order import fused_rows, in_model_order, orders_table, take_intermediate
from helpers import add_peft_adapters, peft_adapter_to_converted, rel_err
from quant_helpers import with_weights, write_gptq_folder
from test_parity import adapter_reference_logits, run_collecting

ADAPTERS = {"mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
            "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])}
G = 16        # divides the tiny llama's 64 hidden and 80 intermediate features


@pytest.fixture(scope="module")
def act_order_llama(tiny_models, tmp_path_factory):
    """(GPTQ act-order folder, converted adapters, float32 PEFT model of the weights that folder defines)."""
    model, src = tiny_models["llama"]
    folder, defined = write_gptq_folder(model, src, tmp_path_factory.mktemp("ao") / "q", 4, G, act_order=True)
    peft = add_peft_adapters(with_weights(model, defined), ADAPTERS)
    return folder, {name: peft_adapter_to_converted(peft, name) for name in ADAPTERS}, peft


def _engine(folder, adapters, monkeypatch, on: bool) -> LLMEngine:
    monkeypatch.setenv("LORAPLEX_MLP_ORDER", "1" if on else "0")
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", quantization="keep",
                                    block_size=4, max_num_batched_tokens=32, enforce_eager=True, max_loras=2))
    for name, adapter in adapters.items():
        engine.add_adapter(name, adapter)
    return engine


def test_mixed_batch_equals_the_model_order(act_order_llama, monkeypatch, caplog):
    folder, adapters, peft = act_order_llama
    requests = {"mlp": ([3, 9, 4, 1], "mlp"), "qv": ([7, 2, 5], "qv"), "base": ([6, 6, 1, 8, 2], None)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    runs = {}
    for on in (True, False):
        with caplog.at_level(logging.INFO):
            caplog.clear()
            engine = _engine(folder, adapters, monkeypatch, on)
        layers = engine.loaded.model.weights.layers
        assert all((lw.mlp_order is not None) == on and lw.down.act_order != on and lw.gate_up.act_order
                   for lw in layers)
        assert ("keep gate/up's rows in down's stored order" in caplog.text) == on
        runs[on] = run_collecting(engine, requests, params, join_at={"qv": 1})
    (tokens, logits), (tokens_off, logits_off) = runs[True], runs[False]
    assert tokens == tokens_off
    for rid, (prompt, key) in requests.items():
        ours = torch.stack(logits[rid])
        assert rel_err(ours, torch.stack(logits_off[rid])) < 1e-5, rid
        assert rel_err(ours, adapter_reference_logits(peft, prompt, tokens[rid], key).float()) < 1e-4, rid


def test_the_load_permutes_gate_up_rows_and_keeps_down_as_stored(act_order_llama, monkeypatch):
    folder, adapters, _ = act_order_llama
    on, off = (_engine(folder, {}, monkeypatch, flag).loaded.model.weights.layers for flag in (True, False))
    for lw, lw_off in zip(on, off):
        order = lw.mlp_order
        assert torch.equal(order, lw_off.down.qweight.perm)
        assert torch.equal(lw.gate_up.dequantize(), lw_off.gate_up.dequantize()[fused_rows(order, 2)])
        assert torch.equal(lw.down.dequantize(), lw_off.down.dequantize()[:, order])
        for name in ("gate_up", "down"):
            assert torch.equal(in_model_order(name, getattr(lw, name).dequantize(), order),
                               getattr(lw_off, name).dequantize())


def test_take_intermediate_and_the_pool_refusing_a_late_change(act_order_llama, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    orders = [torch.randperm(6, generator=gen), None, torch.randperm(6, generator=gen)]
    table = orders_table(orders, torch.device("cpu"))
    assert torch.equal(table[1], torch.arange(6)) and orders_table([None, None], torch.device("cpu")) is None
    b = torch.randn(3, 6, 2, generator=gen)                  # rows of layers 2, 0, 1: [n, I, r]
    layers = np.array([2, 0, 1])
    got = take_intermediate(b, layers, table, 1)
    for k, layer in enumerate(layers):
        assert torch.equal(got[k], b[k][table[layer]])
    a = torch.randn(3, 2, 6, generator=gen)                  # [n, r, I]
    got = take_intermediate(a, layers, table, 2)
    for k, layer in enumerate(layers):
        assert torch.equal(got[k], a[k][:, table[layer]])

    folder, adapters, _ = act_order_llama
    engine = _engine(folder, {"mlp": adapters["mlp"]}, monkeypatch, True)
    slots = engine.slots
    assert isinstance(slots, PagedAdapterSlots) and slots.mlp_orders is not None
    layers_now = engine.loaded.model.weights.layers
    slots.follow_orders(layers_now)                          # the same order: allowed
    changed = copy.copy(layers_now[0])
    changed.mlp_order = torch.arange(changed.mlp_order.numel())
    with pytest.raises(RuntimeError, match="MLP order changed while adapters are in the pool"):
        slots.follow_orders([changed, *layers_now[1:]])
