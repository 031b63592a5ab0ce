"""LORAPLEX_LORA_TAIL=1 on the GPU: a one-token step's LoRA as a shrink launch, its expand added by the base
projection's one-row kernel itself (kernels/lora_tail.py), against the default (the fused LoRA launch writing a
float32 delta the kernel adds). Each prompt decoded alone (one-token steps) in CUDA graphs with dependent launches,
with and without an adapter, on the bf16 model (the dense GEMV) and on the 4-bit one (the one-row 4-bit kernels):
the logits agree within bf16 rounding while both chose the same tokens, and the adapter moves them far more than
that, so a lost, doubled or misplaced expand (a wrong slice, column or rank row) shows."""
from __future__ import annotations

import pytest
import torch

import helpers
from helpers import assert_same_logits, decode_alone, w4_engine

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import test_lora_first_gpu as first  # noqa: E402

mid_llama = first.mid_llama         # the bf16 model and its adapters (a module fixture)


def _tails(monkeypatch, module, name: str) -> list:
    return helpers.record_calls(monkeypatch, module, name, lambda *a, **k: k.get("tail") is not None)


def test_bf16_tail_matches_the_fused_delta(mid_llama, monkeypatch):
    import kernels.dense_gemv as dg

    _, folder, adapters = mid_llama
    seen = _tails(monkeypatch, dg, "dense_gemv")
    monkeypatch.setenv("LORAPLEX_LORA_TAIL", "1")
    engine, tail = first._run(folder, adapters, monkeypatch, "1")
    assert engine.runner.model._lora_tail and any(seen), "no one-token projection added a LoRA tail"
    del engine
    seen.clear()
    monkeypatch.setenv("LORAPLEX_LORA_TAIL", "0")
    _, fused = first._run(folder, adapters, monkeypatch, "1")
    assert not any(seen), "LORAPLEX_LORA_TAIL=0 must keep the fused launch's delta"
    assert_same_logits(tail, fused)


def test_4bit_tail_matches_the_fused_delta(w4_llama, monkeypatch):
    import kernels.quant_matmul as qm

    folder, adapters = w4_llama
    seen = _tails(monkeypatch, qm, "quant_matmul")
    monkeypatch.setenv("LORAPLEX_LORA_TAIL", "1")
    tail = decode_alone(w4_engine(folder, adapters, 2))
    assert any(seen), "no one-token 4-bit projection added a LoRA tail"
    seen.clear()
    monkeypatch.setenv("LORAPLEX_LORA_TAIL", "0")
    fused = decode_alone(w4_engine(folder, adapters, 2))
    assert not any(seen)
    assert_same_logits(tail, fused)
