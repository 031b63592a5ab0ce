"""4-bit weight-only base model vs bf16: kernel times, engine decode TPOT, and what fits in GPU memory.

Llama-3-8B shape with random bf16 weights built on the GPU as in bench/multi_lora.py (its helpers are
imported); the 4-bit engine is the same model with every layer's projection (qkv, o, gate_up, down)
replaced by a QuantLinear of `quantize_rtn(weight, 4, 128)` made on the GPU (`--group-size 32`: what a
Q4_0 / Q4_1 / Q4_K GGUF runs); embedding and LM head stay bf16. Both engines run in one process, CUDA
graphs on.

1. Kernels: each 8B layer shape at T = 1, 8, 32, 64, 128, 256, 512 rows, the quantized matmul (as QuantLinear runs
   it) against bf16 `F.linear`, each timed as a CUDA graph of calls over enough weight copies to exceed
   the L2 cache (CUDA events, median of replays), with its byte floor (weights + x + out over the
   measured copy bandwidth). `--sweep` also tries tile/split configs at T = 1 and 8 and records the best.
2. Engine: decode TPOT at batch 1/8/32/64 (43-token prompts, 100 output tokens, greedy), base and
   every request its own adapter (rank 16 all modules, rank 64 q/k/v), floor = (layer weights as
   stored + norm + LM head + embedding rows + the distinct adapters + KV at the mean length) / copy
   bandwidth.
3. Memory: at 24 and 80 GiB, weights, then KV tokens / 4096-token sequences in the remaining memory
   (after a fixed reserve and the default 5% adapter pool) and how many adapters that pool holds.

    python3 bench/quant_decode.py --commit "$(git rev-parse --short HEAD)" --out bench/results/quant_decode.json \
        --plot bench/results/quant_decode.png
    .venv/bin/python bench/quant_decode.py --smoke --out /tmp/q.json      # checks the script on CPU
    python3 bench/quant_decode.py --labels int4 --batches 1,8 --act-order --no-kernels   # act-order checkpoints
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multi_lora import (  # noqa: E402  (bench helpers: the 8B shape, engine build, runs, floors)
    ALL, LLAMA3_8B, QKV, SMOKE, adapter_bytes, adapter_rows, build_engine, build_hf, case_keys,
    copy_bandwidth, floor, run_engine)

from compute_service.engine.cuda_graphs import median_replay_ms  # noqa: E402
from compute_service.engine.mlp_order import fused_rows, mlp_order_enabled  # noqa: E402
from compute_service.engine.model import LAYER_PROJECTIONS  # noqa: E402
from compute_service.engine.quant_linear import QuantLinear  # noqa: E402
from compute_service.engine.quantized import QuantizedWeight, quantize_rtn  # noqa: E402
from quant_kernel_sweep import SHAPES_8B  # noqa: E402  (the 8B's layer shapes)

LAYER_SHAPES = SHAPES_8B         # [N, K] of the 8B's four projections
KERNEL_ROWS = (1, 8, 32, 64, 128, 256, 512)
CASES = [("base", 0, (), False), ("distinct_r16_all", 16, ALL, True), ("distinct_r64_qkv", 64, QKV, True)]
GIB = 2**30
RESERVE_BYTES = 2 * GIB            # activations, graph pools, workspaces (kept out of the KV / adapter budget)
ADAPTER_POOL_FRACTION = 0.05       # the engine's default lora_gpu_memory_fraction


def graph_time_us(fns: list, dev: torch.device, iters: int = 20) -> float:
    """Median GPU microseconds of one call, timing a CUDA graph that makes all `fns` calls."""
    for f in fns:
        f()
    if dev.type != "cuda":
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns) * 1e6
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return median_replay_ms(graph, iters) * 1e3 / len(fns)


def random_qweight(n: int, k: int, dev: torch.device, gen: torch.Generator, group: int = 128) -> QuantizedWeight:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(n, k // group, device=dev, generator=gen) * 0.002 + 1e-4).half()
    return QuantizedWeight(q, s, (-8 * s.float()).half(), 4, group)


def kernel_table(dev: torch.device, bw: float, shapes: dict, rows: tuple, sweep: bool, res: dict) -> None:
    from kernels.quant_matmul import QuantMatmulConfig, quant_matmul

    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict = {}
    for name, (n, k) in shapes.items():
        bf16_bytes = n * k * 2
        n_dense = max(1, -(-256 * 2**20 // bf16_bytes)) if dev.type == "cuda" else 1
        dense = [torch.randn(n, k, device=dev, generator=gen).mul_(0.02).to(torch.bfloat16) for _ in range(n_dense)]
        group = res["group_size"]
        q_one = QuantLinear(random_qweight(n, k, dev, gen, group), None, dev)
        n_quant = max(1, -(-256 * 2**20 // q_one.nbytes)) if dev.type == "cuda" else 1
        quant = [q_one] + [QuantLinear(random_qweight(n, k, dev, gen, group), None, dev)
                           for _ in range(n_quant - 1)]
        for t in rows:
            x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
            io = (t * k + t * n) * 2
            r = dict(quant_us=graph_time_us([lambda lin=lin: lin(x) for lin in quant], dev),
                     bf16_us=graph_time_us([lambda w=w: F.linear(x, w) for w in dense], dev),
                     quant_floor_us=(q_one.nbytes + io) / bw * 1e6, bf16_floor_us=(bf16_bytes + io) / bw * 1e6)
            if t > 64 and q_one.use_kernel:                     # both prefill paths, to place the switch
                own = q_one.dense_min_tokens
                for key, switch in (("fused_us", 1 << 30), ("dense_us", 0)):
                    for lin in quant:
                        lin.dense_min_tokens = switch
                    r[key] = graph_time_us([lambda lin=lin: lin(x) for lin in quant], dev)
                for lin in quant:
                    lin.dense_min_tokens = own
            r["speedup"] = r["bf16_us"] / r["quant_us"]
            r["quant_over_floor"] = r["quant_us"] / r["quant_floor_us"]
            if sweep and t <= 8 and q_one.use_kernel:
                r["sweep"] = sweep_configs(quant, x, n, k, dev, QuantMatmulConfig, quant_matmul)
                best = min(r["sweep"], key=lambda c: c["us"])
                r["best_us"], r["best_config"] = best["us"], best["config"]
            out.setdefault(name, {})[str(t)] = r
            print(f"kernel {name:8s} T={t:4d} quant {r['quant_us']:8.1f} us (floor {r['quant_floor_us']:7.1f}, "
                  f"x{r['quant_over_floor']:.2f})  bf16 {r['bf16_us']:8.1f} us  speedup {r['speedup']:.2f}"
                  + (f"  best {r['best_us']:.1f} {r['best_config']}" if "best_us" in r else "")
                  + (f"  fused {r['fused_us']:.1f} dense {r['dense_us']:.1f}" if "fused_us" in r else ""), flush=True)
        del dense, quant, q_one
    res["kernels"] = out


def sweep_configs(quant: list, x: torch.Tensor, n: int, k: int, dev: torch.device, config_cls, quant_matmul) -> list:
    t = x.shape[0]
    found = []
    for block_n, block_m in [(bn, bm) for bn in (32, 64, 128) for bm in ((1, 16) if t == 1 else (16,))]:
        for split in (1, 2, 4, 8, 16):
            for stages in (3,):
                cfg = config_cls(block_n, block_m, split, num_warps=4, num_stages=stages)
                outs = [torch.empty(t, n, dtype=x.dtype, device=dev) for _ in quant]
                part = torch.empty(split * t * n, device=dev)
                locks = torch.zeros(4096, dtype=torch.int32, device=dev)
                try:
                    us = graph_time_us([lambda lin=lin, o=o: quant_matmul(x, lin.packed, None, o, cfg, part, locks)
                                        for lin, o in zip(quant, outs)], dev, iters=10)
                except Exception as e:  # a config the compiler refuses (shared memory): skip it
                    print(f"  config {cfg} failed: {e!r}"[:200])
                    continue
                found.append(dict(config=[block_n, block_m, split, 4, stages], us=us))
    return found


def quantize_layers(engine, bits: int, group: int, act_order: bool = False) -> None:
    """Every layer's projections replaced by QuantLinear (round to nearest, on the weights' device). `act_order`:
    each stored with its input channels in a random order (`QuantizedWeight.perm`, as GPTQ's act-order
    checkpoints load: groups of channels taken out of order): o gathers x first, the others read x as the kernel
    before writes it, in their order (`LlamaModel._ordered_x`; LORAPLEX_ORDERED_X=0: every call gathers); down's
    order taken by gate/up's rows as a load does (`mlp_order.py`; LORAPLEX_MLP_ORDER=0: the SwiGLU writes act in
    it), the engine's pool told so."""
    model = engine.runner.model
    gen = torch.Generator().manual_seed(11)
    for lw in model.weights.layers:
        perms = {name: torch.randperm(getattr(lw, name).weight.shape[1], generator=gen).to(model.device)
                 for name in LAYER_PROJECTIONS} if act_order else {}
        order = perms["down"] if act_order and mlp_order_enabled() else None
        for name in LAYER_PROJECTIONS:
            lin = getattr(lw, name)
            weight, bias, perm = lin.weight, lin.bias, perms.get(name)
            if perm is not None:
                weight = weight[:, perm]
            if name == "gate_up" and order is not None:
                rows = fused_rows(order, 2)
                weight, bias = weight[rows], None if bias is None else bias[rows]
            qw = dataclasses.replace(quantize_rtn(weight, bits, group),
                                     perm=None if name == "down" and order is not None else perm)
            setattr(lw, name, QuantLinear(qw, bias, lin.weight.device))
            del lin, weight
        lw.mlp_order = order
    engine.slots.follow_orders(model.weights.layers)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def decode_bytes(model) -> dict:
    w = model.weights
    layers = sum(getattr(lw, p).nbytes for lw in w.layers for p in LAYER_PROJECTIONS)
    norms = sum(lw.input_norm.nbytes + lw.post_norm.nbytes for lw in w.layers) + w.norm.nbytes
    return dict(layers=layers, norms=norms, lm_head=w.lm_head.nbytes, embed_row=w.embed.shape[1] * w.embed.element_size(),
                embed_table=w.embed.nbytes)


