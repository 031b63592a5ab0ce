"""Run by `torchrun --nproc-per-node 2` (see test_tp_gpu.py): NCCL all-reduce correctness, then TP=2
bf16 greedy decoding with CUDA graphs against one GPU, near-tie aware against an fp32 reference, on a
dense base, on a 4-bit base kept quantized, and on a GPTQ act-order 4-bit base (down's stored order taken by
gate/up on each rank, `sharded_source`'s `order_mlp`).
Rank 0 writes a JSON verdict to the path in argv[1]."""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.engine.model import LAYER_PROJECTIONS
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
    verdict.update(_fused_norm_checks(group))
    folder = group.broadcast_object(
        str(save_tiny_llama(Path(out_path).parent / "tiny", 8, 2, seed=5)) if rank == 0 else None)
    dense = against_one_process(group, EngineConfig(model=folder, device="cuda", dtype="bfloat16", block_size=16,
                                                    max_num_seqs=8, kv_cache_bytes=64 * 2**20, max_loras=4))
    quant = against_one_process(group, quantized_config(group, Path(out_path).parent))
    act = against_one_process(group, quantized_config(group, Path(out_path).parent, act_order=True))
    if rank == 0:
        verdict.update(greedy=dense["greedy"], graph_steps=dense["graph_steps"],
                       lora_graph_steps=dense["lora_graph_steps"], quant_kinds=quant["kinds"],
                       quant_kernels=quant["kernels"], quant_greedy=quant["greedy"], act_kinds=act["kinds"],
                       act_kernels=act["kernels"], act_greedy=act["greedy"], act_perms=act["perms"])
        Path(out_path).write_text(json.dumps(verdict, indent=1))
    _close(group)


def against_one_process(group, cfg: EngineConfig) -> dict:
    """Builds `cfg`'s TP engine on every rank. Rank 1 follows until rank 0 stops it and gets {}; rank 0 gets
    its projections' kinds (and whether they run the quantized kernels), the greedy checks
    (`greedy_against_one_process`) and how many decode steps replayed graphs."""
    engine, slots = build_rank_engine(cfg, group)
    if group.rank:
        follow(engine.runner, slots, group)
        return {}
    lw = engine.loaded.model.weights.layers[0]
    kinds = {n: type(getattr(lw, n)).__name__ for n in LAYER_PROJECTIONS}
    kernels = {n: bool(getattr(getattr(lw, n), "use_kernel", False)) for n in kinds}
    perms = {n: bool(getattr(getattr(lw, n), "act_order", False)) for n in kinds}     # x read in an order
    greedy = greedy_against_one_process(engine, cfg)
    return dict(kinds=kinds, kernels=kernels, perms=perms, greedy=greedy, graph_steps=engine.runner.num_graph_steps,
                lora_graph_steps=engine.runner.num_lora_graph_steps)


def greedy_against_one_process(engine, cfg: EngineConfig) -> list[dict]:
    """Rank 0: greedy tokens of the TP engine against the one-process engine of `cfg` in a mixed batch of
    adapters; where they diverge, the gap of the two tokens under an fp32 reference (eager, same weights).
    Stops the TP engine's followers."""
    single = LLMEngine(cfg)
    ref32 = LLMEngine(dataclasses.replace(cfg, dtype="float32", enforce_eager=True))
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
    del single, ref32
    return checks


