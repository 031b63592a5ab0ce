"""Steps of 2-64 tokens in CUDA graphs on the GPU: the LoRA runs on a side stream beside the base projection, into
the model's one zeroed buffer (`LlamaModel._side_delta`), and the kernel that reads the projection's output next
adds the delta and leaves the buffer zero (`kernels.addend.with_extra`), so no zeroing launch comes before the
next projection's LoRA. A delta left behind would be added again by a later projection or step: the logits would
drift from the order without a side stream (LORAPLEX_LORA_OVERLAP=0, the LoRA added after the base projection).
"""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
import helpers
from helpers import MID_DIMS
from loraplex.formats import read_peft
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import test_lora_first_gpu as first  # noqa: E402

mid_llama = first.mid_llama         # the same model and adapters (a module fixture)
ADAPTERS = first.ADAPTERS


def _run(folder, adapters, monkeypatch, overlap: str):
    """8 requests decoded together (steps of 8 tokens): adapter "all", "mlp" or none, twice over."""
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", overlap)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                    lora_backend="kernels", max_loras=4, max_num_seqs=8))
    for name in ADAPTERS:
        engine.add_adapter(name, read_peft(adapters / name))
    g = torch.Generator().manual_seed(5)
    keys = ["all", None, "mlp", "all", None, "all", "mlp", None]
    reqs = {f"r{i}": (torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist(), key)
            for i, key in enumerate(keys)}
    tokens, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return engine, {rid: (tokens[rid], logits[rid]) for rid in reqs}


def test_side_stream_delta_is_added_once_and_left_zero(mid_llama, monkeypatch):
    from compute_service.engine.model import LlamaModel

    _, folder, adapters = mid_llama
    used: list[bool] = []
    real = LlamaModel._project

    def spy(self, *a, **k):
        y, extra = real(self, *a, **k)
        if extra is not None:
            used.append(self._side_delta is not None and extra.data_ptr() == self._side_delta.data_ptr())
        return y, extra

    monkeypatch.setattr(LlamaModel, "_project", spy)
    engine, beside = _run(folder, adapters, monkeypatch, "1")
    model = engine.runner.model
    assert used and all(used), "every deferred side-stream delta comes in the model's one buffer"
    assert not model._side_delta.any(), "the buffer must be left all zeros"
    del engine
    used.clear()
    engine, after = _run(folder, adapters, monkeypatch, "0")
    assert engine.runner.model._side_delta is None and not used
    # The side stream rounds the delta to bf16 before adding it, the order without one adds it in fp32 into the
    # projection's output: two roundings against one, ~2e-2 of the logit scale after 10 steps (a delta left
    # behind or added twice moves the logits by a whole adapter's delta, far more).
    helpers.assert_logits_agree(after, beside, tol=4e-2)
