"""Host cache settings (flags and LORAPLEX_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.settings import SettingsError


@dataclass(frozen=True)
class CacheConfig:
    """Settings of `loraplex cache` (TensorRT-LLM/Triton names in docs/host_cache.md)."""

    listen: str = field(default="127.0.0.1:50052", metadata={"help": "address to serve AdapterCache on"})
    backend: str = field(default="shm", metadata={"help": "where adapters live: shm (shared memory) or redis"})
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis server for --backend redis"})
    redis_prefix: str = field(default="loraplex", metadata={"help": "key prefix in Redis (keys are <prefix>:<fingerprint>:...)"})
    host_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "byte budget of the LRU (lora_cache_host_memory_bytes)"})
    shm_spare_bytes: int = field(
        default=256 << 20, metadata={"help": "shm: blank segments kept ready, pages allocated, so a cold adapter's "
                                             "conversion does not wait on page faults (beyond the budget; adapters "
                                             "larger than this get none; 0 = off)"})
    convert_processes: int = field(default=-1, metadata={
        "help": "shm: worker processes that convert never-seen PEFT adapters into shared memory, side by side "
                "and outside the service's GIL (0 = convert in the service's process; -1 = auto: a quarter of "
                "the CPU cores, at most 4, none below 8 cores)"})
    convert_local_first: bool = field(default=True, metadata={
        "help": "with conversion workers: a conversion that finds none running in the service's process runs "
                "there (no hand-over to a worker for a lone cold adapter); only those arriving meanwhile go to "
                "the workers (off: every conversion goes to a worker)"})
    lora_root: str = field(default="", metadata={"help": "folder of named adapters (<root>/<name>/ or <root>/<name>.safetensors)"})
    lora_prefetch_dir: str = field(default="", metadata={"help": "folder of <task_id>/model.lora_{config,weights}.npy loaded at start"})
    model: str = field(default="", metadata={"help": "base model (GGUF, HF folder or config.json) adapters are validated against; default SmolLM2"})
    max_lora_rank: int = field(default=256, metadata={"help": "largest adapter rank accepted"})
    max_message_bytes: int = field(default=64 << 20, metadata={"help": "largest gRPC message; adapters move in chunks below it"})
    chunk_bytes: int = field(default=4 << 20, metadata={"help": "weight bytes per streamed message (below max_message_bytes)"})
    retired_grace_s: float = field(
        default=60.0, metadata={"help": "redis: seconds an evicted or replaced version stays readable for streams already reading it"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 = off)"})
    gil_switch_interval_us: int = field(default=500, metadata={
        "help": "Python thread switch interval while serving, in microseconds (0 = Python's 5000): conversions "
                "of several new adapters at once, the spare maker and the event loop share the GIL"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="text", metadata={"help": "text, or json: one JSON object per line, with "
                                                              "request ids"})

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"log_format: expected text or json, got {self.log_format!r}")
        if self.backend not in ("shm", "redis"):
            raise SettingsError(f"backend: expected shm or redis, got {self.backend!r}")
        if self.host_cache_bytes <= 0:
            raise SettingsError("host_cache_bytes: must be positive")
        if self.gil_switch_interval_us < 0:
            raise SettingsError("gil_switch_interval_us must be >= 0")
        if self.convert_processes < -1:
            raise SettingsError("convert_processes: must be >= 0, or -1 (auto)")
        if self.shm_spare_bytes < 0:
            raise SettingsError("shm_spare_bytes: must be >= 0")
        if not 1 <= self.max_lora_rank <= 1024:
            raise SettingsError("max_lora_rank: must be in 1..1024")
        if self.max_message_bytes < (1 << 20):
            raise SettingsError("max_message_bytes: must be at least 1 MiB")
        if not 4096 <= self.chunk_bytes <= self.max_message_bytes - (64 << 10):
            raise SettingsError(f"chunk_bytes: must be in [4096, max_message_bytes - 64 KiB] "
                                f"({self.max_message_bytes - (64 << 10)}), got {self.chunk_bytes}")
        if self.retired_grace_s < 0:
            raise SettingsError("retired_grace_s: must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError("metrics_port: must be in 0..65535")


def auto_convert_processes(cpus: int) -> int:
    """`--convert-processes -1`: a quarter of the cores, at most 4; none below 8 cores, where the workers
    would take the cores the service and the compute service need (16 cores, H200 host: 16 cold rank-64
    SmolLM2 adapters at once resolved in 0.58-0.60 s with 4 workers against 1.10-1.34 s without)."""
    return 0 if cpus < 8 else min(4, cpus // 4)