def quantized_config(group, tmp: Path, act_order: bool = False) -> EngineConfig:
    """A 4-bit checkpoint (groups of 32, `loraplex quantize`'s AWQ layout, written by rank 0) kept quantized:
    under TP=2 every shard of every projection stays quantized (a row-parallel rank holds 32 | 64 in
    features: whole groups) and runs the quantized kernels. With `act_order`, GPTQ with its channels in a
    random order: o's shards are dense (its channels are spread over every group), down's stored columns of
    each rank's 64 intermediate features stay quantized with no perm, gate's and up's rows in their order."""
    from compute_service.engine.quant_formats.export import quantize_checkpoint

    folder = None
    if group.rank == 0:
        dense = save_tiny_llama(tmp / "q_dense", 8, 2, seed=6, intermediate_size=128)
        if act_order:
            folder = str(quantize_checkpoint(dense, tmp / "q_gptq_act_order", fmt="gptq", group_size=32,
                                             symmetric=True, act_order_seed=1, progress=False).out)
        else:
            folder = str(quantize_checkpoint(dense, tmp / "q_awq", fmt="awq", group_size=32, progress=False).out)
    return EngineConfig(model=group.broadcast_object(folder), device=group.device.type, dtype="bfloat16",
                        block_size=16, max_num_seqs=8, kv_cache_bytes=64 * 2**20, max_loras=4, quantization="keep")


def _fused_norm_checks(group) -> dict:
    """`reduce_add_rms_norm` (fused over peer memory where it fits) against NCCL's all-reduce and then
    `add_rms_norm`, eagerly and replayed from a CUDA graph with new inputs; both ranks must get the same
    bits. Four calls in a chain (h carried), slots alternating as the model uses them."""
    import torch.distributed as dist

    from kernels.rms_norm import add_rms_norm

    res: dict = {}
    dev, rank = group.device, group.rank

    def inputs(rows, dtype, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        h = torch.randn(rows, 512, device=dev, generator=g).to(dtype)            # the same on every rank
        g.manual_seed(seed * 10 + rank + 1)
        xs = [torch.randn(rows, 512, device=dev, generator=g).to(dtype) for _ in range(4)]
        return h, xs

    def fused(h, xs, w, outs):
        for k, x in enumerate(xs):
            group.reduce_add_rms_norm(x, h, w, 1e-5, outs[k], k % 2)

    def reference(h, xs, w, outs):
        for k, x in enumerate(xs):
            s = x.clone()
            dist.all_reduce(s, group=group.device_group)
            add_rms_norm(s, h, w, 1e-5, outs[k], h)

    def same_on_every_rank(t):
        got = [torch.empty_like(t) for _ in range(group.world_size)]
        dist.all_gather(got, t.contiguous(), group=group.device_group)
        return all(torch.equal(got[0], g) for g in got)

    for dtype in (torch.bfloat16, torch.float32):
        w = torch.linspace(0.5, 1.5, 512, device=dev).to(dtype)
        for rows in (1, 5, 64):
            h, xs = inputs(rows, dtype, rows)
            h_ref, outs_ref = h.clone(), [torch.empty_like(h) for _ in xs]
            reference(h_ref, xs, w, outs_ref)
            outs = [torch.empty_like(h) for _ in xs]
            fused(h, xs, w, outs)
            ok = torch.equal(h, h_ref) and all(torch.equal(a, b) for a, b in zip(outs, outs_ref))
            res[f"fused_norm_{dtype}_{rows}"] = bool(ok and same_on_every_rank(h) and same_on_every_rank(outs[-1]))
        h, xs = inputs(5, dtype, 99)
        outs = [torch.empty_like(h) for _ in xs]
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            fused(h.clone(), xs, w, outs)                          # compile outside the capture
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused(h, xs, w, outs)
        ok = True
        for seed in (3, 4, 5):
            h_new, xs_new = inputs(5, dtype, seed)
            h.copy_(h_new)
            for x, x_new in zip(xs, xs_new):
                x.copy_(x_new)
            graph.replay()
            h_ref, outs_ref = h_new.clone(), [torch.empty_like(h) for _ in xs]
            reference(h_ref, xs_new, w, outs_ref)
            ok = ok and torch.equal(h, h_ref) and all(torch.equal(a, b) for a, b in zip(outs, outs_ref))
        res[f"fused_norm_graph_{dtype}"] = bool(ok)
        del graph
    return res


def _close(group) -> None:
    """Frees the captured graphs (which hold the NCCL communicator's work) before leaving the group."""
    gc.collect()
    torch.cuda.synchronize()
    group.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1])
