"""TP=2 on CPU over gloo with a quantized checkpoint kept quantized (`quantization="keep"`): each rank
holds its slices of the codes (whole rows; whole groups of in features, else that projection dense),
and rank 0's logits equal the single-process quantized engine's in a mixed batch of adapters."""
from __future__ import annotations

import dataclasses
import itertools
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from compute_service.engine import LLMEngine
from compute_service.engine.model import LAYER_PROJECTIONS
from compute_service.engine.quant_formats.export import quantize_checkpoint
from test_tp_cpu import REQUESTS, TOL, adapters_for, config, free_port, run_mixed
from tp_helpers import save_tiny_llama


def quantized_config(folder: str):
    return dataclasses.replace(config(folder), quantization="keep")


def worker(rank: int, port: int, folder: str, results) -> None:
    from compute_service.parallel.engine import build_rank_engine
    from compute_service.parallel.group import init_group
    from compute_service.parallel.schedule import follow

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = init_group("cpu", timeout_s=60)
    try:
        engine, slots = build_rank_engine(quantized_config(folder), group)
        lw = engine.loaded.model.weights.layers[0]
        results[f"kinds{rank}"] = {n: type(getattr(lw, n)).__name__ for n in LAYER_PROJECTIONS}
        results[f"perms{rank}"] = {n: bool(getattr(getattr(lw, n), "act_order", False)) for n in LAYER_PROJECTIONS}
        if rank:
            follow(engine.runner, slots, group)
            return
        single = LLMEngine(quantized_config(folder))
        adapters = adapters_for(single.spec)
        for e, (name, a) in itertools.product((single, engine), adapters.items()):
            e.add_adapter(name, a)
        want, got = run_mixed(single), run_mixed(engine)
        engine.runner.stop()
        results["errs"] = {rid: max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got[rid], want[rid]))
                           for rid in REQUESTS if len(got[rid]) == len(want[rid]) == 5}
        results["fingerprints"] = (engine.fingerprint, single.fingerprint)
    except Exception:
        results[f"error{rank}"] = traceback.format_exc()
        raise
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["awq", "gptq-act-order"])
def test_tp2_quantized_logits_equal_single_process(tmp_path, kind):
    """AWQ: down's in features split 40 | 40, not whole groups of 16, so its shards are dense. GPTQ act-order
    (128 intermediate features, 64 | 64): each rank keeps down's stored columns of its half quantized and
    gate's and up's rows of the same features (`sharded_source`'s `order_mlp`), adapters split to match; o's
    act-order channels are spread over every group, so o's shards are dense."""
    if kind == "awq":
        dense = save_tiny_llama(tmp_path / "dense", 4, 2, seed=4)
        folder = quantize_checkpoint(dense, tmp_path / "q", fmt="awq", group_size=16, progress=False).out
        want = {"qkv": "QuantLinear", "o": "QuantLinear", "gate_up": "QuantLinear", "down": "Linear"}
        perms = dict.fromkeys(want, False)
    else:
        dense = save_tiny_llama(tmp_path / "dense", 4, 2, seed=4, intermediate_size=128)
        folder = quantize_checkpoint(dense, tmp_path / "q", fmt="gptq", group_size=16, symmetric=True,
                                     act_order_seed=1, progress=False).out
        want = {"qkv": "QuantLinear", "o": "Linear", "gate_up": "QuantLinear", "down": "QuantLinear"}
        perms = {"qkv": True, "o": False, "gate_up": True, "down": False}     # down's perm taken by gate/up
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(free_port(), str(folder), results), nprocs=2, join=True)
        results = dict(results)
    assert not any(k.startswith("error") for k in results), results
    assert results["kinds0"] == results["kinds1"] == want
    assert results["perms0"] == results["perms1"] == perms
    assert set(results["errs"]) == set(REQUESTS) and max(results["errs"].values()) < TOL, results["errs"]
    assert results["fingerprints"][0] == results["fingerprints"][1]
