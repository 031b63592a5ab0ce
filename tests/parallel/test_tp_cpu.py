"""TP=2 on CPU over gloo, two processes: rank 0's logits equal the single-process engine's (fp32,
1e-5 relative) in a mixed batch of base requests and adapters of different ranks, on a model whose
KV heads split over the ranks, one whose single KV head is replicated, and a Qwen2 with q/k/v biases."""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from tp_helpers import random_adapter, save_tiny_llama

TOL = 1e-5
ADAPTERS = {"r4": ((1, 2, 3, 4, 5, 6, 7), 4), "r8": ((1, 3, 4, 6), 8), "r2": ((2, 5, 7), 2)}
# request -> (adapter, prompt length, step at which it joins)
REQUESTS = {"base": (None, 9, 0), "a": ("r4", 13, 0), "b": ("r8", 6, 0), "a2": ("r4", 11, 2), "c": ("r2", 7, 3)}


def config(folder: str) -> EngineConfig:
    return EngineConfig(model=folder, block_size=4, max_num_batched_tokens=16, max_loras=4, lora_backend="torch")


def run_mixed(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """The requests (joining mid-way), greedy to the end; logits rows per request."""
    g = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(0, 96, (n,), generator=g).tolist() for rid, (_, n, _) in REQUESTS.items()}
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in REQUESTS}
    pending, step = dict(REQUESTS), 0
    while pending or engine.has_unfinished():
        for rid in [r for r, (_, _, at) in pending.items() if at <= step]:
            key = pending.pop(rid)[0]
            engine.add_request(rid, prompts[rid], params, key)
        _, rows = engine.step_with_logits()
        for rid, row in rows.items():
            logits[rid].append(row.clone())
        step += 1
    return logits


def adapters_for(spec) -> dict:
    return {name: random_adapter(spec, mods, rank, seed=i) for i, (name, (mods, rank)) in enumerate(ADAPTERS.items())}


def worker(rank: int, port: int, folders: list[str], results) -> None:
    from compute_service.parallel.engine import build_rank_engine
    from compute_service.parallel.group import init_group
    from compute_service.parallel.schedule import follow

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = init_group("cpu", timeout_s=60)
    try:
        for folder in folders:
            engine, slots = build_rank_engine(config(folder), group)
            if rank:
                follow(engine.runner, slots, group)
                continue
            single = LLMEngine(config(folder))
            for name, a in adapters_for(single.spec).items():
                single.add_adapter(name, a)
                engine.add_adapter(name, a)
            want = run_mixed(single)
            got = run_mixed(engine)
            engine.runner.stop()
            assert engine.runner.num_graph_steps == 0 and slots.resident("r8")
            errs = {rid: max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got[rid], want[rid]))
                    for rid in REQUESTS if len(got[rid]) == len(want[rid]) == 5}
            results[folder] = (errs, {rid: len(v) for rid, v in got.items()})
    except Exception:
        results[f"error{rank}"] = traceback.format_exc()
        raise
    finally:
        group.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    folders = [str(save_tiny_llama(tmp_path_factory.mktemp("kv2"), 4, 2, seed=0)),
               str(save_tiny_llama(tmp_path_factory.mktemp("kv1"), 4, 1, seed=1)),
               str(save_tiny_llama(tmp_path_factory.mktemp("qwen"), 4, 2, seed=2, qwen=True))]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(free_port(), folders, results), nprocs=2, join=True)
        return folders, dict(results)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["kv-split", "kv-replicated", "qwen2-bias"])
def test_tp2_logits_equal_single_process(tp_results, which):
    folders, results = tp_results
    assert not any(k.startswith("error") for k in results), results
    errs, counts = results[folders[which]]
    assert counts == {rid: 5 for rid in REQUESTS}
    assert set(errs) == set(REQUESTS)
    assert max(errs.values()) < TOL, errs
