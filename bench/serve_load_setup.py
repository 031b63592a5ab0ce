"""What bench/serve_load.py serves: a random model with a real tokenizer, PEFT adapters, prompts.

- `make_random_model(dir, shape)`: a Llama-family HF folder (config.json, random
  weights as one safetensors file per layer, a tokenizer) that `loraplex serve`
  and the in-process engine both load, so the gateway (which needs a tokenizer)
  is in the path. "8b" is Llama-3-8B's shape with the default model's tokenizer
  copied in (so a 49152-entry vocabulary instead of 128256: the LM head is 0.4 GB
  rather than 1 GB); "tiny" is a 2-layer model with a byte-level tokenizer built
  here (256 byte tokens + 3 specials), small enough for a CPU check in seconds.
- `write_adapters(root, model, n, ranks)`: `n` PEFT folders (`adapter_config.json`
  + `adapter_model.safetensors`) on all seven projections, ranks cycling over
  `ranks`, under an adapter root, named `a000`, `a001`, ...
- `make_prompts(n, length, vocab)`: fixed-length random token-id prompts, the same
  for the served system and the engine.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True),
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is one token, plus three specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], bos_token=SPECIALS[0],
                                   unk_token=SPECIALS[0])


def default_tokenizer():
    """The default model's tokenizer (read from its GGUF file)."""
    from loraplex.model_files import load_tokenizer

    return load_tokenizer("")


def make_random_model(out: Path, shape: str, *, dtype: str = "bfloat16", device: str = "cpu",
                      seed: int = 0) -> Path:
    """Writes a random Llama model of `shape` with a tokenizer into `out`; returns `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tokenizer = byte_tokenizer() if shape == "tiny" else default_tokenizer()
    dims = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"],
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **dims)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter = dims["hidden_size"], dims["intermediate_size"]
    head_dim = h // dims["num_attention_heads"]
    kv = dims["num_key_value_heads"] * head_dim
    std = 0.02 if shape == "8b" else 0.08   # the tiny model's logits should differ between tokens

    def rand(*shape_: int) -> torch.Tensor:
        return torch.randn(*shape_, generator=gen, device=device).mul_(std).to(tdtype).cpu()

    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    ones = torch.ones(h, dtype=tdtype)
    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors = {f"{p}{name}.weight": rand(*s) for name, s in shapes.items()}
        tensors[f"{p}input_layernorm.weight"] = ones.clone()
        tensors[f"{p}post_attention_layernorm.weight"] = ones.clone()
        save_file(tensors, str(out / f"model-layer{layer:03d}.safetensors"), metadata={"format": "pt"})
    top = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "model.norm.weight": ones.clone()}
    if not dims["tie_word_embeddings"]:
        top["lm_head.weight"] = rand(cfg.vocab_size, h)
    save_file(top, str(out / "model-top.safetensors"), metadata={"format": "pt"})
    return out


def write_adapters(root: Path, model: str, num: int, ranks: list[int]) -> dict[str, int]:
    """`num` random PEFT folders for `model` under `root`; returns {name: rank}."""
    sys.path.insert(0, str(ROOT / "examples"))
    from make_demo_adapters import write_adapter  # the demo's PEFT writer, any base model

    from loraplex.formats import ModelSpec
    from loraplex.model_files import resolve_model_path

    spec = ModelSpec.from_path(resolve_model_path(model))
    names = {}
    for i in range(num):
        name, rank = f"a{i:03d}", ranks[i % len(ranks)]
        if not (root / name / "adapter_model.safetensors").is_file():
            write_adapter(root / name, spec, seed=1000 + i, rank=rank, std=0.02)
        names[name] = rank
    return names


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of `length` random token ids, clear of the low ids where special tokens live."""
    rng = random.Random(seed)
    low = min(300, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(num)]


def main() -> None:
    """`python bench/serve_load_setup.py DIR --shape 8b`: only writes the model."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda is faster)")
    args = ap.parse_args()
    make_random_model(args.out, args.shape, device=args.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
