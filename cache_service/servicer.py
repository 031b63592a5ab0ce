"""loraplex.v1.AdapterCache: protobuf <-> domain objects, nothing else.

Backend calls block (shared-memory copies, Redis round trips), so they run in
worker threads; the event loop only moves messages.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import grpc
import numpy as np

from loraplex.cache_client import PROTO_TO_DTYPE, DTYPE_TO_PROTO
from loraplex.errors import InvalidArgumentError
from loraplex.formats.modules import MODULE_NAMES
from loraplex.grpc_errors import maps_errors
from loraplex.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from cache_service.host_cache import HostCache
from cache_service.records import AdapterRecord, SourceEntry
from cache_service.sources import check_name
from cache_service.uploads import UploadClaim

_LOAD_MODES = {common_pb2.LOAD_MODE_AUTO: "auto", common_pb2.LOAD_MODE_ALWAYS: "always",
               common_pb2.LOAD_MODE_NEVER: "never"}


def record_to_header(r: AdapterRecord) -> cache_pb2.AdapterHeader:
    config = r.config_array()
    return cache_pb2.AdapterHeader(
        task_id=r.task_id, name=r.name, version=r.version,
        config=common_pb2.Tensor(dtype=common_pb2.INT32, shape=list(config.shape), data=config.tobytes()),
        weights_dtype=_dtype_proto(r.dtype), weights_shape=list(r.shape), weights_num_bytes=r.num_bytes,
        fingerprint=r.fingerprint, source=r.source, metadata=r.extra,
        row_features=[v for pair in r.in_out for v in pair], original_format=r.original_format)


def _dtype_proto(name: str) -> Any:
    return next(v for k, v in DTYPE_TO_PROTO.items() if str(k) == f"torch.{name}")


def record_to_info(r: AdapterRecord, last_used: float = 0.0) -> common_pb2.AdapterInfo:
    config = r.config_array()
    modules = []
    for module_id in sorted(set(config[:, 0].tolist())):
        ranks = config[config[:, 0] == module_id][:, 2]
        modules.append(common_pb2.AdapterModule(
            module_id=module_id, module_name=MODULE_NAMES.get(module_id, str(module_id)),
            num_layers=len(ranks), min_rank=int(ranks.min()), max_rank=int(ranks.max())))
    return common_pb2.AdapterInfo(task_id=r.task_id, name=r.name, version=r.version, modules=modules,
                                  num_bytes=r.num_bytes, in_host_cache=True, last_used_unix_s=last_used,
                                  source=r.source, dtype=_dtype_proto(r.dtype), max_rank=r.max_rank)


def source_to_info(s: SourceEntry) -> common_pb2.AdapterInfo:
    return common_pb2.AdapterInfo(task_id=s.task_id, name=s.name, source=s.path or s.kind, in_host_cache=False)


def claim_from_header(h: cache_pb2.AdapterHeader) -> UploadClaim:
    dtype = PROTO_TO_DTYPE.get(h.weights_dtype)
    if dtype is None:
        raise InvalidArgumentError(f"weights_dtype {common_pb2.DType.Name(h.weights_dtype) if h.weights_dtype in common_pb2.DType.values() else h.weights_dtype} is not FLOAT16, BFLOAT16 or FLOAT32")
    if h.config.dtype != common_pb2.INT32 or len(h.config.shape) != 2 or h.config.shape[1] != 3:
        raise InvalidArgumentError("config must be an INT32 tensor of shape [N, 3]")
    if len(h.config.data) != h.config.shape[0] * 12:
        raise InvalidArgumentError(f"config data is {len(h.config.data)} bytes, expected {h.config.shape[0] * 12}")
    config = np.frombuffer(h.config.data, dtype=np.int32).reshape(-1, 3).copy()
    return UploadClaim(task_id=h.task_id, config=config, dtype=str(dtype).removeprefix("torch."),
                       shape=tuple(h.weights_shape), num_bytes=h.weights_num_bytes, version=h.version,
                       fingerprint=h.fingerprint, source=h.source or "inline", name=h.name,
                       original_format=h.original_format or "inline", extra=dict(h.metadata))


class AdapterCacheServicer(cache_pb2_grpc.AdapterCacheServicer):
    """Serves one HostCache."""

    def __init__(self, cache: HostCache, *, chunk_bytes: int) -> None:
        self.cache = cache
        self.chunk_bytes = chunk_bytes

    @maps_errors
    async def PutAdapter(self, request_iterator: AsyncIterator[cache_pb2.PutAdapterRequest],
                         context: grpc.aio.ServicerContext) -> cache_pb2.PutAdapterResponse:
        upload = None
        replace = False
        try:
            async for req in request_iterator:
                part = req.WhichOneof("part")
                if upload is None:
                    if part != "header":
                        raise InvalidArgumentError("the first PutAdapter message must carry the header")
                    if req.header.name:
                        check_name(req.header.name)
                    replace = req.replace
                    upload = await asyncio.to_thread(self.cache.begin_upload, claim_from_header(req.header))
                elif part == "chunk":
                    upload.write(req.chunk)
                else:
                    raise InvalidArgumentError("only the first PutAdapter message may carry a header")
            if upload is None:
                raise InvalidArgumentError("PutAdapter stream was empty (send a header, then the weight bytes)")
        except BaseException:
            if upload is not None:
                upload.abort()
            raise
        outcome = await asyncio.to_thread(self.cache.finish_upload, upload, replace=replace)
        return cache_pb2.PutAdapterResponse(adapter=record_to_info(outcome.record, time.time()),
                                            evicted=outcome.evicted)

    @maps_errors
    async def GetAdapter(self, request: cache_pb2.GetAdapterRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[cache_pb2.GetAdapterResponse]:
        started = time.perf_counter()
        reader = await asyncio.to_thread(self.cache.get, request.task_id, request.version or None)
        try:
            yield cache_pb2.GetAdapterResponse(header=record_to_header(reader.record))
            location = reader.shm_location
            if request.allow_shared_memory and location is not None:
                yield cache_pb2.GetAdapterResponse(shm=cache_pb2.SharedMemoryLocation(
                    segment_name=location[0], offset=location[1], num_bytes=reader.record.num_bytes))
                # The client maps it by name; if it is evicted before that, the
                # client's shm_open fails and it asks again for chunks.
                return
            chunks = reader.chunks(self.chunk_bytes)
            while True:
                chunk = await asyncio.to_thread(next, chunks, None)
                if chunk is None:
                    break
                yield cache_pb2.GetAdapterResponse(chunk=bytes(chunk))
        finally:
            reader.close()
            self.cache.metrics.get_seconds.observe(time.perf_counter() - started)

    @maps_errors
    async def HasAdapter(self, request, context):  # type: ignore[no-untyped-def]
        version = await asyncio.to_thread(self.cache.has, request.task_id)
        return cache_pb2.HasAdapterResponse(present=version is not None, version=version or "")

    @maps_errors
    async def EvictAdapter(self, request, context):  # type: ignore[no-untyped-def]
        task_id = request.task_id if request.HasField("task_id") else None
        evicted = await asyncio.to_thread(self.cache.evict, task_id, request.name, request.forget_name)
        return cache_pb2.EvictAdapterResponse(evicted=evicted)

    @maps_errors
    async def ListAdapters(self, request, context):  # type: ignore[no-untyped-def]
        cached, named, stats = await asyncio.to_thread(self.cache.listing)
        infos = [record_to_info(a.record, a.last_used_unix_s) for a in cached] + [source_to_info(s) for s in named]
        return cache_pb2.ListAdaptersResponse(adapters=infos, bytes_used=stats.bytes_used,
                                              bytes_total=stats.bytes_total, hits=stats.hits,
                                              misses=stats.misses, evictions=stats.evictions)

    @maps_errors
    async def ResolveName(self, request, context):  # type: ignore[no-untyped-def]
        mode = _LOAD_MODES.get(request.load_mode)
        if mode is None:
            raise InvalidArgumentError(f"unknown load_mode {request.load_mode}")
        task_id, version = await asyncio.to_thread(self.cache.resolve_name, request.name, mode)
        return cache_pb2.ResolveNameResponse(task_id=task_id, version=version)

    @maps_errors
    async def LoadPath(self, request, context):  # type: ignore[no-untyped-def]
        task_id = request.task_id if request.HasField("task_id") else None
        outcome = await asyncio.to_thread(self.cache.load_path, request.path, task_id, request.name, request.replace)
        return cache_pb2.LoadPathResponse(adapter=record_to_info(outcome.record, time.time()))

    @maps_errors
    async def GetCacheInfo(self, request, context):  # type: ignore[no-untyped-def]
        c = self.cache
        return cache_pb2.GetCacheInfoResponse(fingerprint=c.fingerprint, bytes_total=c.backend.budget_bytes,
                                              backend=c.backend.kind, max_lora_rank=c.max_lora_rank)
