"""Multi-LoRA serving throughput: the loraplex engine vs transformers (+ PEFT), one run, one GPU.

Llama-3-8B-shaped model with random bf16 weights built on the GPU (no
download); the engine is built from the very same tensors. Every request has a
43-token random prompt and decodes 100 tokens greedily (EOS ignored). Cases:
base model, one adapter shared by the batch, and every request its own adapter
(rank 16 / 64, q/k/v only / all seven modules); transformers runs base and
multi-LoRA through PEFT's `generate(..., adapter_names=...)`.

Prefill cases: long prompts (512 to 4096 tokens, 1 to 64 requests, each
request its own adapter in the distinct cases) are prefilled to their first
token; prefill tokens/s = prompt tokens / wall time, against the base model's.

Per case: tokens/s over the whole run (prefill included), time per output
token (decode steps only), and the decode floor: bytes a decode step must read
(base weights without the embedding table, each distinct adapter's weights,
the batch's KV cache at its mean length) over the measured copy bandwidth
(bytes read + written of a 2 GiB device copy). For engine cases the GPU time of
one decode-graph replay is recorded too, so step time = GPU time + host time.

    python3 bench/multi_lora.py --commit "$(git rev-parse HEAD)" --out bench/results/multi_lora.json \
        --plot bench/results/multi_lora.png
    .venv/bin/python bench/multi_lora.py --smoke --out /tmp/x.json      # checks the script on CPU
    .venv/bin/python bench/multi_lora.py --plot-only bench/results/multi_lora.json --plot out.png
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5)
QKV = ("q_proj", "k_proj", "v_proj")
ALL = QKV + ("o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
# (name, rank, modules, distinct adapters?) ; rank 0 = base model
ENGINE_CASES = [("base", 0, (), False), ("shared_r64_qkv", 64, QKV, False), ("distinct_r16_qkv", 16, QKV, True),
                ("distinct_r64_qkv", 64, QKV, True), ("distinct_r16_all", 16, ALL, True),
                ("distinct_r64_all", 64, ALL, True)]
# (prompt tokens, requests): every request of a distinct case has its own adapter, so 1-64 distinct adapters.
PREFILL_SHAPES = [(512, 64), (2048, 8), (4096, 1)]
SMOKE_PREFILL_SHAPES = [(40, 4), (100, 1)]
PREFILL_CASES = ("base", "distinct_r16_qkv", "distinct_r64_qkv", "distinct_r16_all", "distinct_r64_all")
HF_CASES = [("base", 0, ()), ("distinct_r64_qkv", 64, QKV)]
EAGER_CASES = {("base", 1), ("base", 32), ("distinct_r64_qkv", 8)}   # also timed without CUDA graphs
HF_MAX_ADAPTERS = 8          # as the transformers + PEFT table: 8 adapters, cycled over the batch


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes read + written per second of a device-to-device copy (median of 10)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        sync(dev)
        t = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / sorted(times)[5]


def module_shape(dims: dict, m: str) -> tuple[int, int]:
    h, inter = dims["hidden_size"], dims["intermediate_size"]
    q = h
    kv = dims["num_key_value_heads"] * (h // dims["num_attention_heads"])
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}[m]


def adapter_bytes(dims: dict, rank: int, modules: tuple[str, ...], elem: int) -> int:
    per_layer = sum(rank * sum(module_shape(dims, m)) for m in modules)
    return per_layer * dims["num_hidden_layers"] * elem


def build_hf(dims: dict, dev: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**dims, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def build_loaded(hf, dev: torch.device, dtype: torch.dtype, max_len: int):
    """The engine's `LoadedModel` over `hf`'s very tensors, and the bytes a decode step reads of them."""
    from compute_service.engine.loader import LoadedModel
    from compute_service.engine.model import LlamaModel
    from compute_service.engine.spec import ModelSpec
    from compute_service.engine.weights import build_weights

    cfg = hf.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg, name="llama3-8b-shape-random")
    state = hf.state_dict()
    weights, fingerprint = build_weights(spec, state.get, dtype, dev)
    loaded = LoadedModel(spec, LlamaModel(spec, weights, max_len), fingerprint, Path("/tmp/random-llama"), None)
    w = weights
    base_bytes = sum(t.nbytes for lw in w.layers for t in vars(lw).values() if t is not None)
    base_bytes += (w.norm.numel() + w.lm_head.numel()) * w.norm.element_size()
    return loaded, base_bytes


def build_engine(hf, dev: torch.device, dtype: torch.dtype, max_batch: int, in_len: int, out_len: int,
                 shapes: list[tuple[int, int]], async_scheduling: bool | None = None):
    from compute_service.engine import EngineConfig, LLMEngine

    prefill_tokens = max(p * n for p, n in shapes)
    max_len = max(256, max(p for p, _ in shapes) + 16)
    loaded, base_bytes = build_loaded(hf, dev, dtype, max_len)
    spec = loaded.spec
    kv_tokens = max(2 * max_batch * 256, prefill_tokens + 64 * 16 * len(shapes))
    kv_bytes = kv_tokens * 2 * spec.num_layers * spec.kv_size * loaded.model.dtype.itemsize
    config = EngineConfig(device=str(dev), dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
                          max_num_seqs=max(max_batch, max(n for _, n in shapes)),
                          max_num_batched_tokens=max(4096, max_batch * in_len),
                          max_model_len=max_len, kv_cache_bytes=kv_bytes, max_loras=max_batch,
                          max_lora_rank=64, lora_backend="kernels", async_scheduling=async_scheduling)
    engine = LLMEngine(config, loaded)
    return engine, base_bytes


def adapter_rows(dims: dict, rank: int, modules: tuple[str, ...], dev: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=dev).manual_seed(rank * 100 + len(modules))
    rows = []
    for layer in range(dims["num_hidden_layers"]):
        for m in modules:
            fin, fout = module_shape(dims, m)
            a = torch.randn(rank, fin, generator=gen, device=dev).mul_(fin ** -0.5).to(dtype)
            b = torch.randn(fout, rank, generator=gen, device=dev).mul_(0.02).to(dtype)
            rows.append((MODULE_IDS[m], layer, rank, a, b))
    return rows


def run_engine(engine, batch: int, keys: list, in_len: int, out_len: int, seed: int) -> dict:
    from compute_service.engine import SamplingParams

    vocab = engine.spec.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    ids = [f"s{seed}-{i}" for i in range(batch)]
    for rid, key in zip(ids, keys):
        engine.add_request(rid, torch.randint(0, vocab, (in_len,), generator=g).tolist(), params, key)
    started: set[str] = set()
    t0 = time.perf_counter()
    t_first = None
    n_tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            if o.new_token_ids:
                started.add(o.request_id)
                n_tokens += len(o.new_token_ids)
        if t_first is None and len(started) == batch:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    assert n_tokens == batch * out_len, (n_tokens, batch, out_len)
    tpot = (t_end - t_first) / (out_len - 1)
    return dict(total_s=t_end - t0, tok_per_s=n_tokens / (t_end - t0), ttft_s=t_first - t0, tpot_ms=tpot * 1e3,
                decode_tok_per_s=batch / tpot)


def run_prefill(engine, prompt_len: int, keys: list, seed: int) -> dict:
    """Prefill of len(keys) prompts of `prompt_len` tokens to their first token; tokens/s over the wall time."""
    from compute_service.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, key in enumerate(keys):
        engine.add_request(f"p{seed}-{i}", torch.randint(0, engine.spec.vocab_size, (prompt_len,),
                                                          generator=g).tolist(), params, key)
    sync(engine.loaded.model.device)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(engine.loaded.model.device)
    s = time.perf_counter() - t0
    n = prompt_len * len(keys)
    return dict(prompt_len=prompt_len, requests=len(keys), tokens=n, s=s, tok_per_s=n / s, steps=steps)


def case_keys(engine, name: str, n: int, rows, distinct: bool, loaded: set) -> list:
    """Adapter key per request (None for the base model), loading the adapters not resident yet."""
    if rows is None:
        return [None] * n
    keys = [f"{name}-{i if distinct else 0}" for i in range(n)]
    for k in sorted(set(keys) - loaded):
        engine.slots.load_rows(k, rows)
        loaded.add(k)
    return keys


def prefill_cases(engine, name: str, rows, distinct: bool, shapes, loaded: set, res: dict) -> None:
    """Prefill throughput of one case at every shape, warm-up first; ratio to base where base ran."""
    for prompt_len, n_req in shapes:
        keys = case_keys(engine, name, n_req, rows, distinct, loaded)
        run_prefill(engine, prompt_len, keys, seed=5)                   # warm-up: compiles at these shapes
        r = run_prefill(engine, prompt_len, keys, seed=6)
        r["distinct_adapters"] = len({k for k in keys if k is not None})
        base = res["prefill"].get("base", {}).get(f"{prompt_len}x{n_req}")
        if base:
            r["over_base"] = r["tok_per_s"] / base["tok_per_s"]
        res["prefill"].setdefault(name, {})[f"{prompt_len}x{n_req}"] = r
        print(f"prefill {name:18s} {prompt_len:5d} x {n_req:2d} {r['tok_per_s']:9.0f} tok/s ({r['steps']} steps)"
              + (f"  x{r['over_base']:.3f} of base" if base else ""), flush=True)


def run_hf(model, batch: int, in_len: int, out_len: int, dev: torch.device, vocab: int, names=None) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, in_len), generator=g).to(dev)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if names is not None:
        kw["adapter_names"] = names

    def gen(n: int) -> float:
        sync(dev)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(dev)
        assert out.shape[1] == in_len + n
        return time.perf_counter() - t

    gen(4)                                             # warm-up
    t1 = gen(1)
    total = gen(out_len)
    tpot = (total - t1) / (out_len - 1)
    return dict(total_s=total, tok_per_s=batch * out_len / total, ttft_s=t1, tpot_ms=tpot * 1e3,
                decode_tok_per_s=batch / tpot)


def gemm_ms(engine, batch: int) -> float:
    """GPU ms of a decode step's base matmuls alone (4 per layer + LM head) at `batch` rows, as one graph."""
    import torch.nn.functional as F

    from compute_service.engine.cuda_graphs import median_replay_ms

    w = engine.runner.model.weights
    x = torch.randn(batch, w.embed.shape[1], dtype=w.embed.dtype, device=w.embed.device)
    xi = torch.randn(batch, w.layers[0].down.in_features, dtype=x.dtype, device=x.device)
    xq = torch.randn(batch, w.layers[0].o.in_features, dtype=x.dtype, device=x.device)

    def body() -> None:
        for lw in w.layers:
            lw.qkv(x)
            lw.o(xq)
            lw.gate_up(x)
            lw.down(xi)
        F.linear(x, w.lm_head)

    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return median_replay_ms(graph, 10)


