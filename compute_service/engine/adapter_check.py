"""Checks a converted adapter against the loaded base model before it takes a slot.

The rules are the formats package's door validation (`loraplex.formats.validate`),
so an adapter the cache service accepted is accepted here and vice versa; its
`AdapterError`s (ValueError subclasses naming the bad row) pass through.
"""
from __future__ import annotations

from loraplex.formats import ModelSpec as AdapterModelSpec
from loraplex.formats import validate
from loraplex.formats.adapter import Adapter

from compute_service.engine.spec import ModelSpec


def adapter_model_spec(spec: ModelSpec) -> AdapterModelSpec:
    """The formats package's shape-only view of the engine's model."""
    return AdapterModelSpec(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                            head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
                            vocab_size=spec.vocab_size, model_type=spec.architecture)


def check_adapter(adapter: Adapter, spec: ModelSpec, max_lora_rank: int) -> Adapter:
    """Returns the adapter with `in_out` filled; raises a formats `AdapterError` naming the first bad row."""
    return validate(adapter, adapter_model_spec(spec), max_lora_rank)
