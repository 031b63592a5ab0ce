"""Test doubles for the gateway's downstreams, used until tests run the real services.

`ScriptedCompute` is a real gRPC Compute server whose "model" replays a fixed
text per adapter, token by token, so the gateway's detokenization, stop strings,
fan-out, cancellation and error paths run over the wire. `PerRequestStreams`
serves StreamTokens (the multiplexed call the gateway uses) over a fake's
per-request `GenerateTokens`, each request in its own task. `MemoryStore` keeps
adapters in a dict with the host cache's semantics (put, replace, names).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc

from loraplex.errors import AlreadyExistsError, NotFoundError, UnavailableError
from loraplex.formats import Adapter, ModelSpec
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc
from gateway.adapters import StoreLimits

# What each "adapter" says: different outputs per adapter, CJK included.
SCRIPTS = {
    None: "Paris is the capital of France. 東京は日本の首都です。",
    1: "华盛顿是美国的首都。Washington, D.C.",
    2: "ワシントン D.C. です。\nUser: more",
}
FAIL_TASK_ID = 666  # compute fails this adapter's stream after one message


class RequestAborted(Exception):
    """A scripted request ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class RequestContext:
    """What a scripted GenerateTokens sees of its request inside a StreamTokens call."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s or None

    def time_remaining(self) -> float | None:
        return self._timeout_s

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RequestAborted(code, details)


class PerRequestStreams:
    """StreamTokens over `self.GenerateTokens(request, context)`: one message per scripted message."""

    async def StreamTokens(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[int, asyncio.Task] = {}

        async def run_one(start) -> None:
            try:
                async for msg in self.GenerateTokens(start.request, RequestContext(start.timeout_s)):
                    resp = compute_pb2.StreamTokensResponse(handles=[start.handle], num_tokens=[len(msg.token_ids)],
                                                            token_ids=msg.token_ids)
                    if msg.finish_reason:
                        resp.finished.add(handle=start.handle, finish_reason=msg.finish_reason, usage=msg.usage)
                        out.put_nowait(resp)
                        return
                    out.put_nowait(resp)
                # the script ended without a finish reason
                out.put_nowait(compute_pb2.StreamTokensResponse(finished=[compute_pb2.TokensFinished(
                    handle=start.handle)]))
            except RequestAborted as exc:
                out.put_nowait(compute_pb2.StreamTokensResponse(errors=[compute_pb2.TokensError(
                    handle=start.handle, code=exc.code.value[0], message=exc.details)]))

        async def read() -> None:
            async for req in request_iterator:
                for start in req.start:
                    tasks[start.handle] = asyncio.create_task(run_one(start))
                for handle in req.cancel:
                    task = tasks.pop(handle, None)
                    if task is not None:
                        task.cancel()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()


@dataclass
class ComputeLog:
    requests: list[compute_pb2.GenerateTokensRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    deadlines: list[float | None] = field(default_factory=list)


class ScriptedCompute(PerRequestStreams, compute_pb2_grpc.ComputeServicer):
    def __init__(self, tokenizer, max_model_len: int = 256, delay_s: float = 0.0) -> None:
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.delay_s = delay_s
        self.log = ComputeLog()

    async def GenerateTokens(self, request, context):
        self.log.requests.append(request)
        self.log.deadlines.append(context.time_remaining())
        task_id = request.adapter.task_id if request.HasField("adapter") else None
        ids = self.tok.encode(SCRIPTS.get(task_id, SCRIPTS[None]), add_special_tokens=False)
        ids = ids + [self.tok.eos_token_id]
        max_tokens = request.sampling.max_tokens
        try:
            sent = 0
            while True:
                n = 1 + sent % 2  # one or two tokens per message, like a real step loop
                chunk = ids[sent:sent + n][:max_tokens - sent]
                sent += len(chunk)
                if task_id == FAIL_TASK_ID and sent > 2:
                    await context.abort(grpc.StatusCode.INTERNAL, "engine step failed")
                msg = compute_pb2.GenerateTokensResponse(token_ids=chunk)
                if chunk and chunk[-1] == self.tok.eos_token_id:
                    msg.finish_reason = common_pb2.STOP
                elif sent >= max_tokens:
                    msg.finish_reason = common_pb2.LENGTH
                if msg.finish_reason:
                    msg.usage.prompt_tokens = len(request.input_ids)
                    msg.usage.completion_tokens = sent
                    self.log.finished.append(request.request_id)
                    yield msg
                    return
                yield msg
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.log.cancelled.append(request.request_id)
            raise

    async def DropAdapter(self, request, context):
        self.log.dropped.append(request.task_id)
        return compute_pb2.DropAdapterResponse(dropped=True)

    async def GetStats(self, request, context):
        return compute_pb2.GetStatsResponse(resident_task_ids=[1])

    async def GetModelInfo(self, request, context):
        return compute_pb2.ComputeModelInfoResponse(model=common_pb2.ModelInfo(
            model_name="scripted", max_model_len=self.max_model_len, vocab_size=len(self.tok),
            eos_token_id=self.tok.eos_token_id))


class MemoryStore:
    """The host cache's semantics over a dict (task id -> adapter)."""

    def __init__(self, spec: ModelSpec, max_lora_rank: int = 64, max_bytes: int = 0) -> None:
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.max_bytes = max_bytes
        self.adapters: dict[int, Adapter] = {}
        self.names: dict[str, int] = {}
        self.root: dict[str, tuple[int, Adapter]] = {}  # adapters "on disk" under the adapter root
        self.puts = 0
        self.down = False  # True: every call fails as if the cache service were unreachable

    def _check(self):
        if self.down:
            raise UnavailableError("the host cache service at 127.0.0.1:1 is unavailable")

    def info(self, task_id: int) -> common_pb2.AdapterInfo:
        a = self.adapters[task_id]
        name = next((n for n, t in self.names.items() if t == task_id), "")
        return common_pb2.AdapterInfo(task_id=task_id, name=name, version=a.content_hash,
                                      num_bytes=a.num_bytes, in_host_cache=True, max_rank=a.max_rank)

    async def cached_version(self, task_id):
        self._check()
        a = self.adapters.get(task_id)
        return None if a is None else a.content_hash

    async def put(self, task_id, adapter, *, name="", replace=False):
        self._check()
        if task_id in self.adapters and not replace:
            raise AlreadyExistsError(f"task id {task_id} is cached")
        self.puts += 1
        self.adapters[task_id] = adapter
        if name:
            self.names[name] = task_id
        return self.info(task_id)

    async def resolve_name(self, name, load_mode):
        self._check()
        if name in self.names and self.names[name] in self.adapters and load_mode != common_pb2.LOAD_MODE_ALWAYS:
            return self.names[name], self.adapters[self.names[name]].content_hash
        if name not in self.root or load_mode == common_pb2.LOAD_MODE_NEVER:
            raise NotFoundError(f"no adapter named {name!r}")
        task_id, adapter = self.root[name]
        await self.put(task_id, adapter, name=name, replace=True)
        return task_id, adapter.content_hash

    async def limits(self):
        self._check()
        return StoreLimits(self.spec.fingerprint, self.max_lora_rank, self.max_bytes)

    async def load_path(self, path, task_id, name, replace):
        raise NotFoundError(f"{path} is not under the adapter root")

    async def evict(self, task_id, name):
        self._check()
        if task_id is None:
            task_id = self.names.get(name)
        self.names = {n: t for n, t in self.names.items() if t != task_id and n != name}
        return self.adapters.pop(task_id, None) is not None

    async def list(self):
        self._check()
        return [self.info(t) for t in self.adapters], sum(a.num_bytes for a in self.adapters.values()), 1 << 30


@contextlib.asynccontextmanager
async def grpc_server(register, port: int = 0):
    """A real aio server on `port` (0: a free one); yields its address."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    register(server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
