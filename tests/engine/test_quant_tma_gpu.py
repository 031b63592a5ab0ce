"""The one-row 4-bit kernel with its words read by TMA (`kernels.quant_gemv_tma`) inside the engine: one-token
steps in CUDA graphs with dependent launches (its L2 requests before the wait, the pipeline's copies after it),
with and without an adapter (the LoRA-first addend). LORAPLEX_H2_TMA=2 puts every float16-pairs launch on it (a
model this small has no projection `pick_config` sends there), LORAPLEX_H2_TMA=0 none; the two runs' logits agree
within bf16 rounding while they chose the same tokens, and the adapter moves the logits far more than that."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same_logits, decode_alone, w4_engine

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _run(folder, adapters, monkeypatch, tma: str):
    monkeypatch.setenv("LORAPLEX_H2_TMA", tma)
    return decode_alone(w4_engine(folder, adapters, 2))


def test_tma_kernel_in_the_engine_matches_the_register_set_kernel(w4_llama, monkeypatch):
    import kernels.quant_matmul as qm

    folder, adapters = w4_llama
    launches = {"tma": 0, "addend": 0}
    real = qm.quant_gemv_tma_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches["tma"] += 1
                launches["addend"] += bool(kwargs["ADD"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(qm, "quant_gemv_tma_kernel", Spy())
    tma = _run(folder, adapters, monkeypatch, "2")
    assert launches["tma"] > 0 and launches["addend"] > 0, launches
    seen = dict(launches)
    plain = _run(folder, adapters, monkeypatch, "0")
    assert launches == seen, "LORAPLEX_H2_TMA=0 must keep every launch on the register-set kernel"
    assert_same_logits(tma, plain)