def floor(base_bytes: int, lora_bytes: int, batch: int, dims: dict, in_len: int, out_len: int, bw: float,
          elem: int) -> dict:
    kv_per_token = 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] \
        * (dims["hidden_size"] // dims["num_attention_heads"]) * elem
    mean_ctx = in_len + out_len / 2
    kv = batch * mean_ctx * kv_per_token
    step = (base_bytes + lora_bytes + kv) / bw
    return dict(bytes_base=base_bytes, bytes_lora=lora_bytes, bytes_kv=kv, step_ms=step * 1e3,
                tok_per_s=batch / step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--plot-only", type=Path, help="re-plot an existing results JSON")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--hf-batches", default="1,8,32")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, no figures")
    ap.add_argument("--cases", default="", help="comma-separated engine cases to run (default: all)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the long-prompt prefill cases")
    ap.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                    help="overlapped decode steps or plain ones (default: the engine's, on with a GPU)")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot)
        return
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    dims = SMOKE if args.smoke else LLAMA3_8B
    in_len, out_len = 43, (8 if args.smoke else 100)
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    elem = torch.empty((), dtype=dtype).element_size()
    res: dict = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", commit=args.commit,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     torch=torch.__version__, dims=dims, input_len=in_len, output_len=out_len, dtype=str(dtype),
                     engine={}, prefill={}, hf={}, errors=[])

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))

    t_start = time.perf_counter()
    bw = copy_bandwidth(dev, 2**31 if dev.type == "cuda" else 2**26)
    res["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    hf = build_hf(dims, dev, dtype)
    shapes = SMOKE_PREFILL_SHAPES if args.smoke else PREFILL_SHAPES
    engine, base_bytes = build_engine(hf, dev, dtype, max(batches), in_len, out_len, shapes, args.async_scheduling)
    res["async_scheduling"] = engine.overlap
    res["base_weight_bytes"] = base_bytes
    print(f"built model and engine in {time.perf_counter() - t_start:.1f} s; base bytes {base_bytes / 1e9:.2f} GB",
          flush=True)
    graphs = engine.runner.graphs
    wanted = set(args.cases.split(",")) if args.cases else {c[0] for c in ENGINE_CASES}
    for name, rank, modules, distinct in ENGINE_CASES:
        if name not in wanted:
            continue
        rows = adapter_rows(dims, rank, modules, dev, dtype) if rank else None
        loaded: set[str] = set()
        for batch in batches:
            try:
                keys = case_keys(engine, name, batch, rows, distinct, loaded)
                n_distinct = len({k for k in keys if k is not None})
                run_engine(engine, batch, keys, in_len, 3, seed=1)            # warm-up: compiles, captures
                r = run_engine(engine, batch, keys, in_len, out_len, seed=2)
                if graphs is not None:
                    r["gpu_step_ms"] = graphs.time_replay(batch, rows is not None)
                    r["host_step_ms"] = r["tpot_ms"] - (r["gpu_step_ms"] or 0.0)
                    if name == "base":
                        r["gemm_only_ms"] = gemm_ms(engine, batch)
                if (name, batch) in EAGER_CASES and graphs is not None:
                    engine.runner.graphs = None
                    r["eager"] = run_engine(engine, batch, keys, in_len, out_len, seed=3)
                    engine.runner.graphs = graphs
                r["floor"] = floor(base_bytes, n_distinct * adapter_bytes(dims, rank, modules, elem), batch,
                                   dims, in_len, out_len, bw, elem)
                r["tpot_over_floor"] = r["tpot_ms"] / r["floor"]["step_ms"]
                r["distinct_adapters"] = n_distinct
                res["engine"].setdefault(name, {})[str(batch)] = r
                print(f"engine {name:18s} B={batch:3d} {r['tok_per_s']:9.1f} tok/s  tpot {r['tpot_ms']:7.2f} ms "
                      f"(gpu {r.get('gpu_step_ms') or 0:6.2f})  floor {r['floor']['step_ms']:6.2f} ms  "
                      f"x{r['tpot_over_floor']:.2f}" + (f"  eager tpot {r['eager']['tpot_ms']:.2f}" if 'eager' in r
                                                        else ""), flush=True)
            except Exception as e:  # keep the other cases; the error goes into the results
                engine.runner.graphs = graphs
                res["errors"].append(f"engine {name} B={batch}: {e!r}")
                traceback.print_exc()
            save()
        if name in PREFILL_CASES and not args.no_prefill:
            try:
                prefill_cases(engine, name, rows, distinct, shapes, loaded, res)
            except Exception as e:
                res["errors"].append(f"prefill {name}: {e!r}")
                traceback.print_exc()
            save()
        for k in loaded:
            engine.slots.evict(k)
    del engine
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if hf_batches:
        run_hf_cases(hf, dims, dev, dtype, hf_batches, in_len, out_len, bw, base_bytes, elem, res, save)
    res["wall_s"] = time.perf_counter() - t_start
    save()
    if args.plot:
        plot(res, args.plot)


def run_hf_cases(hf, dims, dev, dtype, batches, in_len, out_len, bw, base_bytes, elem, res, save) -> None:
    from peft import LoraConfig, get_peft_model

    vocab = dims["vocab_size"]
    for batch in batches:
        try:
            r = run_hf(hf, batch, in_len, out_len, dev, vocab)
            r["floor"] = floor(base_bytes, 0, batch, dims, in_len, out_len, bw, elem)
            res["hf"].setdefault("base", {})[str(batch)] = r
            print(f"transformers base   B={batch:3d} {r['tok_per_s']:9.1f} tok/s  tpot {r['tpot_ms']:7.2f} ms",
                  flush=True)
        except Exception as e:
            res["errors"].append(f"hf base B={batch}: {e!r}")
            traceback.print_exc()
        save()
    _, rank, modules = HF_CASES[1]
    names = [f"a{i}" for i in range(HF_MAX_ADAPTERS)]
    peft_model = None
    torch.manual_seed(1)
    for n in names:
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(modules), lora_dropout=0.0,
                         init_lora_weights=False)
        peft_model = get_peft_model(hf, cfg, adapter_name=n) if peft_model is None else peft_model
        if n != names[0]:
            peft_model.add_adapter(n, cfg)
    peft_model = peft_model.to(dtype).eval()
    for batch in batches:
        try:
            use = [names[i % len(names)] for i in range(batch)]
            r = run_hf(peft_model, batch, in_len, out_len, dev, vocab, names=use)
            nd = len(set(use))
            r["floor"] = floor(base_bytes, nd * adapter_bytes(dims, rank, modules, elem), batch, dims, in_len,
                               out_len, bw, elem)
            r["distinct_adapters"] = nd
            res["hf"].setdefault(HF_CASES[1][0], {})[str(batch)] = r
            print(f"transformers+PEFT   B={batch:3d} {r['tok_per_s']:9.1f} tok/s  tpot {r['tpot_ms']:7.2f} ms "
                  f"({nd} adapters)", flush=True)
        except Exception as e:
            res["errors"].append(f"hf peft B={batch}: {e!r}")
            traceback.print_exc()
        save()


