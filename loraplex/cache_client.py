"""Async client of the host adapter cache (loraplex.v1.AdapterCache), free of protobuf for callers.

The gateway and the compute service use it; it imports no service. Errors
come back as `loraplex.errors` exceptions chosen by status code (NotFoundError,
UnavailableError, ...), each keeping its `grpc_code` so a servicer that lets
one through answers with the same status.

Shared memory: when the cache runs the `shm` backend on this host,
`get_adapter` maps the adapter's segment read-only-shared / copy-on-write
(private) instead of copying bytes through gRPC. It attaches with
`shm_open` + `mmap` directly, not `multiprocessing.shared_memory`, whose
resource tracker would unlink the service's segment when this process exits
or crashes. A segment that cannot be opened (another host, or just evicted)
falls back to chunks.
"""
from __future__ import annotations

import asyncio
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import AsyncIterator, NamedTuple

import grpc
import numpy as np
import torch

from loraplex import errors
from loraplex.channels import channel_options
from loraplex.formats.adapter import Adapter, AdapterMetadata
from loraplex.v1 import cache_pb2, cache_pb2_grpc, common_pb2

DTYPE_TO_PROTO = {torch.float32: common_pb2.FLOAT32, torch.float16: common_pb2.FLOAT16,
                  torch.bfloat16: common_pb2.BFLOAT16}
PROTO_TO_DTYPE = {v: k for k, v in DTYPE_TO_PROTO.items()}
_NAME_TO_PROTO = {str(k).removeprefix("torch."): v for k, v in DTYPE_TO_PROTO.items()}
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
_SHM_MAGIC = b"LPXSHM01"
_SHM_HEADER = struct.Struct("<8s32sQQ")  # must match cache_service/shm_segments.py


@dataclass(frozen=True)
class ModuleSummary:
    module_id: int
    module_name: str
    num_layers: int
    min_rank: int
    max_rank: int


@dataclass(frozen=True)
class CachedAdapter:
    """What the cache knows about one adapter (mirrors loraplex.v1.AdapterInfo)."""

    task_id: int
    name: str
    version: str
    num_bytes: int
    in_host_cache: bool
    last_used_unix_s: float
    source: str
    dtype: str
    max_rank: int
    modules: tuple[ModuleSummary, ...] = ()

    @classmethod
    def from_proto(cls, info: common_pb2.AdapterInfo) -> "CachedAdapter":
        dtype = PROTO_TO_DTYPE.get(info.dtype)
        return cls(info.task_id, info.name, info.version, info.num_bytes, info.in_host_cache,
                   info.last_used_unix_s, info.source, str(dtype).removeprefix("torch.") if dtype else "",
                   info.max_rank, tuple(ModuleSummary(m.module_id, m.module_name, m.num_layers, m.min_rank,
                                                      m.max_rank) for m in info.modules))

    def to_proto(self) -> common_pb2.AdapterInfo:
        """For a service that forwards it (the gateway's ListLoras)."""
        return common_pb2.AdapterInfo(
            task_id=self.task_id, name=self.name, version=self.version, num_bytes=self.num_bytes,
            in_host_cache=self.in_host_cache, last_used_unix_s=self.last_used_unix_s, source=self.source,
            dtype=_NAME_TO_PROTO.get(self.dtype, common_pb2.DTYPE_UNSPECIFIED),
            max_rank=self.max_rank,
            modules=[common_pb2.AdapterModule(module_id=m.module_id, module_name=m.module_name,
                                              num_layers=m.num_layers, min_rank=m.min_rank, max_rank=m.max_rank)
                     for m in self.modules])


@dataclass(frozen=True)
class PutResult:
    adapter: CachedAdapter
    evicted: list[int] = field(default_factory=list)  # task ids pushed out to make room


@dataclass(frozen=True)
class CacheListing:
    adapters: list[CachedAdapter]  # cached ones (most recently used first), then named ones not cached
    bytes_used: int
    bytes_total: int
    hits: int
    misses: int
    evictions: int


class ResolvedName(NamedTuple):
    task_id: int
    version: str


@dataclass(frozen=True)
class CacheInfo:
    fingerprint: str
    bytes_total: int
    backend: str
    max_lora_rank: int


def error_from_rpc(exc: grpc.aio.AioRpcError | grpc.RpcError) -> errors.LoraplexError:
    """A status from the cache -> the matching domain exception (message kept)."""
    code = exc.code()
    cls = errors.BY_GRPC_CODE.get(code)
    err = cls(exc.details()) if cls is not None else errors.LoraplexError(f"host cache: {exc.details()}")
    if cls is None:
        err.grpc_code = code  # DEADLINE_EXCEEDED, CANCELLED, INTERNAL ... propagate as they are
    return err


