"""Engine decode with distinct adapters on the CPU: what the CPU LoRA path costs over the base model.

The default model (SmolLM2-135M, fp32) or `--model`, `--streams` requests at
once, each with its own random adapter (rank `--rank` on all seven modules),
a 16-token prompt and `--out-len` greedy tokens (EOS ignored). Decode tok/s is
measured from the step where every request had its first token to the end,
best of `--repeats` runs (CPU timing is noisy). The base model alone runs the
same workload for comparison, and the LoRA work of one decode step is timed
alone (`lora_step_ms`: the backend's prepare + apply over every layer).

    .venv/bin/python bench/cpu_multi_lora.py --out bench/results/cpu_multi_lora.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def random_adapter(spec, rank: int, seed: int):
    """Converted form, every module of every layer at `rank`, fresh random weights."""
    from loraplex.formats.adapter import Adapter

    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    feats = {1: (h, q), 2: (h, kv), 3: (h, kv), 4: (q, h), 5: (h, i), 6: (i, h), 7: (h, i)}
    g = torch.Generator().manual_seed(seed)
    cfg, rows = [], []
    for layer in range(spec.num_layers):
        for m, (fin, fout) in feats.items():
            a = torch.randn(rank, fin, generator=g) / fin ** 0.5
            b = torch.randn(fout, rank, generator=g) * 0.02
            cfg.append([m, layer, rank])
            rows.append(torch.cat([a.flatten(), b.flatten()]))
    w = torch.zeros(len(rows), max(r.numel() for r in rows))
    for n, r in enumerate(rows):
        w[n, : r.numel()] = r
    return Adapter(config=np.asarray(cfg, dtype=np.int32), weights=w)


def decode_tok_per_s(engine, keys: list, out_len: int, seed: int) -> float:
    from compute_service.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    ids = [f"r{seed}-{n}" for n in range(len(keys))]
    for rid, key in zip(ids, keys):
        engine.add_request(rid, torch.randint(0, engine.spec.vocab_size, (16,), generator=g).tolist(), params, key)
    started: set[str] = set()
    t_first, n_after = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids:
                if t_first is not None:
                    n_after += len(o.new_token_ids)
                started.add(o.request_id)
        if t_first is None and len(started) == len(keys):
            t_first = time.perf_counter()
    return n_after / (time.perf_counter() - t_first)


def lora_step_ms(engine, keys: list, repeats: int = 7) -> float:
    """Best time of the LoRA work alone in one decode step (prepare + every layer's four groups), one token per key."""
    spec, lora = engine.spec, engine.runner.lora
    h, q, kv, i, n = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, len(keys)
    groups = {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}
    xs = {g: torch.randn(n, fin) for g, (fin, _) in groups.items()}
    ys = {g: torch.randn(n, sum(outs)) for g, (_, outs) in groups.items()}
    ids = torch.tensor([engine.slots.slot_of(k) for k in keys], dtype=torch.int32)
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        lora.prepare(ids)
        for layer in range(spec.num_layers):
            for g, (_, outs) in groups.items():
                lora.apply(layer, g, xs[g], list(ys[g].split(outs, dim=1)))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--lora-backend", default="auto", choices=("auto", "torch", "kernels"),
                    help="kernels on the CPU = the kernels' paged torch reference (the service's former CPU path)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from compute_service.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.streams, max_loras=args.streams,
                                    max_model_len=256, max_lora_rank=max(args.rank, 16),
                                    lora_backend=args.lora_backend))
    keys = [f"a{n}" for n in range(args.streams)]
    for n, k in enumerate(keys):
        engine.add_adapter(k, random_adapter(engine.spec, args.rank, seed=n))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    res: dict = dict(streams=args.streams, rank=args.rank, out_len=args.out_len, threads=torch.get_num_threads(),
                     model=engine.loaded.path.name, commit=commit.strip(),
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     lora_backend=type(engine.runner.lora).__name__)
    for name, ks in (("base", [None] * args.streams), ("distinct", keys)):
        decode_tok_per_s(engine, ks, 3, seed=0)                       # warm-up
        runs = [decode_tok_per_s(engine, ks, args.out_len, seed=r + 1) for r in range(args.repeats)]
        res[name] = dict(decode_tok_per_s=max(runs), runs=runs)
        print(f"{name:9s} {max(runs):8.1f} decode tok/s (runs {', '.join(f'{r:.1f}' for r in runs)})", flush=True)
    res["distinct_over_base"] = res["distinct"]["decode_tok_per_s"] / res["base"]["decode_tok_per_s"]
    res["lora_step_ms"] = lora_step_ms(engine, keys)
    print(f"distinct / base = {res['distinct_over_base']:.2f}; LoRA alone {res['lora_step_ms']:.1f} ms per decode step")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
