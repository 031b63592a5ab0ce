"""A mixed batch of 5 requests (base, A, B, A, C) with joins mid-way equals each request alone through PEFT.

A: rank 8 on q/v; B: rank 16 on all seven modules with rank_pattern and
alpha_pattern; C: rsLoRA. Adapters go PEFT folder -> `read_peft` -> engine,
and the check runs against both LoRA backends (torch reference, kernels).
"""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from helpers import TINY_DIMS, add_peft_adapters, rel_err
from loraplex.formats import read_peft
from test_parity import ALL_MODULES, TOL, assert_peft_parity, run_collecting

ADAPTERS = {
    "A": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "B": dict(r=16, lora_alpha=8, target_modules=ALL_MODULES, rank_pattern={"o_proj": 4, "down_proj": 12},
              alpha_pattern={"up_proj": 32}),
    "C": dict(r=8, lora_alpha=32, use_rslora=True, target_modules=["k_proj", "up_proj", "gate_proj"]),
}
# request -> (adapter, prompt length, step at which it joins)
REQUESTS = {"base": (None, 9, 0), "a1": ("A", 13, 0), "b": ("B", 6, 0), "a2": ("A", 11, 2), "c": ("C", 7, 3)}


@pytest.fixture(scope="module")
def peft_qwen(tiny_models, tmp_path_factory):
    model, folder = tiny_models["qwen2"]
    peft_model = add_peft_adapters(copy.deepcopy(model), ADAPTERS)
    out = tmp_path_factory.mktemp("adapters")
    peft_model.save_pretrained(out)      # one sub-folder per named adapter
    return peft_model, folder, {name: read_peft(out / name) for name in ADAPTERS}


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_mixed_batch_matches_each_request_alone(peft_qwen, backend):
    peft_model, folder, adapters = peft_qwen
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_num_batched_tokens=16,
                                    lora_backend=backend, max_loras=4))
    for name, adapter in adapters.items():
        engine.add_adapter(name, adapter)
    g = torch.Generator().manual_seed(3)
    reqs = {rid: (torch.randint(0, TINY_DIMS["vocab_size"], (n,), generator=g).tolist(), key)
            for rid, (key, n, _) in REQUESTS.items()}
    joins = {rid: step for rid, (_, _, step) in REQUESTS.items()}
    tokens, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                    join_at=joins)
    assert_peft_parity(peft_model, reqs, tokens, logits, 6)
    # adapters really differ from each other and from the base model
    firsts = [logits[r][0] for r in ("base", "a1", "b", "c")]
    assert all(rel_err(x, y) > 100 * TOL for i, x in enumerate(firsts) for y in firsts[i + 1:])
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0
