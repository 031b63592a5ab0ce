"""The OpenAI-compatible HTTP API with the official `openai` client (sync, async, streaming) and curl.

Against `loraplex serve` (real cache, compute on the CPU, gateway) over a tiny
model: completions and chat, the base model and adapters, n, seeds, stop
strings, usage in the last chunk, `loras` fan-out, the adapter routes, every
error status with an OpenAI error body, and a client that goes away cancelling
its request on compute. Outputs are checked against the gRPC API's for the
same request: both run the same code.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import subprocess
import threading
import time
import urllib.parse

import grpc
import openai
import pytest

from gateway.cache_store import CacheStore
from gateway.config import GatewayConfig
from gateway.http.app import HttpServer, build_app, http_server_for
from gateway.router import SingleReplicaRouter
from gateway.server import build_servicer
from loraplex.client import Client
from loraplex.errors import LoraplexError
from loraplex.formats import ModelSpec
from loraplex.grpc_errors import MAX_STATUS_MESSAGE
from http_stack import make_tiny_model, start_http_stack, write_adapters

pytestmark = pytest.mark.timeout(300)
PROMPT = "The capital of France is"


class UnauthenticatedError(LoraplexError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
BASE = "tiny"        # the model folder's name is the served name


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("http")
    model = make_tiny_model(tmp / BASE, tokenizer)
    root = tmp / "root"
    write_adapters(model, root, {"alpha": 4, "beta": 4, "gamma": 4, "huge": 256})
    s = start_http_stack(model, root, "--host-cache-bytes", "512KiB", "--gateway-flags", "--max-message-bytes 4MiB")
    s.root, s.model = root, model
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with Client(stack.grpc_address, timeout=60) as c:
        yield c


def test_models_lists_base_and_named_adapters(client, grpc_client):
    grpc_client.generate("warm", lora="alpha", max_tokens=1)     # cached now: listed with its task id
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == BASE
    assert {"alpha", "beta", "gamma"} <= set(ids)
    alpha_task = next(a.task_id for a in grpc_client.list_loras().adapters if a.name == "alpha")
    assert f"task:{alpha_task}" in ids
    card = client.models.retrieve("alpha")
    assert (card.id, card.parent, card.task_id) == ("alpha", BASE, alpha_task)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize("model", [BASE, "alpha"])
def test_completion_equals_grpc_generate(client, grpc_client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    want = grpc_client.generate(PROMPT, lora=None if model == BASE else model, max_tokens=12)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
    assert out.model == model and out.object == "text_completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
    assert out.usage.total_tokens == want.prompt_tokens + want.completion_tokens


def test_adapters_change_the_output(client):
    texts = {m: client.completions.create(model=m, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
             for m in (BASE, "alpha", "beta")}
    assert len(set(texts.values())) == 3, texts


def test_streaming_completion_has_usage_in_its_last_chunk(client):
    whole = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="alpha", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1]) and len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    no_usage = list(client.completions.create(model="alpha", prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert all(c.choices for c in no_usage)


def test_chat_sync_stream_and_async_equal_grpc_chat(client, grpc_client, stack):
    messages = [{"role": "user", "content": "Say hello"}]
    want = grpc_client.generate("Say hello", chat=True, lora="beta", max_tokens=10)
    out = client.chat.completions.create(model="beta", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text
    assert out.usage.prompt_tokens == want.prompt_tokens and out.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="beta", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    async def run():
        aclient = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
        try:
            whole = await aclient.chat.completions.create(model="beta", messages=messages, max_tokens=10,
                                                          temperature=0)
            stream = await aclient.chat.completions.create(model="beta", messages=messages, max_tokens=10,
                                                           temperature=0, stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            acomp = await aclient.completions.create(model=BASE, prompt=PROMPT, max_tokens=5, temperature=0)
            return whole.choices[0].message.content, "".join(parts), acomp.choices[0].text
        finally:
            await aclient.close()
    whole, streamed, acomp = asyncio.run(run())
    assert whole == streamed == want.text
    assert acomp == grpc_client.generate(PROMPT, max_tokens=5).text


def test_chat_with_a_system_turn_uses_the_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=BASE, messages=messages, max_tokens=3, temperature=0)
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))


def test_n_choices_with_a_seed_differ_and_repeat(client):
    def ask():
        out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)], out.usage
    first, usage = ask()
    assert len(set(first)) == 3, first
    assert ask()[0] == first
    assert usage.completion_tokens == 24 and usage.prompt_tokens == 5    # the prompt counts once
    streamed: dict[int, str] = {}
    for c in client.completions.create(model="alpha", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3,
                                       stream=True):
        streamed[c.choices[0].index] = streamed.get(c.choices[0].index, "") + c.choices[0].text
    assert [streamed[i] for i in range(3)] == first


def test_stop_strings_cut_the_output(client):
    full = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    cut = full[:full.index(stop)]
    out = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=BASE, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_loras_fan_out_one_choice_per_model(client):
    models = [BASE, "alpha", "beta"]
    out = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"loras": models})
    alone = [client.completions.create(model=m, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
             for m in models]
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == alone
    assert [c.model for c in choices] == models       # extension field: which model made each choice
    # several prompts x models x n: index = (prompt * models + model) * n + copy
    out = client.completions.create(model=BASE, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, n=2,
                                    extra_body={"loras": ["alpha", BASE]})
    assert sorted(c.index for c in out.choices) == list(range(8))
    by_index = {c.index: c for c in out.choices}
    assert by_index[0].text == by_index[1].text == alone[1][:len(by_index[0].text)]
    assert by_index[6].model == BASE


def _post(stack, path: str, body) -> tuple[int, dict]:
    url = urllib.parse.urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_load_and_unload_routes(stack, client):
    status, body = _post(stack, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(stack.root / "gamma")})
    assert status == 200, body
    assert "mine" in [m.id for m in client.models.list().data]
    got = client.completions.create(model="mine", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    assert got == client.completions.create(model="gamma", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    status, body = _post(stack, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(stack.root / "beta")})
    assert status == 409 and body["error"]["code"] == "already_exists", body      # taken, and no load_inplace
    assert _post(stack, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(stack.root / "beta"),
                                                  "load_inplace": True})[0] == 200
    assert _post(stack, "/v1/unload_lora_adapter", {"lora_name": "mine"}) == (200, pytest.approx(
        {"object": "lora_adapter", "id": "mine", "deleted": True, "message": "adapter 'mine' unloaded"}))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mine", prompt=PROMPT, max_tokens=2)
    status, body = _post(stack, "/v1/unload_lora_adapter", {"lora_name": "mine"})
    assert status == 404 and body["error"]["type"] == "not_found_error"


def assert_error(exc: openai.APIStatusError, status: int, code: str | None = None) -> dict:
    assert exc.status_code == status, (exc.status_code, exc.body)
    err = exc.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert len(err["message"]) <= MAX_STATUS_MESSAGE
    if code is not None:
        assert err["code"] == code, err
    return err


def test_error_statuses(stack, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=PROMPT, temperature=-1)
    assert assert_error(e.value, 400)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=PROMPT, logprobs=2)
    assert assert_error(e.value, 400, "unsupported_parameter")["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=[99_999_999], max_tokens=2)     # outside the vocabulary
    assert_error(e.value, 400, "invalid_argument")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="x " * 5000, max_tokens=2)     # longer than max_model_len
    assert_error(e.value, 400, "invalid_argument")
    assert _post(stack, "/v1/completions", b"{not json")[0] == 400
    status, body = _post(stack, "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}')   # not text
    assert status == 400 and body["error"]["code"] == "invalid_json", body
    for model in ("nope", "task:123456"):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True)
        assert_error(e.value, 404, "not_found")
    with pytest.raises(openai.BadRequestError) as e:          # the name is refused, and not echoed whole
        client.completions.create(model="x" * 20_000, prompt=PROMPT)
    assert "characters cut" in assert_error(e.value, 400)["message"]
    status, body = _post(stack, "/v1/nothing", {})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=BASE, prompt="x" * (5 << 20), max_tokens=1)      # over --max-message-bytes
    assert_error(e.value, 413, "request_too_large")
    status, body = _post(stack, "/v1/load_lora_adapter", {"lora_name": "huge"})   # rank 256: over the cache budget
    assert status == 429 and body["error"]["code"] == "resource_exhausted", body


def test_client_going_away_cancels_on_compute(stack):
    url = urllib.parse.urlsplit(stack.base_url)
    body = json.dumps({"model": BASE, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert stack.compute_busy() == 1
    conn.close()
    _wait_idle(stack)
    # not streaming: the answer is not ready when the client gives up
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=0.5)
    with pytest.raises(TimeoutError):
        conn.request("POST", "/v1/completions", body=body.replace('"stream": true', '"stream": false'),
                     headers={"Content-Type": "application/json"})
        conn.getresponse()
    assert stack.compute_busy() == 1
    conn.close()
    _wait_idle(stack)


def _wait_idle(stack, timeout_s: float = 30.0) -> None:   # polls: the bound matters only on failure
    deadline = time.monotonic() + timeout_s
    while stack.compute_busy():
        assert time.monotonic() < deadline, "the request kept running on compute after its client left"
        time.sleep(0.05)


def test_curl_streams_and_health(stack):
    out = subprocess.run(["curl", "-sN", f"{stack.base_url}/v1/completions", "-H", "Content-Type: application/json",
                          "-H", "x-request-id: curl-1",
                          "-d", json.dumps({"model": "alpha", "prompt": PROMPT, "max_tokens": 5, "stream": True})],
                         capture_output=True, text=True, timeout=60)
    events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2, out.stdout
    assert json.loads(events[0][6:])["object"] == "text_completion"
    assert json.loads(events[0][6:])["id"] == "cmpl-curl-1"      # the caller's request id
    health = subprocess.run(["curl", "-s", f"{stack.base_url}/health"], capture_output=True, text=True, timeout=30)
    assert json.loads(health.stdout)["status"] == "ok"
    metrics = subprocess.run(["curl", "-s", f"{stack.base_url}/metrics"], capture_output=True, text=True, timeout=30)
    assert 'loraplex_gateway_requests_total{code="200",method="POST /v1/completions"}' in metrics.stdout
    assert "loraplex_gateway_time_to_first_token_seconds_count" in metrics.stdout


@contextlib.contextmanager
def gateway_http_in_process(model, tokenizer, dead: str, guard=None):
    """The gateway's HTTP server, built as `loraplex gateway` builds it, on a loop of its own, with its
    cache and compute at `dead` (nothing listens there); `guard` replaces the access-control hook."""
    config = GatewayConfig(cache_address=dead, compute_addresses=(dead,), http_listen="127.0.0.1:0")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        store = CacheStore(dead, config.max_message_bytes, config.downstream_timeout_s)
        servicer = build_servicer(config, tokenizer, ModelSpec.from_path(model), store,
                                  SingleReplicaRouter(dead, config.max_message_bytes))
        server = (http_server_for(config, servicer, model) if guard is None
                  else HttpServer(build_app(servicer, BASE, guard=guard), config.http_listen))
        server.bind()
        await server.start()
        return server
    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="k1", max_retries=0, timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_unavailable_downstream_is_503(stack, tokenizer, free_port):
    """Requests that need the cache or compute while they are down answer 503 naming them."""
    dead = f"127.0.0.1:{free_port}"
    with gateway_http_in_process(stack.model, tokenizer, dead) as c:
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=BASE, prompt=PROMPT, max_tokens=2)
        assert dead in assert_error(e.value, 503, "unavailable")["message"]
        with pytest.raises(openai.APIStatusError) as e:
            c.models.list()
        assert dead in assert_error(e.value, 503, "unavailable")["message"]


def test_the_guard_refuses_before_the_body_is_read(stack, tokenizer, free_port):
    seen = []

    @contextlib.asynccontextmanager
    async def guard(request, action, models):
        seen.append((action, request.headers.get("authorization")))
        raise UnauthenticatedError("no such API key")
        yield
    with gateway_http_in_process(stack.model, tokenizer, f"127.0.0.1:{free_port}", guard) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model=BASE, prompt=PROMPT, max_tokens=2)
        assert assert_error(e.value, 401, "unauthenticated")["message"] == "no such API key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    assert seen == [("generate", "Bearer k1"), ("read", "Bearer k1")]
