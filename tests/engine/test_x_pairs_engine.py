"""At one token the kernels that write a quantized projection's x (the norms, the SwiGLU) write its pairs form too
where the projection's one-row kernel reads it (`LlamaModel._x_sums`, `QuantLinear.reads_pairs`), and the engine's
tokens and logits are those of the kernels converting x themselves (LORAPLEX_X_PAIRS=0), bit for bit.

bfloat16 on the GPU, or on the CPU in Triton's interpreter: a one-layer llama of width 256 (MLP 512) whose four
projections are 4-bit groups of 128 on the kernels, every one-row launch in 64-feature programs split in two (the
rule's own case); o's x comes from attention, which writes no form.
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import SamplingParams
from test_parity import run_collecting
from test_quant_x_sums import DEVICES, _quantized_engine
from test_split_defer import random_llama

DIMS = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def mlp_llama(tmp_path_factory):
    return random_llama(tmp_path_factory, "mlp", DIMS, 6)


def _engine(folder, device: str):
    return _quantized_engine(folder, device, ("qkv", "o", "gate_up", "down"), 4, 128, "bfloat16")


@pytest.mark.parametrize("device", DEVICES)
def test_producers_hand_the_form_and_nothing_changes(mlp_llama, monkeypatch, device):
    import kernels.quant_matmul as qm

    real_pick, real_matmul = qm.pick_config, qm.quant_matmul
    monkeypatch.setattr(qm, "pick_config", lambda t, *a, **k: (qm.QuantMatmulConfig(64, 1, 2) if t == 1
                                                                else real_pick(t, *a, **k)))
    read: list[tuple[int, int]] = []

    def recording(x, w, *a, x_pairs=None, **k):
        if x_pairs is not None:
            read.append((x.shape[1], w.out_features))
        return real_matmul(x, w, *a, x_pairs=x_pairs, **k)

    monkeypatch.setattr(qm, "quant_matmul", recording)
    requests = {"a": ([5, 9, 13], None)}
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    monkeypatch.setenv("LORAPLEX_X_PAIRS", "0")
    tokens_own, logits_own = run_collecting(_engine(mlp_llama, device), requests, params)
    assert not read, "LORAPLEX_X_PAIRS=0: no producer writes the form"
    monkeypatch.delenv("LORAPLEX_X_PAIRS")
    tokens, logits = run_collecting(_engine(mlp_llama, device), requests, params)

    # two decode steps of one token: q/k/v (K 256, N 512), gate/up (256, 1024) and down (512, 256) read the
    # form; o (its x from attention) does not
    assert sorted(set(read)) == [(256, 512), (256, 1024), (512, 256)], read
    assert len(read) == 2 * 3
    assert tokens == tokens_own
    for row, row_own in zip(logits["a"], logits_own["a"]):
        assert torch.equal(row, row_own)
