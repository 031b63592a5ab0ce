"""One-token steps on the GPU with LORAPLEX_LORA_READY=1: the LoRA launch releases the base kernel that adds its
delta at its start, and that kernel reads x only once the LoRA launch has set the projection's flag after its wait
(kernels/pdl.py, `x_ready`; `LlamaModel._project`).

Each request decodes alone (steps of one token) in CUDA graphs with dependent launches, on a bf16 base (the dense
one-row GEMV) and on a 4-bit one (the quantized one-row kernels). A base kernel that read x before the norm wrote it
(a flag set too early, or a missed fence) shows as logits off the default order's, where the base kernel starts only
once the LoRA launch has passed its wait.
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine
import helpers
from helpers import ALL_MODULES
from loraplex.formats import read_peft

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    folder, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("mid_adapters")
    helpers.mid_llama({"all": ALL_MODULES}, folder, adapters)
    return folder, adapters


@pytest.fixture(scope="module")
def w4_llama(tmp_path_factory):
    return helpers.w4_mid_llama(tmp_path_factory)


def _run(folder, adapters, quantized: bool, monkeypatch, ready: str) -> tuple[LLMEngine, dict]:
    """Two prompts decoded alone with the adapter "all", and each without one (the control)."""
    monkeypatch.setenv("LORAPLEX_LORA_READY", ready)
    if quantized:
        engine = helpers.w4_engine(folder, adapters, max_num_seqs=2)
    else:
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                        lora_backend="kernels", max_loras=2, max_num_seqs=2))
        engine.add_adapter("all", read_peft(adapters / "all"))
    return engine, helpers.decode_alone(engine)


@pytest.mark.parametrize("quantized", [False, True])
def test_lora_ready_matches_the_default_order(bf16_llama, w4_llama, quantized, monkeypatch):
    import kernels.fused as fused

    folder, adapters = w4_llama if quantized else bf16_llama
    flagged = helpers.record_calls(monkeypatch, fused, "lora_fused_triton", lambda *a, **k: k.get("ready") is not None)
    engine, ready = _run(folder, adapters, quantized, monkeypatch, "1")
    assert engine.runner.model._ready_flags is not None and any(flagged), "no LoRA launch took a ready flag"
    flagged.clear()
    _, default = _run(folder, adapters, quantized, monkeypatch, "0")
    assert not any(flagged)
    helpers.assert_same_logits(default, ready)
