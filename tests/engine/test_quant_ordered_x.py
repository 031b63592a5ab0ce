"""Act-order projections read x written in their stored channel order by the kernel before them (the norms
ahead of q/k/v and gate/up, the SwiGLU ahead of down: `LlamaModel._ordered_x`, `kernels.perm`), with no gather
launch of their own, and the LoRA launches of a step still read x in the model's order; o (x from attention)
keeps its gather. LORAPLEX_ORDERED_X=0 gathers x in every projection: the two runs agree.

On the CPU in Triton's interpreter (float16; the tiny llama's first layer's q/k/v, o and gate/up as act-order
4-bit groups of 32, adapters on some groups, so that a norm writes x in both orders for one projection and in one
for the other; the second layer's plain);
on the GPU, a GPTQ act-order checkpoint of the MID_DIMS llama in bfloat16 against its float32 model, one-token
steps in CUDA graphs with and without its adapter (the LoRA-first addend; o's x gathered before the LoRA launch)
and a batch of two (also with the SwiGLU scattering down's x, as SCATTER_MIN_TOKENS+ rows do), with down's order
taken by gate/up's rows (`mlp_order.py`) and without."""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import QuantizedWeight, quantize_rtn
from helpers import add_peft_adapters, peft_adapter_to_converted
from test_parity import run_collecting

ADAPTERS = {"qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj"])}


def _act_order(dense, gen: torch.Generator, device: str) -> QuantLinear:
    """`dense`'s weight quantized in groups of 32 over a random order of its input channels (act-order)."""
    w = dense.weight.float().cpu()
    perm = torch.randperm(w.shape[1], generator=gen)
    qw = quantize_rtn(w[:, perm], 4, 32)                   # stored column j: the model's channel perm[j]
    return QuantLinear(QuantizedWeight(qw.q, qw.scales, qw.offsets, 4, 32, perm), dense.bias, torch.device(device),
                       use_kernel=True)


def _cpu_engine(folder, adapters: dict, monkeypatch, ordered: bool) -> LLMEngine:
    monkeypatch.setenv("LORAPLEX_ORDERED_X", "1" if ordered else "0")
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float16", block_size=4,
                                    max_num_batched_tokens=16, enforce_eager=True, max_loras=2))
    engine.runner.decode_kernel = True
    model = engine.runner.model
    model.fused = True                              # the norms, RoPE and SwiGLU launches of a GPU step
    gen = torch.Generator().manual_seed(3)
    for lw in model.weights.layers[:1]:             # the first layer's; the second's stay plain, in model order
        for name in ("qkv", "o", "gate_up"):        # down's K (80) holds no groups of 32
            setattr(lw, name, _act_order(getattr(lw, name), gen, "cpu"))
    for name, adapter in adapters.items():
        engine.add_adapter(name, adapter)
    return engine


