"""Steps of 1-16 tokens on the GPU whose LoRA runs right after the base projection, as a dependent launch beside
it that adds its delta once the projection is done (`LlamaModel._project`, LORAPLEX_LORA_AFTER_TOKENS).

In CUDA graphs with dependent launches the LoRA launch reads x before its wait and adds into the projection's
output after it: a missed wait (the delta added before the projection wrote its output, then overwritten) or a
lost delta shows as logits off the default order's (LoRA first at one token, on a side stream at 2-16), on a
bf16 base (the dense one-row GEMV and the library GEMM) and on a 4-bit one (the quantized kernels).
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
import helpers
from helpers import ALL_MODULES, MID_DIMS
from loraplex.formats import read_peft
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    folder, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("mid_adapters")
    helpers.mid_llama({"all": ALL_MODULES}, folder, adapters)
    return folder, adapters


@pytest.fixture(scope="module")
def w4_llama(tmp_path_factory):
    return helpers.w4_mid_llama(tmp_path_factory)


def _engine(folder, adapters, quantized: bool) -> LLMEngine:
    if quantized:
        return helpers.w4_engine(folder, adapters, max_num_seqs=4)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                    lora_backend="kernels", max_loras=2, max_num_seqs=4))
    engine.add_adapter("all", read_peft(adapters / "all"))
    return engine


def _run(folder, adapters, quantized: bool, monkeypatch, after: str) -> dict[str, tuple[list[int], list]]:
    """Request "a" alone (one-token steps), then "b" (no adapter), "c" and "d" together (steps of 3 tokens)."""
    monkeypatch.setenv("LORAPLEX_LORA_AFTER_TOKENS", after)
    engine = _engine(folder, adapters, quantized)
    g = torch.Generator().manual_seed(11)
    prompts = {rid: torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist() for rid in "abcd"}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens, logits = run_collecting(engine, {"a": (prompts["a"], "all")}, params)
    out = {"a": (tokens["a"], logits["a"])}
    batch = {"b": (prompts["b"], None), "c": (prompts["c"], "all"), "d": (prompts["d"], "all")}
    tokens, logits = run_collecting(engine, batch, params)
    out.update({rid: (tokens[rid], logits[rid]) for rid in batch})
    tokens, logits = run_collecting(engine, {"a0": (prompts["a"], None)}, params)
    out["a0"] = (tokens["a0"], logits["a0"])
    return out


@pytest.mark.parametrize("quantized", [False, True])
def test_lora_after_the_base_projection_matches_the_default_order(bf16_llama, w4_llama, quantized, monkeypatch):
    import kernels.fused as fused

    folder, adapters = w4_llama if quantized else bf16_llama
    afters = []
    real = fused.lora_fused_triton

    def spy(*a, **k):
        afters.append(k.get("after", False))
        return real(*a, **k)

    monkeypatch.setattr(fused, "lora_fused_triton", spy)
    after = _run(folder, adapters, quantized, monkeypatch, "16")
    assert any(afters), "no LoRA launch ran after its base projection"
    afters.clear()
    default = _run(folder, adapters, quantized, monkeypatch, "0")
    assert not any(afters)
    helpers.assert_logits_agree(default, after)
    # The adapter moves the logits far more than the tolerance: a lost delta would not pass the comparison.
    assert helpers.rel_err(after["a"][1][0], after["a0"][1][0]) > 0.1
