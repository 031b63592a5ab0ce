"""Server-sent events of the HTTP API when a stream fails part-way (no servers: the event builder alone).

A failure after the first chunk cannot change the status line any more: the
stream ends with an OpenAI error event, then [DONE], which the `openai` client
raises as an error.
"""
from __future__ import annotations

import asyncio
import json

from loraplex.errors import UnavailableError
from loraplex.v1 import common_pb2, gateway_pb2
from gateway.http.streams import DONE, ChoiceBook, events


def run(book: ChoiceBook, messages: list, failure: Exception | None = None) -> list[dict | str]:
    async def rest():
        for msg in messages[1:]:
            yield msg
        if failure is not None:
            raise failure

    async def collect():
        return [e async for e in events(book, messages[0], rest())]
    out = []
    for event in asyncio.run(collect()):
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        out.append("[DONE]" if event == DONE else json.loads(event[6:]))
    return out


def book(chat: bool = False, choices: int = 1) -> ChoiceBook:
    return ChoiceBook(chat=chat, request_id="r1", model="m", choice_prompts=[0] * choices, choice_models=None,
                      include_usage=True)


def test_a_broken_compute_stream_ends_with_an_error_event():
    msgs = [gateway_pb2.GenerateResponse(index=0, text="a"), gateway_pb2.GenerateResponse(index=0, text="b")]
    out = run(book(), msgs, UnavailableError("the token stream to the compute replica at 127.0.0.1:1 broke"))
    assert [e["choices"][0]["text"] for e in out[:2]] == ["a", "b"] and out[0]["id"] == "cmpl-r1"
    assert out[2]["error"]["code"] == "unavailable" and "127.0.0.1:1" in out[2]["error"]["message"]
    assert out[3:] == ["[DONE]"]


def test_a_failed_fan_out_entry_ends_with_its_error_event():
    msgs = [gateway_pb2.GenerateResponse(index=0, text="x"),
            gateway_pb2.GenerateResponse(index=1, finish_reason=common_pb2.ERROR,
                                         error="RESOURCE_EXHAUSTED: loras[1]: the queue is full")]
    out = run(book(chat=True, choices=2), msgs)
    assert [e["choices"][0]["delta"].get("role") for e in out[:2]] == ["assistant", "assistant"]
    assert out[2]["choices"][0]["delta"] == {"content": "x"}
    assert out[3]["error"] == {"message": "loras[1]: the queue is full", "type": "rate_limit_error", "param": None,
                               "code": "resource_exhausted"}
    assert out[4:] == ["[DONE]"]


def test_usage_comes_last_and_counts_the_prompt_once():
    usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=3)
    msgs = [gateway_pb2.GenerateResponse(index=i, text="t", finish_reason=common_pb2.LENGTH, usage=usage)
            for i in range(2)]
    out = run(book(choices=2), msgs)
    assert [e["choices"][0]["finish_reason"] for e in out[:2]] == ["length", "length"]
    assert all(e["usage"] is None for e in out[:2])
    assert out[2]["choices"] == [] and out[2]["usage"] == {"prompt_tokens": 7, "completion_tokens": 6,
                                                          "total_tokens": 13}
    assert out[3:] == ["[DONE]"]
