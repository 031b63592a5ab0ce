"""loraplex.v1.Gateway: protobuf <-> the gateway's domain pieces.

Generate: validate, tokenize, resolve each entry's adapter, run one compute
stream per entry (`gateway.generation`). LoadLora/UnloadLora/ListLoras go to
the host cache (and tell compute to drop unloaded adapters); GetModelInfo asks
compute. `@maps_errors` turns domain exceptions into precise statuses.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Sequence

import grpc

from loraplex.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, UnavailableError
from loraplex.grpc_errors import maps_errors
from loraplex.v1 import common_pb2, compute_pb2, gateway_pb2, gateway_pb2_grpc
from gateway.adapters import AdapterResolver, AdapterStore
from gateway.auth import current_principal
from gateway.config import GatewayConfig
from gateway.downstream import DownstreamError, from_rpc_error
from gateway.generation import Entry, EntryJob, run_entries
from gateway.requests import (REQUEST_ID_KEY, PromptCodec, check_loras, check_prompt_length, check_sampling,
                              take_request_id)
from gateway.router import ComputeRouter, until_connected_timeout

log = logging.getLogger(__name__)

# A deadline further away than this is treated as none (grpc reports "no deadline" as a huge number).
_NO_DEADLINE_S = 1e8


def _metadata_request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str):
            return value
    return ""


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The public API over the host cache and the compute router."""

    def __init__(self, config: GatewayConfig, codec: PromptCodec, store: AdapterStore,
                 resolver: AdapterResolver, router: ComputeRouter) -> None:
        self._config = config
        self._codec = codec
        self._store = store
        self._resolver = resolver
        self._router = router
        self._model_info: common_pb2.ModelInfo | None = None
        self._model_info_lock = asyncio.Lock()

    @property
    def codec(self) -> PromptCodec:
        return self._codec

    @property
    def config(self) -> GatewayConfig:
        return self._config

    async def model_info(self) -> common_pb2.ModelInfo:
        """The compute service's model description, asked once and kept."""
        async with self._model_info_lock:
            if self._model_info is None:
                # replicas serve the same model: the first one that answers will do
                failure: Exception = UnavailableError("no compute replica is known (see --compute-addresses)")
                for replica in self._router.replicas():
                    timeout_s, wait = until_connected_timeout(replica, self._config.downstream_timeout_s)
                    try:
                        resp = await replica.stub.GetModelInfo(compute_pb2.ComputeModelInfoRequest(),
                                                               timeout=timeout_s, wait_for_ready=wait)
                    except grpc.aio.AioRpcError as exc:
                        failure = from_rpc_error(exc, "compute", replica.address)
                        if wait and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                            failure = DownstreamError(grpc.StatusCode.UNAVAILABLE, (
                                f"the compute service at {replica.address} is unavailable (no connection in "
                                f"{timeout_s:.0f} s); start it or point the gateway at a running one"))
                        continue
                    self._model_info = resp.model
                    break
                else:
                    raise failure
            return self._model_info

    def _check_size(self, request: gateway_pb2.GenerateRequest | gateway_pb2.LoadLoraRequest) -> None:
        size = request.ByteSize()
        limit = self._config.max_message_bytes
        if size > limit:
            raise ResourceExhaustedError(
                f"the request is {size} bytes, over the gateway's limit of {limit} bytes "
                f"(max_message_bytes: raise it with --max-message-bytes or LORAPLEX_MAX_MESSAGE_BYTES, "
                f"or load a large adapter from a server-side path with LoadLora)")

    @maps_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self._check_size(request)
        check_loras(request.loras)
        prompt_ids = await self._codec.encode_async(request)
        sampling = check_sampling(request.sampling, self._config.default_max_tokens)
        info = await self.model_info()
        check_prompt_length(len(prompt_ids), info.max_model_len)
        request_id = take_request_id(request.request_id, _metadata_request_id(context))
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None and remaining < _NO_DEADLINE_S else None
        specs = list(request.loras) or [common_pb2.LoraSpec()]
        level = self._config.request_log_level
        if log.isEnabledFor(level):
            log.log(level, "generate %s: %d prompt tokens, %d entr%s, max_tokens %d%s", request_id, len(prompt_ids),
                    len(specs), "y" if len(specs) == 1 else "ies", sampling.max_tokens,
                    "" if timeout is None else f", deadline {timeout:.1f}s")

        def entry(index: int, spec: common_pb2.LoraSpec) -> Entry:
            rid = request_id if len(specs) == 1 else f"{request_id}/{index}"
            job = EntryJob(index, rid, prompt_ids, sampling, list(request.sampling.stop), timeout)
            return Entry(job, spec, f"loras[{index}]" if request.loras else "lora")

        # One entry: its failures are the call's status (NOT_FOUND, UNAVAILABLE ...); several: per entry.
        async for msg in self.run_entries([entry(i, s) for i, s in enumerate(specs)]):
            yield msg

    def run_entries(self, entries: Sequence[Entry], *, resolve_first: bool = False
                    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Streams checked entries on compute (gateway.generation.run_entries); the HTTP API calls it too.
        The caller's key must reach every adapter named (PERMISSION_DENIED before anything runs)."""
        current_principal().check_lora_specs(e.spec for e in entries)
        return run_entries(entries, self._resolver, self._router, self._codec, resolve_first=resolve_first)

    @maps_errors
    async def LoadLora(self, request: gateway_pb2.LoadLoraRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.LoadLoraResponse:
        return gateway_pb2.LoadLoraResponse(adapter=await self.load_lora(request))

    async def load_lora(self, request: gateway_pb2.LoadLoraRequest) -> common_pb2.AdapterInfo:
        """Stores an adapter in the host cache; returns what was stored (also the HTTP API's load route)."""
        current_principal().check_management(request.name, request.HasField("task_id"))
        self._check_size(request)
        has_inline = request.HasField("weights") or request.HasField("config")
        task_id = request.task_id if request.HasField("task_id") else None
        if has_inline and request.path:
            raise InvalidArgumentError("give one source: a path or inline weights + config, not both")
        if request.path:
            info = await self._store.load_path(request.path, task_id, request.name, request.replace)
        elif has_inline:
            if not (request.HasField("weights") and request.HasField("config")):
                raise InvalidArgumentError("inline adapters need both weights and config")
            if task_id is None:
                raise InvalidArgumentError("inline weights need a task_id to store them under")
            adapter = await self._resolver.validate_inline(request.weights, request.config, "adapter")
            info = await self._store.put(task_id, adapter, name=request.name, replace=request.replace)
        elif request.name:
            # A name alone: load it from the adapter root.
            mode = common_pb2.LOAD_MODE_ALWAYS if request.replace else common_pb2.LOAD_MODE_AUTO
            resolved, _ = await self._store.resolve_name(request.name, mode)
            info = await self._find(resolved)
        else:
            raise InvalidArgumentError("nothing to load: give a path, inline weights + config, or a name "
                                       "under the adapter root")
        self._resolver.forget(info.task_id, info.name or request.name)   # its next request sees this version
        return info

    async def _find(self, task_id: int) -> common_pb2.AdapterInfo:
        adapters, _, _ = await self._store.list()
        for a in adapters:
            if a.task_id == task_id:
                return a
        raise NotFoundError(f"task id {task_id} was loaded but is no longer cached (evicted at once: "
                            "is the host cache budget too small?)")

    @maps_errors
    async def UnloadLora(self, request: gateway_pb2.UnloadLoraRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.UnloadLoraResponse:
        return gateway_pb2.UnloadLoraResponse(unloaded=await self.unload_lora(request))

    async def unload_lora(self, request: gateway_pb2.UnloadLoraRequest) -> bool:
        """Removes an adapter everywhere; False when nothing was cached (also the HTTP API's unload route)."""
        current_principal().check_management(request.name, request.HasField("task_id"))
        task_id = request.task_id if request.HasField("task_id") else None
        if task_id is None and not request.name:
            raise InvalidArgumentError("give the task_id or the name of the adapter to unload")
        if task_id is None:
            task_id = await self._task_id_of(request.name)
        unloaded = await self._store.evict(task_id, request.name)
        self._resolver.forget(task_id, request.name)
        if task_id is not None:
            await self._drop_from_compute(task_id)
        return unloaded

    async def _task_id_of(self, name: str) -> int | None:
        try:
            task_id, _ = await self._store.resolve_name(name, common_pb2.LOAD_MODE_NEVER)
            return task_id
        except NotFoundError:
            return None

    async def _drop_from_compute(self, task_id: int) -> None:
        """Tells every replica to drop the adapter once its running requests finish (best effort:
        a replica that is down holds nothing)."""
        for replica in self._router.replicas():
            try:
                await replica.stub.DropAdapter(compute_pb2.DropAdapterRequest(task_id=task_id),
                                               timeout=self._config.downstream_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("compute %s: DropAdapter(%d) failed: %s", replica.address, task_id, exc.details())

    @maps_errors
    async def ListLoras(self, request: gateway_pb2.ListLorasRequest,
                        context: grpc.aio.ServicerContext) -> gateway_pb2.ListLorasResponse:
        return await self.list_loras()

    async def list_loras(self, gpu_residency: bool = True) -> gateway_pb2.ListLorasResponse:
        """Every adapter the host cache holds or knows by name (`in_gpu_cache` only with `gpu_residency`)."""
        adapters, used, total = await self._store.list()
        principal = current_principal()      # a key scoped to name prefixes sees only those adapters
        adapters = [a for a in adapters if principal.adapters is None or principal.allows_adapter(a.name)]
        resident = await self._gpu_resident() if gpu_residency else set()
        for a in adapters:
            a.in_gpu_cache = a.task_id in resident
        return gateway_pb2.ListLorasResponse(adapters=adapters, host_cache_bytes_used=used,
                                             host_cache_bytes_total=total)

    async def _gpu_resident(self) -> set[int]:
        resident: set[int] = set()
        for replica in self._router.replicas():
            try:
                stats = await replica.stub.GetStats(compute_pb2.GetStatsRequest(), timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                log.warning("compute %s: GetStats failed: %s", replica.address, exc.details())
                continue
            resident.update(stats.resident_task_ids)
        return resident

    @maps_errors
    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.GetModelInfoResponse:
        return gateway_pb2.GetModelInfoResponse(model=await self.model_info())

