"""Builds the compute runtime from ComputeConfig: model, KV cache, paged adapter pool, runner.

Order matters: weights, then the KV cache (inside the engine), then the
adapter pool, sized from what is left (`lora_gpu_memory_fraction` of the free
GPU memory, as the seed's `lora_cache_gpu_memory_fraction`) unless
`lora_gpu_cache_bytes` fixes it. On CPU the fraction applies to a nominal
4 GiB, so a laptop does not give a quarter of its RAM to adapters.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from compute_service.adapter_cache.loader import Fetch
from compute_service.adapter_cache.backends import lora_backend_for
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.config import ComputeConfig
from compute_service.engine.config import EngineConfig
from compute_service.engine.llm_engine import LLMEngine
from compute_service.engine.loader import LoadedModel, load_model
from compute_service.engine.quant_formats.summary import describe_projections
from compute_service.runner import EngineRunner
from loraplex.formats import AdapterError, ModelSpec
from loraplex.v1 import common_pb2

log = logging.getLogger(__name__)
CPU_NOMINAL_BYTES = 4 << 30
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class Runtime:
    engine: LLMEngine
    slots: PagedAdapterSlots
    runner: EngineRunner
    loaded: LoadedModel
    device: torch.device

    def model_info(self) -> common_pb2.ModelInfo:
        """The served model as GetModelInfo reports it."""
        spec, loaded = self.engine.spec, self.loaded
        return common_pb2.ModelInfo(
            model_name=spec.name or loaded.path.name, architecture=_ARCH.get(spec.architecture, spec.architecture),
            fingerprint=self.slots.fingerprint or loaded.fingerprint, num_layers=spec.num_layers,
            hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
            max_model_len=self.engine.max_model_len, max_lora_rank=self.slots.max_lora_rank,
            lora_module_ids=[0, 1, 2, 3, 4, 5, 6, 7], dtype=str(loaded.model.dtype).removeprefix("torch."),
            device=str(self.device), tokenizer=str(loaded.path),
            eos_token_id=spec.eos_token_id if spec.eos_token_id is not None else 0,
            weights=describe_projections(loaded.model.weights, loaded.model.dtype))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def engine_config(config: ComputeConfig, device: torch.device) -> EngineConfig:
    return EngineConfig(
        model=config.model or None, device=str(device), dtype=config.dtype, quantization=config.quantization,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, kv_cache_bytes=config.kv_cache_bytes or None,
        gpu_memory_fraction=config.gpu_memory_utilization, max_lora_rank=config.max_lora_rank,
        lora_backend="kernels", async_scheduling=config.async_scheduling,
        # A pool of a fixed size comes out of the same share as the KV cache (a fractional one is sized
        # from what the KV cache leaves): KV + pool stay within gpu_memory_utilization of the free memory.
        kv_reserve_bytes=config.lora_gpu_cache_bytes if device.type == "cuda" else 0)


def pool_bytes(config: ComputeConfig, device: torch.device) -> int:
    if config.lora_gpu_cache_bytes:
        return config.lora_gpu_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.lora_gpu_memory_fraction)
    return int(CPU_NOMINAL_BYTES * config.lora_gpu_memory_fraction)


def adapter_fingerprint(loaded: LoadedModel) -> str | None:
    """The fingerprint the host cache validates adapters against, computed the same way (from the model's
    shapes), so both services agree on which adapters fit; None when the files cannot be read that way.

    A GGUF's shapes are already in `loaded.spec`, read from the same header fields: reading the file's
    header a second time would cost a second or two of start-up.
    """
    if loaded.path.suffix == ".gguf":
        s = loaded.spec
        return ModelSpec(num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_heads,
                         num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                         intermediate_size=s.intermediate_size, vocab_size=s.vocab_size,
                         model_type=s.architecture).fingerprint
    try:
        return ModelSpec.from_path(loaded.path).fingerprint
    except (AdapterError, OSError, ValueError, KeyError) as exc:
        log.warning("no adapter fingerprint for %s (%s): adapters are checked by shape only", loaded.path, exc)
        return None


def zero_kv_cache(engine: LLMEngine) -> None:
    """Zeroes the KV cache once: attention pads its gathers with unwritten slots, masked out, but a NaN
    left there by an earlier owner of the memory would still poison the masked product."""
    for k, v in engine.runner.kv_caches:
        k.zero_()
        v.zero_()


def build_runtime(config: ComputeConfig, fetch: Fetch, loaded: LoadedModel | None = None,
                  capture_graphs: bool = True) -> Runtime:
    """Loads the model (unless given) and wires engine, pool and runner (call `runner.start()`).

    `capture_graphs=False` leaves the decode graphs to `compute_service.warmup`, which compiles the
    kernels on many threads first and then captures.
    """
    marks = [("", time.perf_counter())]

    def mark(what: str) -> None:
        marks.append((what, time.perf_counter()))

    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.empty(0, device=device)          # the CUDA context, timed on its own
        mark("CUDA context")
    ecfg = engine_config(config, device)
    if config.tensor_parallel_size > 1:
        return _tensor_parallel_runtime(config, fetch, ecfg, device)
    if loaded is None:
        loaded = load_model(ecfg.model, dtype=ecfg.torch_dtype, device=device, quantization=ecfg.quantization)
        mark("model")
    slots = PagedAdapterSlots(loaded.spec, config.max_lora_rank, device, loaded.model.dtype)
    slots.fingerprint = adapter_fingerprint(loaded)
    backend = lora_backend_for(slots, config.max_num_batched_tokens)   # Triton on CUDA, torch matmuls on CPU
    engine = LLMEngine(ecfg, loaded, None, slots, backend)
    if engine.overlap:
        log.info("overlapped decode steps (--async-scheduling, the default with a GPU): each decode step is "
                 "queued before the previous one's tokens are read back")
    zero_kv_cache(engine)
    mark("engine and KV cache")
    layout = slots.allocate(pool_bytes(config, device), config.lora_cache_optimal_adapter_size,
                            config.max_resident_adapters)
    log.info("adapter pool: %d pages of %d bytes (%.1f MiB), up to %d resident adapters",
             layout.num_pages, layout.page_bytes, layout.pool_bytes / 2**20, layout.max_slots)
    backend.allocate()
    mark("adapter pool")
    log.info("runtime built in %.1f s (%s)", marks[-1][1] - marks[0][1],
             ", ".join(f"{what} {t - prev:.1f} s" for (_, prev), (what, t) in zip(marks, marks[1:])))
    graphs = engine.runner.graphs
    if graphs is not None and capture_graphs:
        # Every decode bucket, base and with adapters, now: before the runner starts loading adapters
        # on other threads, and after every buffer the graphs read has its final address.
        t0 = time.perf_counter()
        graphs.capture_all(backend)
        log.info("captured %d decode CUDA graphs in %.1f s", len(graphs.buckets) * 2, time.perf_counter() - t0)
    return Runtime(engine, slots, runner_for(config, engine, slots, fetch), loaded, device)


def runner_for(config: ComputeConfig, engine: LLMEngine, slots: PagedAdapterSlots, fetch: Fetch) -> EngineRunner:
    return EngineRunner(engine, slots, fetch, handoff=config.step_handoff,
                        trace_path=config.step_trace)


def _tensor_parallel_runtime(config: ComputeConfig, fetch: Fetch, ecfg: EngineConfig,
                             device: torch.device) -> Runtime:
    """Rank 0 of a tensor-parallel group (see compute_service/parallel/service.py)."""
    from compute_service.parallel.service import build_rank0_engine

    engine, slots = build_rank0_engine(config, ecfg)
    slots.fingerprint = adapter_fingerprint(dataclasses.replace(engine.loaded, spec=slots.spec))
    return Runtime(engine, slots, runner_for(config, engine, slots, fetch), engine.loaded, device)
