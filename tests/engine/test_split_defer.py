"""A quantized base's split-K projections leave their partials to the kernel that reads them next (the norm, RoPE
+ cache, the SwiGLU: `kernels.split_sum`), and the engine's tokens and logits are those of the projections summing
them in their own launch (LORAPLEX_DEFER_SPLIT=0), bit for bit (no bias, no addend: the same sum in the same
order).

float16 on the GPU, or on the CPU in Triton's interpreter: a one-layer llama of width 256 whose four projections
are 8-bit groups of 64 on the kernels (two K blocks each), every launch forced to split K in two.
"""
from __future__ import annotations

import pytest
import torch

import kernels.split_sum as split_sum
from compute_service.engine import SamplingParams
from test_parity import run_collecting
from test_quant_x_sums import DEVICES, _quantized_engine

DIMS = dict(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**DIMS, rms_norm_eps=1e-5, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.08)
    folder = tmp_path_factory.mktemp("wide")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _engine(folder, device: str):
    return _quantized_engine(folder, device, ("qkv", "o", "gate_up", "down"), bits=8, group=64)


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_split_sums_match_the_in_launch_sums(wide_llama, monkeypatch, device):
    import kernels.quant_matmul as qm

    monkeypatch.setattr(qm, "pick_config", lambda t, *a, **k: (qm.QuantMatmulConfig(64, 16, 2) if t > 1
                                                                else qm.QuantMatmulConfig(128, 1, 2)))
    made: list[tuple[int, ...]] = []
    real_init = split_sum.SplitSum.__init__

    def counting_init(self, parts, dtype):
        made.append(tuple(parts.shape))
        real_init(self, parts, dtype)

    monkeypatch.setattr(split_sum.SplitSum, "__init__", counting_init)
    requests = {"a": ([5, 9, 13, 2, 7], None), "b": ([3, 3, 8], None)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    join_at = {"b": 2}                              # "a" decodes alone first: one-row steps

    monkeypatch.setenv("LORAPLEX_DEFER_SPLIT", "0")
    tokens_own, logits_own = run_collecting(_engine(wide_llama, device), requests, params, join_at)
    assert not made, "LORAPLEX_DEFER_SPLIT=0: every projection sums its partials in its own launch"
    monkeypatch.delenv("LORAPLEX_DEFER_SPLIT")
    tokens, logits = run_collecting(_engine(wide_llama, device), requests, params, join_at)

    rows = {shape[1] for shape in made}
    assert {shape[0] for shape in made} == {2} and 1 in rows and max(rows) > 1, made
    assert len(made) % 4 == 0, "all four projections of the layer, every step"
    assert tokens == tokens_own
    for rid in requests:
        for row, row_own in zip(logits[rid], logits_own[rid]):
            assert torch.equal(row, row_own)