def engine_cases(engine, label: str, dims: dict, batches: list, in_len: int, out_len: int, bw: float,
                 dev: torch.device, dtype: torch.dtype, res: dict, save) -> None:
    elem = torch.empty((), dtype=dtype).element_size()
    wb = decode_bytes(engine.runner.model)
    res.setdefault("weight_bytes", {})[label] = wb
    for name, rank, modules, distinct in CASES:
        rows = adapter_rows(dims, rank, modules, dev, dtype) if rank else None
        loaded: set[str] = set()
        for batch in batches:
            try:
                keys = case_keys(engine, name, batch, rows, distinct, loaded)
                n_distinct = len({kk for kk in keys if kk is not None})
                run_engine(engine, batch, keys, in_len, 3, seed=1)                 # warm-up: compiles, captures
                r = run_engine(engine, batch, keys, in_len, out_len, seed=2)
                if engine.runner.graphs is not None:
                    r["gpu_step_ms"] = engine.runner.graphs.time_replay(batch, rows is not None)
                base = wb["layers"] + wb["norms"] + wb["lm_head"] + batch * wb["embed_row"]
                r["floor"] = floor(base, n_distinct * adapter_bytes(dims, rank, modules, elem), batch, dims,
                                   in_len, out_len, bw, elem)
                r["tpot_over_floor"] = r["tpot_ms"] / r["floor"]["step_ms"]
                r["distinct_adapters"] = n_distinct
                res["engine"].setdefault(label, {}).setdefault(name, {})[str(batch)] = r
                print(f"engine {label:5s} {name:17s} B={batch:3d} tpot {r['tpot_ms']:7.2f} ms "
                      f"(gpu {r.get('gpu_step_ms') or 0:6.2f})  {r['decode_tok_per_s']:8.1f} tok/s  "
                      f"floor {r['floor']['step_ms']:6.2f} ms  x{r['tpot_over_floor']:.2f}", flush=True)
            except Exception as e:  # keep the other cases; the error goes into the results
                res["errors"].append(f"engine {label} {name} B={batch}: {e!r}")
                traceback.print_exc()
            save()
        for kk in loaded:
            engine.slots.evict(kk)


