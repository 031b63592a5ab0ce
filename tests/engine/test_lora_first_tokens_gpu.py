"""LORAPLEX_LORA_FIRST_TOKENS=16 on a 4-bit base: steps of 2-16 tokens with adapters run their LoRA first, into
float32 zeros, and the base projection's kernel adds it (`LlamaModel._project`, `QuantLinear.takes_addend`: the
asynchronous-dot kernel where it runs, sm_90+, else the register-set tiles; LORAPLEX_ASYNC_DOTS=0 both runs on
the tiles), instead of beside the projection on a side stream. Decode steps of 8 requests, half
of them with an adapter on every module, on a 4-bit MID_DIMS llama in groups of 128, in CUDA graphs with
dependent launches (the kernel then reads x and its sums before waiting for the LoRA launch): the logits agree
with the default's (the LoRA beside the projection) within bf16 rounding while both runs chose the same tokens,
and the delta buffer is left zero."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import SamplingParams
from helpers import MID_DIMS, assert_logits_agree, w4_engine
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _run(folder, adapters, monkeypatch, tokens: str | None, async_dots: str):
    monkeypatch.setenv("LORAPLEX_ASYNC_DOTS", async_dots)
    if tokens is None:
        monkeypatch.delenv("LORAPLEX_LORA_FIRST_TOKENS", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_LORA_FIRST_TOKENS", tokens)
    engine = w4_engine(folder, adapters, 8)
    g = torch.Generator().manual_seed(11)
    reqs = {f"r{i}": (torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist(), "all" if i % 2 else None)
            for i in range(8)}
    tokens_out, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return engine, {rid: (tokens_out[rid], logits[rid]) for rid in reqs}


@pytest.mark.parametrize("async_dots", ["1", "0"])
def test_lora_first_at_2_to_16_tokens_matches_the_side_stream(w4_llama, monkeypatch, async_dots):
    import kernels.quant_matmul as qm

    folder, adapters = w4_llama
    rows_added: list[int] = []
    rings: list[bool] = []
    real = qm.quant_matmul

    def spy(x, w, bias, out, config, partials=None, locks=None, addend=None, x_sums=None):
        if addend is not None:
            rows_added.append(x.shape[0])
            rings.append(bool(config.ring))
        return real(x, w, bias, out, config, partials, locks, addend, x_sums)

    monkeypatch.setattr(qm, "quant_matmul", spy)
    engine, first = _run(folder, adapters, monkeypatch, "16", async_dots)
    assert engine.runner.model._first_tokens == 16
    assert any(1 < t <= 16 for t in rows_added), sorted(set(rows_added))
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    assert any(rings) == (async_dots == "1" and sm90), "the asynchronous-dot kernel adds the delta where it runs"
    assert not engine.runner.model._lora_delta.any(), "the delta buffer must be left all zeros"
    count = len(rows_added)
    del engine
    _, side = _run(folder, adapters, monkeypatch, None, async_dots)
    assert all(t == 1 for t in rows_added[count:]), "by default only one-token steps add the delta in the kernel"
    assert_logits_agree(first, side)
