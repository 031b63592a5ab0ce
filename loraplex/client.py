"""The loraplex Python client, sync (`Client`) and asyncio (`AsyncClient`).

    from loraplex.client import Client, Lora
    with Client("127.0.0.1:50051") as c:
        print(c.generate("The capital of France is", lora=Lora(name="my_adapter")).text)
        for chunk in c.stream("Hi", lora=1, max_tokens=32):   # task id 1
            print(chunk.text, end="", flush=True)
        outs = c.fan_out("Translate: hello", [None, 1, 2])  # base model + two adapters

Errors arrive as `loraplex.errors` exceptions (NotFoundError, InvalidArgumentError,
UnavailableError, ...) whose `grpc_code` is the call's status. A gateway with API keys
takes `api_key=`; one with TLS `tls=True` (system roots) or `tls_ca=` (and `tls_cert=` +
`tls_key=` for mutual TLS). docs/security.md.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence, cast

import grpc

from loraplex.channels import channel_options
from loraplex.client_types import (Chunk, Completion, Lora, LoraLike, build_generate_request, collect,
                                   error_from_rpc)
from loraplex.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
# Inline adapters can be hundreds of MB (a rank-64 all-module 8B adapter is ~335 MB).
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

__all__ = ["Client", "AsyncClient", "Lora", "Chunk", "Completion", "DEFAULT_ADDRESS"]


def _credentials(tls: bool, tls_ca: str | Path | None, tls_cert: str | Path | None,
                 tls_key: str | Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS argument is set: `tls_ca` (PEM) to trust instead of the system's roots,
    `tls_cert` + `tls_key` (PEM) for a gateway that requires client certificates (mutual TLS)."""
    if not (tls or tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together (a client certificate and its key)")

    def read(path: str | Path | None) -> bytes | None:
        return Path(path).read_bytes() if path else None
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _loras(lora: LoraLike | Sequence[LoraLike]) -> list[LoraLike]:
    if isinstance(lora, (list, tuple)):
        return list(lora)
    return [] if lora is None else [cast(LoraLike, lora)]


def _load_request(task_id: int | None, name: str, path: str, local_path: str | Path | None,
                  weights: Any, config: Any, replace: bool, dtype: str | None) -> gateway_pb2.LoadLoraRequest:
    """Only a local path or inline tensors import the tensor code (torch); a server-side path does not."""
    req = gateway_pb2.LoadLoraRequest(name=name, path=path, replace=replace)
    if task_id is not None:
        req.task_id = task_id
    if local_path is not None:
        from loraplex.formats import load_adapter
        adapter = load_adapter(local_path, dtype=dtype)
        weights, config = adapter.weights, adapter.config
    if weights is not None:
        from loraplex.tensor_proto import tensor_to_proto
        req.weights.CopyFrom(tensor_to_proto(weights))
        req.config.CopyFrom(tensor_to_proto(config))
    return req


class _Connections:
    """`connections` channels to one address, each on its own TCP connection; calls take them in turn.

    A gateway run as several processes (`serve --gateway-workers N`) shares its port, and the kernel
    hands each new connection to one of them; one connection puts all of a client's calls on one
    gateway process. With several, they spread over the processes as the kernel spreads connections."""

    def __init__(self, aio: bool, address: str, creds: grpc.ChannelCredentials | None, max_message_bytes: int,
                 connections: int) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        options = channel_options(max_message_bytes)
        if connections > 1:        # channels with the same options would otherwise share one connection
            options += (("grpc.use_local_subchannel_pool", 1),)
        mod = grpc.aio if aio else grpc
        self.channels = [mod.secure_channel(address, creds, options=options) if creds
                         else mod.insecure_channel(address, options=options) for _ in range(connections)]
        self._stubs = [gateway_pb2_grpc.GatewayStub(c) for c in self.channels]
        self._turn = itertools.cycle(self._stubs)

    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        """The next connection's stub (round robin)."""
        return next(self._turn)


def _unload_request(task_id: int | None, name: str) -> gateway_pb2.UnloadLoraRequest:
    req = gateway_pb2.UnloadLoraRequest(name=name)
    if task_id is not None:
        req.task_id = task_id
    return req


class Client:
    """Blocking client of loraplex.v1.Gateway. `timeout` (seconds) applies to every call; `connections`:
    TCP connections its calls take in turn (more than one spreads them over a gateway's processes)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, api_key: str | None = None,
                 tls: bool = False, tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, connections: int = 1) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = _auth_metadata(api_key)
        self._conns = _Connections(False, address, _credentials(tls, tls_ca, tls_cert, tls_key), max_message_bytes,
                                   connections)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._conns.channels:
            channel.close()

    def stream(self, prompt: str | Sequence[int], lora: LoraLike | Sequence[LoraLike] = None,
               **sampling: Any) -> Iterator[Chunk]:
        """Streams chunks; with a list of loras, chunks of every entry interleave (see `Chunk.index`).
        Closing the iterator early cancels the request on the server."""
        request = build_generate_request(prompt, _loras(lora), **sampling)
        call = self._conns.stub().Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            for msg in call:
                yield Chunk.from_proto(msg)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()  # no-op when finished; cancels compute when the caller stopped early

    def generate(self, prompt: str | Sequence[int], lora: LoraLike = None, **sampling: Any) -> Completion:
        """The whole output for one adapter (None: the base model)."""
        return collect(self.stream(prompt, lora, **sampling), 1)[0]

    def fan_out(self, prompt: str | Sequence[int], loras: Sequence[LoraLike], **sampling: Any) -> list[Completion]:
        """The same prompt through each adapter (None: the base model), one Completion per entry;
        a failed entry has finish_reason "error" and its `error`."""
        return collect(self.stream(prompt, list(loras), **sampling), len(loras))

    def load_lora(self, *, task_id: int | None = None, name: str = "", path: str = "",
                  local_path: str | Path | None = None, weights: Any = None, config: Any = None,
                  replace: bool = False, dtype: str | None = None) -> common_pb2.AdapterInfo:
        """Loads an adapter from a server-side `path`, a `local_path` read here and sent inline,
        or inline `weights` + `config`; returns what was stored."""
        req = _load_request(task_id, name, path, local_path, weights, config, replace, dtype)
        return self._call(self._conns.stub().LoadLora, req).adapter

    def unload_lora(self, *, task_id: int | None = None, name: str = "") -> bool:
        return self._call(self._conns.stub().UnloadLora, _unload_request(task_id, name)).unloaded

    def list_loras(self) -> gateway_pb2.ListLorasResponse:
        return self._call(self._conns.stub().ListLoras, gateway_pb2.ListLorasRequest())

    def model_info(self) -> common_pb2.ModelInfo:
        return self._call(self._conns.stub().GetModelInfo, gateway_pb2.GetModelInfoRequest()).model

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None


class AsyncClient:
    """asyncio client of loraplex.v1.Gateway; the same methods (and `connections`) as `Client`, awaited."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, api_key: str | None = None,
                 tls: bool = False, tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, connections: int = 1) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = _auth_metadata(api_key)
        self._conns = _Connections(True, address, _credentials(tls, tls_ca, tls_cert, tls_key), max_message_bytes,
                                   connections)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._conns.channels:
            await channel.close()

    async def stream(self, prompt: str | Sequence[int], lora: LoraLike | Sequence[LoraLike] = None,
                     **sampling: Any) -> AsyncIterator[Chunk]:
        request = build_generate_request(prompt, _loras(lora), **sampling)
        call = self._conns.stub().Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield Chunk.from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | Sequence[int], lora: LoraLike = None, **sampling: Any) -> Completion:
        return collect([c async for c in self.stream(prompt, lora, **sampling)], 1)[0]

    async def fan_out(self, prompt: str | Sequence[int], loras: Sequence[LoraLike],
                      **sampling: Any) -> list[Completion]:
        return collect([c async for c in self.stream(prompt, list(loras), **sampling)], len(loras))

    async def load_lora(self, *, task_id: int | None = None, name: str = "", path: str = "",
                        local_path: str | Path | None = None, weights: Any = None, config: Any = None,
                        replace: bool = False, dtype: str | None = None) -> common_pb2.AdapterInfo:
        req = _load_request(task_id, name, path, local_path, weights, config, replace, dtype)
        return (await self._call(self._conns.stub().LoadLora, req)).adapter

    async def unload_lora(self, *, task_id: int | None = None, name: str = "") -> bool:
        return (await self._call(self._conns.stub().UnloadLora, _unload_request(task_id, name))).unloaded

    async def list_loras(self) -> gateway_pb2.ListLorasResponse:
        return await self._call(self._conns.stub().ListLoras, gateway_pb2.ListLorasRequest())

    async def model_info(self) -> common_pb2.ModelInfo:
        return (await self._call(self._conns.stub().GetModelInfo, gateway_pb2.GetModelInfoRequest())).model

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