def memory_table(dims: dict, res: dict) -> dict:
    """Weights, KV tokens / sequences and adapter slots at fixed GPU budgets, bf16 vs 4-bit (from byte counts)."""
    kv_per_token = 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] \
        * (dims["hidden_size"] // dims["num_attention_heads"]) * 2
    r16_all, r64_qkv = adapter_bytes(dims, 16, ALL, 2), adapter_bytes(dims, 64, QKV, 2)
    table: dict = {"reserve_bytes": RESERVE_BYTES, "adapter_pool_fraction": ADAPTER_POOL_FRACTION,
                   "kv_bytes_per_token": kv_per_token, "adapter_bytes_r16_all": r16_all,
                   "adapter_bytes_r64_qkv": r64_qkv}
    for budget_gib in (24, 80):
        for label, wb in res.get("weight_bytes", {}).items():
            weights = wb["layers"] + wb["norms"] + wb["lm_head"] + wb["embed_table"]
            free = budget_gib * GIB - weights - RESERVE_BYTES
            row = dict(weights_bytes=weights, fits=free > 0)
            if free > 0:
                pool = ADAPTER_POOL_FRACTION * free
                kv = free - pool
                row.update(kv_tokens=int(kv // kv_per_token), seqs_4096=int(kv // (kv_per_token * 4096)),
                           adapters_r16_all=int(pool // r16_all), adapters_r64_qkv=int(pool // r64_qkv),
                           adapters_r16_all_if_half_free=int(free / 2 // r16_all))
            table[f"{budget_gib}GiB_{label}"] = row
            print(f"memory {budget_gib:3d} GiB {label:5s} weights {weights / GIB:6.2f} GiB  "
                  + (f"KV tokens {row['kv_tokens']:8d} ({row['seqs_4096']:4d} x 4096)  adapters r16-all "
                     f"{row['adapters_r16_all']:5d}, r64-qkv {row['adapters_r64_qkv']:5d}" if free > 0
                     else "does not fit"), flush=True)
    return table


def goals(res: dict) -> dict:
    """Issue 16's goals from the engine rows that ran; a goal whose rows did not run (e.g. --batches without 1)
    is named under "not_run"."""
    eng = res["engine"]
    base_q, base_bf16 = eng.get("int4", {}).get("base", {}), eng.get("bf16", {}).get("base", {})
    out: dict = {"not_run": []}
    if "1" in base_q and "1" in base_bf16:
        out["b1_speedup"] = base_bf16["1"]["tpot_ms"] / base_q["1"]["tpot_ms"]
        out["b1_speedup_goal_2.5"] = out["b1_speedup"] >= 2.5
        out["b1_over_floor"] = base_q["1"]["tpot_over_floor"]
        out["b1_over_floor_goal_1.4"] = out["b1_over_floor"] <= 1.4
    else:
        out["not_run"].append("batch 1, no adapter, both engines")
    both = sorted(set(base_q) & set(base_bf16), key=int)
    if both:
        top = both[-1]
        out[f"b{top}_speedup"] = base_bf16[top]["tpot_ms"] / base_q[top]["tpot_ms"]
    else:
        out["not_run"].append("no adapter, both engines at one batch")
    lora = {c: {b: r["tpot_over_floor"] for b, r in rows.items()}
            for c, rows in eng.get("int4", {}).items() if c != "base"}
    if lora:
        out["multi_lora_over_floor"] = lora
        out["multi_lora_goal_1.2"] = all(v <= 1.2 for c in lora.values() for v in c.values())
    else:
        out["not_run"].append("4-bit with adapters")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--sweep", action="store_true", help="also try tile/split configs in the kernel table")
    ap.add_argument("--no-engine", action="store_true", help="kernel table only")
    ap.add_argument("--no-kernels", action="store_true", help="engine only (no kernel table)")
    ap.add_argument("--labels", default="bf16,int4", help="engines to run: bf16, int4 or both (an A/B of 4-bit "
                    "kernel choices needs int4 only)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, no figures")
    ap.add_argument("--input-len", type=int, default=43, help="prompt tokens a request (the context the decode "
                    "steps attend grows from it)")
    ap.add_argument("--group-size", type=int, help="quantization group (default 128, the smoke run 32); 32 is "
                    "what Q4_0 / Q4_1 / Q4_K GGUF files run")
    ap.add_argument("--act-order", action="store_true", help="the 4-bit projections' input channels stored in a "
                    "random order, as act-order checkpoints load (o gathers x first; LORAPLEX_ORDERED_X=0: every "
                    "projection does)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    dims = SMOKE if args.smoke else LLAMA3_8B
    in_len, out_len = args.input_len, (8 if args.smoke else 100)
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", commit=args.commit,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     torch=torch.__version__, dims=dims, input_len=in_len, output_len=out_len, bits=4,
                     group_size=args.group_size or (32 if args.smoke else 128), act_order=args.act_order,
                     engine={}, errors=[])

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))

    t0 = time.perf_counter()
    bw = copy_bandwidth(dev, 2**31 if dev.type == "cuda" else 2**26)
    res["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    shapes = LAYER_SHAPES if not args.smoke else {"tiny": (64, 256)}
    if not args.no_kernels:
        kernel_table(dev, bw, shapes, KERNEL_ROWS if not args.smoke else (1, 3), args.sweep, res)
    save()
    if not args.no_engine:
        hf = build_hf(dims, dev, dtype)
        for label in args.labels.split(","):
            engine, _ = build_engine(hf, dev, dtype, max(batches), in_len, out_len,
                                     [(in_len + out_len, max(batches))])   # room for every output token
            if label == "int4":
                quantize_layers(engine, 4, res["group_size"], args.act_order)
                res["act_order_projections"] = sum(getattr(lw, p).act_order for lw in engine.runner.model.weights.layers
                                                   for p in LAYER_PROJECTIONS)
                res["mlp_ordered_layers"] = sum(lw.mlp_order is not None for lw in engine.runner.model.weights.layers)
            if dev.type == "cuda":
                res.setdefault("allocated_bytes", {})[label] = torch.cuda.memory_allocated(dev)
            engine_cases(engine, label, dims, batches, in_len, out_len, bw, dev, dtype, res, save)
            del engine
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if "bf16" in res["engine"] and "int4" in res["engine"]:
            res["memory"] = memory_table(dims, res)
            res["goals"] = goals(res)
            print("goals", json.dumps(res["goals"]), flush=True)
    res["wall_s"] = time.perf_counter() - t0
    save()
    if args.plot:
        plot(res, args.plot)


def plot(res: dict, out: Path) -> None:
    """Decode tok/s vs batch (bf16 vs 4-bit, base and distinct adapters, with floors); kernel speedups."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, kx) = plt.subplots(1, 2, figsize=(14, 5))
    for label, style in (("bf16", ":"), ("int4", "-")):
        for (case, *_), color in zip(CASES, ("C0", "C1", "C2")):
            pts = sorted((int(b), r["decode_tok_per_s"]) for b, r in res["engine"].get(label, {}).get(case, {}).items())
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{label} {case}")
            fl = sorted((int(b), r["floor"]["tok_per_s"]) for b, r in res["engine"].get(label, {}).get(case, {}).items())
            if fl and case == "base":
                ax.plot(*zip(*fl), "--", color="gray" if label == "bf16" else "k", alpha=0.5, label=f"{label} base floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-3-8B shape, 4-bit g{res['group_size']} vs bf16, {res['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    kern = res.get("kernels", {})
    rows = sorted({int(t) for v in kern.values() for t in v})
    width = 0.8 / max(1, len(kern))
    for i, (name, by_t) in enumerate(kern.items()):
        kx.bar([j + i * width for j in range(len(rows))], [by_t.get(str(t), {}).get("speedup", 0) for t in rows],
               width, label=name)
    kx.axhline(1.0, color="k", alpha=0.5)
    kx.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"T={t}" for t in rows])
    kx.set_ylabel("bf16 F.linear time / 4-bit kernel time")
    kx.set_title(f"Layer matmuls (8B shapes), 4-bit g{res['group_size']} vs bf16")
    kx.grid(True, axis="y", alpha=0.3)
    kx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
