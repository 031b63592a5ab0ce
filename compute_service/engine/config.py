"""EngineConfig: one frozen, validated dataclass of every engine knob."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Limits and budgets of one engine.

    model: a HF safetensors folder or a .gguf file; None = the default SmolLM2.
    dtype: "auto" = float32 on CPU, bfloat16 on CUDA.
    kv_cache_bytes: KV budget in bytes; None = 256 MiB on CPU, or
      `gpu_memory_fraction` of the GPU memory free after the weights on CUDA,
      less `kv_reserve_bytes`.
    kv_reserve_bytes: on CUDA, with kv_cache_bytes None: bytes of the
      `gpu_memory_fraction` share kept for what is allocated after the KV cache
      (the compute service's adapter pool when its size is fixed), so the two
      together stay inside the share.
    max_model_len: None = the model's max positions, capped at 8192.
    enforce_eager: on CUDA, decode steps of up to `max_num_seqs` sequences
      replay CUDA graphs unless this is True (prefill graphs are off then too).
    prefill_graph_tokens: on CUDA, prefill and mixed steps of up to this many
      tokens (capped at `max_num_batched_tokens`) replay CUDA graphs between
      their attentions (`prefill_graphs.py`); 0 = always eager.
    quantization: a quantized checkpoint's projections: "auto" = kept quantized on
      CUDA, dequantized on CPU; "keep" = kept quantized everywhere (on CPU a slow
      reference path); "none" = dequantized to `dtype` everywhere.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.85
    kv_reserve_bytes: int = 0
    max_loras: int = 8
    max_lora_rank: int = 64
    lora_backend: str = "auto"      # "torch" | "kernels" | "auto" (kernels on CUDA when present)
    seed: int = 0                   # seeds the generators of requests without their own seed
    enforce_eager: bool = False     # True = no CUDA graphs for decode steps (debugging, profiling)
    quantization: str = "auto"      # "auto" | "keep" | "none"
    prefill_graph_tokens: int = 2048  # largest prefill/mixed step replayed from a CUDA graph; 0 = none
    # Queue decode step N+1 before reading step N's tokens (`LLMEngine`); None: on with a GPU, off on the CPU.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_reserve_bytes < 0:
            raise ValueError(f"kv_reserve_bytes must be >= 0, got {self.kv_reserve_bytes}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.quantization not in ("auto", "keep", "none"):
            raise ValueError(f"quantization must be auto, keep or none, got {self.quantization!r}")
        if self.lora_backend not in ("auto", "torch", "kernels"):
            raise ValueError(f"lora_backend must be auto, torch or kernels, got {self.lora_backend!r}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