def adapter_header(adapter: Adapter, task_id: int, name: str = "", *, with_version: bool = True
                   ) -> cache_pb2.AdapterHeader:
    """An adapter's header message (everything but the weight bytes).

    `with_version` hashes the weights (a full pass over them) so the receiver
    can check it got the same bytes; without it the receiver computes the version.
    """
    config = np.ascontiguousarray(adapter.config, dtype=np.int32)
    meta = adapter.metadata
    return cache_pb2.AdapterHeader(
        task_id=task_id, name=name, version=adapter.content_hash if with_version else "",
        config=common_pb2.Tensor(dtype=common_pb2.INT32, shape=list(config.shape), data=config.tobytes()),
        weights_dtype=DTYPE_TO_PROTO[adapter.weights.dtype], weights_shape=list(adapter.weights.shape),
        weights_num_bytes=adapter.num_bytes, fingerprint=meta.fingerprint, source=meta.source,
        metadata=dict(meta.extra), row_features=[v for pair in adapter.in_out for v in pair],
        original_format=meta.original_format)


def adapter_from_header(header: cache_pb2.AdapterHeader, data: object, offset: int = 0) -> Adapter:
    """Header + a buffer holding the weight bytes at `offset` (not copied) -> Adapter."""
    dtype = PROTO_TO_DTYPE.get(header.weights_dtype)
    if dtype is None or header.config.dtype != common_pb2.INT32:
        raise errors.InvalidArgumentError("adapter header has an unknown weights dtype or a non-int32 config")
    shape = tuple(header.weights_shape)
    weights = torch.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset).view(*shape)
    config = np.frombuffer(header.config.data, dtype=np.int32).reshape(tuple(header.config.shape)).copy()
    rf = list(header.row_features)
    meta = AdapterMetadata(source=header.source, fingerprint=header.fingerprint,
                           original_format=header.original_format, extra=dict(header.metadata))
    return Adapter(config=config, weights=weights, in_out=tuple(zip(rf[0::2], rf[1::2])), metadata=meta)


def map_shared_segment(loc: cache_pb2.SharedMemoryLocation, header: cache_pb2.AdapterHeader) -> mmap.mmap:
    """Maps a cache segment privately (copy-on-write); OSError/ValueError when it is not the expected one."""
    import _posixshmem  # CPython's shm_open; no resource tracker involved

    fd = _posixshmem.shm_open("/" + loc.segment_name, os.O_RDONLY, mode=0)
    try:
        size = os.fstat(fd).st_size
        if size < loc.offset + loc.num_bytes or loc.num_bytes != header.weights_num_bytes:
            raise ValueError(f"segment {loc.segment_name} is {size} bytes, too small for the adapter")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    magic, version, task_id, num_bytes = _SHM_HEADER.unpack(mm[:_SHM_HEADER.size])
    if (magic, version.rstrip(b"\0").decode("ascii", "replace"), task_id, num_bytes) != \
            (_SHM_MAGIC, header.version, header.task_id, header.weights_num_bytes):
        mm.close()
        raise ValueError(f"segment {loc.segment_name} does not hold task {header.task_id} version {header.version}")
    return mm


