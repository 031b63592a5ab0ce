"""The handlers of the OpenAI-compatible API, over the gateway's servicer.

Completions and chat completions check the body (`schemas`), encode the
prompts with the servicer's codec (chat through the model's chat template),
build one entry per choice (prompt x model x n) and run them with the
servicer's `run_entries`, the code path of the gRPC Generate. Every adapter
is resolved before the first byte is sent, so an unknown model is a 404, not
an error inside a 200 stream. Adapter management goes to the servicer's
load/unload calls.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex.errors import NotFoundError
from loraplex.v1 import common_pb2, gateway_pb2
from gateway.generation import Entry, EntryJob
from gateway.http.errors import HttpError, error_response
from gateway.http.schemas import GenerationPlan, parse_plan
from gateway.http.streams import ChoiceBook, ClientGone, EntryFailed, EventStream, events, until_disconnect
from gateway.requests import REQUEST_ID_KEY, check_prompt_length, check_sampling, take_request_id
from gateway.servicer import GatewayServicer

log = logging.getLogger(__name__)
TASK_PREFIX = "task:"
MAX_BODY_BYTES = 32 << 20               # no HTTP body carries adapter weights: prompts fit well within


class Guard(Protocol):
    """The access-control hook: entered once per request, before its body is read, with its action
    ("generate", "manage" for the adapter routes, "read" for the model list); raises a domain error
    (UNAUTHENTICATED 401, PERMISSION_DENIED 403, RESOURCE_EXHAUSTED 429) to refuse it, and is held
    open (an async context) until its answer ends, a stream's last event included. `models` is empty:
    the body is not read yet; adapter scopes are checked where the servicer resolves adapters."""

    def __call__(self, request: Request, action: str, models: Sequence[str]) -> AbstractAsyncContextManager[None]:
        ...


@contextlib.asynccontextmanager
async def allow_all(request: Request, action: str, models: Sequence[str]) -> AsyncIterator[None]:
    yield


Route = Callable[["OpenAIRoutes", Request], Awaitable[Response]]


def guarded(action: str | None) -> Callable[[Route], Route]:
    """A route behind the guard (for `action`; None: open), whose every failure becomes an OpenAI error
    body with its status."""
    def decorate(route: Route) -> Route:
        async def wrapper(self: "OpenAIRoutes", request: Request) -> Response:
            held = contextlib.AsyncExitStack()
            try:
                if action is not None:
                    await held.enter_async_context(self._guard(request, action, ()))
                response = await route(self, request)
                if isinstance(response, EventStream):
                    response.on_close = held.pop_all().aclose     # held until the stream's end
                return response
            except EntryFailed as exc:
                return JSONResponse(exc.body, status_code=exc.status)
            except ClientGone:
                return Response(status_code=499)       # nobody reads it
            except Exception as exc:  # noqa: BLE001 - mapped to a status (500 only for the unexpected)
                return error_response(exc)
            finally:
                await held.aclose()
        wrapper.__name__ = route.__name__
        return wrapper
    return decorate


class OpenAIRoutes:
    """The routes' state: the servicer, the base model's name, the access-control hook."""

    def __init__(self, servicer: GatewayServicer, base_model: str, guard: Guard = allow_all) -> None:
        self._servicer = servicer
        self.base_model = base_model
        self._guard = guard
        self._max_body = min(servicer.config.max_message_bytes, MAX_BODY_BYTES)

    # -- helpers ------------------------------------------------------------------------------
    async def _json(self, request: Request) -> Any:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self._max_body:
            raise HttpError(413, f"the body is {int(length)} bytes, over the HTTP API's limit of {self._max_body} "
                                 "(the smaller of 32 MiB and --max-message-bytes, LORAPLEX_MAX_MESSAGE_BYTES)",
                            code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self._max_body:
                raise HttpError(413, f"the body is over the HTTP API's limit of {self._max_body} bytes",
                                code="request_too_large")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise HttpError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        _check_text(data)
        return data

    def spec_of(self, model: str, param: str) -> common_pb2.LoraSpec:
        """A model id as the gRPC API's LoraSpec: the base model, `task:<id>`, or an adapter's name."""
        if model == self.base_model:
            return common_pb2.LoraSpec()
        if model.startswith(TASK_PREFIX):
            digits = model[len(TASK_PREFIX):]
            if not digits.isdigit() or not 0 <= int(digits) < 2**64:
                raise HttpError(400, f"{param}: {model[:64]!r}: expected task:<id> with an id in [0, 2^64)",
                                param=param, code="invalid_value")
            return common_pb2.LoraSpec(task_id=int(digits))
        return common_pb2.LoraSpec(name=model)

    def _entries(self, plan: GenerationPlan, prompts: list[list[int]], max_model_len: int,
                 request_id: str) -> list[Entry]:
        sampling = check_sampling(plan.sampling, self._servicer.config.default_max_tokens)
        specs = [self.spec_of(m, f"loras[{i}]" if plan.fan_out else "model") for i, m in enumerate(plan.models)]
        total = len(prompts) * len(specs) * plan.n
        entries = []
        for p, ids in enumerate(prompts):
            room = max_model_len - len(ids) if max_model_len else 2**31
            if plan.max_tokens is not None:
                max_tokens = min(plan.max_tokens, room)     # compute stops at max_model_len in any case
            else:
                max_tokens = room if plan.chat else sampling.max_tokens
            for m, spec in enumerate(specs):
                for c in range(plan.n):
                    index = (p * len(specs) + m) * plan.n + c
                    s = common_pb2.SamplingParams()
                    s.CopyFrom(sampling)
                    s.max_tokens = max(1, min(max_tokens, 2**32 - 1))
                    if s.seed and c:
                        s.seed = (s.seed + c) % 2**64 or 2**63    # n choices from one seed still differ
                    rid = request_id if total == 1 else f"{request_id}/{index}"
                    job = EntryJob(index, rid, ids, s, list(plan.sampling.stop), None)
                    entries.append(Entry(job, spec, f"loras[{m}]" if plan.fan_out else f"model {plan.models[m]!r}"))
        return entries

    # -- routes -------------------------------------------------------------------------------
    @guarded("generate")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    @guarded("generate")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        plan = parse_plan(await self._json(request), chat)
        codec = self._servicer.codec
        prompts = ([await codec.encode_chat_async(plan.messages)] if chat
                   else [await codec.encode_async(p) for p in plan.prompts])
        info = await self._servicer.model_info()
        for ids in prompts:
            check_prompt_length(len(ids), info.max_model_len)
        request_id = take_request_id(request.headers.get(REQUEST_ID_KEY, ""))
        entries = self._entries(plan, prompts, info.max_model_len, request_id)
        level = self._servicer.config.request_log_level
        if log.isEnabledFor(level):
            log.log(level, "http %s %s: %d prompt(s), %d choice(s)%s", "chat" if chat else "completion",
                    request_id, len(prompts), len(entries), ", streaming" if plan.stream else "")
        book = ChoiceBook(chat=chat, request_id=request_id, model=plan.model,
                          choice_prompts=[e.job.index // (len(plan.models) * plan.n) for e in entries],
                          choice_models=[plan.models[(e.job.index // plan.n) % len(plan.models)] for e in entries]
                          if plan.fan_out else None, include_usage=plan.include_usage)
        stream = self._servicer.run_entries(entries, resolve_first=True)
        if not plan.stream:
            return JSONResponse(await until_disconnect(request.receive, _collect(book, stream)))
        # the first message before the status line: failing to start (unknown adapter, compute down) is
        # the request's status, not an event inside a 200 stream
        try:
            first = await until_disconnect(request.receive, anext(stream))
            if first.finish_reason == common_pb2.ERROR:
                raise EntryFailed(first.error)
        except BaseException:
            await stream.aclose()     # type: ignore[attr-defined]  (stops the other choices)
            raise
        return EventStream(events(book, first, stream))      # type: ignore[return-value]

    @guarded("read")
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self._model_cards()})

    @guarded("read")
    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: one model's card, 404 if it is not listed."""
        model_id = request.path_params["model_id"]
        for card in await self._model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise NotFoundError(f"no model {model_id[:200]!r}: GET /v1/models lists them")

    async def _model_cards(self) -> list[dict[str, Any]]:
        adapters = (await self._servicer.list_loras(gpu_residency=False)).adapters
        created = int(time.time())

        def card(model_id: str, root: str, parent: str | None, **extra: Any) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": created, "owned_by": "loraplex",
                    "root": root, "parent": parent, **extra}

        data = [card(self.base_model, self.base_model, None)]
        for a in adapters:
            root = a.source or a.name or f"{TASK_PREFIX}{a.task_id}"
            if a.name:
                data.append(card(a.name, root, self.base_model, task_id=a.task_id))
            data.append(card(f"{TASK_PREFIX}{a.task_id}", root, self.base_model, task_id=a.task_id))
        return data

    @guarded("manage")
    async def load_lora_adapter(self, request: Request) -> Response:
        body = await self._json(request)
        name, path = _adapter_fields(body)
        replace = body.get("load_inplace", False)
        if not isinstance(replace, bool):
            raise HttpError(400, "load_inplace: expected true or false", param="load_inplace", code="invalid_value")
        info = await self._servicer.load_lora(gateway_pb2.LoadLoraRequest(name=name, path=path, replace=replace))
        return JSONResponse({"object": "lora_adapter", "id": info.name or f"task:{info.task_id}",
                             "task_id": info.task_id, "version": info.version, "num_bytes": info.num_bytes,
                             "max_rank": info.max_rank, "source": info.source,
                             "message": f"adapter {info.name or info.task_id!r} loaded"})

    @guarded("manage")
    async def unload_lora_adapter(self, request: Request) -> Response:
        name, _ = _adapter_fields(await self._json(request))
        unload = gateway_pb2.UnloadLoraRequest()
        spec = self.spec_of(name, "lora_name")
        if spec.HasField("task_id"):
            unload.task_id = spec.task_id
        elif spec.name:
            unload.name = spec.name
        else:
            raise HttpError(400, "lora_name: the base model cannot be unloaded", param="lora_name",
                            code="invalid_value")
        unloaded = await self._servicer.unload_lora(unload)
        if not unloaded:
            raise NotFoundError(f"no adapter {name[:200]!r} is loaded")
        return JSONResponse({"object": "lora_adapter", "id": name, "deleted": True,
                             "message": f"adapter {name!r} unloaded"})

    @guarded(None)
    async def health(self, request: Request) -> Response:
        """200 once the gateway has reached a compute service (503 with the reason until then)."""
        info = await self._servicer.model_info()
        return JSONResponse({"status": "ok", "model": self.base_model, "max_model_len": info.max_model_len})


