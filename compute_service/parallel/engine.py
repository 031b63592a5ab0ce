"""Builds one rank's engine: the sharded model, the KV cache over its KV heads, its adapter pool."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from compute_service.adapter_cache.backends import lora_backend_for
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.config import ComputeConfig
from compute_service.engine.config import EngineConfig
from compute_service.engine.kv_cache import cuda_kv_budget
from compute_service.engine.llm_engine import LLMEngine, _default_lora
from compute_service.engine.loader import LoadedModel, default_model_path, read_model_source, unpack_on
from compute_service.engine.mlp_order import mlp_order_enabled
from compute_service.engine.model import LlamaModel
from compute_service.engine.quant_formats import keeps_quantized
from compute_service.engine.spec import ModelSpec
from compute_service.engine.weights import build_weights
from compute_service.parallel.group import TensorParallelGroup
from compute_service.parallel.schedule import DriverRunner, ShardedSlots
from compute_service.parallel.shard import Shard, local_spec, shard_for, sharded_source, whole_fingerprint

log = logging.getLogger(__name__)


def load_sharded(path: str | None, group: TensorParallelGroup, dtype: torch.dtype,
                 quantization: str = "auto") -> tuple[LoadedModel, ModelSpec, Shard]:
    """The rank's slices of a HF safetensors folder or a GGUF file (each rank reads only its slices
    where the source can, else one whole tensor at a time, keeping its slice: `sharded_source`). A
    quantized checkpoint's shards stay quantized as `quantization` says (see `quant_formats`); on a GPU
    its tensors are unpacked there, as a single-GPU load does."""
    p = default_model_path() if path is None else Path(path)
    t0 = time.perf_counter()
    spec, get, template = read_model_source(p)
    unpack_on(get, group.device)
    shard = shard_for(spec, group.world_size, group.rank)
    local = local_spec(spec, shard)
    keep = keeps_quantized(quantization, group.device)
    source = sharded_source(spec, shard, get, order_mlp=keep and mlp_order_enabled())
    weights, _ = build_weights(local, source, dtype, group.device, keep_quantized=keep)
    model = LlamaModel(local, weights, spec.max_position_embeddings)
    if group.world_size > 1:
        model.shard_over(group)
    log.info("rank %d/%d: %s sharded (%d of %d heads, %d of %d KV heads) in %.1f s", group.rank,
             group.world_size, p.name, local.num_heads, spec.num_heads, local.num_kv_heads, spec.num_kv_heads,
             time.perf_counter() - t0)
    orders = source.mlp_orders()                  # type: ignore[attr-defined]
    return LoadedModel(local, model, whole_fingerprint(spec, get), p, template, orders), spec, shard


def build_rank_engine(config: EngineConfig, group: TensorParallelGroup,
                      service: ComputeConfig | None = None) -> tuple[LLMEngine, ShardedSlots]:
    """This rank's engine; on rank 0 its runner broadcasts every step to the followers.

    The adapter pool is sized as the engine sizes it (`max_loras` adapters of `max_lora_rank` on every
    module), or with `service` as the compute service sizes its own (`lora_gpu_cache_bytes`, or a
    fraction of the memory left after the KV cache), the smallest over the ranks: pools must mirror.
    """
    if config.torch_device.type != group.device.type:
        raise ValueError(f"engine device {config.device} and the group's {group.device} differ")
    if config.async_scheduling and group.rank == 0:
        log.warning("async scheduling is not supported with tensor parallelism (followers read each step's "
                    "tokens from the host): steps run one after another")
    config = dataclasses.replace(config, device=str(group.device), async_scheduling=False)
    loaded, whole_spec, shard = load_sharded(config.model, group, config.torch_dtype, config.quantization)
    if service is None:
        inner, backend = _default_lora(config, loaded.spec, group.device, loaded.model.dtype)
    else:
        inner = PagedAdapterSlots(loaded.spec, config.max_lora_rank, group.device, loaded.model.dtype)
        backend = lora_backend_for(inner, config.max_num_batched_tokens, config.lora_backend)
    slots = ShardedSlots(inner, whole_spec, shard, loaded.shard_mlp_orders)
    if config.kv_cache_bytes is None and group.device.type == "cuda":
        budget = cuda_kv_budget(group.device, config.gpu_memory_fraction, config.kv_reserve_bytes)
        config = dataclasses.replace(config, kv_cache_bytes=group.min_int(budget))
    engine = LLMEngine(config, loaded, slots=slots, lora_backend=backend)  # type: ignore[arg-type]
    if service is not None:
        from compute_service.build import pool_bytes   # build imports this package lazily; no cycle at import

        layout = inner.allocate(group.min_int(pool_bytes(service, group.device)),
                                service.lora_cache_optimal_adapter_size, service.max_resident_adapters)
        backend.allocate()
        log.info("rank %d: adapter pool of %d pages (%.1f MiB), up to %d resident adapters", group.rank,
                 layout.num_pages, layout.pool_bytes / 2**20, layout.max_slots)
    if group.is_driver and group.world_size > 1:
        engine.runner = DriverRunner(engine.runner, slots, group)  # type: ignore[assignment]
    return engine, slots