class CacheClient:
    """Async client; create it inside the event loop that uses it, `await close()` at the end."""

    def __init__(self, target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.target = target
        self.chunk_bytes = min(chunk_bytes, max_message_bytes - (64 << 10))
        self._channel = grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes))
        self._stub = cache_pb2_grpc.AdapterCacheStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def connect(self, timeout_s: float) -> bool:
        """Opens the connection now (the channel is lazy), so the first call does not wait for it; False
        when the cache did not answer within `timeout_s` (calls then connect as they come)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def __aenter__(self) -> "CacheClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def put_adapter(self, adapter: Adapter, task_id: int, *, name: str = "", replace: bool = False,
                          verify: bool = False, timeout_s: float | None = None) -> PutResult:
        """Stores `adapter` under `task_id` (validated by the cache against its base model).

        The cache computes the version (content hash) and returns it; `verify`
        also hashes here and has the cache refuse bytes that do not match.
        """
        header = adapter_header(adapter, task_id, name, with_version=verify)
        data = adapter.weights.contiguous().reshape(-1).view(torch.uint8).numpy().data
        chunk = self.chunk_bytes

        async def requests() -> AsyncIterator[cache_pb2.PutAdapterRequest]:
            yield cache_pb2.PutAdapterRequest(header=header, replace=replace)
            for start in range(0, len(data), chunk):
                yield cache_pb2.PutAdapterRequest(chunk=bytes(data[start:start + chunk]))

        try:
            resp = await self._stub.PutAdapter(requests(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return PutResult(CachedAdapter.from_proto(resp.adapter), list(resp.evicted))

    async def get_adapter(self, task_id: int, version: str | None = None, allow_shm: bool = True,
                          timeout_s: float | None = None) -> Adapter:
        """The adapter (counts as a use); mapped from shared memory when the segment is local."""
        if allow_shm:
            adapter = await self._get(task_id, version, True, timeout_s)
            if adapter is not None:
                return adapter
        adapter = await self._get(task_id, version, False, timeout_s)
        assert adapter is not None
        return adapter

    async def _get(self, task_id: int, version: str | None, shm: bool, timeout_s: float | None) -> Adapter | None:
        call = self._stub.GetAdapter(cache_pb2.GetAdapterRequest(
            task_id=task_id, version=version or "", allow_shared_memory=shm), timeout=timeout_s)
        header: cache_pb2.AdapterHeader | None = None
        buf: bytearray | None = None
        received = 0
        try:
            async for msg in call:
                part = msg.WhichOneof("part")
                if part == "header":
                    header = msg.header
                elif part == "shm" and header is not None:
                    try:
                        mm = map_shared_segment(msg.shm, header)
                    except (OSError, ValueError):
                        call.cancel()
                        return None  # not local, or gone since: ask for chunks
                    return adapter_from_header(header, mm, msg.shm.offset)
                elif part == "chunk" and header is not None:
                    if buf is None:
                        buf = bytearray(header.weights_num_bytes)
                    buf[received:received + len(msg.chunk)] = msg.chunk
                    received += len(msg.chunk)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        if header is None or buf is None or received != header.weights_num_bytes:
            raise errors.UnavailableError(f"host cache at {self.target} ended the stream of task id "
                                          f"{task_id} after {received} bytes")
        return adapter_from_header(header, buf)

    async def has(self, task_id: int) -> str | None:
        """The cached version, or None; not a use."""
        resp = await self._unary(self._stub.HasAdapter, cache_pb2.HasAdapterRequest(task_id=task_id))
        return resp.version if resp.present else None

    async def evict(self, task_id: int | None = None, *, name: str = "", forget_name: bool = False) -> bool:
        req = cache_pb2.EvictAdapterRequest(name=name, forget_name=forget_name)
        if task_id is not None:
            req.task_id = task_id
        return (await self._unary(self._stub.EvictAdapter, req)).evicted

    async def list(self) -> CacheListing:
        r = await self._unary(self._stub.ListAdapters, cache_pb2.ListAdaptersRequest())
        return CacheListing([CachedAdapter.from_proto(a) for a in r.adapters], r.bytes_used, r.bytes_total,
                            r.hits, r.misses, r.evictions)

    async def resolve_name(self, name: str, load_mode: str = "auto") -> ResolvedName:
        """name -> (task id, version); load_mode 'auto' | 'always' | 'never' (llgtrt's)."""
        modes = {"auto": common_pb2.LOAD_MODE_AUTO, "always": common_pb2.LOAD_MODE_ALWAYS,
                 "never": common_pb2.LOAD_MODE_NEVER}
        if load_mode not in modes:
            raise errors.InvalidArgumentError(f"load_mode must be one of {sorted(modes)}, got {load_mode!r}")
        r = await self._unary(self._stub.ResolveName, cache_pb2.ResolveNameRequest(name=name, load_mode=modes[load_mode]))
        return ResolvedName(r.task_id, r.version)

    async def load_path(self, path: str, *, task_id: int | None = None, name: str = "",
                        replace: bool = False) -> CachedAdapter:
        """Loads a server-side adapter under the cache's --lora-root."""
        req = cache_pb2.LoadPathRequest(path=path, name=name, replace=replace)
        if task_id is not None:
            req.task_id = task_id
        return CachedAdapter.from_proto((await self._unary(self._stub.LoadPath, req)).adapter)

    async def info(self) -> CacheInfo:
        r = await self._unary(self._stub.GetCacheInfo, cache_pb2.GetCacheInfoRequest())
        return CacheInfo(r.fingerprint, r.bytes_total, r.backend, r.max_lora_rank)

    async def _unary(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
