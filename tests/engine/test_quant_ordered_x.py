"""Act-order projections read x written in their stored channel order by the kernel before them (the norms
ahead of q/k/v and gate/up, the SwiGLU ahead of down: `LlamaModel._ordered_x`, `kernels.perm`), with no gather
launch of their own, and the LoRA launches of a step still read x in the model's order; o (x from attention)
keeps its gather. LORAPLEX_ORDERED_X=0 gathers x in every projection: the two runs agree.

On the CPU in Triton's interpreter (float16; the tiny llama's q/k/v, o and gate/up as act-order 4-bit groups of
32, adapters on some groups, so that a norm writes x in both orders for one projection and in one for the other);
on the GPU, a GPTQ act-order checkpoint of the MID_DIMS llama in bfloat16, one-token steps in CUDA graphs with
and without its adapter (the LoRA-first addend) and a batch of two."""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import QuantizedWeight, quantize_rtn
from helpers import add_peft_adapters, assert_same_logits, decode_alone, peft_adapter_to_converted
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
    for lw in model.weights.layers:
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
    requests = {"base": ([5, 9, 13, 2, 7], None), "qv": ([3, 3, 8], "qv"), "mlp": ([4, 1, 6, 2], "mlp")}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    runs = {}
    for ordered in (True, False):
        calls.clear()
        runs[ordered] = run_collecting(_cpu_engine(folder, adapters, monkeypatch, ordered), requests, params)
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
    """(a GPTQ act-order 4-bit copy of `mid_llama` in groups of 128, the folder of its adapter "all")."""
    from transformers import AutoModelForCausalLM

    from helpers import ALL_MODULES, mid_llama
    from quant_helpers import write_gptq_folder

    src, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("adapters")
    mid_llama({"all": ALL_MODULES}, src, adapters)
    dense = AutoModelForCausalLM.from_pretrained(str(src))
    folder, _ = write_gptq_folder(dense, src, tmp_path_factory.mktemp("gptq") / "q", 4, 128, act_order=True)
    return folder, adapters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_act_order_checkpoint_decodes_as_with_gathers(gptq_act_order_mid, monkeypatch):
    from helpers import w4_engine

    folder, adapters = gptq_act_order_mid
    calls = _spy_calls(monkeypatch)
    runs = {}
    for ordered in ("1", "0"):
        monkeypatch.setenv("LORAPLEX_ORDERED_X", ordered)
        engine = w4_engine(folder, adapters, 2)
        assert engine.loaded.model.weights.layers[0].down.act_order
        calls.clear()
        alone = decode_alone(engine)
        batch = run_collecting(engine, {"a": ([1, 2, 3, 4], "all"), "b": ([7, 6, 5], None)},
                               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        runs[ordered] = alone, batch
        assert any(o for _, o in calls) == (ordered == "1"), calls[:8]
    assert_same_logits(runs["1"][0], runs["0"][0])
    for rid in ("a", "b"):
        assert_same_logits({(rid, None): (runs["1"][1][0][rid], runs["1"][1][1][rid])},
                           {(rid, None): (runs["0"][1][0][rid], runs["0"][1][1][rid])})