def _spy_calls(monkeypatch) -> list[tuple[int, bool]]:
    """(out_features, ordered) of every QuantLinear call."""
    calls: list[tuple[int, bool]] = []
    real = QuantLinear.__call__

    def spy(self, x, *args, **kwargs):
        calls.append((self.out_features, bool(kwargs.get("ordered", False))))
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(QuantLinear, "__call__", spy)
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs only")
def test_norms_write_x_in_the_act_order(tiny_models, monkeypatch):
    model, folder = tiny_models["llama"]
    peft = add_peft_adapters(copy.deepcopy(model), ADAPTERS)
    adapters = {name: peft_adapter_to_converted(peft, name) for name in ADAPTERS}
    calls = _spy_calls(monkeypatch)
    # "mlp" joins at the second step: steps with q/k/v's LoRA alone, with both, and with the MLP's alone
    requests = {"qv": ([3, 3, 8], "qv"), "mlp": ([4, 1, 6, 2], "mlp")}
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    runs = {}
    for ordered in (True, False):
        calls.clear()
        runs[ordered] = run_collecting(_cpu_engine(folder, adapters, monkeypatch, ordered), requests, params,
                                       join_at={"mlp": 1})
        seen = set(calls)
        hidden, qkv = model.config.hidden_size, model.config.hidden_size * 2    # q 64 + k, v 16 each
        assert (qkv, ordered) in seen and (2 * model.config.intermediate_size, ordered) in seen, seen
        assert (qkv, not ordered) not in seen and (hidden, True) not in seen, seen    # o: never ordered
    (tok, logits), (tok_own, logits_own) = runs[True], runs[False]
    assert tok == tok_own
    for rid in requests:
        for row, row_own in zip(logits[rid], logits_own[rid]):
            assert torch.allclose(row.float(), row_own.float(), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def gptq_act_order_mid(tmp_path_factory):
    """(a GPTQ act-order 4-bit copy of `mid_llama` in groups of 128, the folder of its adapter "all", the float32
    PEFT model of the weights that checkpoint defines with that adapter, and the same in bfloat16), on the GPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import ALL_MODULES, mid_llama
    from quant_helpers import with_weights, write_gptq_folder

    src, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("adapters")
    mid_llama({"all": ALL_MODULES}, src, adapters)
    dense = AutoModelForCausalLM.from_pretrained(str(src))
    folder, defined = write_gptq_folder(dense, src, tmp_path_factory.mktemp("gptq") / "q", 4, 128, act_order=True)
    peft32 = PeftModel.from_pretrained(with_weights(dense, defined), str(adapters / "all"), adapter_name="all")
    peft32 = peft32.cuda().eval()
    return folder, adapters, peft32, copy.deepcopy(peft32).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_act_order_checkpoint_matches_float32(gptq_act_order_mid, monkeypatch):
    """Both ways (x written in order, and gathered) within bf16's own distance of the float32 model, at the tokens
    each chose: requests alone (one-token steps in graphs; with the adapter, the LoRA-first addend) and two at
    once (the LoRA beside the projection). With down's order taken by gate/up (the default, `mlp_order.py`:
    the adapter's gate, up and down packed in it) and without: then in order, the two at once also with the
    SwiGLU scattering down's x and down summing its slices itself (what SCATTER_MIN_TOKENS+ rows do)."""
    import compute_service.engine.model as model_module

    from helpers import MID_DIMS, w4_engine, rel_err
    from test_parity import adapter_reference_logits

    folder, adapters, peft32, peft16 = gptq_act_order_mid
    calls = _spy_calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist() for rid in ("a", "b")}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    scatter = model_module.SCATTER_MIN_TOKENS
    for ordered, scatter_min, mlp in (("1", scatter, "1"), ("1", scatter, "0"), ("1", 2, "0"), ("0", 2, "0")):
        monkeypatch.setenv("LORAPLEX_ORDERED_X", ordered)
        monkeypatch.setenv("LORAPLEX_MLP_ORDER", mlp)
        monkeypatch.setattr(model_module, "SCATTER_MIN_TOKENS", scatter_min)
        engine = w4_engine(folder, adapters, 2)
        lw = engine.loaded.model.weights.layers[0]
        assert lw.down.act_order == (mlp == "0") and (lw.mlp_order is not None) == (mlp == "1")
        calls.clear()
        runs = [run_collecting(engine, {rid: (prompts[rid], key)}, params) for rid in prompts for key in ("all", None)]
        runs.append(run_collecting(engine, {"a": (prompts["a"], "all"), "b": (prompts["b"], None)}, params))
        assert any(o for _, o in calls) == (ordered == "1"), calls[:8]
        keys = {"a": "all", "b": None}
        for i, (tokens, logits) in enumerate(runs):
            for rid, rows in logits.items():
                key = keys[rid] if i == len(runs) - 1 else ("all", None)[i % 2]
                refs = [adapter_reference_logits(m, prompts[rid], tokens[rid], key).float()
                        for m in (peft32, peft16)]
                ours, hf = rel_err(torch.stack(rows).float(), refs[0]), rel_err(refs[1], refs[0])
                assert ours <= 3 * hf + 1e-2, (ordered, i, rid, key, ours, hf)
