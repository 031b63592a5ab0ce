"""Compute service settings (flags and LORAPLEX_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.settings import SettingsError


@dataclass(frozen=True)
class ComputeConfig:
    """Settings of `loraplex compute`."""

    listen: str = field(default="127.0.0.1:50053", metadata={"help": "address to serve Compute on"})
    cache_address: str = field(default="127.0.0.1:50052", metadata={"help": "host cache service address"})
    model: str = field(default="", metadata={"help": "GGUF file or HF folder; default SmolLM2-135M-Instruct"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda[:N]"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), float32, float16 or bfloat16"})
    max_lora_rank: int = field(default=256, metadata={"help": "largest adapter rank accepted"})
    lora_gpu_memory_fraction: float = field(
        default=0.05, metadata={"help": "adapter pool as a fraction of memory free after weights and KV cache"})
    lora_gpu_cache_bytes: int = field(default=0, metadata={"help": "adapter pool size in bytes (overrides the fraction)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in a batch"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "most tokens in one step (prefill is chunked)"})
    max_model_len: int = field(default=2048, metadata={"help": "longest prompt + output"})
    kv_cache_bytes: int = field(default=0, metadata={"help": "KV cache size in bytes (0 = from gpu_memory_utilization, or 256 MiB on CPU)"})
    gpu_memory_utilization: float = field(default=0.85, metadata={"help": "fraction of GPU memory for weights + KV + adapters"})
    max_message_bytes: int = field(default=64 << 20, metadata={"help": "largest gRPC message"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 = off)"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})

    def __post_init__(self) -> None:
        if not 0.0 < self.lora_gpu_memory_fraction < 1.0:
            raise SettingsError("lora_gpu_memory_fraction: must be in (0, 1)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise SettingsError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise SettingsError(f"dtype: expected auto, float32, float16 or bfloat16, got {self.dtype!r}")
