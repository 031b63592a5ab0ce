"""The default SmolLM2 GGUF kept quantized (`--quantization keep` on the CPU): every projection a 4-bit
group-32 QuantLinear (Q4_1), the tied embedding dense, the fingerprint unchanged, and greedy text equal
to the dequantized load's (on the CPU both compute in float32 from the same weight values)."""
from __future__ import annotations

import pytest

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams, load_model, load_tokenizer
from compute_service.engine.linear import Linear
from compute_service.engine.model import LAYER_PROJECTIONS
from compute_service.engine.quant_linear import QuantLinear

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def test_default_gguf_kept_quantized_generates_the_dequantized_text(caplog):
    with caplog.at_level("INFO"):
        kept = load_model(None, quantization="keep")
    dense = load_model(None, quantization="none")
    assert kept.fingerprint == dense.fingerprint
    layers = [getattr(lw, n) for lw in kept.model.weights.layers for n in LAYER_PROJECTIONS]
    assert len(layers) == 120 and all(isinstance(x, QuantLinear) and (x.bits, x.group_size) == (4, 32)
                                      for x in layers)
    assert "quantized base (gguf): 120 of 120 projections kept quantized (4-bit group 32: 120)" in caplog.text
    quantized_bytes = sum(x.nbytes for x in layers)
    dense_bytes = sum(getattr(lw, n).nbytes for lw in dense.model.weights.layers
                      for n in LAYER_PROJECTIONS)
    assert quantized_bytes * 6 < dense_bytes        # 0.625 bytes a weight (codes, scales, offsets) vs float32's 4
    assert kept.model.weights.embed.dtype == dense.model.weights.embed.dtype and isinstance(
        dense.model.weights.layers[0].qkv, Linear)
    tok = load_tokenizer(None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    cfg = EngineConfig(max_model_len=256)
    got = greedy(LLMEngine(cfg, loaded=kept, tokenizer=tok), prompts)
    want = greedy(LLMEngine(cfg, loaded=dense, tokenizer=tok), prompts)
    assert got == want, [tok.decode(t) for t in got + want]
    assert "Paris" in tok.decode(got[0])
