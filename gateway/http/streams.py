"""GenerateResponse messages -> OpenAI completion responses, chunks and server-sent events.

`ChoiceBook` follows one request's choices: it turns each message into a
streaming chunk (`text_completion` or `chat.completion.chunk`), or gathers the
text for the whole response, and counts usage the OpenAI way (each prompt's
tokens once, however many choices share it; every choice's completion tokens).
A message whose entry failed (`finish_reason` ERROR) raises `EntryFailed`.
`EventStream` is the ASGI response of a stream: it sends each event as it
comes and stops the generation as soon as the client goes away.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from loraplex.v1 import common_pb2, gateway_pb2
from gateway.http.errors import error_of, status_of_entry_error

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_FINISH = {common_pb2.STOP: "stop", common_pb2.LENGTH: "length", common_pb2.CANCELLED: "abort"}


class EntryFailed(Exception):
    """A choice's entry ended with ERROR: its HTTP status and OpenAI error body."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.status, self.body = status_of_entry_error(error)


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ChoiceBook:
    """One request's choices: index -> (its prompt, the model it runs on)."""

    def __init__(self, *, chat: bool, request_id: str, model: str, choice_prompts: Sequence[int],
                 choice_models: Sequence[str] | None, include_usage: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self._prompts = list(choice_prompts)
        self._models = list(choice_models) if choice_models is not None else None
        self._include_usage = include_usage
        self._texts = [""] * len(self._prompts)
        self._finish: list[str | None] = [None] * len(self._prompts)
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    # -- both forms ---------------------------------------------------------------------------
    def _take(self, msg: gateway_pb2.GenerateResponse) -> str | None:
        """Records `msg`; returns its finish reason (OpenAI's word) when it is its choice's last."""
        if msg.finish_reason == common_pb2.ERROR:
            raise EntryFailed(msg.error)
        if msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            return None
        self._prompt_tokens[self._prompts[msg.index]] = msg.usage.prompt_tokens
        self._completion_tokens += msg.usage.completion_tokens
        finish = _FINISH.get(msg.finish_reason, "stop")
        self._finish[msg.index] = finish
        return finish

    def usage(self) -> dict[str, int]:
        prompt = sum(self._prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self._completion_tokens,
                "total_tokens": prompt + self._completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, **fields: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, **fields}
        if self._models is not None:
            choice["model"] = self._models[index]       # extension: which of `loras` made it
        return choice

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        head["choices"] = choices
        if self._include_usage:
            head["usage"] = None
        return sse(head)

    def opening(self) -> list[bytes]:
        """Chat streams first give every choice the assistant role."""
        if not self.chat:
            return []
        return [self._chunk([self._choice(i, delta={"role": "assistant", "content": ""}, logprobs=None,
                                          finish_reason=None)]) for i in range(len(self._prompts))]

    def chunk(self, msg: gateway_pb2.GenerateResponse) -> bytes | None:
        finish = self._take(msg)
        if not msg.text and finish is None:
            return None         # tokens held back until their character is complete
        if self.chat:
            choice = self._choice(msg.index, delta={"content": msg.text} if msg.text else {}, logprobs=None,
                                  finish_reason=finish)
        else:
            choice = self._choice(msg.index, text=msg.text, logprobs=None, finish_reason=finish)
        return self._chunk([choice])

    def closing(self) -> list[bytes]:
        if not self._include_usage:
            return [DONE]
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        head.update(choices=[], usage=self.usage())
        return [sse(head), DONE]

    # -- whole responses ----------------------------------------------------------------------
    def add(self, msg: gateway_pb2.GenerateResponse) -> None:
        self._take(msg)
        self._texts[msg.index] += msg.text

    def response(self) -> dict[str, Any]:
        head = self._head("chat.completion" if self.chat else "text_completion")
        if self.chat:
            head["choices"] = [self._choice(i, message={"role": "assistant", "content": t}, logprobs=None,
                                            finish_reason=f) for i, (t, f) in enumerate(zip(self._texts, self._finish))]
        else:
            head["choices"] = [self._choice(i, text=t, logprobs=None, finish_reason=f)
                               for i, (t, f) in enumerate(zip(self._texts, self._finish))]
        head["usage"] = self.usage()
        return head


async def events(book: ChoiceBook, first: gateway_pb2.GenerateResponse,
                 stream: AsyncIterator[gateway_pb2.GenerateResponse]) -> AsyncIterator[bytes]:
    """The stream's events; a failure after the first event is sent as an error event, then [DONE]."""
    try:
        for event in book.opening():
            yield event
        event = book.chunk(first)
        if event is not None:
            yield event
        async for msg in stream:
            event = book.chunk(msg)
            if event is not None:
                yield event
    except EntryFailed as exc:
        yield sse(exc.body)
        yield DONE
        return
    except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
        yield sse(error_of(exc)[1])
        yield DONE
        return
    finally:
        await stream.aclose()      # type: ignore[attr-defined]  (closed here too, stops compute at once)
    for event in book.closing():
        yield event


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and so its compute requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """A `text/event-stream` response that ends the generation when the client goes away."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self._body = body
        self.on_close = on_close       # called once the stream ended, however it ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for event in self._body:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, pump())
        except (ClientGone, OSError):
            pass            # the client left: nobody to tell
        finally:
            await self._body.aclose()       # type: ignore[attr-defined]
            if self.on_close is not None:
                await self.on_close()
