"""A gateway over a scripted compute server and an in-memory store, in one event loop."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.client import AsyncClient
from loraplex.formats import ModelSpec
from loraplex.model_files import resolve_model_path
from loraplex.v1 import compute_pb2_grpc, gateway_pb2_grpc
from gateway.config import GatewayConfig
from gateway.router import SingleReplicaRouter, build_router
from gateway.server import build_servicer, transport_limit
from gateway_fakes import MemoryStore, ScriptedCompute, grpc_server

_SPEC: ModelSpec | None = None


def smollm2_spec() -> ModelSpec:
    global _SPEC
    if _SPEC is None:
        _SPEC = ModelSpec.from_path(resolve_model_path(""))
    return _SPEC


def random_adapter(rank: int = 2, layers=(0, 1), modules=(1, 3), dtype=torch.float16, seed: int | None = None):
    """(weights [N, W], config int32 [N, 3]) of a valid random adapter for SmolLM2."""
    spec = smollm2_spec()
    gen = torch.Generator().manual_seed(seed if seed is not None else int(np.random.randint(1 << 30)))
    rows, cfg = [], []
    for layer in layers:
        for m in modules:
            shape = spec.module_shape(m)
            n = rank * (shape.in_features + shape.out_features)
            rows.append(torch.randn(n, generator=gen) * 0.01)
            cfg.append((m, layer, rank))
    width = max(r.numel() for r in rows)
    weights = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r.to(dtype)
    return weights, np.asarray(cfg, dtype=np.int32)


@dataclass
class Stack:
    client: AsyncClient
    address: str
    compute: ScriptedCompute
    store: MemoryStore


@contextlib.asynccontextmanager
async def gateway_stack(tokenizer, *, compute_address: str | None = None, max_model_len: int = 256,
                        delay_s: float = 0.0, max_message_bytes: int = 64 << 20, health_checked: bool = False,
                        **config):
    """Starts scripted compute (unless `compute_address` points elsewhere) and a gateway (routing as the
    served gateway does, with replica health checks, when `health_checked`)."""
    compute = ScriptedCompute(tokenizer, max_model_len=max_model_len, delay_s=delay_s)
    store = MemoryStore(smollm2_spec())
    async with contextlib.AsyncExitStack() as stack:
        if compute_address is None:
            compute_address = await stack.enter_async_context(
                grpc_server(lambda s: compute_pb2_grpc.add_ComputeServicer_to_server(compute, s)))
        cfg = GatewayConfig(compute_addresses=(compute_address,), max_message_bytes=max_message_bytes, **config)
        router = (build_router(cfg.compute_addresses, cfg.max_message_bytes) if health_checked
                  else SingleReplicaRouter(compute_address, cfg.max_message_bytes))
        servicer = build_servicer(cfg, tokenizer, smollm2_spec(), store, router)

        def register(server):
            gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)

        import grpc
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", transport_limit(cfg.max_message_bytes))])
        register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        client = AsyncClient(address, timeout=30)
        try:
            yield Stack(client, address, compute, store)
        finally:
            await client.close()
            await server.stop(0)
            await router.close()
