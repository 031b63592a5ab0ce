"""Run by `torchrun --nproc-per-node 2` (see test_tp_gpu.py): NCCL all-reduce correctness, then TP=2
bf16 greedy decoding with CUDA graphs against one GPU, near-tie aware against an fp32 reference.
Rank 0 writes a JSON verdict to the path in argv[1]."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.parallel.engine import build_rank_engine
from compute_service.parallel.group import init_group
from compute_service.parallel.schedule import follow
from tp_helpers import random_adapter, save_tiny_llama

STEPS = 24


def main(out_path: str) -> None:
    group = init_group("cuda", timeout_s=60)
    rank = group.rank
    verdict: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.arange(4099, device=group.device, dtype=dtype) * (rank + 1)
        group.all_reduce(t)
        verdict[f"all_reduce_{dtype}"] = bool(torch.equal(t, torch.arange(4099, device=group.device, dtype=dtype) * 3))
    big = torch.full((1 << 19, 3), float(rank + 1), device=group.device)    # 6 MiB: past the one-shot path
    group.all_reduce(big)
    verdict["all_reduce_large"] = bool((big == 3).all())
    verdict["peer_all_reduce"] = group.peer_all_reduce is not None
    folder = group.broadcast_object(
        str(save_tiny_llama(Path(out_path).parent / "tiny", 8, 2, seed=5)) if rank == 0 else None)
    cfg = EngineConfig(model=folder, device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=8,
                       kv_cache_bytes=64 * 2**20, max_loras=4)
    engine, slots = build_rank_engine(cfg, group)
    if rank:
        follow(engine.runner, slots, group)
        del engine, slots
        _close(group)
        return
    single = LLMEngine(cfg)
    ref32 = LLMEngine(EngineConfig(model=folder, device="cuda", dtype="float32", kv_cache_bytes=64 * 2**20,
                                   max_loras=4, enforce_eager=True))
    adapters = {"a": random_adapter(single.spec, (1, 2, 3, 4, 5, 6, 7), 8, seed=1),
                "b": random_adapter(single.spec, (1, 3, 4, 6), 16, seed=2)}
    for e in (engine, single, ref32):
        for k, a in adapters.items():
            e.add_adapter(k, a)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9, 13, 7)]
    keys = [None, "a", "b", "a"]
    p = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    got = engine.generate(prompts, p, keys)
    want = single.generate(prompts, p, keys)
    engine.runner.stop()
    checks = []
    for prompt, key, a, b in zip(prompts, keys, got, want):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        entry = {"adapter": key, "equal_prefix": n}
        if n < len(a):       # diverged: both tokens must be a near tie under the fp32 reference
            ref32.add_request("r", prompt + a[:n], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), key)
            row = None
            while ref32.has_unfinished():
                _, rows = ref32.step_with_logits()
                row = rows.get("r", row)
            gap = float((row[a[n]] - row[b[n]]).abs() / row.abs().max())
            entry["gap"] = gap
        checks.append(entry)
    verdict.update(greedy=checks, graph_steps=engine.runner.num_graph_steps,
                   lora_graph_steps=engine.runner.num_lora_graph_steps)
    Path(out_path).write_text(json.dumps(verdict, indent=1))
    del engine, slots, single, ref32
    _close(group)


def _close(group) -> None:
    """Frees the captured graphs (which hold the NCCL communicator's work) before leaving the group."""
    gc.collect()
    torch.cuda.synchronize()
    group.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1])
