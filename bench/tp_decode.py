"""Tensor-parallel decode: time per output token at TP=1 and TP=2 (8B shape) and TP=2 (70B shape).

Launched as two processes (one per GPU) by the distributed launcher:

    python3 -m torch.distributed.run --nproc-per-node 2 bench/tp_decode.py \
        --commit "$(git rev-parse HEAD)" --out bench/results/tp_decode.json
    python3 -m torch.distributed.run --nproc-per-node 2 bench/tp_decode.py --tiny --out /tmp/x.json   # CPU, gloo

Each rank builds only its own slices of a random bf16 model directly on its GPU, through the engine's
tensor-parallel construction (`shard_for` / `local_spec` / `sharded_source` / `build_weights`) over a
random tensor source that makes each slice where it is needed, so no GPU ever holds the whole 70B model.
TP=1 (8B only) runs on rank 0 alone while rank 1 waits.

Every request has a 43-token random prompt and decodes 100 tokens greedily (EOS ignored), as in
`bench/multi_lora.py`. Cases: the base model, and every request its own adapter (rank 16, all seven
modules, each rank holding its share by the seed's rule), at batch 1, 8, 32, 64. Per case:

- `tpot_ms`: wall time per output token of rank 0's engine loop (decode steps only), host work and the
  per-step broadcast to the follower included (what a client sees); TP=1 overlaps each step's host work
  with the GPU (the single-GPU default), TP=2 cannot yet (followers take each step's tokens from rank 0);
- `gpu_step_ms`: GPU time of one decode step, the median of 20 replays of the step's CUDA graph timed
  with CUDA events, every rank replaying in lock step (the all-reduces are inside the graph);
- `floor`: the per-GPU byte floor: (that rank's weight bytes without the embedding table + the step's
  distinct adapters' bytes on that rank + the batch's KV bytes on that rank at its mean length) / the
  bandwidth of a 2 GiB device-to-device copy measured in the run (bytes read + written);
- `allreduce_ms` (TP=2): GPU time of a step's all-reduces alone (2 per layer, [batch, hidden]) in a graph;
  `reduce_norm_ms`: the same all-reduces with their residual adds and RMSNorms, as the model runs them
  (one fused launch each unless LORAPLEX_TP_ALL_REDUCE says otherwise).

The JSON holds every figure plus the ratios TP2 / TP1 and measured / floor.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# copy_bandwidth: bytes read + written per second of a device copy; run_engine: wall TPOT of the decode steps
from multi_lora import copy_bandwidth, run_engine  # noqa: E402
from compute_service.parallel.fast_all_reduce import ENV  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
LORA_RANK = 16
# (name, distinct adapters of rank LORA_RANK on all modules?)
CASES = [("base", False), ("distinct_r16_all", True)]
ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")     # column-parallel: a slice of rows


def model_spec(dims: dict, name: str):
    from compute_service.engine.spec import ModelSpec

    cfg = dict(dims, architectures=["LlamaForCausalLM"], max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, tie_word_embeddings=False)
    return ModelSpec.from_hf_config(cfg, name=name)


class RandomSource:
    """A tensor source of random weights under checkpoint names, made on `device` in `dtype`.

    `rows` / `columns` make only the asked slice (what `sharded_source` reads for q/k/v/gate/up and
    o/down), so a rank allocates nothing beyond its shard.
    """

    def __init__(self, spec, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def _rand(self, *shape: int) -> torch.Tensor:
        t = torch.empty(*shape, device=self.device, dtype=self.dtype)
        return t.normal_(0.0, 0.02, generator=self.gen)

    def __call__(self, name: str) -> torch.Tensor | None:
        s = self.spec
        if name.endswith("norm.weight"):
            return torch.ones(s.hidden_size, device=self.device, dtype=self.dtype)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._rand(s.vocab_size, s.hidden_size)
        if name.endswith(".bias"):
            return None
        raise KeyError(f"random source reads {name!r} only as a slice")

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._rand(b - a, self.spec.hidden_size)

    def columns(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._rand(self.spec.hidden_size, b - a)


def module_shape(spec, m: str) -> tuple[int, int]:
    """(in, out) features of module `m` in `spec` (a rank's local spec gives its local shapes)."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}[m]


def adapter_share_rows(local, device: torch.device, dtype: torch.dtype, seed: int) -> list:
    """One adapter's share on this rank, made directly: column-parallel modules keep the whole A and
    their rows of B, row-parallel ones (o, down) their columns of A and the whole B, which are exactly
    the local spec's module shapes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for layer in range(local.num_layers):
        for m in ALL:
            fin, fout = module_shape(local, m)
            a = torch.randn(LORA_RANK, fin, generator=gen, device=device).mul_(fin ** -0.5).to(dtype)
            b = torch.randn(fout, LORA_RANK, generator=gen, device=device).mul_(0.02).to(dtype)
            rows.append((MODULE_IDS[m], layer, LORA_RANK, a, b))
    return rows


def adapter_bytes(local, elem: int) -> int:
    return sum(LORA_RANK * sum(module_shape(local, m)) for m in ALL) * local.num_layers * elem


class Built:
    """One rank's engine over its shard, and what the floor needs."""

    def __init__(self, spec, tp: int, rank: int, device: torch.device, dtype: torch.dtype, group, max_batch: int,
                 max_len: int) -> None:
        from compute_service.engine import EngineConfig, LLMEngine
        from compute_service.engine.llm_engine import _default_lora
        from compute_service.engine.loader import LoadedModel
        from compute_service.engine.model import LlamaModel
        from compute_service.engine.weights import build_weights
        from compute_service.parallel.schedule import DriverRunner, ShardedSlots
        from compute_service.parallel.shard import local_spec, shard_for, sharded_source

        shard = shard_for(spec, tp, rank)
        self.local = local = local_spec(spec, shard)
        source = RandomSource(spec, device, dtype, seed=1000 + rank)
        weights, fingerprint = build_weights(local, sharded_source(spec, shard, source), dtype, device)
        model = LlamaModel(local, weights, max_len)
        if tp > 1:
            model.shard_over(group)
        elem = torch.empty((), dtype=dtype).element_size()
        self.elem = elem
        self.weight_bytes = sum(t.nbytes for lw in weights.layers for t in vars(lw).values()
                                if t is not None) + (weights.norm.numel() + weights.lm_head.numel()) * elem
        self.kv_per_token = 2 * local.num_layers * local.kv_size * elem
        kv_tokens = 2 * max_batch * max_len
        config = EngineConfig(device=str(device), dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
                              max_num_seqs=max_batch, max_num_batched_tokens=max(4096, max_batch * 64),
                              max_model_len=max_len, kv_cache_bytes=kv_tokens * self.kv_per_token,
                              max_loras=max_batch, max_lora_rank=LORA_RANK,
                              lora_backend="kernels" if device.type == "cuda" else "auto",
                              async_scheduling=None if tp == 1 else False)   # as the service runs each
        loaded = LoadedModel(local, model, fingerprint, Path("/tmp/random-llama"), None)
        inner, backend = _default_lora(config, local, device, dtype)
        self.slots = ShardedSlots(inner, spec, shard) if tp > 1 else inner
        self.engine = LLMEngine(config, loaded, slots=self.slots, lora_backend=backend)
        if tp > 1 and rank == 0:
            self.engine.runner = DriverRunner(self.engine.runner, self.slots, group)
        self.graphs = self.engine.runner.graphs


def profile_replays(graphs, batch: int, with_lora: bool, iters: int = 10) -> dict | None:
    """GPU microseconds per step by kernel (the top 12) and by kind, from a profile of `iters` replays of
    the batch's decode graph (every rank replays in lock step)."""
    from torch.profiler import ProfilerActivity, profile

    graph = graphs.graph_for(batch, with_lora)
    if graph is None:
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
            per_kernel[ev.name] = per_kernel.get(ev.name, 0.0) + ev.device_time_total / iters
    kinds = {"matmul": ("gemm", "gemv", "nvjet", "sm90_", "cutlass", "quant_mma"),
             "all_reduce": ("all_reduce", "allreduce", "nccl", "one_shot", "reduce_add_rms"),
             "attention": ("attention",), "lora": ("shrink", "expand", "fused_lora", "lora"),
             "norm_rope_act": ("rms", "rope", "silu")}
    by_kind: dict[str, float] = {}
    for name, us in per_kernel.items():
        kind = next((k for k, pats in kinds.items() if any(p in name.lower() for p in pats)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return dict(total_us=sum(per_kernel.values()), by_kind_us=by_kind, top_kernels_us=dict(top))


def allreduce_ms(group, hidden: int, layers: int, batch: int, dtype: torch.dtype) -> float | None:
    """GPU ms of one step's all-reduces alone (2 per layer of [batch, hidden]) captured in a graph."""
    if group.device.type != "cuda":
        return None
    x = torch.randn(batch, hidden, device=group.device, dtype=dtype)

    def body() -> None:
        for _ in range(2 * layers):
            group.all_reduce(x)

    return _graph_ms(body)


def reduce_norm_ms(group, hidden: int, layers: int, batch: int, dtype: torch.dtype) -> float | None:
    """GPU ms of one step's all-reduces with their residual adds and RMSNorms (2 per layer), as the
    model runs them (`reduce_add_rms_norm`: fused where it fits), captured in a graph."""
    if group.device.type != "cuda":
        return None
    x = torch.randn(batch, hidden, device=group.device, dtype=dtype)
    h, out = torch.zeros_like(x), torch.empty_like(x)
    w = torch.ones(hidden, device=group.device, dtype=dtype)

    def body() -> None:
        for k in range(2 * layers):
            group.reduce_add_rms_norm(x, h, w, 1e-5, out, k % 2)

    return _graph_ms(body)


def _graph_ms(body) -> float:
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / 20          # mean of 20 back-to-back replays


def bench_config(label: str, spec, tp: int, group, dtype, batches, in_len, out_len, bw, res, save,
                 profile: bool = False) -> None:
    """Every case and batch of one (shape, tp); ranks >= tp only wait (TP=1 runs on rank 0 alone)."""
    from compute_service.parallel.schedule import follow

    rank, dev = group.rank, group.device
    if rank >= tp:
        dist.barrier(group=group.control_group)
        return
    t0 = time.perf_counter()
    max_len = 256
    b = Built(spec, tp, rank, dev, dtype, group, max(batches), max_len)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    out = res["configs"].setdefault(label, dict(tp=tp, dims={k: getattr(spec, k) for k in (
        "num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")}, cases={}))
    out.update(build_s=time.perf_counter() - t0, weight_bytes_per_gpu=b.weight_bytes,
               adapter_bytes_per_gpu=adapter_bytes(b.local, b.elem), kv_bytes_per_token_per_gpu=b.kv_per_token)
    if dev.type == "cuda":
        out["gpu_memory_allocated_bytes"] = torch.cuda.memory_allocated(dev)
    if rank == 0:
        print(f"{label}: built rank 0 in {out['build_s']:.1f} s, {b.weight_bytes / 1e9:.2f} GB weights per GPU",
              flush=True)
    rows = None
    for name, distinct in CASES:
        loaded: list[str] = []
        if distinct:
            rows = adapter_share_rows(b.local, dev, dtype, seed=7 + rank)
        for batch in batches:
            r: dict = {}
            try:
                keys = [None] * batch
                if distinct:
                    keys = [f"a{i}" for i in range(batch)]
                    for k in keys[len(loaded):]:
                        b.slots.load_rows(k, rows)          # same keys in the same order: same slots everywhere
                        loaded.append(k)
                if rank == 0:
                    run_engine(b.engine, batch, keys, in_len, 3, seed=1)          # warm-up: compiles, captures
                    r = run_engine(b.engine, batch, keys, in_len, out_len, seed=2)
                    if tp > 1:
                        b.engine.runner.stop()
                elif tp > 1:
                    follow(b.engine.runner, b.slots, group)
                if b.graphs is not None:                     # every rank replays in lock step
                    r["gpu_step_ms"] = b.graphs.time_replay(batch, distinct)
                    if profile and batch in (1, max(batches)):
                        r["profile"] = profile_replays(b.graphs, batch, distinct)
                        if rank == 0 and r["profile"]:
                            p = r["profile"]
                            print(f"  profile {label} {name} B={batch}: total {p['total_us']:.0f} us, by kind "
                                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(p["by_kind_us"].items())), flush=True)
                            for kname, us in p["top_kernels_us"].items():
                                print(f"    {us:8.1f} us  {kname[:110]}", flush=True)
                if tp > 1:
                    r["allreduce_ms"] = allreduce_ms(group, spec.hidden_size, spec.num_layers, batch, dtype)
                    r["reduce_norm_ms"] = reduce_norm_ms(group, spec.hidden_size, spec.num_layers, batch, dtype)
                n_ad = batch if distinct else 0
                kv = batch * (in_len + out_len / 2) * b.kv_per_token
                step_s = (b.weight_bytes + n_ad * adapter_bytes(b.local, b.elem) + kv) / bw
                r["floor"] = dict(bytes_weights=b.weight_bytes, bytes_adapters=n_ad * adapter_bytes(b.local, b.elem),
                                  bytes_kv=kv, step_ms=step_s * 1e3)
                r["distinct_adapters"] = n_ad
                if rank == 0:
                    r["tpot_over_floor"] = r["tpot_ms"] / r["floor"]["step_ms"]
                    if r.get("gpu_step_ms"):
                        r["gpu_over_floor"] = r["gpu_step_ms"] / r["floor"]["step_ms"]
                    out["cases"].setdefault(name, {})[str(batch)] = r
                    print(f"{label:8s} {name:17s} B={batch:3d} tpot {r['tpot_ms']:7.2f} ms  gpu "
                          f"{r.get('gpu_step_ms') or 0:7.2f} ms  floor {r['floor']['step_ms']:6.2f} ms  "
                          f"x{r['tpot_over_floor']:.2f}" + (f"  all-reduces {r['allreduce_ms']:.2f} ms, with add+norm "
                                                             f"{r['reduce_norm_ms']:.2f} ms"
                                                             if r.get("allreduce_ms") else ""), flush=True)
            except Exception as e:   # keep the other cases; the error goes into the results
                res["errors"].append(f"{label} {name} B={batch} rank {rank}: {e!r}")
                traceback.print_exc()
                raise
            save()
        for k in loaded:
            b.slots.evict(k)
    del b, rows
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    if tp < group.world_size:
        dist.barrier(group=group.control_group)


def ratios(res: dict) -> None:
    """TP2 / TP1 per case and batch (tpot and GPU step)."""
    one, two = res["configs"].get("8b_tp1"), res["configs"].get("8b_tp2")
    if not one or not two:
        return
    out: dict = {}
    for case, rows in two["cases"].items():
        for batch, r in rows.items():
            r1 = one["cases"].get(case, {}).get(batch)
            if r1:
                e = out.setdefault(case, {})[batch] = dict(tpot=r["tpot_ms"] / r1["tpot_ms"])
                if r.get("gpu_step_ms") and r1.get("gpu_step_ms"):
                    e["gpu_step"] = r["gpu_step_ms"] / r1["gpu_step_ms"]
                e["floor"] = r["floor"]["step_ms"] / r1["floor"]["step_ms"]
    res["tp2_over_tp1_8b"] = out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) / "tp_decode.json" if "OUT" in os.environ
                    else None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU over gloo: checks the script, no figures")
    ap.add_argument("--profile", action="store_true", help="also a per-kernel GPU time breakdown of the decode "
                    "graph at the smallest and largest batch. Make it a run of its own: timings taken after a "
                    "profile in the same process came out up to 6%% slower (2e3ca11), and with dependent "
                    "launches the kernels' times overlap, so they do not add up to the step")
    args = ap.parse_args()

    from compute_service.parallel.group import init_group

    group = init_group("cpu" if args.tiny else "cuda", timeout_s=300, control_timeout_s=1800)
    if group.world_size != 2:
        raise SystemExit("run with --nproc-per-node 2")
    dev = group.device
    dtype = torch.float32 if args.tiny else torch.bfloat16
    batches = [int(x) for x in args.batches.split(",")]
    in_len, out_len = 43, (8 if args.tiny else args.output_len)
    res: dict = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (--tiny: no figures)",
                     gpus=group.world_size, commit=args.commit, torch=torch.__version__,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     dtype=str(dtype), input_len=in_len, output_len=out_len, lora_rank=LORA_RANK,
                     lora_modules=list(ALL), configs={}, errors=[],
                     all_reduce=(f"one-shot peer memory up to 1 MiB, NCCL above ({ENV}="
                                 f"{os.environ.get(ENV, 'auto')}: 'auto' fuses the add + RMSNorm)")
                     if group.peer_all_reduce is not None else "NCCL" if dev.type == "cuda" else "gloo")

    def save() -> None:
        if args.out and group.rank == 0:
            args.out.write_text(json.dumps(res, indent=1))

    t_start = time.perf_counter()
    bw = copy_bandwidth(dev, 2**31 if dev.type == "cuda" else 2**26)
    res["copy_bandwidth_Bps"] = bw
    if group.rank == 0:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    small = TINY if args.tiny else LLAMA3_8B
    spec8 = model_spec(small, "llama3-8b-shape-random" if not args.tiny else "tiny")
    try:
        bench_config("8b_tp1", spec8, 1, group, dtype, batches, in_len, out_len, bw, res, save, args.profile)
        bench_config("8b_tp2", spec8, 2, group, dtype, batches, in_len, out_len, bw, res, save, args.profile)
        ratios(res)
        save()
        if not args.skip_70b:
            spec70 = model_spec(TINY if args.tiny else LLAMA_70B, "llama-70b-shape-random" if not args.tiny else "tiny")
            bench_config("70b_tp2", spec70, 2, group, dtype, batches, in_len, out_len, bw, res, save, args.profile)
    finally:
        res["wall_s"] = time.perf_counter() - t_start
        save()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    group.close()


if __name__ == "__main__":
    main()
