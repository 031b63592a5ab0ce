"""One-token steps on a 4-bit base whose q/k/v LoRA has no launch of its own (LORAPLEX_LORA_PARTS=1,
`kernels.lora_parts`): the one-row projection's launch stores the shrink, RoPE + cache adds the delta.

Each request decodes alone (steps of one token) in CUDA graphs, with the adapter "all" (rank 16 on every module)
and without one, against LORAPLEX_LORA_PARTS=0 (the fused LoRA launch first, its delta added by the one-row
kernel): the logits agree within bf16 rounding while both runs chose the same tokens; the parts path ran only in
the first run, and the adapter moves the logits far more than the tolerance (a lost delta would show).
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import SamplingParams
from helpers import MID_DIMS, assert_logits_agree, record_calls, rel_err, w4_engine
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _run(folder, adapters, monkeypatch, flag: str) -> dict:
    monkeypatch.setenv("LORAPLEX_LORA_PARTS", flag)
    engine = w4_engine(folder, adapters, 4)
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = {}
    for rid in ("a", "b"):
        prompt = torch.randint(0, MID_DIMS["vocab_size"], (5,), generator=g).tolist()
        for key in ("all", None):
            tokens, logits = run_collecting(engine, {rid: (prompt, key)}, params)
            out[rid, key] = (tokens[rid], logits[rid])
    return out


def test_lora_parts_match_the_fused_launch(w4_llama, monkeypatch):
    import kernels.quant_matmul as qm

    folder, adapters = w4_llama
    used = record_calls(monkeypatch, qm, "quant_matmul", lambda *a, **k: k.get("lora_parts") is not None)
    on = _run(folder, adapters, monkeypatch, "1")
    assert any(used), "no one-row q/k/v launch took the LoRA parts"
    count = len(used)
    off = _run(folder, adapters, monkeypatch, "0")
    assert not any(used[count:]), "LORAPLEX_LORA_PARTS=0 must not take the parts"
    assert_logits_agree(on, off)
    for rid in ("a", "b"):       # the adapter moves the logits well beyond the agreement's tolerance
        assert rel_err(on[rid, "all"][1][0], on[rid, None][1][0]) > 0.1
