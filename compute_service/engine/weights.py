"""Builds the model's fused weights from Hugging Face-named tensors, and the base-model fingerprint."""
from __future__ import annotations

import hashlib
import json
from typing import Callable

import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.linear import Linear
from compute_service.engine.model import LayerWeights, ModelWeights
from compute_service.engine.spec import ModelSpec

# get(name) -> float tensor as stored in the checkpoint, or None when absent.
TensorSource = Callable[[str], "torch.Tensor | None"]


def build_weights(spec: ModelSpec, get: TensorSource, dtype: torch.dtype,
                  device: torch.device) -> tuple[ModelWeights, str]:
    """Reads every tensor through `get`, fuses q/k/v and gate/up, casts; returns (weights, fingerprint)."""
    hasher = _Fingerprint(spec)

    def need(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
        return t

    def opt(name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return need(name, shape) if present else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def cast_opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else cast(t)

    s = spec
    hid, q, kv, inter = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size
    embed = need("model.embed_tokens.weight", (s.vocab_size, hid))
    hasher.add("embed", embed[:8])
    layers = []
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([need(p + "self_attn.q_proj.weight", (q, hid)),
                         need(p + "self_attn.k_proj.weight", (kv, hid)),
                         need(p + "self_attn.v_proj.weight", (kv, hid))])
        qkv_bias = None
        if s.qkv_bias:
            qkv_bias = torch.cat([need(p + "self_attn.q_proj.bias", (q,)), need(p + "self_attn.k_proj.bias", (kv,)),
                                  need(p + "self_attn.v_proj.bias", (kv,))])
        gate_up = torch.cat([need(p + "mlp.gate_proj.weight", (inter, hid)),
                             need(p + "mlp.up_proj.weight", (inter, hid))])
        gate_up_bias = None
        if s.mlp_bias:
            gate_up_bias = torch.cat([need(p + "mlp.gate_proj.bias", (inter,)), need(p + "mlp.up_proj.bias", (inter,))])
        if i in (0, s.num_layers - 1):
            hasher.add(f"qkv{i}", qkv[:, :8])
        layers.append(LayerWeights(
            input_norm=cast(need(p + "input_layernorm.weight", (hid,))),
            qkv=Linear(cast(qkv), cast_opt(qkv_bias)),
            o=Linear(cast(need(p + "self_attn.o_proj.weight", (hid, q))),
                     cast_opt(opt(p + "self_attn.o_proj.bias", (hid,), s.o_bias))),
            post_norm=cast(need(p + "post_attention_layernorm.weight", (hid,))),
            gate_up=Linear(cast(gate_up), cast_opt(gate_up_bias)),
            down=Linear(cast(need(p + "mlp.down_proj.weight", (hid, inter))),
                        cast_opt(opt(p + "mlp.down_proj.bias", (hid,), s.mlp_bias))),
        ))
    norm = need("model.norm.weight", (hid,))
    hasher.add("norm", norm)
    embed_c = cast(embed)
    if s.tie_word_embeddings:
        lm_head = embed_c
    else:
        head = need("lm_head.weight", (s.vocab_size, hid))
        hasher.add("lm_head", head[:8])
        lm_head = cast(head)
    weights = ModelWeights(embed=embed_c, layers=layers, norm=cast(norm), lm_head=lm_head)
    return weights, hasher.hexdigest()


class _Fingerprint:
    """sha256 of the architecture and dims plus a few tensors' float32 bytes (dtype-independent)."""

    def __init__(self, spec: ModelSpec) -> None:
        dims = {k: getattr(spec, k) for k in ("architecture", "num_layers", "hidden_size", "num_heads",
                                              "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")}
        self._h = hashlib.sha256(json.dumps(dims, sort_keys=True).encode())

    def add(self, name: str, t: torch.Tensor) -> None:
        self._h.update(name.encode())
        self._h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]