async def _collect(book: ChoiceBook, stream: AsyncIterator[gateway_pb2.GenerateResponse]) -> dict[str, Any]:
    try:
        async for msg in stream:
            book.add(msg)
    finally:
        await stream.aclose()        # type: ignore[attr-defined]
    return book.response()


def _check_text(data: Any) -> None:
    """JSON's \\ud800-style escapes can make strings that are not text (lone surrogates), which no
    tokenizer takes: refused here, for every string of the body."""
    todo = [data]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise HttpError(400, "the body holds a string with a lone surrogate (an escape in \\ud800-"
                                     "\\udfff not part of a pair): not text", code="invalid_json") from None
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)


def _adapter_fields(body: Any) -> tuple[str, str]:
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object such as {\"lora_name\": ..., \"lora_path\": ...}",
                        code="invalid_json")
    name, path = body.get("lora_name"), body.get("lora_path") or ""
    if not isinstance(name, str) or not name:
        raise HttpError(400, "lora_name: expected the adapter's name", param="lora_name", code="invalid_value")
    if not isinstance(path, str):
        raise HttpError(400, "lora_path: expected a path on the cache service's host (a PEFT folder, .npy "
                             "folder or .safetensors file); leave it out to load lora_name from the adapter root",
                        param="lora_path", code="invalid_value")
    return name, path
