"""Tiny random Llama/Qwen2 in fp32 on CPU: prefill and decode logits equal transformers' (+ PEFT)."""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from helpers import TINY_DIMS, add_peft_adapters, peft_adapter_to_converted, rel_err

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 1e-4


def run_collecting(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]], params: SamplingParams,
                   join_at: dict[str, int] | None = None) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Steps to completion; returns output tokens and the logits row of every sampling step per request."""
    join_at = join_at or {}
    tokens = {r: [] for r in requests}
    logits = {r: [] for r in requests}
    step = 0
    pending = dict(requests)
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if join_at.get(r, 0) <= step]:
            prompt, key = pending.pop(rid)
            engine.add_request(rid, prompt, params, key)
        outs, rows = engine.step_with_logits()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
        for rid, row in rows.items():
            logits[rid].append(row.clone())
        step += 1
    return tokens, logits


def reference_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits at the positions our engine sampled from: [len(output), V]."""
    with torch.no_grad():
        full = model(torch.tensor([prompt + output], device=model.device)).logits[0]
    return full[len(prompt) - 1: len(prompt) - 1 + len(output)]


def adapter_reference_logits(peft_model, prompt: list[int], output: list[int], key: str | None) -> torch.Tensor:
    """`reference_logits` of `peft_model` with its adapter `key` set, or with its adapters disabled for None."""
    if key is None:
        with peft_model.disable_adapter():
            return reference_logits(peft_model, prompt, output)
    peft_model.set_adapter(key)
    return reference_logits(peft_model, prompt, output)


def assert_peft_parity(peft_model, reqs: dict[str, tuple[list[int], str | None]], tokens: dict, logits: dict,
                       steps: int) -> None:
    """Every request's `steps` logits rows within TOL of PEFT's (its adapter set, or none) at the same tokens."""
    for rid, (prompt, key) in reqs.items():
        assert len(logits[rid]) == steps
        ref = adapter_reference_logits(peft_model, prompt, tokens[rid], key)
        for i, row in enumerate(logits[rid]):
            assert rel_err(row.cpu(), ref[i]) < TOL, (rid, key, i)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied"])
@pytest.mark.parametrize("chunk", [64, 5])
def test_base_logits_match_transformers(tiny_models, kind, chunk):
    model, folder = tiny_models[kind]
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_num_batched_tokens=chunk))
    g = torch.Generator().manual_seed(11)
    reqs = {f"r{i}": (torch.randint(0, TINY_DIMS["vocab_size"], (n,), generator=g).tolist(), None)
            for i, n in enumerate((1, 9, 17))}
    tokens, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for rid, (prompt, _) in reqs.items():
        assert len(tokens[rid]) == 6 and len(logits[rid]) == 6
        ref = reference_logits(model, prompt, tokens[rid])
        for i, row in enumerate(logits[rid]):
            assert rel_err(row, ref[i]) < TOL, (rid, i)
        assert tokens[rid] == ref.argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_adapter_logits_match_peft(tiny_models, kind):
    model, folder = tiny_models[kind]
    peft_model = add_peft_adapters(copy.deepcopy(model), {"all": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES)})
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_num_batched_tokens=7))
    engine.add_adapter("all", peft_adapter_to_converted(peft_model, "all"))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, TINY_DIMS["vocab_size"], (12,), generator=g).tolist()
    tokens, logits = run_collecting(engine, {"a": (prompt, "all"), "base": (prompt, None)},
                                    SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    ref = reference_logits(peft_model, prompt, tokens["a"])
    for i, row in enumerate(logits["a"]):
        assert rel_err(row, ref[i]) < TOL, i
    # the adapter changes the logits far beyond the tolerance, so the check above has teeth
    assert rel_err(logits["a"][0], logits["base"][0]) > 100 * TOL
