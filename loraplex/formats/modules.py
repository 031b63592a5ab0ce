"""The LoRA module-id table (TensorRT-LLM's numbering) and Hugging Face name mapping.

Module ids 0-17 follow the seed's table. Hugging Face projection names map to
ids the way the converters in the wild do (TensorRT-LLM's `hf_lora_convert.py`
and llgtrt's extractor): `gate_proj` -> 5 (`mlp_h_to_4h`), `up_proj` -> 7
(`mlp_gate`), `down_proj` -> 6 (`mlp_4h_to_h`). The seed's prose calls 5 the up
projection and 7 the gate; loraplex follows the files users actually have.
"""
from __future__ import annotations

from dataclasses import dataclass

# id -> TensorRT-LLM module name
MODULE_NAMES: dict[int, str] = {
    0: "attn_qkv",
    1: "attn_q",
    2: "attn_k",
    3: "attn_v",
    4: "attn_dense",
    5: "mlp_h_to_4h",
    6: "mlp_4h_to_h",
    7: "mlp_gate",
    8: "cross_attn_qkv",
    9: "cross_attn_q",
    10: "cross_attn_k",
    11: "cross_attn_v",
    12: "cross_attn_dense",
    13: "moe_h_to_4h",
    14: "moe_4h_to_h",
    15: "moe_gate",
    16: "moe_router",
    17: "mlp_router",
}
MODULE_IDS: dict[str, int] = {name: mid for mid, name in MODULE_NAMES.items()}

# Hugging Face projection name -> module id (the converters' mapping).
HF_TO_MODULE_ID: dict[str, int] = {
    "qkv_proj": 0,
    "query_key_value": 0,
    "q_proj": 1,
    "k_proj": 2,
    "v_proj": 3,
    "o_proj": 4,
    "dense": 4,
    "gate_proj": 5,
    "down_proj": 6,
    "up_proj": 7,
    "gate_up_proj": 5,
}
# module id -> the Llama-family Hugging Face name loraplex writes back.
MODULE_ID_TO_HF: dict[int, str] = {
    0: "qkv_proj",
    1: "q_proj",
    2: "k_proj",
    3: "v_proj",
    4: "o_proj",
    5: "gate_proj",
    6: "down_proj",
    7: "up_proj",
}
# Modules the loraplex engine applies (Llama family).
SERVED_MODULE_IDS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)


@dataclass(frozen=True)
class ModuleShape:
    """Input and output features of one module's linear layer."""

    in_features: int
    out_features: int


def module_shape(module_id: int, *, hidden_size: int, num_attention_heads: int,
                 num_key_value_heads: int, head_dim: int, intermediate_size: int) -> ModuleShape:
    """In/out features of module `module_id` in a Llama-family decoder layer."""
    q = num_attention_heads * head_dim
    kv = num_key_value_heads * head_dim
    shapes = {
        0: ModuleShape(hidden_size, q + 2 * kv),
        1: ModuleShape(hidden_size, q),
        2: ModuleShape(hidden_size, kv),
        3: ModuleShape(hidden_size, kv),
        4: ModuleShape(q, hidden_size),
        5: ModuleShape(hidden_size, intermediate_size),
        6: ModuleShape(intermediate_size, hidden_size),
        7: ModuleShape(hidden_size, intermediate_size),
    }
    if module_id not in shapes:
        name = MODULE_NAMES.get(module_id, "unknown")
        raise KeyError(f"module id {module_id} ({name}) has no shape in a Llama-family decoder")
    return shapes[module_id]
