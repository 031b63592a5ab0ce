"""The norms ahead of a quantized base's q/k/v and gate/up write the slice sums of x that the pair-codes path of
their projections reads (`Model._x_sums`), so that no launch of their own sits between the norm and the
projection; the numbers are those of the projection computing them itself.

float16 on the GPU, or on the CPU in Triton's interpreter: the tiny llama's q/k/v, o and gate/up as 4-bit groups
of 32 on the kernels, the pair-codes tiles forced at 2+ rows (its own rule keeps such small weights on other tiles).
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.engine.model import LlamaModel
from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import quantize_rtn
from test_parity import run_collecting


DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs only")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _quantized_engine(folder, device: str, names=("qkv", "o", "gate_up"), bits: int = 4,
                      group: int = 32) -> LLMEngine:
    """An eager float16 engine on the fused GPU-step path whose projections `names` run the quantized kernels
    (the tiny llama's K = 64: down's 80 holds no groups of 32, left dense by default)."""
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, dtype="float16", block_size=4,
                                    max_num_batched_tokens=16, enforce_eager=True))
    engine.runner.decode_kernel = True              # the Triton decode kernel (on the CPU: interpreted)
    model = engine.runner.model
    model.fused = True                              # the norms, RoPE and SwiGLU launches of a GPU step
    for lw in model.weights.layers:
        for name in names:
            dense = getattr(lw, name)
            setattr(lw, name, QuantLinear(quantize_rtn(dense.weight.float(), bits, group), dense.bias,
                                          torch.device(device), use_kernel=True))
    return engine


@pytest.mark.parametrize("device", DEVICES)
def test_norms_write_the_sums_the_quantized_projections_read(tiny_models, monkeypatch, device):
    import kernels.quant_matmul as qm

    real_pick, real_sums = qm.pick_config, qm.half_sums
    monkeypatch.setattr(qm, "pick_config", lambda t, *a, **k: (qm.QuantMatmulConfig(16, 16, 1) if t > 1
                                                                else real_pick(t, *a, **k)))
    launches: list[tuple[int, int]] = []
    monkeypatch.setattr(qm, "half_sums", lambda x, width=128: launches.append(tuple(x.shape)) or real_sums(x, width))
    requests = {"a": ([5, 9, 13, 2, 7], None), "b": ([3, 3, 8], None)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    _, folder = tiny_models["llama"]
    tokens, logits = run_collecting(_quantized_engine(folder, device), requests, params)
    given = list(launches)
    launches.clear()
    monkeypatch.setattr(LlamaModel, "_x_sums", lambda self, linear, x, ordered=False: None)      # every projection sums x itself
    tokens_own, logits_own = run_collecting(_quantized_engine(folder, device), requests, params)

    # Steps of 2+ tokens: the projection computes sums only for o (its x comes from attention), 1 a layer,
    # where without the norms' sums it does for q/k/v and gate/up as well.
    assert launches and all(shape[1] == 64 for shape in launches)
    assert len(given) * 3 == len(launches) and all(shape[1] == 64 for shape in given)
    assert tokens == tokens_own
    for rid in requests:
        for row, row_own in zip(logits[rid], logits_own[rid]):
            assert torch.allclose(row.float(), row_own.float(), rtol=1e-3, atol=1e-3)
