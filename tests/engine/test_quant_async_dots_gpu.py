"""The asynchronous-dot 4-bit kernel (`kernels.quant_wgmma`) inside the engine: decode steps of 4 base requests
(its 8-row tiles) and of 18 requests, half of them with an adapter (32-row tiles, the LoRA on a side stream
beside it in CUDA graphs), on a 4-bit MID_DIMS llama in groups of 128 (gate/up and down are large enough for
`pick_config` to send there). LORAPLEX_ASYNC_DOTS=1 against 0 (the tiles of `kernels.quant_mma`): the logits
agree within bf16 rounding while both runs chose the same tokens, and the kernel ran only in the first."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import SamplingParams
from helpers import MID_DIMS, assert_logits_agree, w4_engine
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a CUDA GPU of sm_90 or later", allow_module_level=True)


def _run(folder, adapters, monkeypatch, flag: str) -> dict:
    monkeypatch.setenv("LORAPLEX_ASYNC_DOTS", flag)
    engine = w4_engine(folder, adapters, 18)
    assert engine.loaded.model.weights.layers[0].gate_up.async_dots == (flag == "1")
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for batch in ({f"b{i}": None for i in range(4)}, {f"m{i}": "all" if i % 2 else None for i in range(18)}):
        reqs = {rid: (torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist(), key)
                for rid, key in batch.items()}
        tokens, logits = run_collecting(engine, reqs, params)
        out.update({rid: (tokens[rid], logits[rid]) for rid in reqs})
    return out


def test_async_dot_kernel_in_the_engine_matches_the_tiles(w4_llama, monkeypatch):
    import kernels.quant_matmul as qm

    folder, adapters = w4_llama
    seen: list[int] = []
    real = qm.quant_wgmma

    def spy(x, w, bias, out, x_sums, block_m, *args, **kwargs):
        seen.append(block_m)
        return real(x, w, bias, out, x_sums, block_m, *args, **kwargs)

    monkeypatch.setattr(qm, "quant_wgmma", spy)
    on = _run(folder, adapters, monkeypatch, "1")
    assert 8 in seen and 32 in seen, sorted(set(seen))
    count = len(seen)
    off = _run(folder, adapters, monkeypatch, "0")
    assert len(seen) == count, "LORAPLEX_ASYNC_DOTS=0 must keep every launch on the tiles"
    assert_logits_agree(on, off)
