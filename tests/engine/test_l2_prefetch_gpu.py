"""The decode graphs' L2 prefetch (LORAPLEX_L2_PREFETCH, compute_service/engine/l2_prefetch.py) on the GPU: a plan
with a rule at every point launches its prefetches in the captured steps, and the engine's tokens and logits are
those of the engine without a plan, bit for bit (a prefetch moves nothing into registers or memory), with
adapters on every projection and without."""
from __future__ import annotations

import pytest
import torch

import kernels.l2_prefetch as l2
from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
import helpers
from helpers import ALL_MODULES, MID_DIMS
from loraplex.formats import read_peft
from test_parity import run_collecting

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

EVERY_POINT = ("pre_qkv:qkv:0.5,post_qkv:o:1,post_qkv:gate_up:0.25,pre_o:gate_up:0.25-0.5,pre_gate_up:down:0.5,"
               "post_gate_up:down:0.5-1,pre_down:qkv+1:1")


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory):
    folder, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("mid_adapters")
    helpers.mid_llama({"all": ALL_MODULES}, folder, adapters)
    return folder, adapters


def _run(folder, adapters, monkeypatch, plan: str | None):
    if plan is None:
        monkeypatch.delenv("LORAPLEX_L2_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_L2_PREFETCH", plan)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                    lora_backend="kernels", max_loras=2, max_num_seqs=4))
    engine.add_adapter("all", read_peft(adapters / "all"))
    g = torch.Generator().manual_seed(3)
    requests = {rid: (torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist(), key)
                for rid, key in (("a", "all"), ("b", None), ("c", "all"))}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = run_collecting(engine, {"a": requests["a"]}, params)            # one-token steps
    together = run_collecting(engine, requests, params, join_at={"c": 3})   # 2-3 token steps
    return engine, alone, together


def test_prefetch_plan_changes_no_result(mid_llama, monkeypatch):
    if not l2.supported(torch.device("cuda")):
        pytest.skip("the bulk L2 prefetch needs sm_90 or later")
    folder, adapters = mid_llama
    launches = []
    real = l2.l2_prefetch
    monkeypatch.setattr(l2, "l2_prefetch", lambda table: launches.append(table.shape[0]) or real(table))
    _, alone_ref, together_ref = _run(folder, adapters, monkeypatch, None)
    assert not launches
    engine, alone, together = _run(folder, adapters, monkeypatch, EVERY_POINT)
    layers = MID_DIMS["num_hidden_layers"]
    assert len(engine.runner.model._prefetcher.tables) == 6 * layers - 1     # no pre_down after the last layer
    assert launches, "the captured steps launch the plan's prefetches"
    for got, want in ((alone, alone_ref), (together, together_ref)):
        assert got[0] == want[0]
        for rid in want[1]:
            for row, row_ref in zip(got[1][rid], want[1][rid]):
                assert torch.equal(row, row_ref)
