"""The aio gRPC server of cache_service: builds the cache, serves, cleans up on SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import sys

import grpc

from loraplex.errors import LoraplexError
from loraplex.formats import AdapterError, ModelSpec
from loraplex.host_limits import usable_cpus
from loraplex.model_files import resolve_model_path
from loraplex.serving import run_server
from loraplex.v1 import cache_pb2_grpc
from cache_service.backend import CacheBackend
from cache_service.config import CacheConfig, auto_convert_processes
from cache_service.convert_procs import ConvertProcesses
from cache_service.host_cache import HostCache
from cache_service.servicer import AdapterCacheServicer

log = logging.getLogger(__name__)


def make_backend(config: CacheConfig, fingerprint: str) -> CacheBackend:
    if config.backend == "redis":
        from cache_service.redis_backend import RedisBackend

        return RedisBackend(config.redis_url, config.host_cache_bytes, fingerprint,
                            prefix=config.redis_prefix, retired_grace_s=config.retired_grace_s)
    from cache_service.shm_backend import ShmBackend
    from cache_service.shm_segments import sweep_dead_owners

    removed = sweep_dead_owners()
    if removed:
        log.warning("removed %d shared-memory segments left by a cache service that died: %s",
                    len(removed), ", ".join(removed[:5]))
    return ShmBackend(config.host_cache_bytes, spare_bytes=config.shm_spare_bytes)


def build_cache(config: CacheConfig) -> HostCache:
    """The base model's spec, the backend and the cache (nothing served yet)."""
    spec = ModelSpec.from_path(resolve_model_path(config.model))
    backend = make_backend(config, spec.fingerprint)
    convert = None
    workers = config.convert_processes
    if workers < 0:
        workers = auto_convert_processes(usable_cpus())        # the container's CPU quota included
    if workers and backend.kind == "shm":
        convert = ConvertProcesses(workers, local_first=config.convert_local_first)
        log.info("converting never-seen PEFT adapters in %d worker processes (--convert-processes)", workers)
    elif workers and config.convert_processes > 0:
        log.info("--convert-processes: the redis backend converts in the service's process (workers need "
                 "shared memory)")
    return HostCache(backend, spec, max_lora_rank=config.max_lora_rank, lora_root=config.lora_root,
                     lora_prefetch_dir=config.lora_prefetch_dir, convert=convert)


async def serve(config: CacheConfig) -> None:
    """Serves loraplex.v1.AdapterCache on `config.listen` until SIGTERM; shm segments are unlinked on the way out."""
    if config.gil_switch_interval_us > 0:
        sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
    try:
        cache = build_cache(config)
    except (LoraplexError, AdapterError) as exc:
        print(f"loraplex cache_service: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        try:
            await asyncio.to_thread(cache.start)
        except (LoraplexError, AdapterError) as exc:
            print(f"loraplex cache_service: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        if config.metrics_port:
            cache.metrics.serve(config.metrics_port)
            log.info("metrics on :%d/metrics", config.metrics_port)
        log.info("host cache: backend %s, budget %d bytes, base model fingerprint %s",
                 config.backend, config.host_cache_bytes, cache.fingerprint)

        def register(server: grpc.aio.Server) -> list[str]:
            servicer = AdapterCacheServicer(cache, chunk_bytes=config.chunk_bytes)
            cache_pb2_grpc.add_AdapterCacheServicer_to_server(servicer, server)
            return ["loraplex.v1.AdapterCache"]

        await run_server("cache_service", config.listen, register, max_message_bytes=config.max_message_bytes)
    finally:
        cache.close()
