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
    quantization: str = field(default="auto", metadata={
        "help": "a quantized checkpoint (AWQ, GPTQ, compressed-tensors, GGUF Q4_0/Q4_1/Q8_0): auto (kept quantized "
                "on a GPU when its projections take 1 GiB or more in 16 bits, else dequantized, as on the CPU), "
                "keep (quantized on the CPU too: a slow reference path) or none (dequantized to --dtype "
                "everywhere)"})
    max_lora_rank: int = field(default=256, metadata={"help": "largest adapter rank accepted"})
    lora_gpu_memory_fraction: float = field(
        default=0.05, metadata={"help": "adapter pool as a fraction of memory free after weights and KV cache"})
    lora_gpu_cache_bytes: int = field(default=0, metadata={"help": "adapter pool size in bytes (overrides the fraction)"})
    lora_cache_optimal_adapter_size: int = field(
        default=8, metadata={"help": "rank rows of the widest module per adapter page (the seed's page sizing)"})
    max_resident_adapters: int = field(
        default=0, metadata={"help": "most adapters resident at once (0 = as many as pages and row tables allow)"})
    gil_switch_interval_us: int = field(
        default=500, metadata={"help": "Python thread switch interval while serving, in microseconds (0 = Python's "
                                       "5000): short, so adapter loads in side threads do not hold up engine steps"})
    step_handoff: str = field(default="read", metadata={
        "help": "when the engine thread hands a step's tokens to the event loop: launch (once the next step's GPU "
                "work is queued, so the two threads' Python does not interleave), read (once the next step is "
                "about to wait for its tokens) or step_end (at once)"})
    async_scheduling: bool | None = field(default=None, metadata={
        "help": "overlapped decode steps: queue step N+1 before reading step N's tokens back, so the engine's "
                "host work runs while the GPU computes (default: on with a GPU, off on the CPU where there is "
                "nothing to overlap; --no-async-scheduling for plain steps; not with --tensor-parallel-size)"})
    engine_process: str = field(default="auto", metadata={
        "help": "on: run the engine in a child process and only the gRPC side in this one, so the two do not "
                "share one GIL; auto (default): on with a GPU and one process, off on the CPU and with "
                "--tensor-parallel-size (not supported there yet); off: one process"})
    step_trace: str = field(default="", metadata={
        "help": "file to write every engine step's host start and end times to at shutdown (benchmarks)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes (GPUs, or CPU processes) the model is split over (tensor parallelism; "
                "see docs/tensor_parallel.md)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in a batch"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "most tokens in one step (prefill is chunked)"})
    max_model_len: int = field(default=2048, metadata={"help": "longest prompt + output"})
    kv_cache_bytes: int = field(default=0, metadata={"help": "KV cache size in bytes (0 = from gpu_memory_utilization, or 256 MiB on CPU)"})
    gpu_memory_utilization: float = field(default=0.85, metadata={"help": "fraction of the GPU memory free after the weights for the KV cache and a fixed-size adapter pool (--lora-gpu-cache-bytes)"})
    max_message_bytes: int = field(default=64 << 20, metadata={"help": "largest gRPC message"})
    warmup: str = field(default="auto", metadata={
        "help": "start-up warm-up before health says SERVING: full (compile every kernel a request can launch, "
                "capture the decode graphs, run real requests), light (graphs and real requests only), off "
                "(graphs only), auto (full on a GPU, light on the CPU)"})
    warmup_threads: int = field(default=0, metadata={"help": "threads compiling kernels during warm-up (0 = "
                                                           "one per CPU core, up to 16)"})
    compile_processes: int = field(default=0, metadata={
        "help": "at a cold start (no kernels in Triton's cache), processes compiling the kernels (0 = one per "
                "CPU core but one, up to 16; -1 = none, the warm-up threads compile)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 = off)"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="text", metadata={"help": "text, or json: one JSON object per line, with "
                                                              "request ids"})

    def uses_engine_process(self, device_type: str) -> bool:
        """Whether the engine runs in a child process, for an engine on `device_type` ("cuda" or "cpu")."""
        if self.engine_process == "auto":
            return device_type == "cuda" and self.tensor_parallel_size == 1
        return self.engine_process == "on"

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"log_format: expected text or json, got {self.log_format!r}")
        if not 0.0 < self.lora_gpu_memory_fraction < 1.0:
            raise SettingsError("lora_gpu_memory_fraction: must be in (0, 1)")
        if self.lora_cache_optimal_adapter_size < 1 or self.max_resident_adapters < 0:
            raise SettingsError("lora_cache_optimal_adapter_size must be >= 1 and max_resident_adapters >= 0")
        if self.gil_switch_interval_us < 0:
            raise SettingsError("gil_switch_interval_us must be >= 0")
        if self.lora_gpu_cache_bytes < 0 or not 1 <= self.max_lora_rank <= 4096:
            raise SettingsError("lora_gpu_cache_bytes must be >= 0 and max_lora_rank in [1, 4096]")
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError("metrics_port: must be in 0..65535")
        if self.tensor_parallel_size < 1:
            raise SettingsError("tensor_parallel_size must be >= 1")
        if self.engine_process not in ("auto", "on", "off"):
            raise SettingsError(f"engine_process: expected auto, on or off, got {self.engine_process!r}")
        if self.engine_process == "on" and self.tensor_parallel_size > 1:
            raise SettingsError("engine_process on is not supported with tensor_parallel_size > 1 yet "
                                "(rank 0 serves gRPC in its own process)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise SettingsError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")
        if self.warmup not in ("auto", "full", "light", "off") or self.warmup_threads < 0 \
                or self.compile_processes < -1:
            raise SettingsError(f"warmup: expected auto, full, light or off, got {self.warmup!r}; "
                                "warmup_threads must be >= 0, compile_processes >= -1")
        if self.step_handoff not in ("launch", "read", "step_end"):
            raise SettingsError(f"step_handoff: expected launch, read or step_end, got {self.step_handoff!r}")
        if self.quantization not in ("auto", "keep", "none"):
            raise SettingsError(f"quantization: expected auto, keep or none, got {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise SettingsError(f"dtype: expected auto, float32, float16 or bfloat16, got {self.dtype!r}")
