"""One-token steps on the GPU whose projections take the one-row kernels: the LoRA runs first, into float32
zeros, and the base kernel adds it (`LlamaModel._project`, LORAPLEX_LORA_FIRST).

Every projection of a one-token step with an adapter takes the dense one-row GEMV then (a base-only step
keeps the library GEMM for q/k/v and o, which are too small for the GEMV to pay on its own). Each request
decodes alone (steps of one token), in CUDA
graphs with dependent launches, so the GEMV reads x and its weight before waiting for the LoRA launch: a
missed wait or a lost delta shows as logits off the earlier order's (the LoRA added after the base
projection, LORAPLEX_LORA_FIRST=0).
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
import helpers
from helpers import MID_DIMS
from loraplex.formats import read_peft
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ADAPTERS = {
    "all": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
    "mlp": dict(r=8, lora_alpha=8, target_modules=["up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory):
    folder, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("mid_adapters")
    return helpers.mid_llama(ADAPTERS, folder, adapters), folder, adapters


def _run(folder, adapters, monkeypatch, first: str):
    """Each prompt decoded alone (one-token steps) with its adapter and, as a control, without one."""
    monkeypatch.setenv("LORAPLEX_LORA_FIRST", first)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                    lora_backend="kernels", max_loras=4, max_num_seqs=4))
    for name in ADAPTERS:
        engine.add_adapter(name, read_peft(adapters / name))
    g = torch.Generator().manual_seed(7)
    out = {}
    for rid, key in (("a", "all"), ("b", "mlp"), ("c", "all")):
        prompt = torch.randint(0, MID_DIMS["vocab_size"], (5,), generator=g).tolist()
        for k in (key, None):
            tokens, logits = run_collecting(engine, {rid: (prompt, k)},
                                            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            out[rid, k] = (tokens[rid], logits[rid])
    return engine, out


def test_lora_first_matches_the_earlier_order(mid_llama, monkeypatch):
    """LORAPLEX_LORA_FIRST=1 against =0 (the LoRA added after the base projection, the order the other GPU
    tests hold against PEFT): the same logits within bf16 rounding while both chose the same tokens, and
    the adapters move the logits far more than that (a dropped or half-added delta would show)."""
    import kernels.dense_gemv as dg

    _, folder, adapters = mid_llama
    added = helpers.record_calls(monkeypatch, dg, "dense_gemv", lambda *a, **k: k.get("addend") is not None)
    engine, first = _run(folder, adapters, monkeypatch, "1")
    assert engine.runner.model._lora_delta is not None
    assert any(added), "no one-token projection added the LoRA delta in its GEMV"
    assert not engine.runner.model._lora_delta.any(), "the delta buffer must be left all zeros"
    _, after = _run(folder, adapters, monkeypatch, "0")
    helpers.assert_same_logits(first, after)
