"""Writes small random PEFT LoRA adapters for the default base model (SmolLM2-135M-Instruct).

    python examples/make_demo_adapters.py adapters      # -> adapters/demo_a/, adapters/demo_b/

Each folder is what PEFT's `save_pretrained` writes (adapter_config.json +
adapter_model.safetensors) for rank-8 LoRA on every attention and MLP
projection, with random factors large enough that each adapter visibly changes
the model's answers. They are for trying loraplex, not for quality.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.formats import ModelSpec
from loraplex.model_files import resolve_model_path

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, spec: ModelSpec, seed: int, rank: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    h, m = spec.hidden_size, spec.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}
    tensors = {}
    for layer in range(spec.num_layers):
        for proj, block in PROJECTIONS.items():
            fin, fout = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) * std).half()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * std).half()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(PROJECTIONS), "base_model_name_or_path": spec.model_type}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write demo_a/ and demo_b/ into (use it as --lora-root)")
    parser.add_argument("--model", default="", help="base model (GGUF or HF folder); default SmolLM2")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--std", type=float, default=0.06, help="scale of the random factors")
    args = parser.parse_args()
    spec = ModelSpec.from_path(resolve_model_path(args.model))
    for seed, name in enumerate(("demo_a", "demo_b"), start=1):
        write_adapter(args.out / name, spec, seed, args.rank, args.std)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
