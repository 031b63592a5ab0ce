"""loraplex's compute engine: a Llama-family model with paged KV cache, continuous batching and per-request LoRA.

Names are imported lazily so that the plain-Python parts (scheduler, block
manager, sampling params) can be used without importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "config",
    "CapacityError": "errors", "EngineError": "errors", "InvalidAdapterError": "errors",
    "InvalidRequestError": "errors", "ModelLoadError": "errors", "UnsupportedModelError": "errors",
    "LLMEngine": "llm_engine",
    "LoadedModel": "loader", "default_model_path": "loader", "load_model": "loader", "load_tokenizer": "loader",
    "AdapterSlots": "lora_backend", "LoraBackend": "lora_backend",
    "EngineStats": "outputs", "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "ModelSpec": "spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