def plot(res: dict, out: Path | None) -> None:
    """Throughput vs batch, base vs multi-LoRA, loraplex vs transformers, with the decode floors."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (re-plot later with --plot-only)")
        return
    prefill = res.get("prefill", {})
    fig, axes = plt.subplots(1, 2 if prefill else 1, figsize=(14 if prefill else 8, 5), squeeze=False)
    ax = axes[0][0]
    if prefill:
        plot_prefill(axes[0][1], prefill, res["device"])
    series = [("engine", "base", "loraplex base", "C0", "-"),
              ("engine", "distinct_r64_qkv", "loraplex, distinct r64 q/k/v per request", "C1", "-"),
              ("engine", "distinct_r16_all", "loraplex, distinct r16 all modules", "C2", "-"),
              ("hf", "base", "transformers base", "C0", ":"),
              ("hf", "distinct_r64_qkv", "transformers + PEFT, 8 r64 q/k/v adapters", "C1", ":")]
    for src, case, label, color, style in series:
        pts = sorted((int(b), r["tok_per_s"]) for b, r in res.get(src, {}).get(case, {}).items())
        if pts:
            ax.plot(*zip(*pts), style, marker="o", color=color, label=label)
    for case, color in (("base", "C0"), ("distinct_r64_qkv", "C1")):
        pts = sorted((int(b), r["floor"]["tok_per_s"]) for b, r in res["engine"].get(case, {}).items())
        if pts:
            ax.plot(*zip(*pts), "--", color=color, alpha=0.5, label=f"decode floor ({case})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens/s (input 43, output 100)")
    ax.set_title(f"Llama-3-8B shape, bf16, {res['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if out:
        fig.savefig(out, dpi=120)


def plot_prefill(ax, prefill: dict, device: str) -> None:
    """Prefill tokens/s of each adapter case over the base model's, per prompt shape."""
    cases = [c for c in PREFILL_CASES if c != "base" and c in prefill]
    shapes = sorted({s for c in cases for s in prefill[c]}, key=lambda s: [int(v) for v in s.split("x")])
    width = 0.8 / max(1, len(cases))
    for i, case in enumerate(cases):
        ys = [prefill[case].get(s, {}).get("over_base", 0.0) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=case)
    ax.axhline(0.85, color="k", linestyle="--", alpha=0.5, label="goal 0.85x base")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))],
                  [f"{s.split('x')[1]} x {s.split('x')[0]} tok" for s in shapes])
    ax.set_ylabel("prefill tokens/s over base")
    ax.set_title(f"Prefill with distinct adapters, {device}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
