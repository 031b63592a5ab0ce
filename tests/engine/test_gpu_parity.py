"""bf16 on a CUDA GPU: tiny models within bf16 tolerance of an fp32 reference; SmolLM2 greedy tokens tie-aware.

"Within bf16 tolerance" is measured against transformers itself: our bf16
logits may be off the fp32 reference by at most a small multiple of
transformers' own bf16 error (+ a floor). With LORAPLEX_RESULTS_DIR set, the
measured numbers are written there as JSON.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from helpers import TINY_DIMS, add_peft_adapters, rel_err
from loraplex.formats import read_peft
from test_mixed_batch import ADAPTERS, REQUESTS
from test_parity import adapter_reference_logits, reference_logits, run_collecting

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
RESULTS: dict[str, object] = {}


def _record(name: str, value: object) -> None:
    RESULTS[name] = value
    out = os.environ.get("LORAPLEX_RESULTS_DIR")
    if out:
        Path(out, "engine_gpu_parity.json").write_text(json.dumps(RESULTS, indent=1))


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_mixed_batch_bf16(tiny_models, tmp_path, kind, backend):
    model, folder = tiny_models[kind]
    peft32 = add_peft_adapters(copy.deepcopy(model), ADAPTERS).cuda()
    peft32.save_pretrained(tmp_path)
    peft16 = copy.deepcopy(peft32).to(torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=4,
                                    max_num_batched_tokens=16, lora_backend=backend, max_loras=4))
    for name in ADAPTERS:
        engine.add_adapter(name, read_peft(tmp_path / name))
    g = torch.Generator().manual_seed(3)
    reqs = {rid: (torch.randint(0, TINY_DIMS["vocab_size"], (n,), generator=g).tolist(), key)
            for rid, (key, n, _) in REQUESTS.items()}
    joins = {rid: step for rid, (_, _, step) in REQUESTS.items()}
    tokens, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                    join_at=joins)
    worst = {}
    for rid, (prompt, key) in reqs.items():
        refs = [adapter_reference_logits(m, prompt, tokens[rid], key).float() for m in (peft32, peft16)]
        ours = torch.stack(logits[rid])
        worst[rid] = (rel_err(ours, refs[0]), rel_err(refs[1], refs[0]))
    _record(f"tiny_{kind}_{backend}", {r: {"ours_vs_fp32": a, "transformers_bf16_vs_fp32": b}
                                        for r, (a, b) in worst.items()})
    for rid, (ours_err, hf_err) in worst.items():
        assert ours_err <= 3 * hf_err + 1e-2, (rid, ours_err, hf_err)


def _smollm2_path() -> Path:
    env = os.environ.get("LORAPLEX_SMOLLM2_GGUF")
    if env:
        return Path(env)
    from compute_service.engine import default_model_path
    return default_model_path()


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_smollm2_bf16_greedy_32_tokens(quantization):
    """Our bf16 greedy tokens, teacher-forced through transformers in fp32 and bf16: every token we chose is
    the fp32 argmax, or within the bf16 tolerance of it (where the reference itself is tied in bf16). Under
    `auto` (the default) the GGUF's Q4_1 projections run 4-bit on the quantized kernels, whose weights are
    the same values as the dequantized reference's; `none` dequantizes them to bf16."""
    from hf_reference import reference_model, reference_tokenizer

    path = _smollm2_path()
    tok = reference_tokenizer(path)
    ref32 = reference_model(path).cuda()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", max_model_len=1024,
                                    quantization=quantization), tokenizer=tok)
    from compute_service.engine.quant_linear import QuantLinear
    assert isinstance(engine.runner.model.weights.layers[0].qkv, QuantLinear) == (quantization == "auto")
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three prime numbers and explain why they are prime."]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in prompts]
    got = engine.generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    report = []
    for p, out in zip(ids, got):
        l32 = reference_logits(ref32, p, out).float()           # [32, V] fp32 logits along our tokens
        l16 = reference_logits(ref16, p, out).float()
        chosen = torch.tensor(out, device=l32.device)
        margin = l32.max(dim=-1).values - l32.gather(1, chosen[:, None])[:, 0]   # 0 where we took the argmax
        tol = 3 * (l16 - l32).abs().max(dim=-1).values + 1e-3                    # bf16's own error, per step
        report.append({"argmax_equal": int((margin == 0).sum()), "worst_margin_over_tol": float((margin / tol).max()),
                       "text": tok.decode(out)})
        assert len(out) == 32
        assert bool((margin <= tol).all()), (report[-1], margin.tolist(), tol.tolist())
    _record(f"smollm2_bf16_greedy_{quantization}", report)
    assert sum(r["argmax_equal"] for r in report) >= 0.9 * 32 * len(ids), report


def test_seeded_sampling_and_preemption_on_cuda(tiny_models):
    """fp32 on CUDA: per-request generators on the GPU; batch mates and preemption leave seeded tokens unchanged."""
    _, folder = tiny_models["qwen2"]
    prompts = [torch.randint(0, TINY_DIMS["vocab_size"], (8 + 3 * i,), generator=torch.Generator().manual_seed(i))
               .tolist() for i in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    results = []
    for kv_bytes in (1 << 22, 2048 * 20):
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", block_size=4,
                                        max_model_len=64, kv_cache_bytes=kv_bytes, max_num_batched_tokens=24))
        results.append((engine.generate(prompts, params), engine.stats().num_preemptions))
    alone = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", block_size=4))
    first_alone = alone.generate(prompts[:1], params[:1])[0]
    _record("cuda_seeded", {"preemptions": [n for _, n in results], "equal": results[0][0] == results[1][0]})
    (roomy, n_roomy), (tight, n_tight) = results
    assert n_roomy == 0 and n_tight > 0 and tight == roomy
    assert first_alone == roomy[0] and len(set(first_alone)) > 1
