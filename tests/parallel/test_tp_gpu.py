"""TP=2 on two GPUs over NCCL (two processes under torchrun): all-reduce correctness (NCCL, one-shot,
and the fused all-reduce + add + RMSNorm, eager and in a graph), greedy bf16
tokens equal one GPU's (a divergence only at a near tie of the fp32 reference), decode steps replayed
from CUDA graphs with and without adapters; the same greedy check on a 4-bit base kept quantized, every
shard on the quantized kernels, and on a GPTQ act-order 4-bit base (down in its stored order on each rank)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compute_service.engine.model import LAYER_PROJECTIONS

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus(tmp_path):
    out = tmp_path / "verdict.json"
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(here / "tp_gpu_worker.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    v = json.loads(out.read_text())
    print(json.dumps(v))
    assert all(v[k] for k in v if k.startswith("all_reduce")), v
    assert len([k for k in v if k.startswith("fused_norm")]) == 8, v      # fused only with peer access
    assert all(v[k] for k in v if k.startswith("fused_norm")), v
    for c in v["greedy"]:
        assert c["equal_prefix"] == 24 or c["gap"] < 0.02, c
    assert sum(c["equal_prefix"] for c in v["greedy"]) >= 48, v
    assert v["graph_steps"] > 0 and v["lora_graph_steps"] > 0, v
    # the 4-bit base: every projection's shards kept quantized and on the kernels, tokens as for bf16
    assert v["quant_kinds"] == dict.fromkeys(LAYER_PROJECTIONS, "QuantLinear"), v
    assert all(v["quant_kernels"].values()), v
    for c in v["quant_greedy"]:
        assert c["equal_prefix"] == 24 or c["gap"] < 0.02, c
    assert sum(c["equal_prefix"] for c in v["quant_greedy"]) >= 48, v
    # GPTQ act-order: o dense on each rank, down quantized in its stored order with no perm (gate/up take it)
    assert v["act_kinds"] == {"qkv": "QuantLinear", "o": "Linear", "gate_up": "QuantLinear", "down": "QuantLinear"}, v
    assert all(v["act_kernels"][n] for n in ("qkv", "gate_up", "down")), v
    assert not v["act_perms"]["down"] and v["act_perms"]["qkv"] and v["act_perms"]["gate_up"], v
    for c in v["act_greedy"]:
        assert c["equal_prefix"] == 24 or c["gap"] < 0.02, c
    assert sum(c["equal_prefix"] for c in v["act_greedy"]) >= 48, v
