"""GGUF reading: metadata -> ModelSpec, tensors dequantized to float32 with Hugging Face names.

llama.cpp's converter permutes the q and k rows of Llama checkpoints for its
interleaved RoPE; we undo it (as transformers does) to use the rotate-half
layout. Qwen2 GGUFs are not permuted.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError
from compute_service.engine.spec import ModelSpec, spec_from_gguf_fields

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    norm = m.group(2).endswith("norm")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}" + (".weight" if norm else f".{m.group(3)}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (pairs interleaved -> halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_gguf(path: Path) -> tuple[ModelSpec, Callable[[str], torch.Tensor | None], str | None]:
    """Returns (spec, get-by-HF-name, chat template)."""
    from gguf import dequantize

    from compute_service.engine.gguf_header import read_header

    try:
        header = read_header(path)
    except Exception as e:  # bad files raise ValueErrors/struct errors from deep inside the parse
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None
    fields = {k: v for k, v in header.fields.items()
              if k not in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")}
    num_tokens = header.array_lengths.get("tokenizer.ggml.tokens", len(fields.pop("tokenizer.ggml.tokens", [])))
    tensors = header.tensors
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError(f"{path.name}: GGUF with rope_freqs (Llama-3.1 scaling) is not supported; "
                                    "use the HF safetensors folder instead")
    spec = spec_from_gguf_fields(fields, num_tokens, "output.weight" in tensors, path.stem)
    by_hf = {h: t for t in tensors.values() if (h := _hf_name(t.name)) is not None}
    permute = spec.architecture == "llama"

    def get(name: str) -> torch.Tensor | None:
        t = by_hf.get(name)
        if t is None:
            return None
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if permute and name.endswith("q_proj.weight"):
            w = _unpermute(w, spec.num_heads)
        elif permute and name.endswith("k_proj.weight"):
            w = _unpermute(w, spec.num_kv_heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a writable copy

    return spec, get, fields.get("tokenizer.chat_template")
