"""Fixtures for the adapter-format tests: a tiny random Llama and PEFT adapters made on it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from loraplex.formats import ModelSpec

TINY = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=6, vocab_size=50)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def tiny_config_dict() -> dict[str, Any]:
    from transformers import LlamaConfig

    return LlamaConfig(**TINY).to_dict()


@pytest.fixture(scope="session")
def tiny_spec(tiny_config_dict) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_config_dict)


@pytest.fixture
def tiny_llama():
    """A fresh tiny random LlamaForCausalLM (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture
def make_peft(tmp_path: Path, tiny_llama) -> Callable[..., tuple[Any, Path]]:
    """make_peft(name, **LoraConfig kwargs) -> (PeftModel, saved folder), random A and B."""
    from peft import LoraConfig, get_peft_model

    def make(name: str = "adapter", dtype: torch.dtype = torch.float32, **kwargs: Any):
        kwargs.setdefault("target_modules", ALL_MODULES)
        kwargs.setdefault("r", 4)
        kwargs.setdefault("lora_alpha", 8)
        # random B too (PEFT's default init makes B zero, which would hide scale bugs)
        model = get_peft_model(tiny_llama, LoraConfig(init_lora_weights=False, **kwargs))
        if dtype != torch.float32:
            model = model.to(dtype)
        folder = tmp_path / name
        model.save_pretrained(folder)
        return model, folder

    return make
