"""Host cache settings (flags and LORAPLEX_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.settings import SettingsError


@dataclass(frozen=True)
class CacheConfig:
    """Settings of `loraplex cache`."""

    listen: str = field(default="127.0.0.1:50052", metadata={"help": "address to serve AdapterCache on"})
    backend: str = field(default="shm", metadata={"help": "where adapters live: shm (shared memory) or redis"})
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis server for --backend redis"})
    host_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "byte budget of the LRU (lora_cache_host_memory_bytes)"})
    lora_root: str = field(default="", metadata={"help": "folder of named adapters (<root>/<name>/ or <root>/<name>.safetensors)"})
    lora_prefetch_dir: str = field(default="", metadata={"help": "folder of <task_id>/model.lora_{config,weights}.npy loaded at start"})
    model: str = field(default="", metadata={"help": "base model (GGUF, HF folder or config.json) adapters are validated against; default SmolLM2"})
    max_lora_rank: int = field(default=256, metadata={"help": "largest adapter rank accepted"})
    max_message_bytes: int = field(default=64 << 20, metadata={"help": "largest gRPC message; adapters move in chunks below it"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 = off)"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})

    def __post_init__(self) -> None:
        if self.backend not in ("shm", "redis"):
            raise SettingsError(f"backend: expected shm or redis, got {self.backend!r}")
        if self.host_cache_bytes <= 0:
            raise SettingsError("host_cache_bytes: must be positive")
        if not 1 <= self.max_lora_rank <= 1024:
            raise SettingsError("max_lora_rank: must be in 1..1024")
