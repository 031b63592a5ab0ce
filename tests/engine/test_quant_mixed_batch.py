"""Adapters on a quantized base: a mixed batch (base, A, B, A, C joining mid-way) on a 4-bit
compressed-tensors tiny Qwen2 kept quantized equals each request run alone on the same engine, and
transformers + PEFT on the same model with its projections replaced by the dequantized weights."""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from compute_service.engine.quant_formats.export import quantize_checkpoint
from compute_service.engine.quant_linear import QuantLinear
from helpers import TINY_DIMS, add_peft_adapters, rel_err
from loraplex.formats import read_peft
from test_mixed_batch import ADAPTERS, REQUESTS
from test_parity import TOL, adapter_reference_logits, run_collecting

SPLIT = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def quantized_qwen(tiny_models, tmp_path_factory):
    model, src = tiny_models["qwen2"]
    folder = quantize_checkpoint(src, tmp_path_factory.mktemp("q") / "ct4", bits=4, group_size=16, progress=False).out
    dequantized = copy.deepcopy(model)      # the reference: the same model with the dequantized projections
    loaded = load_model(folder, quantization="keep")
    sd = dequantized.state_dict()
    with torch.no_grad():
        for i, lw in enumerate(loaded.model.weights.layers):
            for name, parts in SPLIT.items():
                layer = getattr(lw, name)
                assert isinstance(layer, QuantLinear)
                w, row = layer.dequantize(), 0
                for part in parts:
                    target = sd[f"model.layers.{i}.{part}.weight"]
                    target.copy_(w[row: row + target.shape[0]])
                    row += target.shape[0]
    peft_model = add_peft_adapters(dequantized, ADAPTERS)
    out = tmp_path_factory.mktemp("adapters")
    peft_model.save_pretrained(out)
    return peft_model, folder, {name: read_peft(out / name) for name in ADAPTERS}


def engine_for(folder, adapters) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_num_batched_tokens=16, lora_backend="torch",
                                    max_loras=4, quantization="keep"))
    assert isinstance(engine.loaded.model.weights.layers[0].qkv, QuantLinear)
    for name, adapter in adapters.items():
        engine.add_adapter(name, adapter)
    return engine


def test_mixed_batch_on_a_quantized_base_matches_each_request_alone(quantized_qwen):
    peft_model, folder, adapters = quantized_qwen
    g = torch.Generator().manual_seed(3)
    reqs = {rid: (torch.randint(0, TINY_DIMS["vocab_size"], (n,), generator=g).tolist(), key)
            for rid, (key, n, _) in REQUESTS.items()}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens, logits = run_collecting(engine_for(folder, adapters), reqs, params,
                                    join_at={rid: step for rid, (_, _, step) in REQUESTS.items()})
    alone_engine = engine_for(folder, adapters)
    for rid, (prompt, key) in reqs.items():
        alone_tokens, alone = run_collecting(alone_engine, {rid: (prompt, key)}, params)
        assert alone_tokens[rid] == tokens[rid], rid
        for row, ref in zip(logits[rid], alone[rid]):
            assert rel_err(row, ref) < 1e-5, rid
        ref = adapter_reference_logits(peft_model, prompt, tokens[rid], key)
        assert max(rel_err(row, ref[i]) for i, row in enumerate(logits[rid])) < TOL, (rid, key)
    firsts = [logits[r][0] for r in ("base", "a1", "b", "c")]
    assert all(rel_err(x, y) > 100 * TOL for i, x in enumerate(firsts) for y in firsts[i + 1:])
