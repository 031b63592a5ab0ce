"""loraplex.v1.Compute: protobuf <-> domain objects, nothing else.

Errors of the engine and the adapter cache become `loraplex.errors` here, so
`@maps_errors` answers with the right status code; a cancelled call or a
passed deadline lands in the runner's stream, which aborts the request.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from compute_service.adapter_cache.loader import task_of
from compute_service.conversions import finish_of, sampling_from_proto
from compute_service.request_errors import domain_error
from compute_service.token_session import TokenSession
from loraplex.grpc_errors import maps_errors
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc


class ServedRuntime(Protocol):
    """What the servicer needs: a runner (`compute_service.runner.EngineRunner`, or the engine process's
    `compute_service.engine_link.RemoteRunner`) and the model's description."""

    runner: Any

    def model_info(self) -> common_pb2.ModelInfo:
        """The served model (GetModelInfo)."""


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    """Serves one runtime (engine + paged adapter cache), in this process or in the engine process."""

    def __init__(self, runtime: ServedRuntime, max_model_len: int) -> None:
        self.rt = runtime
        self.max_model_len = max_model_len

    @maps_errors
    async def GenerateTokens(self, request: compute_pb2.GenerateTokensRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[compute_pb2.GenerateTokensResponse]:
        params = sampling_from_proto(request.sampling)
        task_id, version = None, ""
        if request.HasField("adapter"):
            task_id, version = request.adapter.task_id, request.adapter.version
        rid = request.request_id or f"compute-{id(request):x}"
        try:
            async for out in self.rt.runner.generate(rid, request.input_ids, params, task_id, version):
                resp = compute_pb2.GenerateTokensResponse(token_ids=out.new_token_ids)
                if out.finished:
                    resp.finish_reason, usage = finish_of(out)
                    resp.usage.CopyFrom(usage)
                yield resp
        except Exception as exc:  # noqa: BLE001 - mapped to a status by maps_errors
            raise domain_error(exc) from exc

    @maps_errors
    async def StreamTokens(self, request_iterator: AsyncIterator[compute_pb2.StreamTokensRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[compute_pb2.StreamTokensResponse]:
        async for resp in TokenSession(self.rt.runner).run(request_iterator):
            yield resp

    @maps_errors
    async def PrefetchAdapter(self, request: compute_pb2.PrefetchAdapterRequest,
                              context: grpc.aio.ServicerContext) -> compute_pb2.PrefetchAdapterResponse:
        try:
            resident = await self.rt.runner.prefetch(request.adapter.task_id, request.adapter.version)
        except Exception as exc:  # noqa: BLE001
            raise domain_error(exc) from exc
        return compute_pb2.PrefetchAdapterResponse(resident=resident)

    @maps_errors
    async def DropAdapter(self, request: compute_pb2.DropAdapterRequest,
                          context: grpc.aio.ServicerContext) -> compute_pb2.DropAdapterResponse:
        return compute_pb2.DropAdapterResponse(dropped=await self.rt.runner.drop(request.task_id))

    @maps_errors
    async def GetStats(self, request: compute_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> compute_pb2.GetStatsResponse:
        eng, pool = await self.rt.runner.snapshot()
        resp = compute_pb2.GetStatsResponse(
            num_running=eng.num_running, num_waiting=eng.num_waiting,
            kv_blocks_used=eng.num_kv_blocks_used, kv_blocks_total=eng.num_kv_blocks_total,
            adapter_pool_bytes_used=pool.bytes_used, adapter_pool_bytes_total=pool.bytes_total,
            adapter_pages_used=pool.pages_used, adapter_pages_total=pool.pages_total,
            adapter_pins=pool.num_holds,
            resident_task_ids=sorted({task_of(k) for k in pool.resident_keys}))
        keys = (set(eng.running_per_adapter) | set(eng.waiting_per_adapter)) - {""}
        per_task: dict[int, list[int]] = {}
        for k in keys:
            c = per_task.setdefault(task_of(k), [0, 0])
            c[0] += eng.running_per_adapter.get(k, 0)
            c[1] += eng.waiting_per_adapter.get(k, 0)
        for t, (run, wait) in sorted(per_task.items()):
            resp.adapter_requests.add(task_id=t, num_running=run, num_waiting=wait)
        return resp

    @maps_errors
    async def GetModelInfo(self, request: compute_pb2.ComputeModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> compute_pb2.ComputeModelInfoResponse:
        return compute_pb2.ComputeModelInfoResponse(model=self.rt.model_info())
