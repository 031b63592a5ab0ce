"""Property-based fuzzing of the OpenAI-compatible routes' JSON bodies against `loraplex serve`.

Every body, however hostile (not JSON, not an object, wrong types in every
field, huge or odd-unicode strings, huge or negative numbers, NaN, deep
nesting, many choices), gets a 2xx answer or a 4xx/503 one with an OpenAI
error body whose message is at most MAX_STATUS_MESSAGE characters; never a
500. A streamed answer holds only JSON events (an error event at worst) and
ends with [DONE]. The server answers a good request afterwards. Examples are
derandomized, so CI sees the same inputs; the context is short
(--max-model-len 64), so a body that asks for many long choices stays quick.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from loraplex.grpc_errors import MAX_STATUS_MESSAGE
from http_stack import make_tiny_model, start_http_stack, write_adapters

pytestmark = pytest.mark.timeout(300)
FUZZ = settings(derandomize=True, max_examples=100, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
BASE = "tiny"

texts = st.one_of(st.text(max_size=32), st.text(alphabet="\U0001F600\u200b\ud800\x00\ufffd\u0301", max_size=32),
                  st.integers(0, 20_000).map(lambda n: "x" * n))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
models = st.sampled_from([BASE, BASE, BASE, "alpha", "alpha", "task:1", "nope"])
words = st.one_of(st.text(min_size=1, max_size=24), st.text(alphabet="\ud800\U0001F600\x00\u0301", min_size=1,
                                                             max_size=4))
prompts = st.one_of(words, st.lists(st.integers(0, 60_000), min_size=1, max_size=8),
                    st.lists(words, min_size=1, max_size=3))
content = st.one_of(words, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), max_size=2))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "user", "user", "assistant"]),
                                 "content": content})

# Valid values of each field (a body starts valid, so generation is reached) ...
OPTIONAL = {
    "temperature": st.sampled_from([0, 0.7, 2]), "top_p": st.sampled_from([0.5, 1]), "top_k": st.integers(-1, 50),
    "n": st.integers(1, 3), "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(words, st.lists(words, max_size=2)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "loras": st.lists(models, min_size=1, max_size=3), "max_completion_tokens": st.integers(1, 8),
    "logprobs": st.none(), "echo": st.just(False), "best_of": st.just(1), "frequency_penalty": st.just(0),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(0, 60_000), max_size=2), "user": words,
    "tools": st.just([]), "response_format": st.just({"type": "text"}),
}
# ... then, in two bodies out of three, one or two fields get anything at all (or go missing).
FIELDS = sorted(OPTIONAL) + ["model", "prompt", "messages", "max_tokens"]


@st.composite
def generation_bodies(draw, chat: bool):
    body = {"model": draw(models), "max_tokens": draw(st.integers(1, 8))}
    if chat:
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(prompts)
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONAL)), max_size=5, unique=True)):
        body[name] = draw(OPTIONAL[name])
    if body.get("stream_options") is not None:
        body["stream"] = True
    if draw(st.integers(0, 2)):
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True)):
            if draw(st.booleans()):
                body[name] = draw(values)
            else:
                body.pop(name, None)
    return body


@st.composite
def adapter_bodies(draw):
    body = {"lora_name": draw(st.sampled_from(["alpha", "mine", "task:1", BASE, "task:x", ""])),
            "lora_path": draw(st.sampled_from(["", "/etc/passwd", "../..", "alpha"]))}
    for name in draw(st.lists(st.sampled_from(["lora_name", "lora_path", "load_inplace"]), max_size=2, unique=True)):
        body[name] = draw(values)
    return body


def raw(body) -> bytes:
    """`body` as JSON bytes (NaN and lone surrogates included), or as it is when it is already bytes."""
    return body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", "surrogatepass")


def bodies(objects):
    """Mostly `objects`, sometimes not an object, not JSON, or nested past any parser's depth."""
    return st.one_of(objects, objects, objects, values, st.binary(max_size=64), st.just(b"[" * 100_000))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("http-fuzz")
    model = make_tiny_model(tmp / BASE, tokenizer)
    write_adapters(model, tmp / "root", {"alpha": 2})
    s = start_http_stack(model, tmp / "root", "--max-model-len", "64")
    yield s
    s.stop()


def call(stack, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, str]:
    url = urllib.parse.urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("content-type", "")
    finally:
        conn.close()


def check_error(payload: object) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    assert 0 < len(err["message"]) <= MAX_STATUS_MESSAGE, len(err["message"])


def assert_clean(stack, path: str, body) -> None:
    status, data, ctype = call(stack, "POST", path, raw(body))
    assert status < 500 or status == 503, (status, data[:300])
    if status >= 400:
        check_error(json.loads(data))
    elif ctype.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", data[-300:]
        for event in map(json.loads, events[:-1]):
            if "error" in event:
                check_error(event)
    else:
        assert "choices" in json.loads(data) or path.endswith("lora_adapter")


def assert_serves(stack) -> None:
    status, data, _ = call(stack, "POST", "/v1/completions",
                           raw({"model": BASE, "prompt": "hi", "max_tokens": 3, "temperature": 0}))
    assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] in ("stop", "length"), data
    assert call(stack, "GET", "/v1/models")[0] == 200 and call(stack, "GET", "/health")[0] == 200


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_fuzz_generation_routes(stack, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"

    @FUZZ
    @given(bodies(generation_bodies(chat=chat)))
    def check(body):
        assert_clean(stack, path, body)
    check()
    assert_serves(stack)


def test_fuzz_adapter_routes_and_methods(stack):
    @FUZZ
    @given(bodies(adapter_bodies()), bodies(adapter_bodies()), st.sampled_from(["GET", "PUT", "DELETE", "POST"]),
           st.sampled_from(["/v1/models", "/health", "/v1/completions", "/v1/x", "/metrics"]))
    def check(load, unload, method, path):
        assert_clean(stack, "/v1/load_lora_adapter", load)
        assert_clean(stack, "/v1/unload_lora_adapter", unload)
        status, data, _ = call(stack, method, path)
        assert status < 500, (status, data[:300])
        if status >= 400:
            check_error(json.loads(data))
    check()
    assert_serves(stack)
