"""Generate from SmolLM2 with the base model and two adapters in one batch.

    python examples/engine_demo.py                         # two random adapters, to show mixing
    python examples/engine_demo.py --adapter sql=/path/to/peft_folder --adapter chat=/other
    python examples/engine_demo.py --model /path/to/hf_folder_or.gguf --device cuda

Adapters given with --adapter are read by `loraplex.formats.load_adapter` (PEFT,
TensorRT-LLM npy, or llgtrt safetensors). Without them the demo builds two
random rank-8 adapters on q/v and gate/up, so their answers visibly differ from
the base model's while all three run in the same steps.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from compute_service.engine import EngineConfig, LLMEngine, ModelSpec, SamplingParams
from loraplex.formats import Adapter
from loraplex.formats.modules import module_shape


def random_adapter(spec: ModelSpec, module_ids: tuple[int, ...], rank: int, scale: float, seed: int) -> Adapter:
    """A converted adapter with small random A and B on every layer of `module_ids`."""
    g = torch.Generator().manual_seed(seed)
    rows, config = [], []
    for layer in range(spec.num_layers):
        for mid in module_ids:
            s = module_shape(mid, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                             num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                             intermediate_size=spec.intermediate_size)
            a = torch.randn(rank, s.in_features, generator=g) / s.in_features ** 0.5
            b = torch.randn(s.out_features, rank, generator=g) * scale / rank ** 0.5
            rows.append(torch.cat([a.flatten(), b.flatten()]))
            config.append([mid, layer, rank])
    weights = torch.zeros(len(rows), max(r.numel() for r in rows))
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r
    return Adapter(config=np.asarray(config, dtype=np.int32), weights=weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF safetensors folder or .gguf file (default: SmolLM2 GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--prompt", default="Give me one sentence about the ocean.")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()

    t0 = time.perf_counter()
    engine = LLMEngine.from_config(EngineConfig(model=args.model, device=args.device, max_model_len=1024))
    print(f"loaded {engine.spec.name} ({engine.spec.num_layers} layers) in {time.perf_counter() - t0:.1f}s, "
          f"fingerprint {engine.fingerprint}")
    keys: list[str | None] = [None]
    if args.adapter:
        from loraplex.formats import load_adapter
        for item in args.adapter:
            name, path = item.split("=", 1)
            engine.add_adapter(name, load_adapter(path))
            keys.append(name)
    else:
        engine.add_adapter("random-attn", random_adapter(engine.spec, (1, 3), 8, 0.5, seed=1))
        engine.add_adapter("random-mlp", random_adapter(engine.spec, (5, 7), 8, 0.5, seed=2))
        keys += ["random-attn", "random-mlp"]
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    t0 = time.perf_counter()
    outputs = engine.generate([prompt] * len(keys), params, keys)
    took = time.perf_counter() - t0
    for key, out in zip(keys, outputs):
        print(f"\n[{key or 'base'}] {tok.decode(out, skip_special_tokens=True)!r}")
    print(f"\n{sum(map(len, outputs))} tokens for {len(keys)} requests in one batch, {took:.1f}s")


if __name__ == "__main__":
    main()
